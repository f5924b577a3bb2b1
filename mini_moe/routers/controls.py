"""Routing controls, for experiments that ask whether the *learned* routing matters: a router
frozen at its initialisation (:func:`freeze`, :class:`FrozenWeight`) and the hash router's
fixed random projection (:class:`HashProjection`). Re-exported by :mod:`mini_moe.routers`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from mini_moe.routers.types import Affinities, Array, Budget
from mini_moe.validate import check_int

if TYPE_CHECKING:
    from mini_moe.routers.registry import Router


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

    per_token = False  # it centres each token on its group's mean
    learned = False  # a fixed partition: nothing about the task decides it

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
