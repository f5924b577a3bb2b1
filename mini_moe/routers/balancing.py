"""The affinities that balance with state of their own instead of (or besides) an auxiliary
loss: DeepSeek-V3's :class:`SigmoidGates` with its :class:`ExpertBias`, ReMoE's
:class:`ReluGates` with its :class:`L1Weight`, and the steps of that state a model takes
(:func:`update_l1_weights`). Both follow the protocol of ``stateful.py``
(:class:`~mini_moe.routers.StatefulAffinity`). Re-exported by :mod:`mini_moe.routers`."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from mini_moe import losses, routing
from mini_moe.routers.affinities import Affinity
from mini_moe.routers.types import Affinities, Array, Budget
from mini_moe.validate import InputError, check_int


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
    move the bias: the training step calls :meth:`deferred_update` once with every micro-batch's
    metrics, which sums their ``pick_load`` and calls :meth:`update_bias`, so the update sees the
    whole accumulated batch (the bug of torchtitan#1304 was one update per micro-batch). This is
    the protocol of :class:`StatefulAffinity`.

    Metrics: ``bias_spread`` (max - min of b), ``sequence_balance_loss`` and ``pick_load`` (``[E]``,
    picks per expert in this call).
    """

    balance_knob = "bias_rate"

    @property
    def bias_moves(self) -> bool:
        """The loss-free bias moves in training (``bias_rate > 0``)."""
        return self.bias_rate > 0

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

    def deferred_update(self, metrics: Sequence[dict]) -> None:
        """:class:`StatefulAffinity`'s step under gradient accumulation: one step of the bias
        (:meth:`update_bias`) from the picks summed over the micro-batches (``metrics``: this
        layer's metrics of each micro-batch, with their ``pick_load``)."""
        if self.bias_rate > 0:
            self.update_bias(sum(m["pick_load"] for m in metrics))

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

    Under gradient accumulation (``defer = True``, set by :func:`defer_updates`) no call moves
    lambda: the training step moves it once from the whole batch, a layer's own lambda in
    :meth:`deferred_update` and the model's in :meth:`model_update` (the protocol of
    :class:`StatefulAffinity`).

    Args:
      target_k: k, the average number of active experts per token the controller aims at.
      l1_init: lambda's initial value (ReMoE: 1e-8).
      l1_rate: the controller's multiplicative step (ReMoE: 1.2).
      l1_scope: ``"model"`` (ReMoE's reference) or ``"layer"``, as above.

    Metrics: ``sparsity`` (fraction of zero gates), ``active_experts`` (mean per token),
    ``l1_weight`` (lambda).
    """

    L1_SCOPES = ("model", "layer")

    pick_rule = "relu"

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

    def deferred_update(self, metrics: Sequence[dict]) -> None:
        """:class:`StatefulAffinity`'s step under gradient accumulation: with ``l1_scope="layer"``,
        one step of lambda by the sparsity averaged over the micro-batches (``metrics``: this
        layer's metrics of each micro-batch; they are equal-sized). The model's lambda
        (``l1_scope="model"``) moves in :meth:`model_update`."""
        if self.l1_scope == "layer":
            self.step_l1(_mean_sparsity(metrics))

    @classmethod
    def model_update(cls, layers: Sequence[tuple[ReluGates, Sequence[dict]]]) -> None:
        """:class:`StatefulAffinity`'s model-level step: ReMoE's one lambda for the model,
        moved once by :func:`update_l1_weights` from the sparsity of every ReLU layer of the model
        (``layers``: ``(affinity, metrics of each micro-batch)``), averaged over the micro-batches
        and then over the layers. Layers in ``l1_scope="layer"`` or in eval mode are left alone."""
        update_l1_weights([gates for gates, _ in layers], [_mean_sparsity(metrics) for _, metrics in layers])

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


def _mean_sparsity(metrics: Sequence[dict]) -> Array:
    """A layer's sparsity over equal-sized micro-batches: the mean of their ``sparsity`` metrics
    (the one micro-batch's own value after a single forward pass)."""
    if len(metrics) == 1:
        return metrics[0]["sparsity"]
    return jnp.mean(jnp.stack([m["sparsity"] for m in metrics]))
