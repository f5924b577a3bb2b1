"""Allocation: turning token/expert scores into routing tensors.

Every router of the book ends here. Given an affinity matrix ``scores`` of shape
``[..., T, E]`` (T tokens of one group, E experts; any leading group/batch axes), the
functions below return a :class:`Routing` with a dispatch and a combine tensor of shape
``[..., T, E, C]`` for the MoE layer of paper 000, eq. (2):

    MoE(X)[t] = sum_{r, c} combine[t, r, c] * MLP_r( sum_s dispatch[s, r, c] * X[s] )

* :func:`token_choice` is Algorithm 1 (each token picks its top-k experts while the
  expert's buffer of capacity C has room), optionally with Batch Priority Routing.
* :func:`expert_choice` is Algorithm 2 (each expert picks its top-C tokens).
* :func:`soft_routing` is Soft MoE's pair of softmaxes (paper 002, eq. 1-2).

:func:`token_choice_loop` and :func:`expert_choice_loop` are the same algorithms written
as the plain loops printed in the paper (NumPy, one group). They are slow on purpose: the
book shows them and the tests prove the vectorised versions equal them.

``combine_scores`` gives the "softmax combine" routers (paper 000, Section 3.4): positions
are chosen from ``scores`` (e.g. an optimal-transport plan), but the combine weights at
the chosen positions are read from ``combine_scores`` (e.g. the softmax).
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mini_moe.validate import InputError, check_int

Array = Any


@flax.struct.dataclass
class Routing:
    """Routing tensors of paper 000, eq. (5).

    Attributes:
      dispatch: ``[..., T, E, C]``; ``dispatch[t, r, c]`` is how much of token t goes to
        slot c of expert r (0/1 for sparse routers).
      combine: ``[..., T, E, C]``; weight of the output of slot (r, c) in token t's output.
      sparse: static flag: every slot holds at most one token and ``combine`` is zero
        wherever ``dispatch`` is. Sparse routings may use the gather/scatter path of
        :func:`mini_moe.layer.moe`.
      slot_token: optional ``int32 [..., E, C]``, the same sparse routing in compact
        form: the token in each slot, or T for an empty slot.
      slot_weight: optional ``[..., E, C]``, the combine weight of each slot (0 if empty).

    :func:`token_choice` and :func:`expert_choice` fill both forms; the dense tensors
    are built from the compact one, so under ``jit`` XLA drops them when only the
    gather path and :func:`routing_metrics` use the routing.
    """

    dispatch: Array
    combine: Array
    sparse: bool = flax.struct.field(pytree_node=False)
    slot_token: Array | None = None
    slot_weight: Array | None = None

    def slots(self):
        """``(slot_token, slot_weight)`` of a sparse routing, from the dense tensors if needed."""
        if not self.sparse:
            raise InputError("slots() needs a sparse routing (one token per slot).")
        if self.slot_token is not None:
            return self.slot_token, self.slot_weight
        num_tokens = self.dispatch.shape[-3]
        token = jnp.argmax(self.dispatch, axis=-3)  # [..., E, C]
        filled = jnp.take_along_axis(self.dispatch, token[..., None, :, :], axis=-3)[..., 0, :, :] > 0
        weight = jnp.take_along_axis(self.combine, token[..., None, :, :], axis=-3)[..., 0, :, :]
        return jnp.where(filled, token, num_tokens), jnp.where(filled, weight, 0)


def _from_slots(slot_token, slot_weight, num_tokens, dtype) -> Routing:
    """Dense routing tensors ``[..., T, E, C]`` from the compact form."""
    dispatch = jnp.moveaxis(jax.nn.one_hot(slot_token, num_tokens, dtype=dtype), -1, -3)  # T -> empty
    combine = dispatch * slot_weight[..., None, :, :].astype(dtype)
    return Routing(dispatch, combine, sparse=True, slot_token=slot_token, slot_weight=slot_weight)


def _slot_weights(slot_token, weights):
    """``weights[slot_token[e, c], e]`` for filled slots, 0 for empty ones (any leading axes)."""
    num_tokens = weights.shape[-2]
    picked = jnp.take_along_axis(jnp.swapaxes(weights, -1, -2), jnp.minimum(slot_token, num_tokens - 1), axis=-1)
    return jnp.where(slot_token < num_tokens, picked, 0).astype(weights.dtype)


def capacity(num_tokens: int, num_experts: int, factor: float) -> int:
    """Buffer capacity ``C = round(factor * T / E)``, never below 1 (paper 000, Sec. 3.1).

    ``factor`` is k for token choice and the capacity factor c for expert choice and for
    Soft MoE's slots per expert. Halves round up (``round(2.5) == 3``), unlike Python's
    banker's rounding.
    """
    check_int("num_tokens", num_tokens)
    check_int("num_experts", num_experts)
    if not factor > 0:
        raise InputError(f"factor must be > 0 (k or the capacity factor c), got {factor!r}.")
    return max(1, int(math.floor(factor * num_tokens / num_experts + 0.5)))


# --------------------------------------------------------------------------- checks


def _check_scores(scores, combine_scores, min_rank: int = 2, name: str = "scores"):
    shape = np.shape(scores)
    if len(shape) < min_rank:
        raise InputError(
            f"{name} must have shape [..., T, E] (rank >= {min_rank}), got shape {shape}."
        )
    if combine_scores is not None and np.shape(combine_scores) != shape:
        raise InputError(
            f"combine_scores must have the same shape as {name} {shape}, "
            f"got {np.shape(combine_scores)}."
        )
    return shape


# --------------------------------------------------------------------- token choice


def token_choice(
    scores: Array,
    *,
    capacity: int,
    k: int = 1,
    batch_priority: bool = False,
    combine_scores: Array | None = None,
    min_score: float | None = None,
) -> Routing:
    """Token Choice allocation (paper 000, Algorithm 1), vectorised.

    Each token picks its k highest-scoring experts. All first choices are placed before
    any second choice, and so on. Within round i, tokens are visited in their order in
    the group, or, with ``batch_priority=True``, by decreasing top-1 score (Batch
    Priority Routing, Riquelme et al. 2021; stable sort, the same order in every round).
    A token's buffer position at an expert is the number of tokens that went there
    before it; a pick at position >= C is dropped and not re-routed.

    Args:
      scores: ``[..., T, E]`` affinities (softmax probabilities, a transport plan, ...).
      capacity: C, the buffer size of each expert (>= 1).
      k: experts per token (1 <= k <= E).
      batch_priority: visit tokens by decreasing top-1 score instead of position.
      combine_scores: optional ``[..., T, E]``; combine weights are read from here at the
        chosen places (default: ``scores``). Raw values, not renormalised over the k picks.
      min_score: None, or a pick whose score is not above it is not made (it takes no slot):
        with ``k = E`` and ``min_score = 0`` a token goes to every expert with a positive score
        (ReLU routing, :class:`mini_moe.routers.ReluGates`).

    Returns:
      :class:`Routing` with ``dispatch`` (0/1) and ``combine`` of shape ``[..., T, E, C]``.
    """
    shape = _check_scores(scores, combine_scores)
    num_tokens, num_experts = shape[-2:]
    check_int("capacity", capacity)
    check_int("k", k)
    if k > num_experts:
        raise InputError(f"k must be <= the number of experts E={num_experts}, got k={k}.")
    scores = jnp.asarray(scores)
    weights = scores if combine_scores is None else jnp.asarray(combine_scores)
    flat = scores.reshape((-1, num_tokens, num_experts))
    slot_token = jax.vmap(lambda s: _token_choice_slots(s, capacity, k, batch_priority, min_score))(flat)
    slot_token = slot_token.reshape(shape[:-2] + slot_token.shape[-2:])
    return _from_slots(slot_token, _slot_weights(slot_token, weights), num_tokens, scores.dtype)


def _token_choice_slots(scores, capacity, k, batch_priority, min_score=None):
    """Algorithm 1 for one group ``[T, E]``: the token in each buffer slot ``[E, C]``."""
    num_tokens, num_experts = scores.shape
    if batch_priority:  # visit tokens by decreasing top-1 score (stable), in every round
        order = jnp.argsort(-jnp.max(scores, axis=-1), stable=True)
        scores = scores[order]
    values, experts = jax.lax.top_k(scores, k)  # [T, k]; ties -> lower expert index
    expert = experts.T.reshape(-1)  # round-major: all first choices, then second, ...
    token = jnp.tile(jnp.arange(num_tokens), k)
    picks = jax.nn.one_hot(expert, num_experts, dtype=jnp.int32)  # [kT, E]
    if min_score is not None:  # a pick at or below min_score is not made
        picks = picks * (values.T.reshape(-1) > min_score)[:, None]
    before = jnp.cumsum(picks, axis=0) - picks  # tokens already sent to each expert
    position = jnp.take_along_axis(before, expert[:, None], axis=1)[:, 0]
    if min_score is not None:
        position = jnp.where(picks.any(axis=1), position, capacity)  # unmade picks fall outside
    # Picks at position >= C fall outside the buffer and are dropped (mode="drop").
    slot_token = jnp.full((num_experts, capacity), num_tokens, jnp.int32)
    slot_token = slot_token.at[expert, position].set(token, mode="drop")
    if batch_priority:  # back to the tokens' own indices
        slot_token = jnp.where(slot_token < num_tokens, order[jnp.minimum(slot_token, num_tokens - 1)], num_tokens)
    return slot_token


def _loop_inputs(scores, combine_scores, capacity):
    """NumPy scores and combine weights of one group, and zero routing tensors [T, E, C]."""
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2:
        raise InputError(f"scores must have shape [T, E], got {scores.shape}.")
    weights = scores if combine_scores is None else np.asarray(combine_scores, np.float64)
    zeros = np.zeros(scores.shape + (capacity,))
    return scores, weights, zeros, zeros.copy()


def token_choice_loop(scores, *, capacity, k=1, batch_priority=False, combine_scores=None, min_score=None):
    """Algorithm 1 of paper 000 as printed: plain loops over one group ``[T, E]``.

    Same semantics as :func:`token_choice` (which the tests check it against); returns
    NumPy arrays ``(dispatch, combine)`` of shape ``[T, E, C]``.
    """
    scores, weights, dispatch, combine = _loop_inputs(scores, combine_scores, capacity)
    if batch_priority:  # most confident tokens first (stable sort), in every round
        order = np.argsort(-scores.max(axis=1), kind="stable")
    else:
        order = np.arange(scores.shape[0])
    for i in range(k):  # the i-th choice of every token ...
        for t in order:  # ... before anybody's (i+1)-th choice
            r = np.argsort(-scores[t], kind="stable")[i]  # index of the i-th largest score
            if min_score is not None and not scores[t, r] > min_score:
                continue  # not a pick
            c = int(np.count_nonzero(dispatch[:, r, :]))  # tokens already at expert r
            if c < capacity:
                dispatch[t, r, c] = 1.0
                combine[t, r, c] = weights[t, r]
    return dispatch, combine


# -------------------------------------------------------------------- expert choice


def expert_choice(scores: Array, *, capacity: int, combine_scores: Array | None = None) -> Routing:
    """Expert Choice allocation (paper 000, Algorithm 2; Zhou et al. 2022), vectorised.

    Expert r fills its C slots with the C tokens of highest ``scores[:, r]``, in
    decreasing order (ties: lower token index first). Every buffer is full; a token may
    be picked by several experts or by none.

    Args:
      scores: ``[..., T, E]`` affinities.
      capacity: C, tokens per expert (1 <= C <= T).
      combine_scores: optional ``[..., T, E]`` combine weights (default: ``scores``).

    Returns:
      :class:`Routing` with tensors of shape ``[..., T, E, C]``.
    """
    shape = _check_scores(scores, combine_scores)
    num_tokens = shape[-2]
    check_int("capacity", capacity)
    if capacity > num_tokens:
        raise InputError(
            f"capacity must be <= the number of tokens T={num_tokens} for expert choice, "
            f"got capacity={capacity}."
        )
    scores = jnp.asarray(scores)
    weights = scores if combine_scores is None else jnp.asarray(combine_scores)
    _, slot_token = jax.lax.top_k(jnp.swapaxes(scores, -1, -2), capacity)  # [..., E, C]
    slot_token = slot_token.astype(jnp.int32)
    return _from_slots(slot_token, _slot_weights(slot_token, weights), num_tokens, scores.dtype)


def expert_choice_loop(scores, *, capacity, combine_scores=None):
    """Algorithm 2 of paper 000 as printed: loops over experts and buffer slots.

    One group ``[T, E]``; returns NumPy ``(dispatch, combine)`` of shape ``[T, E, C]``.
    """
    scores, weights, dispatch, combine = _loop_inputs(scores, combine_scores, capacity)
    for r in range(scores.shape[1]):
        ranking = np.argsort(-scores[:, r], kind="stable")
        for c in range(capacity):
            t = ranking[c]  # the token with the c-th largest score for expert r
            dispatch[t, r, c] = 1.0
            combine[t, r, c] = weights[t, r]
    return dispatch, combine


# ------------------------------------------------------------------------- soft MoE


def soft_routing(logits: Array) -> Routing:
    """Soft MoE routing tensors (paper 002, eq. 1-2; paper 000, eq. 11).

    Args:
      logits: ``[..., T, E, S]`` token/slot logits (S slots per expert), for one image.

    Returns:
      :class:`Routing` (``sparse=False``): ``dispatch`` is a softmax over the tokens
      (each slot is a convex combination of tokens) and ``combine`` a softmax over all
      (expert, slot) pairs jointly (each output is a convex combination of slot outputs).
    """
    shape = np.shape(logits)
    if len(shape) < 3:
        raise InputError(f"logits must have shape [..., T, E, S], got shape {shape}.")
    logits = jnp.asarray(logits)
    dispatch = jax.nn.softmax(logits, axis=-3)
    flat = logits.reshape(shape[:-2] + (shape[-2] * shape[-1],))
    combine = jax.nn.softmax(flat, axis=-1).reshape(shape)
    return Routing(dispatch, combine, sparse=False)


# ------------------------------------------------------------------------- metrics


def routing_metrics(routing: Routing) -> dict[str, Array]:
    """Summaries of a routing, averaged over leading axes.

    Returns a dict with
      * ``dropped``: fraction of tokens that reach no expert slot;
      * ``experts_per_token``: mean number of experts a token reaches;
      * ``tokens_per_expert``: ``[E]``, mean number of (token, slot) pairs per expert;
      * ``buffer_fill``: fraction of the E*C slots that hold any token.
    """
    if routing.slot_token is not None:  # compact form: no [T, E, C] work
        num_tokens = routing.dispatch.shape[-3]
        token = routing.slot_token
        filled = token < num_tokens  # [..., E, C]
        flat = token.reshape((-1, token.shape[-2] * token.shape[-1]))
        hits = jax.vmap(lambda t: jnp.zeros(num_tokens, jnp.int32).at[t].add(1, mode="drop"))(flat)
        lead = tuple(range(filled.ndim - 2))
        return {
            "dropped": jnp.mean(hits == 0),
            "experts_per_token": jnp.mean(hits),  # an expert takes a token at most once
            "tokens_per_expert": jnp.mean(filled.sum(axis=-1), axis=lead),
            "buffer_fill": jnp.mean(filled),
        }
    nonzero = routing.dispatch > 0  # [..., T, E, C]
    reached = nonzero.any(axis=-1)  # [..., T, E]
    lead = tuple(range(nonzero.ndim - 3))
    return {
        "dropped": jnp.mean(~reached.any(axis=-1)),
        "experts_per_token": jnp.mean(reached.sum(axis=-1)),
        "tokens_per_expert": jnp.mean(nonzero.sum(axis=(-3, -1)), axis=lead),
        "buffer_fill": jnp.mean(nonzero.any(axis=-3)),
    }


def pick_load(scores: Array, *, k: int = 1, min_score: float | None = None) -> Array:
    """How many tokens pick each expert, over every token of every group: ``[E]``.

    A token's picks are its ``k`` highest scores (those above ``min_score`` when it is given),
    counted before any capacity limit: the demand the experts see, which Token Choice then cuts
    to C per expert and group. ``scores [..., T, E]``.
    """
    num_experts = np.shape(scores)[-1]
    values, picks = jax.lax.top_k(jnp.asarray(scores), k)  # [..., T, k]
    made = jnp.ones_like(values) if min_score is None else (values > min_score).astype(values.dtype)
    counts = jnp.sum(jax.nn.one_hot(picks, num_experts, dtype=values.dtype) * made[..., None], axis=-2)
    return counts.reshape(-1, num_experts).sum(0)


def group_limit(scores: Array, num_groups: int, top_groups: int) -> Array:
    """Group-limited routing (DeepSeek-V2/V3, node-limited): which experts a token may pick.

    The E experts form ``num_groups`` equal groups of consecutive experts (a group = a device or a
    node in a deployment). A group's score is the sum of its two highest scores (its highest when
    it holds one expert); each token keeps its ``top_groups`` best groups (ties: the lower group)
    and may pick only inside them. ``scores [..., T, E]`` (DeepSeek-V3: the *biased* scores) ->
    ``bool [..., T, E]``, True where the expert's group is kept.
    """
    num_experts = np.shape(scores)[-1]
    if num_experts % num_groups or not 1 <= top_groups <= num_groups:
        raise InputError(f"num_groups must divide E={num_experts} and 1 <= top_groups <= num_groups, "
                         f"got num_groups={num_groups}, top_groups={top_groups}.")
    size = num_experts // num_groups
    grouped = jnp.reshape(scores, (*np.shape(scores)[:-1], num_groups, size))  # [..., T, G, E/G]
    group_score = jax.lax.top_k(grouped, min(2, size))[0].sum(-1)  # [..., T, G]
    keep = jax.nn.one_hot(jax.lax.top_k(group_score, top_groups)[1], num_groups, dtype=jnp.int32).sum(-2) > 0
    return jnp.repeat(keep, size, axis=-1)


def sort_by_expert(expert: Array, num_experts: int) -> tuple[Array, Array]:
    """The dropless layout (chapter 13; MegaBlocks, arXiv 2211.15841): the picks grouped by expert.

    ``expert [M]`` int, the expert of each pick (pick j of token n at ``n * k + j``) ->
    ``(order [M], group_sizes [E] int32)``: ``expert[order]`` is sorted, picks of one expert keep
    their order (a stable sort), and ``group_sizes[e]`` picks go to expert e, so expert e's rows
    are the contiguous block ``order[sum(group_sizes[:e]) : sum(group_sizes[:e + 1])]``.
    """
    order = jnp.argsort(expert, stable=True)
    return order, jnp.bincount(expert, length=num_experts).astype(jnp.int32)


def loss_free_bias_step(bias: Array, load: Array, rate: float) -> Array:
    """One update of auxiliary-loss-free balancing's expert bias (Wang et al. 2024, arXiv
    2408.15664, Algorithm 1; DeepSeek-V3 Sec. 2.1.2): ``b_e + rate * sign(mean load - load_e)``.
    An overloaded expert's bias falls, an underloaded one's rises, one at mean load stays.
    ``bias [E]``, ``load [E]`` (picks per expert over the whole batch) -> ``[E]``.

    The sign is taken of ``sum(load) - E * load_e``, the same sign without the division: for
    counts both terms are exact, so an expert exactly at the mean stays put whatever code XLA
    emits (``mean`` computed as ``sum * (1/E)`` is not exact, e.g. 6 * (1/3) != 2 in float32)."""
    return bias + rate * jnp.sign(jnp.sum(load) - load.shape[-1] * load)


def max_violation(load: Array) -> Array:
    """``max_e load_e / mean_e load_e - 1``, the "MaxVio" of Wang et al. 2024 (arXiv 2408.15664,
    eq. 6): 0 when every expert gets the same load, ``E - 1`` when one expert gets all of it
    (and 0 when nothing is loaded). ``load [E]``, e.g. :func:`pick_load`."""
    mean = jnp.mean(load)
    return jnp.where(mean > 0, jnp.max(load) / jnp.where(mean > 0, mean, 1.0) - 1.0, 0.0)
