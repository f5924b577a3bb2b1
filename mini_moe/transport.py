"""Affinity by optimal transport: balanced token/expert plans.

All plans here solve a transport problem between T tokens (mass 1 each) and E experts
(mass T/E each) for scores ``[..., T, E]`` (leading axes are independent groups):

* :func:`sinkhorn` — entropic OT, paper 000 eq. (8): ``max <P, L> - eps <P, log P>``.
  Solved by Sinkhorn's iterations in the log domain, a fixed number of times (a scan).
* :func:`quadratic_plan` — quadratically regularised OT of SVMoE (paper 001, Sec. 2):
  ``max <P, S> - (gamma / 2) ||P||^2``. Solved by exact alternating dual maximisation,
  each half-step a projection of every row (column) onto a scaled simplex — the
  quadratic analogue of Sinkhorn's row/column normalisations. The plan is sparse.
* :func:`sparsity_constrained_plan` — paper 000 eq. (9) (Liu et al. 2023): the quadratic
  problem with at most C nonzeros per expert column. Solved on the semi-dual by
  gradient descent, each column a k-sparse simplex projection, until the token
  marginal error is below a tolerance or the semi-dual stops improving.

The simplex projections are exposed too: :func:`project_simplex` and
:func:`project_ksparse_simplex`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mini_moe.validate import InputError, check_positive

Array = Any


def _check_plan_inputs(scores, name="logits"):
    shape = np.shape(scores)
    if len(shape) < 2:
        raise InputError(f"{name} must have shape [..., T, E] (rank >= 2), got shape {shape}.")
    return shape


# ----------------------------------------------------------------------- Sinkhorn


def sinkhorn(logits: Array, *, num_iters: int, epsilon: float = 1.0) -> Array:
    """Entropic optimal transport plan of paper 000, eq. (8), by log-domain Sinkhorn.

    ``P = argmax <P, logits> - epsilon <P, log P>`` subject to ``P 1_E = 1_T`` and
    ``P^T 1_T = (T/E) 1_E``. The solution is ``P[t, r] = exp(logits[t, r] / epsilon + f[t]
    + g[r])`` (f = log u, g = log v of the kernel form ``diag(u) exp(logits / epsilon)
    diag(v)``); each iteration sets f so rows sum to 1, then g so columns sum to
    T/E (the expert marginal is exact on return, the token marginal approaches 1).
    Working with ``logsumexp`` keeps it finite for logits of any size, where the
    multiplicative version underflows to zero rows once ``|logits| / epsilon`` is large.

    Args:
      logits: ``[..., T, E]``.
      num_iters: fixed number of row+column updates (>= 1): traces to a ``lax.scan``.
      epsilon: entropic regularisation (paper 000 uses 1).

    Returns:
      The plan ``[..., T, E]``, differentiable through the unrolled iterations.
    """
    _check_plan_inputs(logits)
    check_positive("num_iters", num_iters, integer=True)
    check_positive("epsilon", epsilon)
    return _sinkhorn(jnp.asarray(logits, dtype=jnp.result_type(logits, jnp.float32)),
                     num_iters=int(num_iters), epsilon=float(epsilon))


@functools.partial(jax.jit, static_argnames=("num_iters", "epsilon"))
def _sinkhorn(logits, *, num_iters, epsilon):
    num_tokens, num_experts = logits.shape[-2:]
    kernel = logits / epsilon
    log_a = 0.0  # log of the token marginal, 1
    log_b = jnp.log(num_tokens / num_experts)

    def step(carry, _):
        f, g = carry
        f = log_a - jax.nn.logsumexp(kernel + g[..., None, :], axis=-1)
        g = log_b - jax.nn.logsumexp(kernel + f[..., :, None], axis=-2)
        return (f, g), None

    f0 = jnp.zeros(kernel.shape[:-1], kernel.dtype)
    g0 = jnp.zeros(kernel.shape[:-2] + (num_experts,), kernel.dtype)
    (f, g), _ = jax.lax.scan(step, (f0, g0), None, length=num_iters)
    return jnp.exp(kernel + f[..., :, None] + g[..., None, :])


# ---------------------------------------------------------------- simplex projections


def _simplex_threshold(sorted_desc: Array, mass) -> Array:
    """tau with ``sum(max(v - tau, 0)) == mass`` for v given sorted in decreasing order."""
    n = sorted_desc.shape[-1]
    cumsum = jnp.cumsum(sorted_desc, axis=-1) - jnp.expand_dims(mass, -1)
    rank = jnp.arange(1, n + 1, dtype=sorted_desc.dtype)
    support = sorted_desc - cumsum / rank > 0  # a prefix of True
    count = jnp.maximum(jnp.sum(support, axis=-1), 1)
    return jnp.take_along_axis(cumsum, count[..., None] - 1, axis=-1)[..., 0] / count


def _michelot_threshold(v: Array, mass, where: Array | None = None) -> Array:
    """The threshold of :func:`_simplex_threshold` without sorting (Michelot 1986).

    Starting from ``tau = (sum(v) - mass) / n`` (a lower bound), repeatedly average over
    the entries still above tau: tau increases monotonically and reaches the exact value
    once the support stops changing (at most n rounds, a handful in practice). Cheaper
    than a sort on CPU. ``where`` restricts the problem to a subset of each row's entries.

    Differentiable in forward and reverse mode although the loop is a ``while_loop``: on
    the support ``S = {v > tau}``, ``tau = (sum_S v - mass) / |S|``, so ``d tau = (sum_S dv
    - d mass) / |S|`` (a custom JVP, exact wherever no entry equals tau).
    """
    where = jnp.ones(v.shape, bool) if where is None else where
    return _michelot(v, jnp.asarray(mass, v.dtype), where)


@jax.custom_jvp
def _michelot(v, mass, where):
    n = v.shape[-1]
    size = jnp.maximum(jnp.sum(where, axis=-1), 1)
    tau0 = (jnp.sum(jnp.where(where, v, 0.0), axis=-1) - mass) / size

    def update(tau):
        above = where & (v > tau[..., None])
        count = jnp.maximum(jnp.sum(above, axis=-1), 1)
        return (jnp.sum(jnp.where(above, v, 0.0), axis=-1) - mass) / count

    def cond(state):
        previous, tau, i = state
        return jnp.any(tau != previous) & (i < n)

    def body(state):
        _, tau, i = state
        return tau, update(tau), i + 1

    _, tau, _ = jax.lax.while_loop(cond, body, (tau0, update(tau0), 1))
    return tau


@_michelot.defjvp
def _michelot_jvp(primals, tangents):
    v, mass, where = primals
    dv, dmass, _ = tangents
    tau = _michelot(v, mass, where)
    above = where & (v > tau[..., None])  # the support, fixed under a small change of v
    count = jnp.maximum(jnp.sum(above, axis=-1), 1)
    return tau, (jnp.sum(jnp.where(above, dv, 0.0), axis=-1) - dmass) / count


def project_simplex(v: Array, mass=1.0) -> Array:
    """Euclidean projection of each row ``v[..., :]`` onto ``{p >= 0, sum(p) = mass}``."""
    sorted_desc = -jnp.sort(-v, axis=-1)
    tau = _simplex_threshold(sorted_desc, jnp.asarray(mass, v.dtype))
    return jnp.maximum(v - tau[..., None], 0.0)


def project_ksparse_simplex(v: Array, k: int, mass=1.0) -> Array:
    """Projection of each row of v onto ``{p >= 0, sum(p) = mass, ||p||_0 <= k}``.

    Exact (Kyrillidis et al. 2013): keep the k largest entries (ties: lower index
    first), project them onto the simplex, zero the rest. The k largest are found by
    bisection on the float bits (32 rounds of counting) and the simplex threshold by
    Michelot's iteration: no sort or top-k, which are slow on CPU inside a solver loop.
    """
    n = v.shape[-1]
    k = min(int(k), n)
    keep = _top_k_mask(v, k)
    return jnp.maximum(jnp.where(keep, v - _michelot_threshold(v, mass, keep)[..., None], 0.0), 0.0)


def _sortable_bits(v: Array) -> Array:
    """int32 keys ordered like the float32 values (IEEE-754 trick)."""
    bits = jax.lax.bitcast_convert_type(v.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _top_k_mask(v: Array, k: int) -> Array:
    """Boolean mask of the k largest entries of each row (ties: lower index first)."""
    key = _sortable_bits(v)
    lo = jnp.min(key, axis=-1, keepdims=True)  # count(key >= lo) >= k
    hi = jnp.max(key, axis=-1, keepdims=True)  # count(key > hi) < k

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (((lo & 1) + (hi & 1) + 1) >> 1)  # ceil((lo+hi)/2), no overflow
        enough = jnp.sum(key >= mid, axis=-1, keepdims=True) >= k
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

    kth, _ = jax.lax.fori_loop(0, 33, halve, (lo, hi))  # the k-th largest key
    above, tied = key > kth, key == kth
    room = k - jnp.sum(above, axis=-1, keepdims=True)
    rank = jax.lax.associative_scan(jnp.add, tied.astype(jnp.int32), axis=tied.ndim - 1)
    return above | (tied & (rank <= room))


# -------------------------------------------------------------- quadratic OT (SVMoE)


def quadratic_plan(scores: Array, *, gamma: float = 1.0, num_iters: int = 50) -> Array:
    """Quadratically regularised OT plan (SVMoE, paper 001, Sec. 2; Blondel et al. 2018).

    ``P = argmax <P, scores> - (gamma / 2) ||P||_F^2`` subject to ``P >= 0``,
    ``P 1_E = 1_T`` and ``P^T 1_T = (T/E) 1_E``. SVMoE uses ``scores = softmax(XW)`` and
    ``gamma = 1/k``. The dual is maximised exactly one block at a time: every row of
    ``(scores + g) / gamma`` is projected onto the simplex of mass 1, then every column
    of ``(scores + f) / gamma`` onto the simplex of mass T/E. Like Sinkhorn's
    normalisations, but with a Euclidean projection in place of a division, which is
    why the plan has exact zeros.

    Args:
      scores: ``[..., T, E]``.
      gamma: regularisation strength (> 0).
      num_iters: fixed number of row+column projections (a scan).

    Returns:
      The plan ``[..., T, E]``; columns meet T/E exactly, rows approach 1. Differentiable
      (also in reverse mode) through the unrolled iterations; the plan is piecewise linear
      in the scores.
    """
    _check_plan_inputs(scores, "scores")
    check_positive("gamma", gamma)
    check_positive("num_iters", num_iters, integer=True)
    return _quadratic_plan(jnp.asarray(scores, jnp.result_type(scores, jnp.float32)),
                           gamma=float(gamma), num_iters=int(num_iters))


@functools.partial(jax.jit, static_argnames=("gamma", "num_iters"))
def _quadratic_plan(scores, *, gamma, num_iters):
    num_tokens, num_experts = scores.shape[-2:]
    kernel = scores / gamma
    col_mass = jnp.asarray(num_tokens / num_experts, kernel.dtype)

    def row_potential(g):  # f with rows of [kernel + f + g]_+ summing to 1
        return -_michelot_threshold(kernel + g[..., None, :], jnp.ones((), kernel.dtype))

    def col_potential(f):
        return -_michelot_threshold(jnp.swapaxes(kernel + f[..., :, None], -1, -2), col_mass)

    def step(g, _):
        return col_potential(row_potential(g)), None

    g0 = jnp.zeros(kernel.shape[:-2] + (num_experts,), kernel.dtype)
    g, _ = jax.lax.scan(step, g0, None, length=num_iters)
    f = row_potential(g)
    g = col_potential(f)
    return jnp.maximum(kernel + f[..., :, None] + g[..., None, :], 0.0)


# ---------------------------------------------------- sparsity-constrained OT (eq. 9)


class PlanInfo(NamedTuple):
    """Convergence report of :func:`sparsity_constrained_plan`, one entry per group
    (fields have the leading shape of the scores)."""

    iterations: Array  # iterations run
    marginal_error: Array  # max_t |sum_r P[t, r] - 1| of the returned plan
    mean_marginal_error: Array  # mean_t |sum_r P[t, r] - 1| of the returned plan
    objective: Array  # semi-dual objective F at the returned iterate (F is minimised)
    converged: Array  # marginal_error <= tol, or neither F nor the error improved for `patience` iterations
    # (the relaxation's optimum: read marginal_error to see how far the rows are from 1)


def sparsity_constrained_plan(
    scores: Array,
    *,
    max_nonzeros: int,
    tol: float = 1e-3,
    max_iters: int = 1000,
    patience: int = 100,
    return_info: bool = False,
):
    """Sparsity-constrained OT plan of paper 000, eq. (9) (Liu, Puigcerver, Blondel 2023).

    ``P = argmax <P, scores> - 1/2 ||P||_F^2`` subject to ``P >= 0``, ``P 1_E = 1_T``,
    ``P^T 1_T = (T/E) 1_E`` and at most ``max_nonzeros`` nonzeros in every column.
    Paper 000 applies it to ``scores = softmax(XW)``.

    Solved on the semi-dual, a convex function of a token potential f:
    ``F(f) = sum_t f[t] + sum_r max_{p in S_r} <p, scores[:, r] - f> - |p|^2 / 2``, with
    ``S_r = {p >= 0, sum p = T/E, ||p||_0 <= C}``. The inner maximiser, column r of the
    plan, is the k-sparse simplex projection of ``scores[:, r] - f``; the gradient of F is
    ``1 - P 1_E``. F is piecewise quadratic and not smooth (a column's top C changes
    discontinuously), so the solver takes subgradient steps with heavy-ball momentum,
    ``f += (P 1_E - 1) * step_i + 0.6 (f - f_previous)``, with steps that shrink geometrically
    from ``2 spread(scores) / (2 E)`` to 0.3 % of that at ``max_iters`` (large steps first bring F
    close to its minimum; the small ones then search the plans there for the most balanced),
    keeping the iterate with the smallest mean token-marginal error. Four things make it fast
    (chapter 5 measures them):

    * it starts from ``f[t]`` just below token t's c-th largest score (1 % of the way to the
      (c+1)-th; c = round(C E / T), the number of experts a token gets on average), so every
      token begins level with its c-th best expert, and no two tokens tie;
    * each iteration evaluates the plan once (its residual is the next step's direction), and
      when every kept entry stays in its column's support the simplex threshold is the closed
      form ``(sum of the kept values - T/E) / C`` (Michelot's loop only runs otherwise);
    * each column's top C is searched among its candidates, not among all T: its 2 C to 3 C
      best tokens when they were last chosen (at most T). An iteration gathers those values,
      and one pass over the group checks that no other token has overtaken the C-th; when one
      has (in a minority of iterations, mostly early ones), the candidates are chosen again;
    * among the candidates, the top C starts from the previous iteration's: if its weakest
      member still beats the strongest other candidate, the set is unchanged and nothing is
      searched; otherwise the new C-th value lies between those two values and bisection finds
      it there; an exact sort-free top C runs wherever bisection fails (ties).

    It stops when the token-marginal error ``max_t |P 1_E - 1|[t]`` is at most ``tol``, when
    neither F (by a relative 1e-6) nor the mean error has improved for ``patience`` iterations,
    or after ``max_iters``.

    Column sums and sparsity hold exactly at every iteration. Because eq. (9) is not
    convex, the relaxation stops with a token-marginal gap even at its optimum: on
    random scores the mean gap ``mean_t |P 1_E - 1|[t]`` is typically 0.05-0.1 (a few
    tokens per group get no expert), and 0 only in easy cases (see the tests). No gradient
    flows through the solver (``stop_gradient``): routers take positions from this plan and
    combine weights from the softmax.

    Args:
      scores: ``[..., T, E]``.
      max_nonzeros: C, nonzeros allowed per expert column (>= 1).
      tol: target token-marginal error.
      max_iters: iteration cap.
      patience: iterations without improvement of F or of the error before stopping.
      return_info: also return a :class:`PlanInfo`.

    Returns:
      The plan ``[..., T, E]``, and a :class:`PlanInfo` if ``return_info``.
    """
    shape = _check_plan_inputs(scores, "scores")
    check_positive("max_nonzeros", max_nonzeros, integer=True)
    check_positive("tol", tol)
    check_positive("max_iters", max_iters, integer=True)
    check_positive("patience", patience, integer=True)
    flat = jnp.asarray(scores, jnp.result_type(scores, jnp.float32)).reshape((-1,) + shape[-2:])
    plan, info = _sparse_plan_groups(jax.lax.stop_gradient(flat), max_nonzeros=int(max_nonzeros), tol=float(tol),
                                     max_iters=int(max_iters), patience=int(patience))
    plan = plan.reshape(shape)
    info = PlanInfo(*(field.reshape(shape[:-2]) for field in info))
    return (plan, info) if return_info else plan


def _bracketed_top_k_mask(x: Array, k: int, lo: Array, hi: Array, *, most: int | None = None) -> tuple[Array, Array]:
    """Mask of the k largest entries of each row of ``x [..., n]`` (with ``most``: of its
    largest entries, between k and ``most`` of them) by bisection on the value, given ``lo [...]``
    and ``hi [...]`` with ``count(x >= lo) >= k > count(x >= hi)``. A row is done when some
    threshold keeps an allowed number of entries; returns the mask and whether every row found
    one (a row whose k-th and (k+1)-th values tie, or a wrong bracket, never does; nor may a row
    whose two values lie closer than float32's smallest normal number, 1.2e-38, where XLA's CPU
    flushes the subnormal thresholds between them to zero)."""
    most = k if most is None else most

    def body(state):
        lo, hi, theta, done = state
        mid = 0.5 * (lo + hi)
        count = jnp.sum(x >= mid[..., None], axis=-1)
        hit = ~done & (count >= k) & (count <= most)
        stuck = (mid <= lo) | (mid >= hi)  # the bracket cannot shrink further
        return (jnp.where(count > most, mid, lo), jnp.where(count < k, mid, hi), jnp.where(hit, mid, theta),
                done | hit | stuck)

    count_lo, count_hi = jnp.sum(x >= lo[..., None], axis=-1), jnp.sum(x >= hi[..., None], axis=-1)
    valid = (count_lo >= k) & (count_hi < k)
    start = ~valid | (count_lo <= most)  # lo itself keeps an allowed number: theta = lo
    *_, theta, _ = jax.lax.while_loop(lambda state: ~jnp.all(state[3]), body, (lo, hi, lo, start))
    mask = x >= theta[..., None]
    count = jnp.sum(mask, axis=-1)
    return mask, jnp.all(valid & (count >= k) & (count <= most))


def _candidate_indices(mask: Array, size: int) -> Array:
    """The indices of the True entries of each row of ``mask [..., n]``, in increasing order,
    in ``size`` slots (a row with fewer fills the rest with n; entries beyond ``size`` are
    dropped). Positions come from a prefix count done as two small matrix products (within
    blocks of 32, then over the blocks): a cumulative sum is a slow scan on CPU."""
    n = mask.shape[-1]
    padded = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, -n % 32)]).astype(jnp.float32)
    blocks = padded.reshape(padded.shape[:-1] + (-1, 32))
    within = blocks @ jnp.triu(jnp.ones((32, 32), jnp.float32))  # inclusive counts inside each block
    before = within[..., -1] @ jnp.triu(jnp.ones((blocks.shape[-2],) * 2, jnp.float32), 1)  # in earlier blocks
    position = (within + before[..., None]).reshape(padded.shape)[..., :n].astype(jnp.int32) - 1
    rows = tuple(r[..., None] for r in jnp.indices(mask.shape[:-1], sparse=True))
    index = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), mask.shape)
    slots = jnp.full(mask.shape[:-1] + (size,), n, jnp.int32)
    return slots.at[rows + (jnp.where(mask, position, size),)].set(index, mode="drop")


# Subgradient steps with heavy-ball momentum, f += step_i * (P 1 - 1) + momentum * (f - f_previous), with
# step_i = _STEP * spread / (2 E) * _FINAL ** (i / max_iters). Chosen on 8 groups of 392 and of 1024 tokens
# (E = 32, c = 1 and 2, softmax scores of a random router, float64 prototype, 30 iterations) and checked on a
# second draw of inputs and router: against the previous steps (0.3 * spread / (2 E sqrt(1 + i)), momentum
# 0.7) the mean marginal error of the returned plan fell from 0.023 / 0.059 / 0.060 / 0.073 (g1024 c=1, c=2;
# b32 c=1, c=2) to 0.015 / 0.049 / 0.048 / 0.065, and F's worst relative gap to POT's optimum from 2.3e-3 to
# 8.6e-4. Larger first steps or more momentum lower F faster but leave less balanced plans.
_STEP, _FINAL, _MOMENTUM = 2.0, 0.003, 0.6


@functools.partial(jax.jit, static_argnames=("max_nonzeros", "tol", "max_iters", "patience", "candidates"))
def _sparse_plan_groups(scores, *, max_nonzeros, tol, max_iters, patience, candidates=None):
    """Semi-dual solver of :func:`sparsity_constrained_plan` for groups ``scores [G, T, E]``.

    Each column's top C is searched among at most ``candidates`` of its best tokens (M,
    default 3 C, at most T; a choice keeps between (C + M) / 2 and M), held as indices
    ``cand [G, E, M]``: an iteration gathers M values per column instead of
    T, and one pass over the group checks that no other token has overtaken the C-th; when
    one has, the candidates are chosen again. The answer does not depend on ``candidates``
    (a test solves with C + 1 and with T). Written for the whole batch (no ``vmap``) so that
    the exact top-C fallback and the refresh are real branches; every reduction is per group
    and a group that has stopped no longer changes."""
    num_groups, num_tokens, num_experts = scores.shape
    scores_t = jnp.swapaxes(scores, 1, 2)  # [G, E, T]: one row per expert column
    col_mass = num_tokens / num_experts
    k = min(max_nonzeros, num_tokens)
    size = min(num_tokens, max(k, candidates or 3 * k))  # M candidates per column
    least = (k + size + 1) // 2  # a refresh keeps between `least` and `size` candidates
    step_scale = (jnp.max(scores_t, axis=(1, 2)) - jnp.min(scores_t, axis=(1, 2)) + 1e-12) / (2 * num_experts)
    decay = _FINAL ** (1.0 / max_iters)  # the step shrinks to _FINAL of the first one at max_iters

    def gather(values, cand):  # values [G, E or 1, T] at the candidates [G, E, M]
        values = jnp.broadcast_to(values, cand.shape[:2] + (num_tokens,))
        return jnp.take_along_axis(values, jnp.minimum(cand, num_tokens - 1), axis=-1)

    def at_candidates(f, cand, scores_c):  # scores_c - f at the candidates; -inf in empty slots
        return jnp.where(cand < num_tokens, scores_c - gather(f[:, None, :], cand), -jnp.inf)

    def choose_candidates(shifted):
        # Between `least` and `size` of each column's best entries (a wide target: a few rounds of
        # bisection); the exact top `size` where ties prevent it.
        lo, hi = jnp.min(shifted, axis=-1), jnp.nextafter(jnp.max(shifted, axis=-1), jnp.inf)
        is_cand, found = _bracketed_top_k_mask(shifted, least, lo, hi, most=size)
        is_cand = jax.lax.cond(found, lambda: is_cand, lambda: _top_k_mask(shifted, size))
        return _candidate_indices(is_cand, size), is_cand

    def search(shifted_c, lo, hi):  # bisection in [lo, hi); the exact sort-free top C where it fails (ties)
        mask, exact = _bracketed_top_k_mask(shifted_c, k, lo, hi)
        return jax.lax.cond(exact, lambda: mask, lambda: _top_k_mask(shifted_c, k))

    def top_k(shifted_c, previous):
        # The previous iteration's top C, at the new values: its weakest member a and the strongest
        # other candidate b. If a > b in every column, the set has not changed (the common case late
        # in the solve) and no search runs; otherwise the new C-th value lies in [min(a, b), max(a, b)].
        a = jnp.min(jnp.where(previous, shifted_c, jnp.inf), axis=-1)
        b = jnp.max(jnp.where(previous, -jnp.inf, shifted_c), axis=-1)
        lo, hi = jnp.minimum(a, b), jnp.nextafter(jnp.maximum(a, b), jnp.inf)
        return jax.lax.cond(jnp.all(a > b), lambda: previous, lambda: search(shifted_c, lo, hi))

    def refresh(f):  # new candidates for f, their values and their top C
        cand, is_cand = choose_candidates(scores_t - f[:, None, :])
        scores_c = gather(scores_t, cand)
        shifted_c = at_candidates(f, cand, scores_c)
        lowest = jnp.min(jnp.where(cand < num_tokens, shifted_c, jnp.inf), axis=-1)
        highest = jnp.nextafter(jnp.max(shifted_c, axis=-1), jnp.inf)
        return cand, is_cand, scores_c, shifted_c, search(shifted_c, lowest, highest)

    def evaluate(f, cand, shifted_c, keep):  # the plan at the candidates, P 1 - 1 and F
        kept = jnp.where(keep, shifted_c, 0.0)
        # Usually every kept entry stays in the support (the mass T/E is large next to a column's
        # spread), and then the first Michelot estimate is already exact: one pass, no loop.
        tau = (jnp.sum(kept, axis=-1) - col_mass) / k
        inside = jnp.all(~keep | (shifted_c > tau[..., None]))
        tau = jax.lax.cond(inside, lambda: tau, lambda: _michelot_threshold(kept, col_mass, keep))
        plan_c = jnp.maximum(jnp.where(keep, shifted_c - tau[..., None], 0.0), 0.0)
        groups = jnp.arange(num_groups)[:, None, None]
        residual = jnp.zeros(f.shape, f.dtype).at[groups, cand].add(plan_c, mode="drop") - 1.0  # minus dF
        objective = jnp.sum(f, axis=-1) + jnp.sum(plan_c * kept - 0.5 * plan_c**2, axis=(1, 2))
        return plan_c, residual, objective

    def errors(residual):
        return jnp.mean(jnp.abs(residual), axis=-1), jnp.max(jnp.abs(residual), axis=-1)

    # f[t] starts just below token t's c-th best score (1 % of the way to the (c+1)-th): every
    # token's c-th best expert sits just above its threshold, and tokens do not tie.
    level = max(1, min(num_experts - 1, round(k * num_experts / num_tokens)))
    best = jax.lax.top_k(scores, level + 1)[0] if num_experts > 1 else jnp.concatenate([scores, scores], -1)
    best = jax.lax.optimization_barrier(best)  # XLA:CPU turns top_k + slicing into a full sort (10x slower)
    f = best[..., level - 1] - 0.01 * (best[..., level - 1] - best[..., level])
    cand, is_cand, scores_c, shifted_c, keep = refresh(f)
    _, residual, obj = evaluate(f, cand, shifted_c, keep)
    err, max_err = errors(residual)
    zeros = jnp.zeros((num_groups,), jnp.int32)
    # The loop carries the best iterate's potential, candidates and top-C sets, not its plan (one
    # pass less per iteration); the plan is rebuilt from them once at the end.
    state = dict(i=zeros, f=f, f_prev=f, residual=residual, cand=cand, is_cand=is_cand, scores_c=scores_c, keep=keep,
                 max_err=max_err, best_f=f, best_cand=cand, best_keep=keep, best_err=err, best_max=max_err,
                 best_obj=obj, min_obj=obj, stall=zeros)

    def active(s):
        return (s["i"] < max_iters) & (s["max_err"] > tol) & (s["stall"] < patience)

    def body(s):
        run = active(s)
        step = jnp.where(run, _STEP * step_scale * decay ** s["i"].astype(step_scale.dtype), 0.0)
        momentum = jnp.where(run, _MOMENTUM, 0.0)[:, None] * (s["f"] - s["f_prev"])  # heavy ball
        f = s["f"] + s["residual"] * step[:, None] + momentum
        shifted_c = at_candidates(f, s["cand"], s["scores_c"])
        keep = top_k(shifted_c, s["keep"])
        # One pass over the group: has a token outside the candidates overtaken a column's C-th?
        outside = jnp.max(jnp.where(s["is_cand"], -jnp.inf, scores_t - f[:, None, :]), axis=-1)
        weakest = jnp.min(jnp.where(keep, shifted_c, jnp.inf), axis=-1)
        cand, is_cand, scores_c, shifted_c, keep = jax.lax.cond(
            jnp.all(weakest > outside), lambda: (s["cand"], s["is_cand"], s["scores_c"], shifted_c, keep),
            lambda: refresh(f))
        _, residual, obj = evaluate(f, cand, shifted_c, keep)
        err, max_err = errors(residual)
        better = run & (err < s["best_err"])
        improved = better | (obj < s["min_obj"] - 1e-6 * jnp.abs(s["min_obj"]))

        def pick(new, old, where=run):
            return jnp.where(where.reshape(where.shape + (1,) * (new.ndim - 1)), new, old)

        return dict(
            i=s["i"] + run, f=pick(f, s["f"]), f_prev=pick(s["f"], s["f_prev"]), residual=pick(residual, s["residual"]),
            cand=pick(cand, s["cand"]), is_cand=pick(is_cand, s["is_cand"]), scores_c=pick(scores_c, s["scores_c"]),
            keep=pick(keep, s["keep"]), max_err=pick(max_err, s["max_err"]), best_f=pick(f, s["best_f"], better),
            best_cand=pick(cand, s["best_cand"], better), best_keep=pick(keep, s["best_keep"], better),
            best_err=pick(err, s["best_err"], better), best_max=pick(max_err, s["best_max"], better),
            best_obj=pick(obj, s["best_obj"], better),
            min_obj=pick(jnp.minimum(obj, s["min_obj"]), s["min_obj"]),
            stall=pick(jnp.where(improved, 0, s["stall"] + 1), s["stall"]),
        )

    s = jax.lax.while_loop(lambda s: jnp.any(active(s)), body, state)
    cand = s["best_cand"]
    plan_c = evaluate(s["best_f"], cand, at_candidates(s["best_f"], cand, gather(scores_t, cand)), s["best_keep"])[0]
    groups, experts = jnp.arange(num_groups)[:, None, None], jnp.arange(num_experts)[None, :, None]
    plan_t = jnp.zeros(scores_t.shape, plan_c.dtype).at[groups, experts, cand].set(plan_c, mode="drop")
    converged = (s["max_err"] <= tol) | (s["stall"] >= patience) | (s["best_max"] <= tol)
    info = PlanInfo(s["i"], s["best_max"], s["best_err"], s["best_obj"], converged)
    return jnp.swapaxes(plan_t, 1, 2), info
