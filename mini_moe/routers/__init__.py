"""Trainable routers: one affinity composed with one allocation (Flax NNX modules).

Paper 000's lesson is that a router is two choices: an **affinity**, the scores that say which
token suits which expert, and an **allocation**, the rule that turns scores into routing tensors
under a capacity. Here both are small first-class pieces and a :class:`Router` is one of each:

* affinities (modules with the router's parameters): :class:`Softmax` (softmax(XW)),
  :class:`NoisySoftmax` (V-MoE's noisy softmax with its balancing losses),
  :class:`SinkhornPlan` (eq. 8), :class:`QuadraticPlan` (SVMoE), :class:`SparsityConstrainedPlan`
  (eq. 9) and :class:`SlotLogits` (Soft MoE's l2-normalised slot logits);
* allocations (frozen dataclasses, no parameters): :class:`TokenChoice` (Algorithm 1, k and
  Batch Priority Routing), :class:`ExpertChoice` (Algorithm 2) and :class:`SoftRouting`.

An affinity also says where the combine weights come from (the OT plans take positions from
the plan and, with ``softmax_combine=True``, weights from softmax(XW); paper 000 Sec. 3.4).
Every router maps tokens ``x [..., T, D]`` (leading axes: groups; for Soft MoE, images) to a
:class:`RouterOutput`. The routers of the papers are registered compositions, created by name::

    router = make_router("sinkhorn_expert_choice", dim=64, num_experts=8,
                         capacity_factor=2.0, rngs=nnx.Rngs(0))
    # the same router, composed by hand; any other pair is one line too
    router = Router(SinkhornPlan(64, 8, rngs=nnx.Rngs(0)), ExpertChoice(capacity_factor=2.0))

====================================== ================================ =====================
name                                   affinity                         allocation
====================================== ================================ =====================
``softmax_token_choice``               :class:`NoisySoftmax`            :class:`TokenChoice`
``sinkhorn_token_choice``              :class:`SinkhornPlan`            :class:`TokenChoice`
``svmoe``                              :class:`QuadraticPlan`           :class:`TokenChoice`
``softmax_expert_choice``              :class:`Softmax`                 :class:`ExpertChoice`
``sinkhorn_expert_choice``             :class:`SinkhornPlan`            :class:`ExpertChoice`
``sparsity_constrained_expert_choice`` :class:`SparsityConstrainedPlan` :class:`ExpertChoice`
``soft_moe``                           :class:`SlotLogits`              :class:`SoftRouting`
``hash`` (a routing control)           :class:`HashProjection`          :class:`TokenChoice`
====================================== ================================ =====================

Routing controls, for experiments that ask whether the *learned* routing matters: any router
can be frozen (``make_router(..., frozen=True)``, :func:`freeze`: its weights stay at their
initial values while the experts train), ``hash`` routes by a fixed random projection that
nothing learns, and the options ``noise_std`` and ``balance_loss`` of ``softmax_token_choice`` and
``noise_std`` of ``softmax_expert_choice`` give the two allocations the same noise and losses.

What the rest of the library needs to know about a registered router (how the capacity factor
reaches it, whether it routes each image on its own, where the model places its MoE layers) is
declared with :func:`register`, so a router registered outside the package trains through
:mod:`mini_moe.model`, :mod:`mini_moe.train`, :mod:`mini_moe.study` and :mod:`mini_moe.bench`.

Training-time noise follows Flax's dropout convention: it is added while the module
is not ``deterministic`` (``model.train()``), and never under ``model.eval()``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mini_moe import losses, routing, transport
from mini_moe.validate import InputError, check_int

Array = Any


@flax.struct.dataclass
class RouterOutput:
    """What a router returns.

    Attributes:
      routing: :class:`~mini_moe.routing.Routing`, tensors ``[..., T, E, C]``.
      aux_loss: scalar auxiliary loss (0 for routers that need none).
      metrics: dict of scalars and ``[E]`` arrays (see ``routing.routing_metrics``).
      probs: ``[..., T, E]`` each token's distribution over experts: the (noisy) softmax
        of the router logits (paper 004's r_theta); for Soft MoE the combine weights
        summed over each expert's slots.
      affinities: the :class:`Affinities` the allocation worked from (what the dropless
        layer path sorts by).
    """

    routing: routing.Routing
    aux_loss: Array
    metrics: dict
    probs: Array
    affinities: Any = None


class Budget(NamedTuple):
    """What an allocation grants one routing group of T tokens: ``k`` experts per token
    (Token Choice; 1 otherwise) and ``capacity`` C slots per expert (Soft MoE: its slots)."""

    k: int
    capacity: int


@flax.struct.dataclass
class Affinities:
    """What an affinity gives an allocation.

    Attributes:
      scores: ``[..., T, E]`` what the allocation ranks (Soft MoE: slot logits ``[..., T, E, S]``).
      combine: ``[..., T, E]`` where the combine weights come from; ``None``: from ``scores``.
      probs: ``[..., T, E]`` each token's distribution over experts; ``None``: the combine
        tensor summed over slots.
      aux_loss: scalar auxiliary loss.
      metrics: dict of scalars.
    """

    scores: Array
    combine: Array | None = None
    probs: Array | None = None
    aux_loss: Array = 0.0
    metrics: dict = dataclasses.field(default_factory=dict)


# ------------------------------------------------------------------------------ affinities


class Affinity(nnx.Module):
    """Base affinity: a linear map ``W [D, E]`` from tokens to expert logits."""

    def __init__(self, dim: int, num_experts: int, *, rngs: nnx.Rngs):
        check_int("dim", dim)
        check_int("num_experts", num_experts)
        self.dim, self.num_experts = dim, num_experts
        self.dense = nnx.Linear(dim, num_experts, use_bias=False, rngs=rngs)

    def logits(self, x: Array) -> Array:
        """Clean router logits ``x W``: ``[..., T, E]``."""
        return self.dense(x)

    def __call__(self, x: Array, budget: Budget) -> Affinities:
        raise NotImplementedError


class Softmax(Affinity):
    """``softmax(XW)`` (Expert Choice's affinity, paper 000 Sec. 2.3)."""

    def __call__(self, x: Array, budget: Budget) -> Affinities:
        probs = jax.nn.softmax(self.logits(x), axis=-1)
        return Affinities(probs, probs=probs)


class NoisySoftmax(Affinity):
    """V-MoE's affinity (paper 000 Sec. 2.1): ``softmax(XW + noise)`` with its balancing losses.

    Args:
      noise_std: training noise N(0, (noise_std / E)^2) on the logits (V-MoE: 1).
      balance_loss: the balancing term of the auxiliary loss: ``"importance_load"`` (or
        ``True``; V-MoE's (importance + load) / 2, Appendix A), ``"switch"`` (the Switch
        Transformer / GShard loss, :func:`mini_moe.losses.switch_loss`) or ``"none"`` (or
        ``False``; shows the collapse the losses prevent).
      z_loss: weight of the router z-loss (ST-MoE) inside the auxiliary loss, relative to the
        balancing term (ST-MoE uses 1e-3 against 1e-2, i.e. 0.1); 0 turns it off.
      balance_scope: where the Switch loss counts its frequencies: ``"group"`` (each routing
        group) or ``"batch"`` (the whole batch; Qwen's global-batch balance,
        :func:`mini_moe.losses.switch_loss`).

    Every loss is also reported in the metrics, whichever of them is trained. The load loss
    and the Switch loss count the allocation's k experts per token.
    """

    BALANCE_LOSSES = ("importance_load", "switch", "none")

    def __init__(self, dim, num_experts, *, noise_std=1.0, balance_loss=True, z_loss=0.0, balance_scope="group",
                 deterministic=False, rngs: nnx.Rngs):
        super().__init__(dim, num_experts, rngs=rngs)
        if balance_scope not in losses.BALANCE_SCOPES:
            raise InputError(f"balance_scope must be one of {losses.BALANCE_SCOPES}, got {balance_scope!r}.")
        self.balance_scope = balance_scope
        if noise_std < 0:
            raise InputError(f"noise_std must be >= 0, got {noise_std!r}.")
        self.noise_std = float(noise_std)
        if isinstance(balance_loss, bool):
            balance_loss = "importance_load" if balance_loss else "none"
        if balance_loss not in self.BALANCE_LOSSES:
            raise InputError(f"balance_loss must be one of {self.BALANCE_LOSSES} (or True/False), got {balance_loss!r}.")
        if not z_loss >= 0:
            raise InputError(f"z_loss must be >= 0, got {z_loss!r}.")
        self.balance_loss, self.z_loss = balance_loss, float(z_loss)
        self.deterministic = deterministic
        self.rngs = rngs["noise"].fork()

    def __call__(self, x: Array, budget: Budget) -> Affinities:
        logits = self.logits(x)
        noisy = logits
        if not self.deterministic and self.noise_std > 0:
            noise = jax.random.normal(self.rngs(), logits.shape, logits.dtype)
            noisy = logits + noise * (self.noise_std / self.num_experts)
        probs = jax.nn.softmax(noisy, axis=-1)
        importance = losses.importance_loss(logits)
        load = (losses.load_loss(logits, noisy, k=budget.k, noise_std=self.noise_std)
                if self.noise_std > 0 else importance)
        switch = losses.switch_loss(probs, k=budget.k, scope=self.balance_scope)
        z = losses.z_loss(logits)
        aux = {"importance_load": (importance + load) / 2, "switch": switch, "none": 0.0}[self.balance_loss]
        aux = aux + self.z_loss * z
        metrics = dict(importance_loss=importance, load_loss=load, switch_loss=switch, z_loss=z)
        return Affinities(probs, probs=probs, aux_loss=aux, metrics=metrics)


class ExpertBias(nnx.Variable):
    """The per-expert bias of auxiliary-loss-free balancing: a variable of its own type, not an
    ``nnx.Param``, so no gradient reaches it and the optimizer (``wrt=nnx.Param``) and its weight
    decay never touch it. The router updates it itself in training mode; checkpoints save it
    with the rest of the model's state."""


class SigmoidGates(Affinity):
    """DeepSeek-V3's affinity (arXiv 2412.19437, Sec. 2.1.2; Wang et al. 2024, arXiv 2408.15664):
    sigmoid scores ``s = sigmoid(XW)``; each token's k experts are its top k of ``s + b``, with a
    per-expert bias ``b`` (:class:`ExpertBias`) that balances the load without an auxiliary loss;
    the gate values are the *unbiased* scores of the chosen experts, normalised over the k. At
    k = 1 the gate is the chosen score itself, not normalised (as Megatron-LM's sigmoid router
    does): normalised it would be 1 for every token, and the task would send the router's
    weights no gradient (Megatron-LM#894's failure). DeepSeek-V3 routes to k = 8.

    In training mode every call updates the bias from the load of the whole batch it routed
    (all groups): ``b_e += bias_rate * sign(mean load - load_e)``, so an overloaded expert
    becomes less attractive for the next step. It is a sign step of dual descent (on the dual
    function g of chapter 12, eq. 12.3) for the constraint "every expert gets T k / E picks", the
    balance constraint Sinkhorn and Expert Choice enforce exactly.

    Args:
      bias_rate: u, the bias update speed (DeepSeek-V3: 1e-3).
      seq_balance: weight of the complementary sequence-wise balance loss
        (:func:`mini_moe.losses.sequence_balance_loss`, one sequence = one routing group; its
        f_i counts the top-k of the unbiased scores, V3's eq. 18) inside the router's auxiliary
        loss, which training multiplies by ``aux_loss_weight`` (0.01 by default): DeepSeek-V3's
        alpha = 1e-4 is ``seq_balance = 1e-4 / aux_loss_weight = 1e-2``; 0 turns it off.
      balance_scope: where that loss counts ``f_i`` and ``P_i``: ``"group"`` (V3's sequence-wise
        loss, one sequence = one routing group, averaged over groups) or ``"batch"`` (over every
        token of the batch at once: the batch-wise auxiliary loss of V3's ablation, Sec. 4.5.3).
      num_groups, top_groups: group-limited routing (DeepSeek-V2/V3): the E experts form
        ``num_groups`` equal groups (devices, in a deployment), a group scores the sum of its
        two highest biased scores (its highest when it holds one expert), each token keeps its
        ``top_groups`` best groups and picks its k experts inside them. ``num_groups=1``: off.
        The two is DeepSeek-V3's rule, the sum of a group's K_r / M highest scores (Sec. 2.1.2),
        at its K_r = 8 and M = 4; the library fixes it at 2 whatever ``k`` and ``top_groups``
        are. DeepSeek-V2's device-limited routing scores a group by its highest score instead.

    Under gradient accumulation (``defer = True``, set by :func:`defer_updates`) a call does not
    move the bias: the training step sums the micro-batches' ``pick_load`` and calls
    :meth:`update_bias` once, so the update sees the whole accumulated batch (the bug of
    torchtitan#1304 was one update per micro-batch).

    Metrics: ``bias_spread`` (max - min of b), ``sequence_balance_loss`` and ``pick_load`` (``[E]``,
    picks per expert in this call).
    """

    def __init__(self, dim, num_experts, *, bias_rate=1e-3, seq_balance=0.0, balance_scope="group", num_groups=1,
                 top_groups=1, deterministic=False, rngs: nnx.Rngs):
        super().__init__(dim, num_experts, rngs=rngs)
        if balance_scope not in losses.BALANCE_SCOPES:
            raise InputError(f"balance_scope must be one of {losses.BALANCE_SCOPES}, got {balance_scope!r}.")
        self.balance_scope = balance_scope
        if not bias_rate >= 0:
            raise InputError(f"bias_rate must be >= 0, got {bias_rate!r}.")
        if not seq_balance >= 0:
            raise InputError(f"seq_balance must be >= 0, got {seq_balance!r}.")
        check_int("num_groups", num_groups)
        check_int("top_groups", top_groups)
        if num_experts % num_groups or top_groups > num_groups:
            raise InputError(f"num_groups must divide num_experts={num_experts} and top_groups <= num_groups, "
                             f"got num_groups={num_groups}, top_groups={top_groups}.")
        self.bias_rate, self.seq_balance = float(bias_rate), float(seq_balance)
        self.num_groups, self.top_groups = num_groups, top_groups
        self.deterministic = deterministic
        self.defer = False  # True under gradient accumulation: the training step updates the bias once
        self.bias = ExpertBias(jnp.zeros((num_experts,), jnp.float32))

    def update_bias(self, load: Array) -> None:
        """One step of the bias from the picks per expert ``load [E]`` of a whole batch:
        ``b_e += bias_rate * sign(mean load - load_e)``."""
        self.bias[...] = routing.loss_free_bias_step(self.bias[...], load, self.bias_rate)

    def check(self, k: int) -> None:
        """k picks must fit inside the kept groups."""
        room = self.top_groups * self.num_experts // self.num_groups
        if k > room:
            raise InputError(f"k={k} picks do not fit in top_groups={self.top_groups} groups of "
                             f"{self.num_experts // self.num_groups} experts; raise top_groups or lower k.")

    def _limit_groups(self, biased: Array) -> Array:
        """``biased`` with the experts outside each token's ``top_groups`` best groups at -inf
        (:func:`mini_moe.routing.group_limit`)."""
        if self.num_groups == 1:
            return biased
        return jnp.where(routing.group_limit(biased, self.num_groups, self.top_groups), biased, -jnp.inf)

    def __call__(self, x: Array, budget: Budget) -> Affinities:
        self.check(budget.k)
        scores = jax.nn.sigmoid(self.logits(x))  # [..., T, E]
        selection = self._limit_groups(scores + self.bias[...])
        picks = jax.lax.top_k(selection, budget.k)[1]
        chosen = jax.nn.one_hot(picks, self.num_experts, dtype=scores.dtype).sum(-2)  # [..., T, E]: 0/1
        gates = scores * chosen
        if budget.k > 1:  # normalised over the k; at k = 1 that is 1, and the router would get no gradient
            gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        load = chosen.reshape(-1, self.num_experts).sum(0)  # picks per expert, whole batch
        if not self.deterministic and self.bias_rate > 0 and not self.defer:
            self.update_bias(load)
        # V3's eq. 18 counts f_i on the top-k of the unbiased scores (no bias, no groups), as
        # Megatron's compute_routing_scores_for_aux_loss does; the bias only selects.
        unbiased = jax.nn.one_hot(jax.lax.top_k(scores, budget.k)[1], self.num_experts, dtype=scores.dtype).sum(-2)
        if self.balance_scope == "batch":  # one group of every token: the batch-wise loss
            balance = losses.sequence_balance_loss(scores.reshape(1, -1, self.num_experts),
                                                   unbiased.reshape(1, -1, self.num_experts))
        else:
            balance = losses.sequence_balance_loss(scores, unbiased)
        metrics = dict(sequence_balance_loss=balance, bias_spread=jnp.max(self.bias[...]) - jnp.min(self.bias[...]),
                       pick_load=load)
        # The allocation ranks the biased (group-limited) scores, which picks the same k experts,
        # and takes its combine weights from the normalised gates. The excluded experts get the
        # lowest finite number, below any biased score however far the bias drifts (DeepSeek-V3's
        # Gate masks them with -inf; a finite sentinel keeps the allocation's arithmetic finite).
        sentinel = jnp.finfo(selection.dtype).min
        return Affinities(jnp.where(jnp.isfinite(selection), selection, sentinel), combine=gates,
                          probs=scores / jnp.sum(scores, axis=-1, keepdims=True),
                          aux_loss=self.seq_balance * balance, metrics=metrics)


class L1Weight(nnx.Variable):
    """ReMoE's adaptive L1 coefficient: a variable of its own type (not an ``nnx.Param``, so no
    gradient or optimizer touches it), updated by the router in training mode and saved with
    the model's state."""


class ReluGates(Affinity):
    """ReMoE's affinity (Wang et al. 2024, arXiv 2412.14711): ReLU gates ``g = relu(XW)``; a
    token goes to every expert whose gate is positive (with :class:`TokenChoice` at ``k = E``,
    ``min_score = 0``), so the number of experts per token varies from token to token, and the
    gates themselves are the combine weights (no softmax, no top-k).

    Sparsity comes from an L1 penalty on the gates with an adaptive weight lambda
    (:class:`L1Weight`). The penalty is load-balanced: ``lambda * mean_t sum_e f_e g_te`` with
    ``f_e = E / (k N) * #{tokens with g_te > 0}`` (a constant, no gradient), so a busy expert's
    gates are pushed down harder. In training mode every call moves lambda towards the target
    sparsity ``1 - k / E`` (k active experts per token on average): ``lambda *= rate`` when the
    fraction of zero gates is below the target, ``lambda /= rate`` when above.

    Whose sparsity: ReMoE's reference code keeps **one lambda for the whole model**, moved once
    per training step by the sparsity averaged over all MoE layers; that is ``l1_scope="model"``,
    the default, where the router does not move lambda itself and every model that holds MoE
    layers (:class:`mini_moe.model.VisionMoE`, :class:`mini_moe.subtasks.SubtaskLayer`) calls
    :func:`after_forward` after each training forward pass (so every layer holds the same
    lambda). ``l1_scope="layer"`` gives every layer its own lambda, moved in the router's own call
    by its own sparsity (a router called alone, outside such a model, adapts only this way).

    Args:
      target_k: k, the average number of active experts per token the controller aims at.
      l1_init: lambda's initial value (ReMoE: 1e-8).
      l1_rate: the controller's multiplicative step (ReMoE: 1.2).
      l1_scope: ``"model"`` (ReMoE's reference) or ``"layer"``, as above.

    Metrics: ``sparsity`` (fraction of zero gates), ``active_experts`` (mean per token),
    ``l1_weight`` (lambda).
    """

    L1_SCOPES = ("model", "layer")

    def __init__(self, dim, num_experts, *, target_k=1, l1_init=1e-8, l1_rate=1.2, l1_scope="model",
                 deterministic=False, rngs: nnx.Rngs):
        super().__init__(dim, num_experts, rngs=rngs)
        check_int("target_k", target_k)
        if target_k > num_experts:
            raise InputError(f"target_k must be <= num_experts={num_experts}, got {target_k}.")
        if not l1_init > 0 or not l1_rate > 1:
            raise InputError(f"l1_init must be > 0 and l1_rate > 1, got {l1_init!r} and {l1_rate!r}.")
        if l1_scope not in self.L1_SCOPES:
            raise InputError(f"l1_scope must be one of {self.L1_SCOPES}, got {l1_scope!r}.")
        self.target_k, self.l1_rate, self.deterministic = target_k, float(l1_rate), deterministic
        self.l1_scope = l1_scope
        self.defer = False  # True under gradient accumulation: the training step moves lambda once
        self.l1_weight = L1Weight(jnp.asarray(l1_init, jnp.float32))

    def step_l1(self, sparsity: Array) -> None:
        """One step of lambda towards the target from the fraction of zero gates ``sparsity``."""
        self.l1_weight[...] = self.l1_weight[...] * self.l1_rate ** jnp.sign(self.target_sparsity - sparsity)

    @property
    def target_sparsity(self) -> float:
        """The fraction of zero gates the controller aims at, ``1 - k / E``."""
        return 1.0 - self.target_k / self.num_experts

    def __call__(self, x: Array, budget: Budget) -> Affinities:
        gates = jax.nn.relu(self.logits(x))  # [..., T, E]
        active = (gates > 0).astype(gates.dtype)
        flat = active.reshape(-1, self.num_experts)
        sparsity = 1.0 - jnp.mean(flat)
        load = jax.lax.stop_gradient(self.num_experts * flat.sum(0) / (self.target_k * flat.shape[0]))  # f_e
        penalty = jnp.mean(jnp.sum(load * gates.reshape(-1, self.num_experts), axis=-1))
        weight = self.l1_weight[...]
        if not self.deterministic and self.l1_scope == "layer" and not self.defer:
            self.step_l1(sparsity)
        totals = jnp.sum(gates, axis=-1, keepdims=True)
        probs = jnp.where(totals > 0, gates / jnp.where(totals > 0, totals, 1.0), 1.0 / self.num_experts)
        metrics = dict(sparsity=sparsity, active_experts=jnp.mean(flat.sum(-1)), l1_weight=weight)
        return Affinities(gates, probs=probs, aux_loss=jax.lax.stop_gradient(weight) * penalty, metrics=metrics)


def update_l1_weights(gates: list[ReluGates], sparsities: list[Array]) -> None:
    """ReMoE's model-level controller (its reference code): one step of lambda for all of a
    model's ReLU routers ``gates`` (``l1_scope="model"``), by the sparsity of this step averaged
    over their layers (``sparsities``, one scalar per layer, the routers' ``sparsity`` metric):
    every lambda is multiplied by ``rate ** sign(target - mean sparsity)``. Routers in
    ``l1_scope="layer"`` or in eval mode are left alone."""
    moving = [(g, s) for g, s in zip(gates, sparsities) if g.l1_scope == "model" and not g.deterministic]
    if not moving:
        return
    mean = jnp.mean(jnp.stack([jnp.asarray(s, jnp.float32) for _, s in moving]))
    for g, _ in moving:
        g.step_l1(mean)


def after_forward(layers) -> None:
    """The step of the routers' own state that no layer can take alone, after a training forward
    pass of any model that holds MoE layers (:class:`mini_moe.model.VisionMoE`, chapter 9's one-layer
    :class:`mini_moe.subtasks.SubtaskLayer`): ``layers`` lists ``(affinity, metrics)`` of every MoE
    layer of the pass. Today that is ReMoE's model-level lambda (:func:`update_l1_weights`), skipped
    under gradient accumulation (the training step moves it once from the whole batch). A router
    whose state is its own layer's (DeepSeek-V3's bias, a layer-scope lambda) moves in its call."""
    relu = [(a, m["sparsity"]) for a, m in layers if isinstance(a, ReluGates)]
    if relu and not relu[0][0].defer:
        update_l1_weights(*zip(*relu))


def defer_updates(module, defer: bool = True) -> None:
    """Gradient accumulation: make every router in ``module`` that updates state in its own
    training call (DeepSeek-V3's bias, :class:`SigmoidGates`; ReMoE's lambda, :class:`ReluGates`)
    leave it to the training step, which applies one update from the whole accumulated batch
    (:meth:`mini_moe.model.VisionMoE.apply_deferred_updates`)."""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, (SigmoidGates, ReluGates)):
            node.defer = bool(defer)


class SinkhornPlan(Affinity):
    """The entropic transport plan of ``XW`` (paper 000 eq. 8, Sec. 2.2 and 2.4).

    Args:
      softmax_combine: positions from the plan, combine weights from ``softmax(XW)`` and no
        gradient through Sinkhorn (paper 000 Sec. 3.4); ``False``: both from the plan (Fig. 3).
      num_iters, epsilon: see :func:`mini_moe.transport.sinkhorn`.
    """

    def __init__(self, dim, num_experts, *, softmax_combine=True, num_iters=20, epsilon=1.0, rngs: nnx.Rngs):
        super().__init__(dim, num_experts, rngs=rngs)
        check_int("num_iters", num_iters)
        if not epsilon > 0:
            raise InputError(f"epsilon must be > 0, got {epsilon!r}.")
        self.num_iters, self.epsilon = num_iters, float(epsilon)
        self.softmax_combine = bool(softmax_combine)

    def __call__(self, x: Array, budget: Budget) -> Affinities:
        logits = self.logits(x)
        plan = transport.sinkhorn(logits, num_iters=self.num_iters, epsilon=self.epsilon)
        probs = jax.nn.softmax(logits, axis=-1)
        if self.softmax_combine:  # the backward pass skips Sinkhorn entirely
            return Affinities(jax.lax.stop_gradient(plan), combine=probs, probs=probs)
        return Affinities(plan, probs=probs)


class QuadraticPlan(Affinity):
    """SVMoE's affinity (paper 001): the quadratically regularised transport plan of
    ``softmax(XW)`` with ``gamma = 1/k``; combine weights from the softmax.

    Paper 001 says the plan is found "using the Sinkhorn algorithm"; for a quadratic
    regulariser the exact analogue is :func:`mini_moe.transport.quadratic_plan`.
    """

    def __init__(self, dim, num_experts, *, num_iters=20, rngs: nnx.Rngs):
        super().__init__(dim, num_experts, rngs=rngs)
        check_int("num_iters", num_iters)
        self.num_iters = num_iters

    def __call__(self, x: Array, budget: Budget) -> Affinities:
        probs = jax.nn.softmax(self.logits(x), axis=-1)
        plan = transport.quadratic_plan(jax.lax.stop_gradient(probs), gamma=1.0 / budget.k, num_iters=self.num_iters)
        return Affinities(plan, combine=probs, probs=probs)


class SparsityConstrainedPlan(Affinity):
    """The sparsity-constrained plan of ``softmax(XW)`` (paper 000 eq. 9, Sec. 2.5) with at
    most C tokens per expert (the allocation's capacity); combine weights from the softmax.
    Metrics add the solver's iterations and token-marginal error."""

    def __init__(self, dim, num_experts, *, tol=1e-3, max_iters=30, rngs: nnx.Rngs):
        super().__init__(dim, num_experts, rngs=rngs)
        self.tol, self.max_iters = float(tol), int(max_iters)

    def __call__(self, x: Array, budget: Budget) -> Affinities:
        probs = jax.nn.softmax(self.logits(x), axis=-1)
        plan, info = transport.sparsity_constrained_plan(
            probs, max_nonzeros=budget.capacity, tol=self.tol, max_iters=self.max_iters, return_info=True
        )
        metrics = dict(solver_iterations=jnp.mean(info.iterations.astype(jnp.float32)),
                       solver_marginal_error=jnp.mean(info.marginal_error))
        return Affinities(plan, combine=probs, probs=probs, metrics=metrics)


def l2_normalize(x: Array, axis: int, eps: float = 1e-6) -> Array:
    """``x / sqrt(sum(x^2) + eps)`` along ``axis`` (eps inside the root: finite at 0)."""
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=axis, keepdims=True) + eps)


class SlotLogits(nnx.Module):
    """Soft MoE's affinity (paper 002): token/slot logits ``Z[t, r, s] = <l2n(x_t), scale *
    l2n(Phi[:, r, s])>`` (l2 normalisation over D, learnable scalar ``scale`` initialised at 1).

    Args:
      slots_per_expert: S (paper 002's best setting is 1).
      normalize: use the l2 normalisation and scale (paper 002, Sec. 2.3).
    """

    def __init__(self, dim, num_experts, *, slots_per_expert=1, normalize=True, rngs: nnx.Rngs):
        check_int("dim", dim)
        check_int("num_experts", num_experts)
        check_int("slots_per_expert", slots_per_expert)
        self.dim, self.num_experts, self.slots_per_expert = dim, num_experts, slots_per_expert
        self.normalize = bool(normalize)
        init = nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))
        self.phi = nnx.Param(init(rngs.params(), (dim, num_experts, slots_per_expert)))
        self.scale = nnx.Param(jnp.ones(()))

    def logits(self, x: Array) -> Array:
        """Token/slot logits ``[..., T, E, S]``."""
        phi = self.phi[...]
        if self.normalize:
            x, phi = l2_normalize(x, -1), self.scale[...] * l2_normalize(phi, 0)
        return jnp.einsum("...td,des->...tes", x, phi)

    def __call__(self, x: Array, budget: Budget) -> Affinities:
        return Affinities(self.logits(x), metrics=dict(scale=self.scale[...]))


# ----------------------------------------------------------------------------- allocations


# ------------------------------------------------------------------------- routing controls


class FrozenWeight(nnx.Variable):
    """A router weight held at its initial value (a routing control): a variable of its own type,
    not an ``nnx.Param``, so no gradient reaches it and the optimizer (``wrt=nnx.Param``) keeps no
    state for it; checkpoints save it with the rest of the model's state."""


def freeze(router: "Router") -> "Router":
    """Hold every parameter of ``router``'s affinity at its current value (in place; returns it).

    The control of a learned-routing experiment: the experts train, the routing stays the one
    its random initialisation gives, so a frozen router differs from a learned one only in
    whether the routing learns. Each ``nnx.Param`` of the affinity (the router weights ``W``;
    Soft MoE's ``phi`` and scale) becomes a :class:`FrozenWeight` of the same value. What the
    affinity updates without a gradient (DeepSeek-V3's bias, ReMoE's lambda) still updates.
    ``make_router(..., frozen=True)`` and ``model_router_kwargs={"frozen": True}`` call it.
    """
    modules = nnx.iter_modules(router.affinity) if hasattr(nnx, "iter_modules") else router.affinity.iter_modules()
    for _, module in modules:
        for name, value in list(vars(module).items()):
            if isinstance(value, nnx.Param):
                setattr(module, name, FrozenWeight(value[...]))
    return router


class HashProjection(nnx.Module):
    """A hash router's affinity: a fixed random partition of the token space, not learned.

    The idea of Hash Layers (Roller et al. 2021, arXiv 2106.04426), where a token's expert is a
    fixed hash of its identity, carried to continuous tokens by locality-sensitive hashing: a
    random projection ``Q [D, E]`` with orthonormal columns (Gaussian columns of unit norm when
    ``D < E``), held fixed (:class:`FrozenWeight`), and each token goes to the ``k`` experts whose
    projections ``(x - mean) Q`` are largest, with combine weight ``1 / k``. ``mean`` is the mean
    token of the routing group: the tokens of a network share a large common component, which
    alone would send every token to the same expert (issue 34's pilot saw exactly that), so
    the hash looks at how a token differs from its group. Nearby tokens share experts; nothing
    about the task decides which, and no gradient reaches the choice (the gates are constants).

    Balance: for isotropic tokens (``x ~ N(m, I)``) and ``D >= E``, ``(x - m) Q ~ N(0, I_E)``, so
    every expert is equally likely, each token independently; the load of a group is
    multinomial. On a trained representation, which is not isotropic, the balance is whatever
    the data give (the router's ``max_violation`` metric shows it) and the capacity drops the
    overflow as for any Token Choice router.
    """

    def __init__(self, dim: int, num_experts: int, *, rngs: nnx.Rngs):
        check_int("dim", dim)
        check_int("num_experts", num_experts)
        self.dim, self.num_experts = dim, num_experts
        gauss = jax.random.normal(rngs.params(), (dim, num_experts), jnp.float32)
        if dim >= num_experts:
            projection = jnp.linalg.qr(gauss)[0]  # orthonormal columns
        else:
            projection = gauss / jnp.linalg.norm(gauss, axis=0, keepdims=True)
        self.projection = FrozenWeight(projection)

    def logits(self, x: Array) -> Array:
        """The projections ``(x - mean_T x) Q``: ``[..., T, E]``."""
        return (x - jnp.mean(x, axis=-2, keepdims=True)) @ self.projection[...].astype(x.dtype)

    def __call__(self, x: Array, budget: Budget) -> Affinities:
        picks = jax.lax.top_k(self.logits(x), budget.k)[1]  # [..., T, k]
        gates = jax.nn.one_hot(picks, self.num_experts, dtype=jnp.float32).sum(-2) / budget.k  # [..., T, E]
        return Affinities(gates, probs=gates)


@dataclasses.dataclass(frozen=True)
class TokenChoice:
    """Algorithm 1 (paper 000): every token picks its top ``k`` experts, each expert keeps the
    first C = round(capacity_factor * T / E) in token order (Batch Priority Routing: by score).

    Args:
      k: experts per token (1 or 2 in the paper).
      capacity_factor: default k.
      batch_priority: Batch Priority Routing.
      min_score: None, or picks whose score is not above it are not made (ReLU routing:
        ``k = E``, ``min_score = 0``, so a token goes to every expert with a positive gate).
      pick_bound: None, or on the dropless path at most this many picks per token on average
        over a call (``max_picks = ceil(pick_bound * tokens)`` of
        :func:`mini_moe.layer.moe_sorted`: the picks of largest score are kept).
    """

    k: int = 1
    capacity_factor: float | None = None
    batch_priority: bool = False
    min_score: float | None = None
    pick_bound: float | None = None
    per_image = False

    def __post_init__(self):
        check_int("k", self.k)
        factor = float(self.k if self.capacity_factor is None else self.capacity_factor)
        if not factor > 0:
            raise InputError(f"capacity_factor must be > 0, got {self.capacity_factor!r}.")
        object.__setattr__(self, "capacity_factor", factor)
        object.__setattr__(self, "batch_priority", bool(self.batch_priority))
        if self.pick_bound is not None and not self.pick_bound > 0:
            raise InputError(f"pick_bound must be > 0 (picks per token on average) or None, got {self.pick_bound!r}.")

    def max_picks(self, num_tokens: int) -> int | None:
        """The dropless path's static bound on the picks of a call of ``num_tokens`` tokens."""
        return None if self.pick_bound is None else math.ceil(self.pick_bound * num_tokens)

    def check(self, num_experts: int) -> None:
        if self.k > num_experts:
            raise InputError(f"k must be <= num_experts={num_experts}, got k={self.k}.")

    def budget(self, num_tokens: int, num_experts: int) -> Budget:
        return Budget(self.k, routing.capacity(num_tokens, num_experts, self.capacity_factor))

    def __call__(self, affinities: Affinities, budget: Budget) -> routing.Routing:
        return routing.token_choice(affinities.scores, capacity=budget.capacity, k=self.k,
                                    batch_priority=self.batch_priority, combine_scores=affinities.combine,
                                    min_score=self.min_score)


@dataclasses.dataclass(frozen=True)
class ExpertChoice:
    """Algorithm 2 (paper 000; Zhou et al. 2022): every expert picks its top
    C = round(capacity_factor * T / E) tokens (at most T)."""

    capacity_factor: float = 1.0
    per_image = False

    def __post_init__(self):
        if not self.capacity_factor > 0:
            raise InputError(f"capacity_factor must be > 0, got {self.capacity_factor!r}.")
        object.__setattr__(self, "capacity_factor", float(self.capacity_factor))

    def check(self, num_experts: int) -> None:
        pass

    def budget(self, num_tokens: int, num_experts: int) -> Budget:
        return Budget(1, min(num_tokens, routing.capacity(num_tokens, num_experts, self.capacity_factor)))

    def __call__(self, affinities: Affinities, budget: Budget) -> routing.Routing:
        return routing.expert_choice(affinities.scores, capacity=budget.capacity, combine_scores=affinities.combine)


SOFT_MOE_ABLATIONS = ("soft", "soft/uniform", "uniform/soft", "uniform", "identity")


@dataclasses.dataclass(frozen=True)
class SoftRouting:
    """Soft MoE's allocation (paper 002), for the tokens of one image: dispatch is a softmax of
    the slot logits over tokens, combine a softmax over all (expert, slot) pairs.

    Args:
      ablation: paper 002 Table 2: ``"soft"`` (Soft MoE), ``"soft/uniform"`` (learned
        dispatch, uniform combine), ``"uniform/soft"``, ``"uniform"`` (every slot the
        token average, outputs averaged), ``"identity"`` (token t to slot t; needs
        E * S = T).
    """

    ablation: str = "soft"
    per_image = True

    def __post_init__(self):
        if self.ablation not in SOFT_MOE_ABLATIONS:
            raise InputError(f"ablation must be one of {SOFT_MOE_ABLATIONS}, got {self.ablation!r}.")

    def check(self, num_experts: int) -> None:
        pass

    def budget(self, num_tokens: int, num_experts: int) -> Budget:
        return Budget(1, 0)  # the slots are the affinity's parameters

    def __call__(self, affinities: Affinities, budget: Budget) -> routing.Routing:
        logits = affinities.scores  # [..., T, E, S]
        num_tokens, shape = logits.shape[-3], logits.shape
        if self.ablation == "identity":
            if shape[-2] * shape[-1] != num_tokens:
                raise InputError(
                    f"identity routing needs num_experts * slots_per_expert == T={num_tokens}, "
                    f"got {shape[-2]} * {shape[-1]}."
                )
            eye = jnp.eye(num_tokens, dtype=logits.dtype).reshape((num_tokens,) + shape[-2:])
            return routing.Routing(jnp.broadcast_to(eye, shape), jnp.broadcast_to(eye, shape), sparse=True)
        soft = routing.soft_routing(logits)
        dispatch_kind, combine_kind = (self.ablation.split("/") * 2)[:2]
        dispatch = soft.dispatch if dispatch_kind == "soft" else jnp.full(shape, 1.0 / num_tokens, logits.dtype)
        combine = soft.combine if combine_kind == "soft" else jnp.full(shape, 1.0 / (shape[-1] * shape[-2]),
                                                                       logits.dtype)
        return routing.Routing(dispatch, combine, sparse=False)


# --------------------------------------------------------------------------------- routers


class Router(nnx.Module):
    """A router: one affinity composed with one allocation.

    ``x [..., T, D]`` -> the allocation's budget for T tokens -> the affinity's scores (and
    combine source, probs, auxiliary loss) -> the allocation's routing tensors ``[..., T, E, C]``.
    """

    def __init__(self, affinity: nnx.Module, allocation):
        self.affinity, self.allocation = affinity, allocation
        self.dim, self.num_experts = affinity.dim, affinity.num_experts
        allocation.check(self.num_experts)

    @property
    def per_image(self) -> bool:
        """Whether the router routes the tokens of each image on their own (Soft MoE)."""
        return self.allocation.per_image

    @property
    def capacity_factor(self) -> float:
        return self.allocation.capacity_factor

    @capacity_factor.setter
    def capacity_factor(self, value: float) -> None:
        """Change the allocation's capacity factor (e.g. give every token room at evaluation)."""
        self.allocation = dataclasses.replace(self.allocation, capacity_factor=value)

    def logits(self, x: Array) -> Array:
        """The affinity's logits (``[..., T, E]``; Soft MoE: ``[..., T, E, S]``)."""
        return self.affinity.logits(self._tokens(x))

    def _tokens(self, x):
        shape = np.shape(x)
        if len(shape) < 2 or shape[-1] != self.dim:
            raise InputError(f"x must have shape [..., T, D={self.dim}], got {shape}.")
        return x

    def __call__(self, x: Array, *, dropless: bool = False) -> RouterOutput:
        """Route ``x [..., T, D]``. ``dropless=True`` (Token Choice only): the affinity sees the
        usual budget, the allocation a buffer of C = T slots per expert, so no pick is dropped
        (the routing's dense tensors are never built under ``jit`` unless something reads them)."""
        x = self._tokens(x)
        num_tokens = np.shape(x)[-2]
        budget = self.allocation.budget(num_tokens, self.num_experts)
        affinities = self.affinity(x, budget)
        if dropless:
            if not isinstance(self.allocation, TokenChoice):
                raise InputError(f"dropless routing needs a Token Choice allocation, not "
                                 f"{type(self.allocation).__name__}; use the 'gather' or 'einsum' path.")
            budget = budget._replace(capacity=num_tokens)  # an expert can take every token once
        rt = self.allocation(affinities, budget)
        metrics = routing.routing_metrics(rt)
        if isinstance(self.allocation, TokenChoice):  # the demand before capacity cuts it
            load = routing.pick_load(affinities.scores, k=self.allocation.k, min_score=self.allocation.min_score)
            metrics["max_violation"] = routing.max_violation(load)
            metrics["pick_load"] = load  # [E]: an accumulated step's MaxVio comes from the summed loads
        metrics.update(affinities.metrics)
        probs = affinities.probs if affinities.probs is not None else rt.combine.sum(axis=-1)
        return RouterOutput(rt, jnp.asarray(affinities.aux_loss, jnp.float32), metrics, probs, affinities)


# ---------------------------------------------------------------------------- the registry

ALLOCATIONS = ("token", "expert", "soft")
ALLOCATION_CLASSES = {"token": TokenChoice, "expert": ExpertChoice, "soft": SoftRouting}


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    """What the library needs to know about a registered router.

    Attributes:
      build: ``build(dim, num_experts, *, rngs, **options) -> Router``.
      allocation: how a capacity factor c reaches it: ``"token"`` (options ``k`` and
        ``capacity_factor``), ``"expert"`` (``capacity_factor``) or ``"soft"``
        (``slots_per_expert``).
      placement: the MoE placement :func:`mini_moe.config.get_config` gives it by default.
    """

    build: Callable[..., Router]
    allocation: str
    placement: str = "every2"

    @property
    def per_image(self) -> bool:
        """True when the router routes the tokens of each image on their own (Soft MoE). The
        allocation decides it (``TokenChoice.per_image`` and so on), in that one place."""
        return ALLOCATION_CLASSES[self.allocation].per_image

    def capacity_options(self, capacity: float, *, tokens: int, num_experts: int) -> dict:
        """The options that give every expert ``C = round(c T / E)`` slots (see
        :func:`mini_moe.study.capacity_options`)."""
        if self.allocation == "token":
            return {"k": max(1, int(capacity)), "capacity_factor": capacity}
        if self.allocation == "expert":
            return {"capacity_factor": capacity}
        return {"slots_per_expert": routing.capacity(tokens, num_experts, capacity)}


#: Every registered router, by name, with its :class:`RouterSpec` (see :func:`register`).
ROUTERS: dict[str, RouterSpec] = {}


def register(name: str, *, allocation: str, placement: str = "every2",
             replace: bool = False) -> Callable[[Callable], Callable]:
    """Decorator adding a router builder to :data:`ROUTERS` under ``name``.

    ``allocation`` is ``"token"``, ``"expert"`` or ``"soft"`` (it also decides whether the
    router routes each image on its own, :attr:`RouterSpec.per_image`). A name that is
    already registered is refused unless ``replace=True``. For example::

        @register("noisy_expert_choice", allocation="expert")
        def noisy_expert_choice(dim, num_experts, *, capacity_factor=1.0, rngs):
            return Router(NoisySoftmax(dim, num_experts, rngs=rngs), ExpertChoice(capacity_factor))
    """
    if allocation not in ALLOCATIONS:
        raise InputError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}.")
    if name in ROUTERS and not replace:
        raise InputError(f"A router is already registered as {name!r}; pick another name, or pass "
                         f"replace=True to replace it.")

    def add(build):
        ROUTERS[name] = RouterSpec(build, allocation, placement)
        return build

    return add


def make_router(name: str, dim: int, num_experts: int, *, rngs: nnx.Rngs, frozen: bool = False,
                **kwargs) -> Router:
    """Create the router registered as ``name`` (see :data:`ROUTERS`) with its ``kwargs``.

    ``frozen=True``: the router's weights stay at their initial values (:func:`freeze`), the
    routing control of a learned-routing experiment.
    """
    if not isinstance(frozen, bool):
        raise InputError(f"frozen must be True or False, got {frozen!r}.")
    router = spec(name).build(dim, num_experts, rngs=rngs, **kwargs)
    return freeze(router) if frozen else router


def per_image(name: str | None) -> bool:
    """Whether the router registered as ``name`` routes each image on its own (False for
    ``None``, the dense model)."""
    return name is not None and spec(name).per_image


def spec(name: str) -> RouterSpec:
    """The :class:`RouterSpec` registered as ``name``; a clear error for an unknown name."""
    if name not in ROUTERS:
        raise InputError(f"Unknown router {name!r}; expected one of: {', '.join(sorted(ROUTERS))}.")
    return ROUTERS[name]


# ------------------------------------------------------- the routers of the papers, by name


@register("softmax_token_choice", allocation="token")
def softmax_token_choice(dim, num_experts, *, k=1, capacity_factor=None, batch_priority=False, noise_std=1.0,
                         balance_loss=True, z_loss=0.0, balance_scope="group", deterministic=False,
                         rngs: nnx.Rngs) -> Router:
    """Softmax Token Choice (paper 000, Sec. 2.1): the V-MoE router. Options: see
    :class:`NoisySoftmax` and :class:`TokenChoice`."""
    affinity = NoisySoftmax(dim, num_experts, noise_std=noise_std, balance_loss=balance_loss, z_loss=z_loss,
                            balance_scope=balance_scope, deterministic=deterministic, rngs=rngs)
    return Router(affinity, TokenChoice(k, capacity_factor, batch_priority))


@register("sigmoid_loss_free", allocation="token")
def sigmoid_loss_free(dim, num_experts, *, k=2, capacity_factor=None, batch_priority=False, bias_rate=1e-3,
                      seq_balance=0.0, balance_scope="group", num_groups=1, top_groups=1, deterministic=False,
                      rngs: nnx.Rngs) -> Router:
    """DeepSeek-V3's gating (arXiv 2412.19437, Sec. 2.1.2): sigmoid scores, top-k on scores plus
    a balancing bias updated without an auxiliary loss, gates normalised over the k; Token
    Choice (Algorithm 1) allocates. k = 2 by default; at k = 1 the gate is the chosen score, not
    normalised (normalised it would be 1, and the router would learn nothing from the task).
    Options: :class:`SigmoidGates`."""
    affinity = SigmoidGates(dim, num_experts, bias_rate=bias_rate, seq_balance=seq_balance, balance_scope=balance_scope,
                            num_groups=num_groups, top_groups=top_groups, deterministic=deterministic, rngs=rngs)
    affinity.check(k)
    return Router(affinity, TokenChoice(k, capacity_factor, batch_priority))


@register("group_limited", allocation="token")
def group_limited(dim, num_experts, *, k=2, capacity_factor=None, batch_priority=False, bias_rate=1e-3,
                  seq_balance=0.0, balance_scope="group", num_groups=2, top_groups=1, deterministic=False,
                  rngs: nnx.Rngs) -> Router:
    """Group-limited (device-limited) routing of DeepSeek-V2/V3: :func:`sigmoid_loss_free` with
    the experts in ``num_groups`` groups, of which each token uses its ``top_groups`` best (by
    default 2 groups, 1 kept: every token's k experts share a group)."""
    return sigmoid_loss_free(dim, num_experts, k=k, capacity_factor=capacity_factor, batch_priority=batch_priority,
                             bias_rate=bias_rate, seq_balance=seq_balance, balance_scope=balance_scope,
                             num_groups=num_groups, top_groups=top_groups, deterministic=deterministic, rngs=rngs)


@register("remoe", allocation="token")
def remoe(dim, num_experts, *, k=1, capacity_factor=None, l1_init=1e-8, l1_rate=1.2, l1_scope="model",
          active_bound=2.0, deterministic=False, rngs: nnx.Rngs) -> Router:
    """ReMoE (Wang et al. 2024, arXiv 2412.14711): ReLU gates with an adaptive, load-balanced
    L1 penalty that holds k active experts per token on average (:class:`ReluGates`); every
    positive gate is a pick (:class:`TokenChoice` with k = E, ``min_score = 0``). The number of
    experts varies per token, so buffers of ``capacity_factor`` (default k) drop what overflows;
    ``moe_path="dropless"`` drops nothing. The auxiliary loss is lambda times the penalty; the
    controller moves lambda until the sparsity is reached, whatever weight the training loss
    gives the auxiliary losses. ``l1_scope``: one lambda for the model (``"model"``, ReMoE's
    reference, moved by :class:`mini_moe.model.VisionMoE`) or one per layer (``"layer"``).

    ``active_bound``: on the dropless path at most ``active_bound * k`` picks per token on average
    over a call are sorted, stored and computed (None: all ``E`` pairs of every token). The
    controller holds the average at k, so the default 2 leaves room for twice that; beyond it the
    smallest positive gates are dropped and the layer's ``overflow`` metric says how many. ReMoE's
    first steps, before lambda has grown (it starts at ``l1_init``), are nearly dense, and that is
    where the bound drops picks. ``mini_moe/results/remoe_sparse.py`` measures time and memory
    against dropless top-k."""
    affinity = ReluGates(dim, num_experts, target_k=k, l1_init=l1_init, l1_rate=l1_rate, l1_scope=l1_scope,
                         deterministic=deterministic, rngs=rngs)
    if active_bound is not None and not active_bound > 0:
        raise InputError(f"active_bound must be > 0 (picks per token, in units of k) or None, got {active_bound!r}.")
    return Router(affinity, TokenChoice(num_experts, k if capacity_factor is None else capacity_factor,
                                        min_score=0.0, pick_bound=None if active_bound is None else active_bound * k))


@register("hash", allocation="token")
def hash_router(dim, num_experts, *, k=1, capacity_factor=None, batch_priority=False, rngs: nnx.Rngs) -> Router:
    """A hash router (a routing control; Roller et al. 2021's Hash Layers for continuous tokens):
    each token to the k experts of a fixed random projection (:class:`HashProjection`), combine
    weight 1/k; Token Choice (Algorithm 1) allocates. Nothing in it is learned."""
    return Router(HashProjection(dim, num_experts, rngs=rngs), TokenChoice(k, capacity_factor, batch_priority))


@register("sinkhorn_token_choice", allocation="token")
def sinkhorn_token_choice(dim, num_experts, *, k=1, capacity_factor=None, batch_priority=False,
                          softmax_combine=True, num_iters=20, epsilon=1.0, rngs: nnx.Rngs) -> Router:
    """Sinkhorn Token Choice (paper 000, Sec. 2.2; Clark et al. 2022): Algorithm 1 on the plan
    of eq. (8)."""
    affinity = SinkhornPlan(dim, num_experts, softmax_combine=softmax_combine, num_iters=num_iters,
                            epsilon=epsilon, rngs=rngs)
    return Router(affinity, TokenChoice(k, capacity_factor, batch_priority))


@register("svmoe", allocation="token")
def svmoe(dim, num_experts, *, k=2, capacity_factor=None, batch_priority=False, num_iters=20,
          rngs: nnx.Rngs) -> Router:
    """SVMoE (paper 001): Algorithm 1 on the quadratic plan of softmax(XW), gamma = 1/k."""
    return Router(QuadraticPlan(dim, num_experts, num_iters=num_iters, rngs=rngs),
                  TokenChoice(k, capacity_factor, batch_priority))


@register("softmax_expert_choice", allocation="expert")
def softmax_expert_choice(dim, num_experts, *, capacity_factor=1.0, noise_std=0.0, deterministic=False,
                          rngs: nnx.Rngs) -> Router:
    """Softmax Expert Choice (paper 000, Sec. 2.3; Zhou et al. 2022): Algorithm 2 on softmax(XW).

    ``noise_std > 0``: the experts rank ``softmax(XW + noise)`` with Token Choice's training noise
    N(0, (noise_std / E)^2) (:class:`NoisySoftmax`, no auxiliary loss), so that Expert Choice and
    Token Choice can be compared with the same noise; 0 (the paper's router): no noise."""
    if noise_std == 0:
        return Router(Softmax(dim, num_experts, rngs=rngs), ExpertChoice(capacity_factor))
    affinity = NoisySoftmax(dim, num_experts, noise_std=noise_std, balance_loss="none",
                            deterministic=deterministic, rngs=rngs)
    return Router(affinity, ExpertChoice(capacity_factor))


@register("sinkhorn_expert_choice", allocation="expert")
def sinkhorn_expert_choice(dim, num_experts, *, capacity_factor=1.0, softmax_combine=True, num_iters=20,
                           epsilon=1.0, rngs: nnx.Rngs) -> Router:
    """Sinkhorn Expert Choice (paper 000, Sec. 2.4): Algorithm 2 on the plan of eq. (8)."""
    affinity = SinkhornPlan(dim, num_experts, softmax_combine=softmax_combine, num_iters=num_iters,
                            epsilon=epsilon, rngs=rngs)
    return Router(affinity, ExpertChoice(capacity_factor))


@register("sparsity_constrained_expert_choice", allocation="expert")
def sparsity_constrained_expert_choice(dim, num_experts, *, capacity_factor=1.0, tol=1e-3, max_iters=30,
                                       rngs: nnx.Rngs) -> Router:
    """Sparsity-constrained Expert Choice (paper 000, Sec. 2.5): Algorithm 2 on the plan of
    eq. (9) with at most C tokens per expert."""
    return Router(SparsityConstrainedPlan(dim, num_experts, tol=tol, max_iters=max_iters, rngs=rngs),
                  ExpertChoice(capacity_factor))


@register("soft_moe", allocation="soft", placement="last2")
def soft_moe(dim, num_experts, *, slots_per_expert=1, normalize=True, ablation="soft", rngs: nnx.Rngs) -> Router:
    """Soft MoE (paper 002; paper 000, Sec. 2.6), for the tokens of one image. Options: see
    :class:`SlotLogits` and :class:`SoftRouting`."""
    allocation = SoftRouting(ablation)
    return Router(SlotLogits(dim, num_experts, slots_per_expert=slots_per_expert, normalize=normalize, rngs=rngs),
                  allocation)
