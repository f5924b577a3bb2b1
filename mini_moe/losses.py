"""Auxiliary losses for routers.

* V-MoE's balancing losses (paper 000, Appendix A): :func:`importance_loss` and
  :func:`load_loss`, each the squared coefficient of variation (population std / mean) of a
  per-expert quantity, computed per group and averaged over groups.
* The Switch Transformer / GShard balancing loss :func:`switch_loss` (Fedus et al. 2022,
  eq. 4-6; Lepikhin et al. 2021), used by most language MoEs.
* AdaMoE's null-aware variant :func:`null_aware_switch_loss` (null experts pooled).
* The router z-loss :func:`z_loss` (Zoph et al. 2022, ST-MoE, eq. 5), which keeps the
  router's logits small.
* Pairwise Router Consistency :func:`pairwise_router_consistency` (paper 004).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mini_moe.validate import InputError

Array = Any


def cv_squared(values: Array, axis: int = -1) -> Array:
    """Squared coefficient of variation, ``(std / mean)^2`` with the population std."""
    mean = jnp.mean(values, axis=axis)
    return jnp.var(values, axis=axis) / (mean**2 + 1e-20)


def importance_loss(logits: Array) -> Array:
    """Importance loss: CV^2 of each expert's summed softmax probability over the group.

    Args:
      logits: clean (noise-free) router logits ``[..., T, E]``.

    Returns:
      Scalar, averaged over leading (group) axes.
    """
    importance = jax.nn.softmax(logits, axis=-1).sum(axis=-2)  # [..., E]
    return jnp.mean(cv_squared(importance))


def load_loss(logits: Array, noisy_logits: Array, *, k: int, noise_std: float) -> Array:
    """Load loss, paper 000 eq. (12)-(15) with the noise of V-MoE.

    For token t and expert i, ``load[t, i] = P(logits[t, i] + fresh noise > threshold[t])``
    where the threshold is the k-th largest *noisy* logit of token t and the noise has
    std ``noise_std / E``: ``Phi((logits[t, i] - threshold[t]) / (noise_std / E))``.
    The loss is CV^2 of the per-expert sums over the group's tokens.

    Args:
      logits: clean logits ``[..., T, E]``.
      noisy_logits: the logits with the noise used for routing, same shape.
      k: experts per token.
      noise_std: noise std before division by E (must be > 0).

    Returns:
      Scalar, averaged over leading (group) axes.
    """
    if not noise_std > 0:
        raise InputError(f"noise_std must be > 0 for the load loss, got {noise_std!r}.")
    num_experts = logits.shape[-1]
    threshold = jax.lax.top_k(noisy_logits, k)[0][..., -1:]  # [..., T, 1]
    sigma = noise_std / num_experts
    load = jax.scipy.stats.norm.cdf((logits - threshold) / sigma).sum(axis=-2)  # [..., E]
    return jnp.mean(cv_squared(load))


BALANCE_SCOPES = ("group", "batch")


def switch_loss(probs: Array, *, k: int = 1, scope: str = "group", axis_name: str | None = None) -> Array:
    """Switch Transformer / GShard balancing loss ``E * sum_i f_i P_i``.

    ``f_i`` is the fraction of the group's top-k picks that go to expert i (the argmax picks,
    before any capacity limit; divided by k so that ``sum_i f_i = 1``) and ``P_i`` the mean
    routing probability of expert i. ``f`` is piecewise constant, so the gradient flows through
    ``P`` only: ``dL/dP_i = E f_i`` lowers the probability of the experts that receive most
    tokens. The value is 1 when picks and probabilities are uniform, and E when every token
    picks the same expert with certainty; when ``P = f`` it is ``E sum_i f_i^2 >= 1`` (equal
    shares give 1), otherwise it can be below 1.

    Args:
      probs: routing probabilities ``[..., T, E]`` (rows sum to 1; the ones used to route).
      k: experts per token.
      scope: ``"group"``: ``f`` and ``P`` per routing group, the loss averaged over groups;
        ``"batch"``: over every token of the batch at once (Qwen's global-batch balance, arXiv
        2501.11873): a group may then be unbalanced as long as the batch is. Inside ``jit`` over
        a sharded batch the means are global (XLA adds the cross-device sums).
      axis_name: with ``scope="batch"`` inside ``shard_map``, where each device holds part of the
        batch: every mesh axis the batch is split over, for the library's mesh
        ``mini_moe.parallel.AXES`` (``("data", "expert")``: ``parallel.BATCH`` splits the batch over
        both). The counts and probabilities are summed over them with ``psum``, so every device
        gets the global-batch loss, and its gradient with respect to the device's part of the
        batch is that part of the whole batch's gradient (take one device's loss, not the sum of
        the copies, which would count it once per device). Naming only some of the axes gives a
        partial sum. None outside ``shard_map``.

    Returns:
      Scalar, averaged over leading (group) axes.
    """
    num_experts = probs.shape[-1]
    if not 1 <= k <= num_experts:
        raise InputError(f"k must be in [1, E={num_experts}], got k={k!r}.")
    if scope not in BALANCE_SCOPES:
        raise InputError(f"scope must be one of {BALANCE_SCOPES}, got {scope!r}.")
    if scope == "batch":  # one group of every token (Qwen's global-batch balance)
        probs = probs.reshape(1, -1, num_experts)
    picks = jax.lax.top_k(probs, k)[1]  # [..., T, k]
    counts = jax.nn.one_hot(picks, num_experts, dtype=probs.dtype).sum(-2)  # [..., T, E]
    if scope == "batch" and axis_name is not None:  # the batch is split over devices: global sums
        tokens = jax.lax.psum(probs.shape[-2], axis_name)
        fraction = jax.lax.psum(counts.sum(-2), axis_name) / (tokens * k)
        mean_prob = jax.lax.psum(probs.sum(-2), axis_name) / tokens
    else:
        fraction, mean_prob = counts.mean(-2) / k, probs.mean(-2)  # [..., E]
    return jnp.mean(num_experts * jnp.sum(jax.lax.stop_gradient(fraction) * mean_prob, axis=-1))


def null_aware_switch_loss(probs: Array, *, k: int, null_experts: int) -> Array:
    """AdaMoE's null-aware balancing loss (Zeng et al. 2024, arXiv 2406.13233, Sec. 3):
    :func:`switch_loss` over the E real and Z null experts, with the Z null experts' ``f_i`` and
    ``P_i`` each replaced by their mean over the null experts. The null experts are identical
    (they compute nothing), so how the null picks spread among them does not matter; only
    their total share does, and the loss pushes it toward ``Z / (E + Z)`` of the picks like any
    expert's. Without null experts (``null_experts = 0``) it is :func:`switch_loss`.

    Args:
      probs: ``[..., T, E + Z]`` routing probabilities, the null experts last.
      k: picks per token (real and null together).
      null_experts: Z.

    Returns:
      Scalar, averaged over leading (group) axes.
    """
    total = probs.shape[-1]
    if not 0 <= null_experts < total:
        raise InputError(f"null_experts must be in [0, {total}) (the last columns of probs), got {null_experts!r}.")
    if not 1 <= k <= total:
        raise InputError(f"k must be in [1, E + Z={total}], got k={k!r}.")
    picks = jax.lax.top_k(probs, k)[1]
    fraction = jax.nn.one_hot(picks, total, dtype=probs.dtype).sum(-2).mean(-2) / k  # [..., E + Z]
    mean_prob = probs.mean(-2)
    if null_experts:
        pool = lambda v: jnp.concatenate(  # the null columns -> their mean, repeated
            [v[..., :-null_experts], jnp.repeat(v[..., -null_experts:].mean(-1, keepdims=True), null_experts, -1)], -1)
        fraction, mean_prob = pool(fraction), pool(mean_prob)
    return jnp.mean(total * jnp.sum(jax.lax.stop_gradient(fraction) * mean_prob, axis=-1))


def sequence_balance_loss(scores: Array, chosen: Array) -> Array:
    """DeepSeek-V3's complementary sequence-wise balance loss (arXiv 2412.19437, eq. 17-20)
    without its weight alpha: ``sum_i f_i P_i`` per group, averaged over groups.

    ``f_i = E / (k T) * #{t : expert i among token t's k picks}`` and ``P_i = mean_t s'[t, i]``
    with ``s' = scores / sum_j scores[t, j]`` (the affinities normalised over all experts).
    Uniform picks give 1; the gradient flows through ``P`` only.

    Args:
      scores: ``[..., T, E]`` non-negative affinities (DeepSeek-V3: sigmoid scores).
      chosen: ``[..., T, E]`` 0/1, each token's k picks.
    """
    num_experts = scores.shape[-1]
    k = jnp.maximum(chosen.sum(-1).mean(-1), 1.0)  # [...]: picks per token
    fraction = num_experts / k[..., None] * chosen.mean(-2)  # [..., E]
    share = (scores / jnp.sum(scores, axis=-1, keepdims=True)).mean(-2)  # [..., E]
    return jnp.mean(jnp.sum(jax.lax.stop_gradient(fraction) * share, axis=-1))


def z_loss(logits: Array) -> Array:
    """Router z-loss, ``mean_t (logsumexp_i logits[t, i])^2`` (ST-MoE, eq. 5).

    Penalises large router logits, which make the softmax saturate and round-off errors in
    low precision large, without preferring any expert.

    Args:
      logits: router logits ``[..., T, E]``.

    Returns:
      Scalar, averaged over tokens and leading (group) axes.
    """
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)


def correspondence_matrix(probs1: Array, probs2: Array, index: Array, valid: Array) -> Array:
    """Paper 004's eq. (3): ``S = E / |U| * sum_{(p1, p2) in U} r(x1, p1) r(x2, p2)^T``, ``[E, E]``.

    ``S[i, j]`` is E times the mean, over corresponding patch pairs, of the probability that the
    view-1 patch picks expert i and its partner picks expert j. ``S = I`` exactly when the router is
    confident (one-hot distributions), consistent (partners pick alike) and balanced (each expert
    picked by 1/E of the patches). Arguments as in :func:`pairwise_router_consistency`.
    """
    num_experts = probs1.shape[-1]
    partner = jnp.take_along_axis(probs2, index[..., None], axis=1)  # [B, P1, E]
    weight = valid.astype(probs1.dtype)[..., None]
    pairs = jnp.maximum(jnp.sum(valid), 1)
    return num_experts / pairs * jnp.einsum("bpi,bpj->ij", probs1 * weight, partner)


def pairwise_router_consistency(probs1: Array, probs2: Array, index: Array, valid: Array, *,
                                lambda_diag: float = 5e-3, lambda_offdiag: float = 5e-2) -> Array:
    """Pairwise Router Consistency loss (paper 004, eq. 3-6).

    ``S = E / |U| * sum_{(p1, p2) in U} r(x1, p1) r(x2, p2)^T`` over the corresponding
    patch pairs U of all images, then
    ``L = lambda_diag / E * sum_i (1 - S_ii)^2 + lambda_offdiag / (E (E-1)) * sum_{i!=j} S_ij^2``:
    corresponding patches should pick the same expert (diagonal near 1) and nothing else
    (off-diagonal near 0). Defaults are paper 004's Table 1.

    Args:
      probs1: ``[B, P1, E]`` router distributions of view 1 (the higher-resolution view).
      probs2: ``[B, P2, E]`` router distributions of view 2.
      index: ``[B, P1]`` int, the view-2 patch corresponding to each view-1 patch.
      valid: ``[B, P1]`` bool, whether the correspondence exists (centre inside view 2).

    Returns:
      Scalar loss.
    """
    if probs1.ndim != 3 or probs2.ndim != 3 or probs1.shape[-1] != probs2.shape[-1]:
        raise InputError(f"probs1, probs2 must be [B, P, E] with equal E, got {probs1.shape}, {probs2.shape}.")
    if index.shape != probs1.shape[:2] or valid.shape != probs1.shape[:2]:
        raise InputError(f"index and valid must have shape {probs1.shape[:2]}, got {index.shape}, {valid.shape}.")
    num_experts = probs1.shape[-1]
    s = correspondence_matrix(probs1, probs2, index, valid)
    eye = jnp.eye(num_experts, dtype=s.dtype)
    diag = jnp.sum((1 - jnp.diag(s)) ** 2) * lambda_diag / num_experts
    offdiag = jnp.sum(((1 - eye) * s) ** 2) * lambda_offdiag / max(num_experts * (num_experts - 1), 1)
    return diag + offdiag
