"""Auxiliary losses that balance Softmax Token Choice (paper 000, Appendix A).

Both are the squared coefficient of variation (population std / mean) of a per-expert
quantity, computed per group and averaged over groups.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

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
        raise ValueError(f"noise_std must be > 0 for the load loss, got {noise_std!r}.")
    num_experts = logits.shape[-1]
    threshold = jax.lax.top_k(noisy_logits, k)[0][..., -1:]  # [..., T, 1]
    sigma = noise_std / num_experts
    load = jax.scipy.stats.norm.cdf((logits - threshold) / sigma).sum(axis=-2)  # [..., E]
    return jnp.mean(cv_squared(load))
