"""The allocations (frozen dataclasses, no parameters): :class:`TokenChoice` (Algorithm 1),
:class:`ExpertChoice` (Algorithm 2) and Soft MoE's :class:`SoftRouting`. Re-exported by
:mod:`mini_moe.routers`."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from mini_moe import routing
from mini_moe.routers.types import Affinities, Array, Budget
from mini_moe.validate import InputError, check_int


# ----------------------------------------------------------------------------- allocations


class Allocation:
    """What every allocation answers, so that code outside it never asks which class it is.

    Attributes:
      name: ``"token"``, ``"expert"`` or ``"soft"``, as :func:`mini_moe.routers.register` names it.
      per_image: it routes the tokens of each image on their own (Soft MoE), whatever the group.
      supports_dropless: it has a dropless path (:func:`mini_moe.layer.moe_sorted`; Token Choice).
      null_experts: Z, the affinity's last Z columns are null experts (Token Choice only).
    """

    name = ""
    per_image = False
    supports_dropless = False
    null_experts = 0

    def check(self, num_experts: int) -> None:
        """Refuse a router of ``num_experts`` columns this allocation cannot serve."""

    def picks(self, affinities: Affinities) -> Array | None:
        """``bool [..., T, E (+ Z)]``: the experts each token picks before any capacity cut; None
        when the allocation makes no per-token picks (experts pick tokens, or slots mix them)."""
        return None

    def null_gates(self, affinities: Affinities) -> Array | None:
        """The null experts' combine weights ``[..., T, Z]``; None without null experts."""
        return None


@dataclasses.dataclass(frozen=True)
class TokenChoice(Allocation):
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
      null_experts: Z, the last Z of the affinity's E + Z columns are null experts (AdaMoE, MoE++,
        LongCat-Flash; :class:`mini_moe.layer.NullExperts`): a token's k picks are its top k over
        all E + Z columns, but a pick of a null expert takes no slot and is never dropped (it
        costs no expert FLOPs, so it needs no buffer). The routing tensors ``[..., T, E, C]``
        cover the E real experts, whose picks Algorithm 1 places as usual (each token's real
        picks by decreasing score; C = round(capacity_factor * T / E)), and
        :meth:`null_gates` gives the null picks' combine weights ``[..., T, Z]``.
    """

    k: int = 1
    capacity_factor: float | None = None
    batch_priority: bool = False
    min_score: float | None = None
    pick_bound: float | None = None
    null_experts: int = 0
    name = "token"
    supports_dropless = True

    def __post_init__(self):
        check_int("k", self.k)
        factor = float(self.k if self.capacity_factor is None else self.capacity_factor)
        if not factor > 0:
            raise InputError(f"capacity_factor must be > 0, got {self.capacity_factor!r}.")
        object.__setattr__(self, "capacity_factor", factor)
        object.__setattr__(self, "batch_priority", bool(self.batch_priority))
        if self.pick_bound is not None and not self.pick_bound > 0:
            raise InputError(f"pick_bound must be > 0 (picks per token on average) or None, got {self.pick_bound!r}.")
        check_int("null_experts", self.null_experts, 0)

    def max_picks(self, num_tokens: int) -> int | None:
        """The dropless path's static bound on the picks of a call of ``num_tokens`` tokens."""
        return None if self.pick_bound is None else math.ceil(self.pick_bound * num_tokens)

    def check(self, num_experts: int) -> None:
        if self.k > num_experts:
            raise InputError(f"k must be <= num_experts={num_experts}, got k={self.k}.")
        if self.null_experts >= num_experts:
            raise InputError(f"null_experts={self.null_experts} leaves no real expert among the router's "
                             f"{num_experts} columns; it must be < {num_experts}.")

    def budget(self, num_tokens: int, num_experts: int) -> Budget:
        """``num_experts``: the affinity's columns (E + Z); the capacity is per real expert."""
        return Budget(self.k, routing.capacity(num_tokens, num_experts - self.null_experts, self.capacity_factor))

    def real_picks(self, affinities: Affinities) -> dict:
        """What Algorithm 1 (and :func:`mini_moe.layer.moe_sorted`) needs for the real experts:
        ``scores`` and ``combine_scores`` ``[..., T, E]``, ``k`` and ``min_score``. Without null
        experts, the affinities as they are. With Z null experts, the first E columns, where a
        column that is not among the token's top k of all E + Z (or not above ``min_score``)
        holds the lowest finite number and ``min_score`` is that number, so that pick is not made."""
        combine = affinities.scores if affinities.combine is None else affinities.combine
        if not self.null_experts:
            return dict(scores=affinities.scores, combine_scores=affinities.combine, k=self.k, min_score=self.min_score)
        scores = affinities.scores
        real = scores.shape[-1] - self.null_experts
        picked = self.picks(affinities)[..., :real]
        sentinel = jnp.finfo(scores.dtype).min
        return dict(scores=jnp.where(picked, scores[..., :real], sentinel), combine_scores=combine[..., :real],
                    k=min(self.k, real), min_score=float(sentinel))

    def picks(self, affinities: Affinities) -> Array:
        """``bool [..., T, E + Z]``: the picks each token makes, its top k of the scores (those
        above ``min_score``; the affinity's balancing bias, if any, is in the scores)."""
        scores = affinities.scores
        values, picks = jax.lax.top_k(scores, self.k)
        made = jnp.ones(values.shape, bool) if self.min_score is None else values > self.min_score
        return jnp.any(jax.nn.one_hot(picks, scores.shape[-1], dtype=bool) & made[..., None], axis=-2)

    def null_gates(self, affinities: Affinities) -> Array | None:
        """The null experts' combine weights ``[..., T, Z]`` (the affinity's combine source at the
        null picks, 0 elsewhere); None without null experts."""
        if not self.null_experts:
            return None
        combine = affinities.scores if affinities.combine is None else affinities.combine
        picked = self.picks(affinities)[..., -self.null_experts:]
        return jnp.where(picked, combine[..., -self.null_experts:], 0)

    def __call__(self, affinities: Affinities, budget: Budget) -> routing.Routing:
        picks = self.real_picks(affinities)
        return routing.token_choice(picks["scores"], capacity=budget.capacity, k=picks["k"],
                                    batch_priority=self.batch_priority, combine_scores=picks["combine_scores"],
                                    min_score=picks["min_score"])


@dataclasses.dataclass(frozen=True)
class ExpertChoice(Allocation):
    """Algorithm 2 (paper 000; Zhou et al. 2022): every expert picks its top
    C = round(capacity_factor * T / E) tokens (at most T)."""

    capacity_factor: float = 1.0
    name = "expert"

    def __post_init__(self):
        if not self.capacity_factor > 0:
            raise InputError(f"capacity_factor must be > 0, got {self.capacity_factor!r}.")
        object.__setattr__(self, "capacity_factor", float(self.capacity_factor))

    def budget(self, num_tokens: int, num_experts: int) -> Budget:
        return Budget(1, min(num_tokens, routing.capacity(num_tokens, num_experts, self.capacity_factor)))

    def __call__(self, affinities: Affinities, budget: Budget) -> routing.Routing:
        return routing.expert_choice(affinities.scores, capacity=budget.capacity, combine_scores=affinities.combine)


SOFT_MOE_ABLATIONS = ("soft", "soft/uniform", "uniform/soft", "uniform", "identity")


@dataclasses.dataclass(frozen=True)
class SoftRouting(Allocation):
    """Soft MoE's allocation (paper 002), for the tokens of one image: dispatch is a softmax of
    the slot logits over tokens, combine a softmax over all (expert, slot) pairs.

    Args:
      ablation: paper 002 Table 2: ``"soft"`` (Soft MoE), ``"soft/uniform"`` (learned
        dispatch, uniform combine), ``"uniform/soft"``, ``"uniform"`` (every slot the
        token average, outputs averaged), ``"identity"`` (token t to slot t; needs
        E * S = T).
    """

    ablation: str = "soft"
    name = "soft"
    per_image = True

    def __post_init__(self):
        if self.ablation not in SOFT_MOE_ABLATIONS:
            raise InputError(f"ablation must be one of {SOFT_MOE_ABLATIONS}, got {self.ablation!r}.")

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
