"""Tests of mini_moe.losses: the auxiliary balancing losses of paper 000, Appendix A, the
Switch Transformer / GShard loss and the ST-MoE router z-loss.

Conventions (DESIGN Sec. 3, from google-research/vmoe): CV^2 uses the population std;
the load loss's noise has std noise_std / E; losses are computed per group (leading axes)
and averaged over groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy.stats import norm

from mini_moe import losses

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

importance_jit = jax.jit(losses.importance_loss)
load_jit = jax.jit(losses.load_loss, static_argnames=("k", "noise_std"))


def _softmax_np(x):
    x = np.asarray(x, np.float64)
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def _cv2_np(values):
    values = np.asarray(values, np.float64)
    return values.var(-1) / values.mean(-1) ** 2  # np.var is the population variance


# ------------------------------------------------------------------------ cv_squared


def test_cv_squared_known_value():
    # mean 3, population variance (4 + 1 + 0 + 9) / 4 = 3.5, CV^2 = 3.5 / 9
    np.testing.assert_allclose(float(losses.cv_squared(jnp.array([1.0, 2.0, 3.0, 6.0]))), 3.5 / 9, rtol=1e-6)


def test_cv_squared_axis_and_constant():
    values = jnp.array([[1.0, 4.0], [2.0, 4.0], [3.0, 4.0], [6.0, 4.0]])
    np.testing.assert_allclose(np.asarray(losses.cv_squared(values, axis=0)), [3.5 / 9, 0.0], atol=1e-7)
    # scale invariant
    np.testing.assert_allclose(
        float(losses.cv_squared(jnp.array([10.0, 20.0, 30.0, 60.0]))), 3.5 / 9, rtol=1e-6
    )


# ------------------------------------------------------------------- importance loss


def test_importance_loss_hand_computed():
    logits = np.array(
        [
            # group 0: T = 3 tokens, E = 3 experts
            [[2.0, 0.0, -1.0], [0.5, 0.5, 0.0], [0.0, 1.0, 3.0]],
            # group 1
            [[1.0, 1.0, 1.0], [4.0, 0.0, 0.0], [-2.0, 1.0, 0.0]],
        ],
        np.float32,
    )
    # per token softmax over experts, summed over tokens -> per-expert importance
    importance = _softmax_np(logits).sum(axis=1)  # [groups, E]
    mean = importance.mean(axis=1)
    var = ((importance - mean[:, None]) ** 2).mean(axis=1)
    expected = np.mean(var / mean**2)
    # every token's probabilities sum to 1, so the mean importance is T/E = 1 per group
    np.testing.assert_allclose(mean, 1.0, rtol=1e-12)
    np.testing.assert_allclose(float(losses.importance_loss(logits)), expected, rtol=1e-5)
    # averaged over groups: the mean of the per-group losses
    per_group = [float(importance_jit(g)) for g in logits]
    np.testing.assert_allclose(float(importance_jit(logits)), np.mean(per_group), rtol=1e-6)


def test_importance_loss_zero_when_balanced():
    # rows are cyclic shifts of one vector: each expert gets the same total probability
    row = np.array([3.0, -1.0, 0.5, 2.0], np.float32)
    logits = np.stack([np.roll(row, s) for s in range(4)])
    assert abs(float(losses.importance_loss(logits))) < 1e-10
    assert float(losses.importance_loss(np.zeros((5, 3), np.float32))) == 0.0
    # and positive when one expert takes everything
    skewed = np.zeros((4, 4), np.float32)
    skewed[:, 0] = 10.0
    assert float(losses.importance_loss(skewed)) > 1.0


@SETTINGS
@given(
    data=st.data(),
    shape=st.sampled_from([(6, 4), (3, 5, 2), (2, 2, 4, 3)]),
)
def test_importance_loss_matches_numpy(data, shape):
    logits = data.draw(
        hnp.arrays(np.float32, shape, elements=st.floats(-5, 5, width=32, allow_nan=False))
    )
    importance = _softmax_np(logits).sum(axis=-2)
    expected = np.mean(_cv2_np(importance))
    np.testing.assert_allclose(float(importance_jit(logits)), expected, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------- load loss


def _load_loss_reference(logits, noisy_logits, k, noise_std):
    """P(clean logit + N(0, (noise_std/E)^2) > k-th largest noisy logit of the token),
    summed over each group's tokens; CV^2 over experts; mean over groups."""
    logits = np.asarray(logits, np.float64)
    noisy_logits = np.asarray(noisy_logits, np.float64)
    num_experts = logits.shape[-1]
    threshold = np.sort(noisy_logits, axis=-1)[..., -k][..., None]  # k-th largest
    sigma = noise_std / num_experts
    load = norm.cdf((logits - threshold) / sigma).sum(axis=-2)  # [..., E]
    return np.mean(_cv2_np(load))


def _noisy(seed, shape, noise_std):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=shape).astype(np.float32) * 0.3
    noise = rng.normal(size=shape).astype(np.float32) * (noise_std / shape[-1])
    return logits, logits + noise


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_load_loss_matches_scipy(k, seed):
    noise_std = 1.0
    logits, noisy = _noisy(seed, (3, 6, 4), noise_std)  # 3 groups, T = 6, E = 4
    expected = _load_loss_reference(logits, noisy, k, noise_std)
    got = float(load_jit(logits, noisy, k=k, noise_std=noise_std))
    assert expected > 0
    np.testing.assert_allclose(got, expected, rtol=1e-4)


def test_load_loss_hand_example():
    # One group, T = 2 tokens, E = 2 experts, k = 1, noise_std = 1 -> sigma = 1/2.
    logits = np.array([[1.0, 0.0], [0.0, 0.5]], np.float32)
    noisy = np.array([[1.2, -0.1], [0.1, 0.4]], np.float32)
    # thresholds (largest noisy logit): 1.2 and 0.4
    load = np.array(
        [
            norm.cdf((1.0 - 1.2) / 0.5) + norm.cdf((0.0 - 0.4) / 0.5),
            norm.cdf((0.0 - 1.2) / 0.5) + norm.cdf((0.5 - 0.4) / 0.5),
        ]
    )
    expected = load.var() / load.mean() ** 2
    np.testing.assert_allclose(float(load_jit(logits, noisy, k=1, noise_std=1.0)), expected, rtol=1e-5)


def test_load_loss_is_mean_over_groups():
    logits, noisy = _noisy(2, (3, 6, 4), 1.0)
    per_group = [float(load_jit(a, b, k=1, noise_std=1.0)) for a, b in zip(logits, noisy)]
    np.testing.assert_allclose(float(load_jit(logits, noisy, k=1, noise_std=1.0)), np.mean(per_group), rtol=1e-5)


@pytest.mark.parametrize("noise_std", [0.0, -1.0])
def test_load_loss_rejects_non_positive_noise(noise_std):
    logits = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match="noise_std"):
        losses.load_loss(logits, logits, k=1, noise_std=noise_std)


# ------------------------------------------------------------------- switch and z-loss


def test_switch_loss_hand_computed():
    probs = np.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]], np.float32)
    # top-1 picks 0, 0, 1, 0: f = (3/4, 1/4); mean probabilities P = (0.65, 0.35)
    # E * sum f P = 2 * (0.75 * 0.65 + 0.25 * 0.35) = 1.15
    np.testing.assert_allclose(float(losses.switch_loss(probs)), 1.15, rtol=1e-6)
    # k = 2 with two experts: every token picks both, f = (1/2, 1/2), loss = 2 * (0.5 * 0.65 + 0.5 * 0.35) = 1
    np.testing.assert_allclose(float(losses.switch_loss(probs, k=2)), 1.0, rtol=1e-6)


@pytest.mark.parametrize("k", [1, 2])
def test_switch_loss_matches_numpy_and_bounds(k):
    rng = np.random.default_rng(k)
    logits = rng.normal(size=(3, 16, 4)).astype(np.float32)
    probs = _softmax_np(logits)
    picks = np.argsort(-probs, axis=-1)[..., :k]
    fraction = np.stack([(picks == i).sum(axis=(-1, -2)) for i in range(4)], -1) / (16 * k)
    expected = np.mean(4 * np.sum(fraction * probs.mean(-2), -1))
    got = float(losses.switch_loss(probs.astype(np.float32), k=k))
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    # uniform probabilities: P_i = 1/E, so the loss is exactly 1 whatever the (tied) picks
    np.testing.assert_allclose(float(losses.switch_loss(np.full((8, 4), 0.25, np.float32), k=k)), 1.0, rtol=1e-6)
    # collapse: every token certain of expert 0 gives the maximum, E
    collapsed = np.tile(np.array([1.0, 0.0, 0.0, 0.0], np.float32), (8, 1))
    np.testing.assert_allclose(float(losses.switch_loss(collapsed)), 4.0, rtol=1e-6)


def test_switch_loss_gradient_is_E_times_fraction_through_the_mean_probability():
    probs = jnp.asarray(np.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]], np.float32))
    g = np.asarray(jax.grad(losses.switch_loss)(probs))
    # d/dprobs[t, i] = E * f_i / T, the same for every token: f = (3/4, 1/4), E = 2, T = 4
    np.testing.assert_allclose(g, np.tile([[2 * 0.75 / 4, 2 * 0.25 / 4]], (4, 1)), rtol=1e-6)


def test_switch_loss_rejects_bad_k():
    with pytest.raises(ValueError, match="k must be in"):
        losses.switch_loss(np.full((4, 2), 0.5, np.float32), k=3)


def test_z_loss_hand_computed():
    # one token with logits (0, 0): logsumexp = log 2, z = (log 2)^2
    np.testing.assert_allclose(float(losses.z_loss(np.zeros((1, 2), np.float32))), np.log(2) ** 2, rtol=1e-6)
    logits = np.array([[[1.0, 2.0, 3.0], [0.0, -1.0, 4.0]]], np.float32)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(float(losses.z_loss(logits)), np.mean(lse**2), rtol=1e-6)
    # its gradient is 2 * lse * softmax / (number of tokens): it shrinks every logit of a token
    g = np.asarray(jax.grad(losses.z_loss)(jnp.asarray(logits)))
    np.testing.assert_allclose(g, 2 * lse[..., None] * _softmax_np(logits) / 2, rtol=1e-5)


# ------------------------------------------------------------------------- gradients


def test_gradients_finite():
    logits, noisy_fixed = _noisy(3, (2, 6, 4), 1.0)
    noise = noisy_fixed - logits

    g_imp = np.asarray(jax.jit(jax.grad(losses.importance_loss))(logits))
    assert np.all(np.isfinite(g_imp)) and np.any(g_imp != 0)
    # at a perfectly balanced point the gradient is finite (and zero: CV^2 is minimal there)
    g0 = np.asarray(jax.jit(jax.grad(losses.importance_loss))(np.zeros((4, 4), np.float32)))
    assert np.all(np.isfinite(g0))
    np.testing.assert_allclose(g0, 0.0, atol=1e-7)

    # load loss: the gradient flows through the clean logits and through the threshold
    def load_of(x):
        return losses.load_loss(x, x + noise, k=2, noise_std=1.0)

    g_load = np.asarray(jax.jit(jax.grad(load_of))(logits))
    assert np.all(np.isfinite(g_load)) and np.any(g_load != 0)

    # directional finite difference of both losses
    direction = np.random.default_rng(4).normal(size=logits.shape).astype(np.float32)
    # (h small enough that no token's ranking of noisy logits changes: top_k is piecewise)
    h = 1e-3
    for fn, g in [(importance_jit, g_imp), (jax.jit(load_of), g_load)]:
        fd = (float(fn(logits + h * direction)) - float(fn(logits - h * direction))) / (2 * h)
        np.testing.assert_allclose(fd, float(np.sum(g * direction)), rtol=2e-2, atol=1e-4)
