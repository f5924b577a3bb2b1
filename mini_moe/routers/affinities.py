"""The affinities that hold nothing but their weights: :class:`Affinity` (the base, ``XW``),
:class:`Softmax`, :class:`NoisySoftmax`, the transport plans :class:`SinkhornPlan`,
:class:`QuadraticPlan` and :class:`SparsityConstrainedPlan`, and Soft MoE's :class:`SlotLogits`.
The affinities with state of their own are in ``balancing.py``, the hash router's in
``controls.py``. Re-exported by :mod:`mini_moe.routers`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mini_moe import losses, transport
from mini_moe.routers.types import Affinities, Array, Budget
from mini_moe.validate import InputError, check_int


# ------------------------------------------------------------------------------ affinities


class Affinity(nnx.Module):
    """Base affinity: a linear map ``W [D, E]`` from tokens to expert logits.

    Class attributes declare what code outside the router would otherwise guess from its class
    (an affinity written outside the package sets the ones that differ, one line each):

    * ``per_token``: a token's scores depend on that token alone (True), or on the whole routing
      group (the transport plans, the hash control's centring): :func:`mini_moe.modes.invariance`;
    * ``softmax_choice``: each token's distribution over experts is the softmax it routes by, so
      its entropy says how sure the router is (:mod:`mini_moe.diagnose`);
    * ``balances_group``: the scores already balance the group's load (a transport plan);
    * ``balance_knob``: the router option that balances its load (``"balance_loss"``,
      ``"bias_rate"``), if any;
    * ``pick_rule``: for a number of picks that varies per token (``TokenChoice(min_score=...)``),
      its name (``"relu"``, ``"top-p"``);
    * ``bias_moves`` (a property): a balancing bias is supposed to move in training.
    """

    per_token = True
    softmax_choice = False
    balances_group = False
    balance_knob = None
    pick_rule = None
    bias_moves = False

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

    softmax_choice = True

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

    softmax_choice = True
    balance_knob = "balance_loss"

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


class SinkhornPlan(Affinity):
    """The entropic transport plan of ``XW`` (paper 000 eq. 8, Sec. 2.2 and 2.4).

    Args:
      softmax_combine: positions from the plan, combine weights from ``softmax(XW)`` and no
        gradient through Sinkhorn (paper 000 Sec. 3.4); ``False``: both from the plan (Fig. 3).
      num_iters, epsilon: see :func:`mini_moe.transport.sinkhorn`.
    """

    per_token = False  # a plan balances the whole group's tokens together
    balances_group = True

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

    per_token = False  # a plan balances the whole group's tokens together
    balances_group = True

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

    per_token = False  # a plan balances the whole group's tokens together

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

    per_token = True  # a token's slot logits; the allocation mixes the tokens of one image

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
