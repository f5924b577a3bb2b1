"""Trainable routers: one affinity composed with one allocation (Flax NNX modules).

Every router maps tokens ``x [..., T, D]`` (leading axes: groups; for Soft MoE, images)
to a :class:`RouterOutput`: the routing tensors ``[..., T, E, C]`` for
:func:`mini_moe.layer.moe`, an auxiliary loss to add to the training loss, and routing
metrics. Create them by name::

    router = make_router("sinkhorn_expert_choice", dim=64, num_experts=8,
                         capacity_factor=2.0, rngs=nnx.Rngs(0))

=================================== ============================ =========================
name                                affinity                     allocation
=================================== ============================ =========================
``softmax_token_choice``            softmax(XW + noise)          Algorithm 1 (+ BPR, losses)
``sinkhorn_token_choice``           Sinkhorn plan of XW          Algorithm 1
``svmoe``                           quadratic OT of softmax(XW)  Algorithm 1
``softmax_expert_choice``           softmax(XW)                  Algorithm 2
``sinkhorn_expert_choice``          Sinkhorn plan of XW          Algorithm 2
``sparsity_constrained_expert_choice`` eq. (9) plan of softmax(XW) Algorithm 2
``soft_moe``                        l2-normalised X Phi          two softmaxes
=================================== ============================ =========================

The OT routers take positions from the plan and, with ``softmax_combine=True`` (the
default, paper 000 Sec. 3.4), combine weights from softmax(XW).

Training-time noise follows Flax's dropout convention: it is added while the module
is not ``deterministic`` (``model.train()``), and never under ``model.eval()``.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mini_moe import losses, routing, transport

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
    """

    routing: routing.Routing
    aux_loss: Array
    metrics: dict
    probs: Array


ROUTERS: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator adding a router to the registry under ``name``."""

    def add(cls):
        ROUTERS[name] = cls
        cls.name = name
        return cls

    return add


def make_router(name: str, dim: int, num_experts: int, *, rngs: nnx.Rngs, **kwargs) -> "Router":
    """Create the router registered as ``name`` (see :data:`ROUTERS`)."""
    if name not in ROUTERS:
        raise ValueError(f"Unknown router {name!r}; expected one of: {', '.join(sorted(ROUTERS))}.")
    return ROUTERS[name](dim, num_experts, rngs=rngs, **kwargs)


def _check_int(name, value, low=1):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")


class Router(nnx.Module):
    """Base class: a linear map ``W [D, E]`` from tokens to expert logits."""

    name = "router"

    def __init__(self, dim: int, num_experts: int, *, rngs: nnx.Rngs):
        _check_int("dim", dim)
        _check_int("num_experts", num_experts)
        self.dim, self.num_experts = dim, num_experts
        self.dense = nnx.Linear(dim, num_experts, use_bias=False, rngs=rngs)

    def _tokens(self, x):
        shape = np.shape(x)
        if len(shape) < 2 or shape[-1] != self.dim:
            raise ValueError(f"x must have shape [..., T, D={self.dim}], got {shape}.")
        return x

    def logits(self, x: Array) -> Array:
        """Clean router logits ``x W``: ``[..., T, E]``."""
        return self.dense(self._tokens(x))

    def _output(self, rt, probs, aux_loss=0.0, **extra):
        metrics = routing.routing_metrics(rt)
        metrics.update(extra)
        return RouterOutput(rt, jnp.asarray(aux_loss, jnp.float32), metrics, probs)


class _TokenChoiceOptions:
    """Shared validation of k and the capacity factor for Algorithm-1 routers."""

    def _set_token_choice(self, k, capacity_factor, batch_priority):
        _check_int("k", k)
        if k > self.num_experts:
            raise ValueError(f"k must be <= num_experts={self.num_experts}, got k={k}.")
        self.k = k
        self.capacity_factor = float(k if capacity_factor is None else capacity_factor)
        if not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor!r}.")
        self.batch_priority = bool(batch_priority)

    def _allocate(self, scores, combine_scores):
        cap = routing.capacity(scores.shape[-2], self.num_experts, self.capacity_factor)
        return routing.token_choice(
            scores, capacity=cap, k=self.k, batch_priority=self.batch_priority, combine_scores=combine_scores
        )


@register("softmax_token_choice")
class SoftmaxTokenChoice(Router, _TokenChoiceOptions):
    """Softmax Token Choice (paper 000, Sec. 2.1): the V-MoE router.

    Args:
      k: experts per token (1 or 2 in the paper).
      capacity_factor: C = round(capacity_factor * T / E); default k.
      noise_std: training noise N(0, (noise_std / E)^2) on the logits (V-MoE: 1).
      batch_priority: Batch Priority Routing.
      balance_loss: the balancing term of the auxiliary loss: ``"importance_load"`` (or
        ``True``; V-MoE's (importance + load) / 2, Appendix A), ``"switch"`` (the Switch
        Transformer / GShard loss, :func:`mini_moe.losses.switch_loss`) or ``"none"`` (or
        ``False``; shows the collapse the losses prevent).
      z_loss: weight of the router z-loss (ST-MoE) inside the auxiliary loss, relative to the
        balancing term (ST-MoE uses 1e-3 against 1e-2, i.e. 0.1); 0 turns it off.

    Every loss is also reported in the metrics, whichever of them is trained.
    """

    BALANCE_LOSSES = ("importance_load", "switch", "none")

    def __init__(self, dim, num_experts, *, k=1, capacity_factor=None, noise_std=1.0,
                 batch_priority=False, balance_loss=True, z_loss=0.0, deterministic=False, rngs: nnx.Rngs):
        super().__init__(dim, num_experts, rngs=rngs)
        self._set_token_choice(k, capacity_factor, batch_priority)
        if noise_std < 0:
            raise ValueError(f"noise_std must be >= 0, got {noise_std!r}.")
        self.noise_std = float(noise_std)
        if isinstance(balance_loss, bool):
            balance_loss = "importance_load" if balance_loss else "none"
        if balance_loss not in self.BALANCE_LOSSES:
            raise ValueError(f"balance_loss must be one of {self.BALANCE_LOSSES} (or True/False), got {balance_loss!r}.")
        if not z_loss >= 0:
            raise ValueError(f"z_loss must be >= 0, got {z_loss!r}.")
        self.balance_loss, self.z_loss = balance_loss, float(z_loss)
        self.deterministic = deterministic
        self.rngs = rngs["noise"].fork()

    def __call__(self, x: Array) -> RouterOutput:
        logits = self.logits(x)
        noisy = logits
        if not self.deterministic and self.noise_std > 0:
            noise = jax.random.normal(self.rngs(), logits.shape, logits.dtype)
            noisy = logits + noise * (self.noise_std / self.num_experts)
        probs = jax.nn.softmax(noisy, axis=-1)
        rt = self._allocate(probs, None)
        importance = losses.importance_loss(logits)
        load = (losses.load_loss(logits, noisy, k=self.k, noise_std=self.noise_std)
                if self.noise_std > 0 else importance)
        switch = losses.switch_loss(probs, k=self.k)
        z = losses.z_loss(logits)
        aux = {"importance_load": (importance + load) / 2, "switch": switch, "none": 0.0}[self.balance_loss]
        aux = aux + self.z_loss * z
        return self._output(rt, probs, aux, importance_loss=importance, load_loss=load, switch_loss=switch, z_loss=z)


class _SinkhornOptions:
    def _set_sinkhorn(self, num_iters, epsilon, softmax_combine):
        _check_int("num_iters", num_iters)
        if not epsilon > 0:
            raise ValueError(f"epsilon must be > 0, got {epsilon!r}.")
        self.num_iters, self.epsilon = num_iters, float(epsilon)
        self.softmax_combine = bool(softmax_combine)

    def _plan_and_combine(self, logits):
        plan = transport.sinkhorn(logits, num_iters=self.num_iters, epsilon=self.epsilon)
        if self.softmax_combine:  # the backward pass skips Sinkhorn entirely
            return jax.lax.stop_gradient(plan), jax.nn.softmax(logits, axis=-1)
        return plan, None


@register("sinkhorn_token_choice")
class SinkhornTokenChoice(Router, _TokenChoiceOptions, _SinkhornOptions):
    """Sinkhorn Token Choice (paper 000, Sec. 2.2; Clark et al. 2022).

    Dispatch from Algorithm 1 on the entropic plan of eq. (8); combine from softmax(XW)
    (``softmax_combine=True``) or from the plan itself (``False``; paper 000 Fig. 3).
    """

    def __init__(self, dim, num_experts, *, k=1, capacity_factor=None, batch_priority=False,
                 softmax_combine=True, num_iters=20, epsilon=1.0, rngs: nnx.Rngs):
        super().__init__(dim, num_experts, rngs=rngs)
        self._set_token_choice(k, capacity_factor, batch_priority)
        self._set_sinkhorn(num_iters, epsilon, softmax_combine)

    def __call__(self, x: Array) -> RouterOutput:
        logits = self.logits(x)
        plan, combine_scores = self._plan_and_combine(logits)
        return self._output(self._allocate(plan, combine_scores), jax.nn.softmax(logits, axis=-1))


@register("svmoe")
class SVMoE(Router, _TokenChoiceOptions):
    """SVMoE (paper 001): Algorithm 1 on the quadratically regularised OT plan of
    softmax(XW) with ``gamma = 1/k``; combine weights from the softmax.

    Paper 001 says the plan is found "using the Sinkhorn algorithm"; for a quadratic
    regulariser the exact analogue is :func:`mini_moe.transport.quadratic_plan`.
    """

    def __init__(self, dim, num_experts, *, k=2, capacity_factor=None, batch_priority=False,
                 num_iters=20, rngs: nnx.Rngs):
        super().__init__(dim, num_experts, rngs=rngs)
        self._set_token_choice(k, capacity_factor, batch_priority)
        _check_int("num_iters", num_iters)
        self.num_iters = num_iters

    def __call__(self, x: Array) -> RouterOutput:
        probs = jax.nn.softmax(self.logits(x), axis=-1)
        plan = transport.quadratic_plan(jax.lax.stop_gradient(probs), gamma=1.0 / self.k, num_iters=self.num_iters)
        return self._output(self._allocate(plan, probs), probs)


class _ExpertChoiceOptions:
    def _set_expert_choice(self, capacity_factor):
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor!r}.")
        self.capacity_factor = float(capacity_factor)

    def _capacity(self, num_tokens):
        return min(num_tokens, routing.capacity(num_tokens, self.num_experts, self.capacity_factor))


@register("softmax_expert_choice")
class SoftmaxExpertChoice(Router, _ExpertChoiceOptions):
    """Softmax Expert Choice (paper 000, Sec. 2.3; Zhou et al. 2022): Algorithm 2 on
    softmax(XW), with C = round(capacity_factor * T / E) tokens per expert."""

    def __init__(self, dim, num_experts, *, capacity_factor=1.0, rngs: nnx.Rngs):
        super().__init__(dim, num_experts, rngs=rngs)
        self._set_expert_choice(capacity_factor)

    def __call__(self, x: Array) -> RouterOutput:
        probs = jax.nn.softmax(self.logits(x), axis=-1)
        return self._output(routing.expert_choice(probs, capacity=self._capacity(probs.shape[-2])), probs)


@register("sinkhorn_expert_choice")
class SinkhornExpertChoice(Router, _ExpertChoiceOptions, _SinkhornOptions):
    """Sinkhorn Expert Choice (paper 000, Sec. 2.4): Algorithm 2 on the plan of eq. (8)."""

    def __init__(self, dim, num_experts, *, capacity_factor=1.0, softmax_combine=True,
                 num_iters=20, epsilon=1.0, rngs: nnx.Rngs):
        super().__init__(dim, num_experts, rngs=rngs)
        self._set_expert_choice(capacity_factor)
        self._set_sinkhorn(num_iters, epsilon, softmax_combine)

    def __call__(self, x: Array) -> RouterOutput:
        logits = self.logits(x)
        plan, combine_scores = self._plan_and_combine(logits)
        cap = self._capacity(plan.shape[-2])
        rt = routing.expert_choice(plan, capacity=cap, combine_scores=combine_scores)
        return self._output(rt, jax.nn.softmax(logits, axis=-1))


@register("sparsity_constrained_expert_choice")
class SparsityConstrainedExpertChoice(Router, _ExpertChoiceOptions):
    """Sparsity-constrained Expert Choice (paper 000, Sec. 2.5): Algorithm 2 on the
    eq. (9) plan of softmax(XW) with at most C tokens per expert; combine weights from
    the softmax. Metrics add the solver's iterations and token-marginal error."""

    def __init__(self, dim, num_experts, *, capacity_factor=1.0, tol=1e-3, max_iters=30, rngs: nnx.Rngs):
        super().__init__(dim, num_experts, rngs=rngs)
        self._set_expert_choice(capacity_factor)
        self.tol, self.max_iters = float(tol), int(max_iters)

    def __call__(self, x: Array) -> RouterOutput:
        probs = jax.nn.softmax(self.logits(x), axis=-1)
        cap = self._capacity(probs.shape[-2])
        plan, info = transport.sparsity_constrained_plan(
            probs, max_nonzeros=cap, tol=self.tol, max_iters=self.max_iters, return_info=True
        )
        rt = routing.expert_choice(plan, capacity=cap, combine_scores=probs)
        return self._output(rt, probs, solver_iterations=jnp.mean(info.iterations.astype(jnp.float32)),
                            solver_marginal_error=jnp.mean(info.marginal_error))


def l2_normalize(x: Array, axis: int, eps: float = 1e-6) -> Array:
    """``x / sqrt(sum(x^2) + eps)`` along ``axis`` (eps inside the root: finite at 0)."""
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=axis, keepdims=True) + eps)


SOFT_MOE_ABLATIONS = ("soft", "soft/uniform", "uniform/soft", "uniform", "identity")


@register("soft_moe")
class SoftMoE(Router):
    """Soft MoE router (paper 002; paper 000, Sec. 2.6), for the tokens of one image.

    Logits ``Z[t, r, s] = <l2n(x_t), scale * l2n(Phi[:, r, s])>`` (l2 normalisation
    over D, learnable scalar ``scale`` initialised at 1); dispatch is a softmax over
    tokens, combine a softmax over all (expert, slot) pairs.

    Args:
      slots_per_expert: S (paper 002's best setting is 1).
      normalize: use the l2 normalisation and scale (paper 002, Sec. 2.3).
      ablation: paper 002 Table 2: ``"soft"`` (Soft MoE), ``"soft/uniform"`` (learned
        dispatch, uniform combine), ``"uniform/soft"``, ``"uniform"`` (every slot the
        token average, outputs averaged), ``"identity"`` (token t to slot t; needs
        E * S = T).
    """

    def __init__(self, dim, num_experts, *, slots_per_expert=1, normalize=True, ablation="soft", rngs: nnx.Rngs):
        _check_int("dim", dim)
        _check_int("num_experts", num_experts)
        _check_int("slots_per_expert", slots_per_expert)
        if ablation not in SOFT_MOE_ABLATIONS:
            raise ValueError(f"ablation must be one of {SOFT_MOE_ABLATIONS}, got {ablation!r}.")
        self.dim, self.num_experts, self.slots_per_expert = dim, num_experts, slots_per_expert
        self.normalize, self.ablation = bool(normalize), ablation
        init = nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))
        self.phi = nnx.Param(init(rngs.params(), (dim, num_experts, slots_per_expert)))
        self.scale = nnx.Param(jnp.ones(()))

    def logits(self, x: Array) -> Array:
        """Token/slot logits ``[..., T, E, S]``."""
        x = self._tokens(x)
        phi = self.phi[...]
        if self.normalize:
            x, phi = l2_normalize(x, -1), self.scale[...] * l2_normalize(phi, 0)
        return jnp.einsum("...td,des->...tes", x, phi)

    def __call__(self, x: Array) -> RouterOutput:
        num_tokens = np.shape(x)[-2]
        shape = tuple(np.shape(x)[:-1]) + (self.num_experts, self.slots_per_expert)
        if self.ablation == "identity":
            if self.num_experts * self.slots_per_expert != num_tokens:
                raise ValueError(
                    f"identity routing needs num_experts * slots_per_expert == T={num_tokens}, "
                    f"got {self.num_experts} * {self.slots_per_expert}."
                )
            eye = jnp.eye(num_tokens, dtype=x.dtype).reshape((num_tokens,) + shape[-2:])
            rt = routing.Routing(jnp.broadcast_to(eye, shape), jnp.broadcast_to(eye, shape), sparse=True)
            return self._output(rt, rt.combine.sum(axis=-1))
        soft = routing.soft_routing(self.logits(x))
        dispatch_kind, combine_kind = (self.ablation.split("/") * 2)[:2]
        dispatch = soft.dispatch if dispatch_kind == "soft" else jnp.full(shape, 1.0 / num_tokens, x.dtype)
        combine = soft.combine if combine_kind == "soft" else jnp.full(shape, 1.0 / (shape[-1] * shape[-2]), x.dtype)
        rt = routing.Routing(dispatch, combine, sparse=False)
        return self._output(rt, combine.sum(axis=-1), scale=self.scale[...])
