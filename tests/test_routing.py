"""Allocation (Algorithms 1 and 2, Soft MoE softmaxes): invariants and loop == vectorised."""

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mini_moe
from mini_moe import routing

SETTINGS = settings(max_examples=25, deadline=None)
# The property tests call the allocations jitted: one XLA compilation per drawn shape and setting
# instead of one per primitive run eagerly (test_jit_and_vmap_match_eager checks that the two agree).
_token_choice = jax.jit(routing.token_choice, static_argnames=("capacity", "k", "batch_priority"))


@st.composite
def score_problems(draw, ties=False):
    """Random scores [G, T, E] (optionally from a tiny value set, to create ties)."""
    # Few distinct shapes: every new shape costs XLA compilations.
    groups = draw(st.sampled_from([1, 2]))
    tokens = draw(st.sampled_from([1, 3, 8]))
    experts = draw(st.sampled_from([1, 2, 5]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    if ties:
        scores = rng.choice([0.0, 0.25, 0.5], size=(groups, tokens, experts))
    else:
        scores = rng.random((groups, tokens, experts))
    return scores.astype(np.float32)


# ----------------------------------------------------------------------- capacity


def test_capacity_known_values():
    assert routing.capacity(392, 32, 1) == 12  # 12.25 -> 12
    assert routing.capacity(392, 32, 2) == 25  # 24.5 -> 25 (halves round up)
    assert routing.capacity(8, 4, 1) == 2
    assert routing.capacity(10, 32, 1) == 1  # never below 1
    assert routing.capacity(49 * 8, 32, 1.05) == round(1.05 * 392 / 32)


def test_capacity_rounds_halves_up_exactly():
    """Halves round up on the factor's decimal value, not on its binary float (code review B4):
    0.7 * 45 / 3 is 10.5, which floats compute as 10.4999... and rounded down to 10. Checked
    against exact fractions over T < 100, E <= 12 and c = 0.05, 0.10, ..., 4.00."""
    assert 0.7 * 45 / 3 < 10.5  # the float arithmetic that rounded it down
    assert routing.capacity(45, 3, 0.7) == 11
    assert routing.capacity(45, 3, Fraction(7, 10)) == routing.capacity(45, 3, np.float32(0.7)) == 11
    halves = float_wrong = 0
    for tokens in range(1, 100):
        for experts in range(1, 13):
            for twentieths in range(1, 81):
                exact = Fraction(twentieths, 20) * tokens / experts
                expected = max(1, math.floor(exact + Fraction(1, 2)))
                factor = twentieths / 20
                assert routing.capacity(tokens, experts, factor) == expected, (tokens, experts, factor)
                halves += exact.denominator == 2
                float_wrong += max(1, math.floor(factor * tokens / experts + 0.5)) != expected
    assert halves > 1000 and float_wrong > 10  # the grid holds halves the float formula gets wrong


@pytest.mark.parametrize("args", [(0, 4, 1), (8, 0, 1), (8, 4, 0), (8, 4, -1.0), (8.5, 4, 1), (8, 4, math.inf)])
def test_capacity_rejects_bad_input(args):
    with pytest.raises(ValueError):
        routing.capacity(*args)


# ------------------------------------------------------------------- token choice


@SETTINGS
@given(scores=score_problems(), data=st.data())
def test_token_choice_invariants(scores, data):
    groups, tokens, experts = scores.shape
    k = data.draw(st.integers(1, experts))
    cap = data.draw(st.integers(1, tokens + 1))
    bpr = data.draw(st.booleans())
    rt = _token_choice(scores, capacity=cap, k=k, batch_priority=bpr)
    d, c = np.asarray(rt.dispatch), np.asarray(rt.combine)
    assert d.shape == (groups, tokens, experts, cap)
    assert set(np.unique(d)) <= {0.0, 1.0}  # hard assignment
    assert (d.sum(axis=1) <= 1).all()  # a slot holds at most one token
    assert (d.sum(axis=(1, 3)) <= cap).all()  # no expert above capacity
    assert (d.sum(axis=3) <= 1).all()  # a token uses at most one slot per expert
    assert (d.sum(axis=(2, 3)) <= k).all()  # at most k experts per token
    filled = d.sum(axis=1)  # [G, E, C]: buffers fill from slot 0 without gaps
    assert (np.diff(filled, axis=-1) <= 0).all()
    np.testing.assert_allclose(c, d * scores[..., None])  # raw scores, not renormalised
    # A token reaches an expert only if that expert is among its top-k scores.
    kth = -np.sort(-scores, axis=-1)[..., k - 1 : k]
    assert (scores[d.sum(axis=3) > 0] >= np.broadcast_to(kth, scores.shape)[d.sum(axis=3) > 0]).all()


@SETTINGS
@given(scores=st.one_of(score_problems(), score_problems(ties=True)), data=st.data())
def test_token_choice_equals_algorithm_1_loop(scores, data):
    groups, tokens, experts = scores.shape
    k = data.draw(st.integers(1, experts))
    cap = data.draw(st.integers(1, tokens))
    bpr = data.draw(st.booleans())
    combine_scores = np.random.default_rng(0).random(scores.shape).astype(np.float32)
    rt = _token_choice(scores, capacity=cap, k=k, batch_priority=bpr, combine_scores=combine_scores)
    for g in range(groups):
        d, c = routing.token_choice_loop(
            scores[g], capacity=cap, k=k, batch_priority=bpr, combine_scores=combine_scores[g]
        )
        np.testing.assert_array_equal(np.asarray(rt.dispatch[g]), d)
        np.testing.assert_allclose(np.asarray(rt.combine[g]), c, rtol=1e-6)


def test_token_choice_first_choices_before_second_choices():
    # Capacity 1. Token 0 prefers expert 0 then 1; token 1 prefers expert 1.
    # Token 0's second choice (expert 1) must not take the slot token 1's FIRST choice needs.
    scores = np.array([[0.6, 0.4], [0.2, 0.8]], np.float32)
    d = np.asarray(routing.token_choice(scores, capacity=1, k=2).dispatch)
    assert d[0, 0, 0] == 1 and d[1, 1, 0] == 1
    assert d[0, 1].sum() == 0  # token 0's second pick was dropped, not placed first


def test_token_choice_drops_are_not_rerouted_and_bpr_reorders():
    # Capacity 1, everybody prefers expert 0; token 1 is the most confident.
    scores = np.array([[0.6, 0.4], [0.9, 0.1], [0.7, 0.3]], np.float32)
    plain = np.asarray(routing.token_choice(scores, capacity=1).dispatch)
    assert plain[0, 0, 0] == 1  # first token in order wins
    assert plain[1:].sum() == 0  # the others are dropped, not sent to expert 1
    bpr = np.asarray(routing.token_choice(scores, capacity=1, batch_priority=True).dispatch)
    assert bpr[1, 0, 0] == 1 and bpr[0].sum() == 0 and bpr[2].sum() == 0
    # With capacity 2 and BPR the buffer order follows the top-1 score: token 1, then 2.
    bpr2 = np.asarray(routing.token_choice(scores, capacity=2, batch_priority=True).dispatch)
    assert bpr2[1, 0, 0] == 1 and bpr2[2, 0, 1] == 1 and bpr2[0].sum() == 0


def test_token_choice_bpr_uses_the_same_order_in_every_round():
    # Token 0 is more confident (0.5 > 0.45), so with BPR it goes first in round 2 too.
    scores = np.array([[0.5, 0.3, 0.2], [0.45, 0.3, 0.25]], np.float32)
    d = np.asarray(routing.token_choice(scores, capacity=1, k=2, batch_priority=True).dispatch)
    assert d[0, 0, 0] == 1 and d[0, 1, 0] == 1  # token 0: expert 0, then expert 1
    assert d[1].sum() == 0  # token 1 loses both
    d_plain = np.asarray(routing.token_choice(scores[::-1], capacity=1, k=2).dispatch)
    assert d_plain[0, 0, 0] == 1 and d_plain[0, 1, 0] == 1  # without BPR, position wins


# ------------------------------------------------------------------ expert choice


@SETTINGS
@given(scores=st.one_of(score_problems(), score_problems(ties=True)), data=st.data())
def test_expert_choice_invariants_and_loop(scores, data):
    groups, tokens, experts = scores.shape
    cap = data.draw(st.integers(1, tokens))
    rt = routing.expert_choice(scores, capacity=cap)
    d, c = np.asarray(rt.dispatch), np.asarray(rt.combine)
    assert set(np.unique(d)) <= {0.0, 1.0}
    np.testing.assert_array_equal(d.sum(axis=1), 1.0)  # every buffer slot is filled
    assert (d.sum(axis=3) <= 1).all()  # an expert picks a token at most once
    np.testing.assert_allclose(c, d * scores[..., None])
    # The picks of expert r are its C best tokens: picked scores >= every unpicked score.
    picked = d.sum(axis=3) > 0
    for g in range(groups):
        for r in range(experts):
            col, mask = scores[g, :, r], picked[g, :, r]
            if (~mask).any():
                assert col[mask].min() >= col[~mask].max()
        dl, cl = routing.expert_choice_loop(scores[g], capacity=cap)
        np.testing.assert_array_equal(d[g], dl)
        np.testing.assert_allclose(c[g], cl, rtol=1e-6)


def test_expert_choice_known_example():
    scores = np.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7]], np.float32)
    d = np.asarray(routing.expert_choice(scores, capacity=2).dispatch)
    # Expert 0 takes tokens 0, 1 (in that slot order); expert 1 takes tokens 2, 1.
    assert d[0, 0, 0] == d[1, 0, 1] == d[2, 1, 0] == d[1, 1, 1] == 1
    assert d.sum() == 4
    metrics = routing.routing_metrics(routing.expert_choice(scores, capacity=2))
    assert float(metrics["dropped"]) == 0.0
    np.testing.assert_allclose(float(metrics["experts_per_token"]), 4 / 3, rtol=1e-6)
    metrics1 = routing.routing_metrics(routing.expert_choice(scores, capacity=1))
    np.testing.assert_allclose(float(metrics1["dropped"]), 1 / 3, rtol=1e-6)  # token 1: nobody


# ------------------------------------------------------------------------ Soft MoE


@SETTINGS
@given(
    shape=st.sampled_from([(1, 1, 1, 1), (2, 9, 4, 1), (1, 5, 2, 3), (2, 3, 1, 2)]),
    scale=st.sampled_from([0.1, 1.0, 30.0]),
)
def test_soft_routing_normalisations(shape, scale):
    logits = np.random.default_rng(sum(shape)).normal(size=shape).astype(np.float32) * scale
    rt = routing.soft_routing(logits)
    d, c = np.asarray(rt.dispatch), np.asarray(rt.combine)
    assert not rt.sparse
    np.testing.assert_allclose(d.sum(axis=1), 1.0, rtol=1e-5)  # each slot: convex comb. of tokens
    np.testing.assert_allclose(c.sum(axis=(2, 3)), 1.0, rtol=1e-5)  # each token: over all slots
    # Independent computation of paper 002 eq. (1)-(2) for group 0.
    z = logits[0].astype(np.float64)
    e = np.exp(z - z.max(axis=0, keepdims=True))
    np.testing.assert_allclose(d[0], e / e.sum(axis=0, keepdims=True), rtol=1e-4, atol=1e-7)
    flat = z.reshape(z.shape[0], -1)
    e = np.exp(flat - flat.max(axis=1, keepdims=True))
    np.testing.assert_allclose(c[0], (e / e.sum(axis=1, keepdims=True)).reshape(z.shape), rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------- transformations


def test_jit_and_vmap_match_eager():
    scores = jax.random.uniform(jax.random.PRNGKey(0), (3, 12, 4))
    eager = routing.token_choice(scores, capacity=3, k=2, batch_priority=True)
    jitted = jax.jit(lambda s: routing.token_choice(s, capacity=3, k=2, batch_priority=True))(scores)
    vmapped = jax.vmap(lambda s: routing.token_choice(s, capacity=3, k=2, batch_priority=True))(scores)
    for other in (jitted, vmapped):
        np.testing.assert_array_equal(np.asarray(eager.dispatch), np.asarray(other.dispatch))
        np.testing.assert_allclose(np.asarray(eager.combine), np.asarray(other.combine))
    ec = routing.expert_choice(scores, capacity=3)
    ec_v = jax.vmap(lambda s: routing.expert_choice(s, capacity=3))(scores)
    np.testing.assert_array_equal(np.asarray(ec.dispatch), np.asarray(ec_v.dispatch))


def test_combine_gradient_flows_to_combine_scores_only_at_picks():
    scores = jax.random.uniform(jax.random.PRNGKey(1), (6, 3))

    def total(w):
        return routing.token_choice(scores, capacity=2, combine_scores=w).combine.sum()

    grad = np.asarray(jax.grad(total)(scores))
    picked = np.asarray(routing.token_choice(scores, capacity=2).dispatch).sum(-1)
    np.testing.assert_array_equal(grad, picked)


# ------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s: routing.token_choice(s[0, 0], capacity=1), "scores"),
        (lambda s: routing.token_choice(s, capacity=0), "capacity"),
        (lambda s: routing.token_choice(s, capacity=1.5), "capacity"),
        (lambda s: routing.token_choice(s, capacity=1, k=0), "k"),
        (lambda s: routing.token_choice(s, capacity=1, k=5), "k must be <="),
        (lambda s: routing.token_choice(s, capacity=1, combine_scores=s[0]), "combine_scores"),
        (lambda s: routing.expert_choice(s, capacity=7), "capacity"),
        (lambda s: routing.expert_choice(s, capacity=0), "capacity"),
        (lambda s: routing.soft_routing(s[0]), "logits"),
    ],
)
def test_bad_inputs_raise_value_error(call, match):
    scores = np.random.default_rng(0).random((2, 6, 4)).astype(np.float32)
    with pytest.raises(ValueError, match=match):
        call(scores)


@pytest.mark.parametrize("tokens, experts, factor, expected", [
    (196, 8, 1.0, 25),  # 24.5: half-way, rounds up (Python's round() gives 24)
    (20, 8, 1.0, 3),    # 2.5
    (12, 8, 1.0, 2),    # 1.5
    (196, 8, 0.5, 12),  # 12.25
    (49, 16, 1.0, 3),   # 3.06
    (4, 16, 1.0, 1),    # never below 1
])
def test_every_place_that_sizes_slots_uses_routing_capacity(tokens, experts, factor, expected):
    """One rounding of C = round(c T / E) everywhere: the function itself, the study's capacity
    options for every allocation (Soft MoE's slots per expert included), the configuration's
    default Soft MoE slots and the benchmark's layer."""
    from flax import nnx

    from mini_moe import bench, config, study

    assert routing.capacity(tokens, experts, factor) == expected
    assert study.capacity_options("soft_moe", factor, tokens=tokens, num_experts=experts) == {"slots_per_expert": expected}
    for name in ("softmax_expert_choice", "softmax_token_choice"):
        kwargs = study.capacity_options(name, factor, tokens=tokens, num_experts=experts)
        router = mini_moe.make_router(name, 8, experts, rngs=nnx.Rngs(0), **kwargs)
        assert router.allocation.budget(tokens, experts).capacity == expected
    if factor == 1.0 and tokens in (196, 49):  # 28x28 images in 2x2 / 4x4 patches
        cfg = config.get_config("quick", dataset="fashion_mnist", router="soft_moe", model_num_experts=experts,
                                model_patch_size=28 // int(tokens ** 0.5))
        assert dict(cfg.model.router_kwargs)["slots_per_expert"] == expected
    shape = bench.LAYER_SHAPES["quick"]
    router, _ = bench._router_and_tokens("soft_moe", "quick", nnx.Rngs(0))
    assert router.affinity.slots_per_expert == routing.capacity(shape[1], shape[5], 1.0)


def test_pick_load_and_max_violation_count_the_demand_before_capacity():
    rng = np.random.default_rng(0)
    scores = rng.random((3, 10, 4)).astype(np.float32)
    for k in (1, 2, 4):
        expected = np.zeros(4)
        for row in scores.reshape(-1, 4):
            expected[np.argsort(-row, kind="stable")[:k]] += 1
        load = np.asarray(routing.pick_load(scores, k=k))
        np.testing.assert_array_equal(load, expected)  # counts: exact
        np.testing.assert_allclose(float(routing.max_violation(load)), expected.max() / expected.mean() - 1, rtol=1e-6)
    # min_score: only the scores above it are picks (ReLU routing)
    gates = np.maximum(scores - 0.5, 0.0)
    np.testing.assert_array_equal(np.asarray(routing.pick_load(gates, k=4, min_score=0.0)), (gates > 0).sum((0, 1)))
    # the extremes: balanced -> 0, everything on one expert -> E - 1, nothing -> 0
    assert float(routing.max_violation(jnp.array([5.0, 5.0, 5.0, 5.0]))) == 0.0
    assert float(routing.max_violation(jnp.array([20.0, 0.0, 0.0, 0.0]))) == 3.0
    assert float(routing.max_violation(jnp.zeros(4))) == 0.0
