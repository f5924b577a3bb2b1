"""A :class:`Router` (one affinity composed with one allocation) and the registry of routers by
name: :data:`ROUTERS`, :func:`register`, :func:`make_router`, :func:`spec`, :func:`per_image`.
Re-exported by :mod:`mini_moe.routers`."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mini_moe import routing
from mini_moe.routers.allocations import ExpertChoice, SoftRouting, TokenChoice
from mini_moe.routers.controls import freeze
from mini_moe.routers.types import Array, RouterOutput
from mini_moe.validate import InputError


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
            if not self.allocation.supports_dropless:
                raise InputError(f"dropless routing needs a Token Choice allocation, not "
                                 f"{type(self.allocation).__name__}; use the 'gather' or 'einsum' path.")
            budget = budget._replace(capacity=num_tokens)  # an expert can take every token once
        rt = self.allocation(affinities, budget)
        metrics = routing.routing_metrics(rt)
        picks = self.allocation.picks(affinities)  # None: the allocation makes no per-token picks
        if picks is not None:  # the demand before capacity cuts it
            load = picks.reshape(-1, picks.shape[-1]).sum(0).astype(jnp.float32)  # [E + Z]
            real = self.num_experts - self.allocation.null_experts
            metrics["max_violation"] = routing.max_violation(load[:real])
            metrics["pick_load"] = load  # an accumulated step's MaxVio comes from the summed loads
            if self.allocation.null_experts:  # picks per token, before capacity: real experts and null ones
                tokens = math.prod(np.shape(x)[:-1])
                metrics["real_picks"] = jnp.sum(load[:real]) / tokens
                metrics["null_picks"] = jnp.sum(load[real:]) / tokens
        metrics.update(affinities.metrics)
        probs = affinities.probs if affinities.probs is not None else rt.combine.sum(axis=-1)
        return RouterOutput(rt, jnp.asarray(affinities.aux_loss, jnp.float32), metrics, probs, affinities,
                            self.allocation.null_gates(affinities), picks)


# ---------------------------------------------------------------------------- the registry

ALLOCATIONS = ("token", "expert", "soft")
#: What a router can read (:attr:`RouterSpec.reads`): the MoE layer's tokens, or the raw patches.
READS = ("representation", "pixels")
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
      reads: what its router reads: ``"representation"`` (the tokens the MoE layer transforms) or
        ``"pixels"`` (the raw patches the model's embedding receives, ``p*p*C`` per token, so
        nothing the network learns can steer the routing: the raw-key routers, :class:`RawKey`).
        :class:`mini_moe.model.VisionMoE` builds the router for that input and hands it over.
      data: None for a router that builds for any ``dim`` and number of experts, or the dataset
        family whose structure it reads (``"subtask_vote"`` for ``raw_oracle``: its signatures,
        7x7 patches, 8 experts); it takes the dataset's name as its option ``dataset``, which
        :func:`mini_moe.config.get_config` fills in. Code that builds every router at one shape
        (benchmarks, tests) skips these.
    """

    build: Callable[..., Router]
    allocation: str
    placement: str = "every2"
    reads: str = "representation"
    data: str | None = None

    @property
    def options(self) -> dict:
        """``{option: default}`` of every option ``build`` takes beyond ``dim``, ``num_experts`` and
        ``rngs`` (``k``, ``capacity_factor``, ``z_loss``, ``null_experts``, ...; an option without
        a default maps to ``inspect.Parameter.empty``): what the layer, the configuration and
        ``diagnose`` ask of a router, read from its one declaration."""
        import inspect

        params = inspect.signature(self.build).parameters
        return {n: p.default for n, p in params.items() if n not in ("dim", "num_experts", "rngs")
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}

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


def general_routers() -> list[str]:
    """The registered routers that build for any ``dim`` and number of experts (:attr:`RouterSpec.data`
    None), sorted: what code that builds every router at one shape (benchmarks, the default study)
    loops over."""
    return sorted(name for name, s in ROUTERS.items() if s.data is None)


def register(name: str, *, allocation: str, placement: str = "every2", reads: str = "representation",
             data: str | None = None, replace: bool = False) -> Callable[[Callable], Callable]:
    """Decorator adding a router builder to :data:`ROUTERS` under ``name``.

    ``allocation`` is ``"token"``, ``"expert"`` or ``"soft"`` (it also decides whether the
    router routes each image on its own, :attr:`RouterSpec.per_image`); ``reads`` is
    ``"representation"`` or ``"pixels"`` (:attr:`RouterSpec.reads`); ``data`` names the dataset
    family a router is defined for, if any (:attr:`RouterSpec.data`). A name that is
    already registered is refused unless ``replace=True``. For example::

        @register("noisy_expert_choice", allocation="expert")
        def noisy_expert_choice(dim, num_experts, *, capacity_factor=1.0, rngs):
            return Router(NoisySoftmax(dim, num_experts, rngs=rngs), ExpertChoice(capacity_factor))
    """
    if allocation not in ALLOCATIONS:
        raise InputError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}.")
    if reads not in READS:
        raise InputError(f"reads must be one of {READS}, got {reads!r}.")
    if name in ROUTERS and not replace:
        raise InputError(f"A router is already registered as {name!r}; pick another name, or pass "
                         f"replace=True to replace it.")

    def add(build):
        ROUTERS[name] = RouterSpec(build, allocation, placement, reads, data)
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
