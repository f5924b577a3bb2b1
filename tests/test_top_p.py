"""Top-p routing (Huang et al. 2024, arXiv 2403.07652; issue 54 §2): each token takes the fewest
top experts whose router probabilities reach p. The selection against a loop of the paper's
rule, the routing and the dropless layer it gives, the dynamic (entropy) and balancing losses,
the threshold controller (a P step towards a target number of experts per token) and training."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx

from mini_moe import routers, routing
from mini_moe.modes import eval_mode
from mini_moe.layer import MlpExperts
from mini_moe.model import MoeLayer
from mini_moe.routers import adaptive
from mini_moe.validate import InputError

D, E, T, G = 16, 8, 32, 2


def paper_rule(probs, p):
    """The rule as the paper states it, one token at a time: add experts in decreasing order of
    probability (ties: lower index) until the probability of those added reaches p."""
    probs = np.asarray(probs, np.float64)
    chosen = np.zeros(probs.shape, bool)
    for t in np.ndindex(probs.shape[:-1]):
        total = 0.0
        for e in np.argsort(-probs[t], kind="stable"):
            if total >= p:  # the experts added so far reach p: stop
                break
            chosen[t + (e,)] = True
            total += probs[t + (e,)]
    return chosen


def near_p(probs, p, tol=1e-6):
    """Tokens where the mass ranked before some expert is within ``tol`` of p: float32 and float64
    sums may fall on either side there, so the two rules may differ there and only there."""
    ranked = -np.sort(-np.asarray(probs, np.float64), axis=-1)
    before = np.cumsum(ranked, axis=-1) - ranked
    return (np.abs(before - p) < tol).any(-1)


def _probs(seed, shape, scale=1.0):
    return np.asarray(jax.nn.softmax(scale * jax.random.normal(jax.random.key(seed), shape), axis=-1))


def _router(**kw):
    return adaptive.top_p(D, E, rngs=nnx.Rngs(0), **kw)


def _x(seed, shape=(G, T, D)):
    return jax.random.normal(jax.random.key(seed), shape)


# ------------------------------------------------------------------------------ the selection


@pytest.mark.parametrize("p", [0.1, 0.4, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_selection_equals_the_papers_rule(p, scale):
    probs = _probs(int(p * 100) + int(scale), (4, 128, E), scale)  # ties have probability 0
    mask = np.asarray(adaptive.top_p_mask(probs, p))
    counts = mask.sum(-1)
    assert counts.min() >= 1 and counts.max() <= E
    if p == 1.0:
        # Every expert, except one whose probability is lost in the float32 round-off of the mass
        # ranked before it (that mass rounds to 1): at scale 3 some probabilities are ~1e-8.
        assert mask[probs > 1e-6].all()
        assert mask.all() or scale > 1
        return
    want = paper_rule(probs, p)
    unsure = near_p(probs, p)
    assert unsure.mean() < 0.01
    np.testing.assert_array_equal(mask[~unsure], want[~unsure])
    if p <= 1 / E:  # every top probability is >= 1/E: the top-1 alone
        assert (counts == 1).all()
    else:
        assert counts.min() < counts.max()  # the number of experts varies per token


def test_a_tiny_threshold_is_top_1_and_the_selection_grows_with_p():
    probs = _probs(1, (2, 64, E), 2.0)
    top1 = np.asarray(adaptive.top_p_mask(probs, 1e-6))
    np.testing.assert_array_equal(top1, np.eye(E, dtype=bool)[probs.argmax(-1)])
    masks = [np.asarray(adaptive.top_p_mask(probs, p)) for p in (0.2, 0.5, 0.8, 1.0)]
    for small, large in zip(masks, masks[1:]):
        assert not (small & ~large).any()  # a larger p keeps every expert a smaller one selected


def test_a_cumulative_that_reaches_p_exactly_stops_the_selection():
    """"The smallest set whose probability reaches p": a set summing to exactly p is enough. The
    probabilities are sums of powers of 2, exact in float32, so every cumulative is exact."""
    probs = np.asarray([[0.5, 0.25, 0.125, 0.125], [0.125, 0.5, 0.125, 0.25]], np.float32)
    for p, count in [(0.5, 1), (0.5 + 1e-6, 2), (0.75, 2), (0.875, 3), (1.0, 4)]:
        mask = np.asarray(adaptive.top_p_mask(probs, p))
        np.testing.assert_array_equal(mask, paper_rule(probs, p))
        np.testing.assert_array_equal(mask.sum(-1), [count, count])
    np.testing.assert_array_equal(np.asarray(adaptive.top_p_mask(probs, 0.75)),
                                  [[True, True, False, False], [False, True, False, True]])


def test_p_1_under_round_off_selects_every_expert_and_never_a_zero_probability():
    """Why the rule is "the mass ranked before the expert is < p": these float32 probabilities sum
    to 0.99999994, below p = 1, so their cumulative never reaches p. A search for the first place
    where it does finds none (argmax of all-False is 0: the top-1 alone); the rule used selects
    all three, as p = 1 means."""
    probs = np.asarray([[0.5, 0.25, 0.24999994]], np.float32)
    assert probs.sum(dtype=np.float32) < 1.0
    assert np.asarray(adaptive.top_p_mask(probs, 1.0)).all()
    search = np.argmax(np.cumsum(probs, -1) >= 1.0, -1)  # the rule this one replaces
    assert search[0] == 0
    # A probability that underflowed to 0 after a top one that rounds to 1: the mass before it is
    # already 1, so it is not selected (at p = 1 too).
    saturated = np.asarray([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], np.float32)
    np.testing.assert_array_equal(np.asarray(adaptive.top_p_mask(saturated, 1.0)), saturated > 0)
    # Saturated logits: the top probability rounds to 1, the others to 0. One expert each, and
    # the router makes no pick at a zero probability.
    router = _router(threshold=1.0, capacity_factor=float(E), deterministic=True)
    router.affinity.dense.kernel[...] = 1e3 * router.affinity.dense.kernel[...]
    out = router(_x(2))
    reached = np.asarray(out.routing.dispatch).any(-1)
    assert (reached.sum(-1) >= 1).all()
    assert not (reached & (np.asarray(out.probs) == 0)).any()


# ------------------------------------------------------------------------------ the routing


def test_the_router_dispatches_exactly_the_selection_with_the_probabilities_as_weights():
    p = 0.5
    router = _router(threshold=p, capacity_factor=float(E), deterministic=True)  # C = T: nothing dropped
    x = _x(3)
    out = router(x)
    probs = np.asarray(jax.nn.softmax(x @ router.affinity.dense.kernel[...], axis=-1))
    assert not near_p(probs, p).any()
    want = paper_rule(probs, p)
    reached = np.asarray(out.routing.dispatch).any(-1)
    np.testing.assert_array_equal(reached, want)
    np.testing.assert_allclose(np.asarray(out.routing.combine).sum(-1), probs * want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(out.probs), probs, rtol=1e-6)
    assert float(out.metrics["dropped"]) == 0.0
    np.testing.assert_allclose(float(out.metrics["active_experts"]), want.sum(-1).mean(), rtol=1e-6)
    np.testing.assert_allclose(float(out.metrics["experts_per_token"]), want.sum(-1).mean(), rtol=1e-6)
    assert float(out.metrics["threshold"]) == pytest.approx(p)
    np.testing.assert_array_equal(np.asarray(out.metrics["pick_load"]), want.reshape(-1, E).sum(0))


def test_with_tight_buffers_the_picks_follow_algorithm_1():
    router = _router(k=1, deterministic=True)  # C = round(T / E): buffers overflow
    x = _x(4)
    out = router(x)
    scores, probs = np.asarray(out.affinities.scores), np.asarray(out.probs)
    capacity = routing.capacity(T, E, 1.0)
    assert out.routing.dispatch.shape[-1] == capacity
    for g in range(G):
        dispatch, combine = routing.token_choice_loop(scores[g], capacity=capacity, k=E, combine_scores=probs[g],
                                                      min_score=0.0)
        np.testing.assert_array_equal(np.asarray(out.routing.dispatch[g]), dispatch)
        np.testing.assert_allclose(np.asarray(out.routing.combine[g]), combine, rtol=1e-6)
    assert float(out.metrics["dropped"]) > 0


def test_the_dropless_layer_equals_the_einsum_layer_with_ample_buffers():
    x = _x(5)

    def layer(path, **kw):
        return MoeLayer(_router(threshold=0.6, deterministic=True, **kw), MlpExperts(E, D, 8, rngs=nnx.Rngs(1)),
                        path=path)

    einsum, dropless = layer("einsum", capacity_factor=float(E)), layer("dropless")
    (y_einsum, out), (y_dropless, _) = einsum(x), dropless(x)
    np.testing.assert_allclose(y_dropless, y_einsum, rtol=1e-5, atol=1e-6)
    assert float(out.metrics["experts_per_token"]) > 1.5  # several experts per token on average
    tight, _ = layer("einsum")(x)  # c = k = 2: the buffers drop picks
    assert float(jnp.abs(tight - y_einsum).max()) > 1e-3
    bounded, _ = layer("dropless", pick_bound=float(E))(x)  # a bound that keeps every pick
    np.testing.assert_allclose(bounded, y_einsum, rtol=1e-5, atol=1e-6)

    def grads(layer):
        def loss(router):
            return jnp.sum(jnp.sin(MoeLayer(router, layer.experts, path=layer.path)(x)[0]))
        return nnx.grad(loss)(layer.router).affinity.dense.kernel[...]

    np.testing.assert_allclose(grads(dropless), grads(einsum), rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------ the losses


@pytest.mark.parametrize("scope", ["group", "batch"])
def test_the_dynamic_loss_is_the_mean_entropy_and_the_balance_counts_the_selection(scope):
    w = 0.3
    router = _router(entropy_weight=w, balance_scope=scope, deterministic=True)
    x = _x(6)
    out = router(x)
    probs = np.asarray(jax.nn.softmax(x @ router.affinity.dense.kernel[...], axis=-1), np.float64)
    entropy = scipy.stats.entropy(probs, axis=-1).mean()
    np.testing.assert_allclose(float(out.metrics["entropy"]), entropy, rtol=1e-5)
    chosen = paper_rule(probs, 0.4).astype(np.float64)
    if scope == "batch":
        probs, chosen = probs.reshape(1, -1, E), chosen.reshape(1, -1, E)
    per_group = []
    for p, c in zip(probs, chosen):  # Switch: E sum_e f_e P_e, f_e = share of the picks made
        f = c.sum(0) / c.sum()
        per_group.append(E * np.sum(f * p.mean(0)))
    balance = np.mean(per_group)
    np.testing.assert_allclose(float(out.metrics["balance_loss"]), balance, rtol=1e-5)
    np.testing.assert_allclose(float(out.aux_loss), balance + w * entropy, rtol=1e-5)
    none = _router(entropy_weight=w, balance_loss="none", deterministic=True)(x)
    np.testing.assert_allclose(float(none.aux_loss), w * entropy, rtol=1e-5)
    # The entropy's gradient lowers the entropy (the router grows surer, fewer experts per token).
    entropy_only = _router(entropy_weight=1.0, balance_loss="none", deterministic=True)
    grad = nnx.grad(lambda r: r(x).aux_loss)(entropy_only).affinity.dense.kernel[...]
    before = float(entropy_only(x).metrics["entropy"])
    entropy_only.affinity.dense.kernel[...] = entropy_only.affinity.dense.kernel[...] - 0.1 * grad
    assert float(entropy_only(x).metrics["entropy"]) < before


# ------------------------------------------------------------------------------ the controller


def test_the_controller_holds_the_target_number_of_experts_per_token():
    target = 2.5
    router = _router(threshold=0.3, target_k=target, threshold_rate=0.05)
    stream = [_x(10 + i) for i in range(4)]
    call = nnx.jit(lambda r, x: r(x).metrics["active_experts"])

    def mean_k():  # at the current p, over the whole stream, moving nothing
        with eval_mode(router):
            return float(np.mean([call(router, x) for x in stream]))

    start = float(router.affinity.threshold[...])
    assert abs(mean_k() - target) > 0.5
    assert float(router.affinity.threshold[...]) == start  # evaluation does not move p
    for n in range(200):
        call(router, stream[n % len(stream)])
    p = float(router.affinity.threshold[...])
    assert 1 / E <= p <= 1 and p > start
    assert abs(mean_k() - target) < 0.25
    # The target is reached by where p is, not by chance: p's last steps are small.
    for n in range(4):
        call(router, stream[n])
    assert abs(float(router.affinity.threshold[...]) - p) < 0.05


def test_the_threshold_moves_once_per_accumulated_step_and_never_without_a_target():
    x1, x2 = _x(20), 3.0 * _x(21)  # x2: larger logits, surer tokens, fewer experts
    rate, target = 0.05, 3.0
    router = _router(threshold=0.4, target_k=target, threshold_rate=rate)
    gates = router.affinity
    assert isinstance(gates, routers.StatefulAffinity)
    assert isinstance(gates.threshold, adaptive.TopPThreshold)
    assert "threshold" not in nnx.state(router, nnx.Param)["affinity"]  # no gradient, no optimizer
    m = router(x1).metrics  # a training call: one step
    assert float(gates.threshold[...]) == pytest.approx(0.4 - rate * (float(m["active_experts"]) - target))
    routers.defer_updates(router)
    p0 = float(gates.threshold[...])
    m1, m2 = router(x1).metrics, router(x2).metrics
    assert float(gates.threshold[...]) == p0  # deferred: the calls move nothing
    assert float(m1["active_experts"]) != float(m2["active_experts"])
    routers.after_step([(gates, [m1, m2])])  # the training step: one step, by the mean of the two
    mean = (float(m1["active_experts"]) + float(m2["active_experts"])) / 2
    assert float(gates.threshold[...]) == pytest.approx(np.clip(p0 - rate * (mean - target), 1 / E, 1.0), rel=1e-6)
    fixed = _router(threshold=0.4)  # the paper's router: p is a constant
    for x in (x1, x2):
        fixed(x)
    routers.after_step([(fixed.affinity, [fixed(x1).metrics])])
    assert float(fixed.affinity.threshold[...]) == pytest.approx(0.4)
    low = _router(threshold=0.9, target_k=1.0, threshold_rate=1.0)  # one step would go below 1/E ...
    assert float(low(x1).metrics["active_experts"]) > 1.9
    assert float(low.affinity.threshold[...]) == pytest.approx(1 / E)
    high = _router(threshold=0.9, target_k=float(E), threshold_rate=1.0)  # ... or above 1
    high(x1)
    assert float(high.affinity.threshold[...]) == 1.0


# ------------------------------------------------------------------------------ training


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_model_with_top_p_routers_trains_and_its_threshold_takes_one_step_per_step(grad_accum):
    from mini_moe import config as config_lib
    from mini_moe import train

    rate, target = 0.05, 1.5
    cfg = config_lib.get_config(
        "quick", dataset="digits", router="top_p", steps=3, batch_size=32, eval_every=3, checkpoint_every=3,
        eval_batch_size=64, model_dim=16, model_depth=2, model_heads=2, model_mlp_dim=16, model_num_experts=4,
        model_group_images=4, grad_accum=grad_accum,
        model_router_kwargs={"target_k": target, "threshold_rate": rate, "threshold": 0.9})
    data = train.load_data(cfg)
    model = train.make_model(cfg)
    optimizer = train.make_optimizer(model, cfg)
    gates = [block.mlp.router.affinity for block in model.blocks if block.use_moe]
    assert len(gates) == 1 and isinstance(gates[0], adaptive.TopPGates)
    assert gates[0].defer == (grad_accum > 1)
    for step in range(3):
        p = float(gates[0].threshold[...])
        metrics = train._step(model, optimizer, train.batch_at(data[0], cfg, step), cfg)
        assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["aux_loss"]))
        active = float(metrics["router"]["active_experts"])  # the mean over the micro-batches
        assert float(metrics["router"]["threshold"]) == pytest.approx(p)
        assert float(gates[0].threshold[...]) == pytest.approx(np.clip(p - rate * (active - target), 1 / 4, 1),
                                                                rel=1e-5)
    assert float(gates[0].threshold[...]) < 0.9  # p = 0.9 selects more than 1.5 experts: p came down


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("kwargs, name", [
    ({"threshold": 0.0}, "threshold"), ({"threshold": 1.5}, "threshold"), ({"threshold": -0.1}, "threshold"),
    ({"threshold": float("nan")}, "threshold"), ({"threshold": "high"}, "threshold"),
    ({"threshold": True}, "threshold"),
    ({"target_k": 0.5}, "target_k"), ({"target_k": E + 0.5}, "target_k"),
    ({"entropy_weight": -1e-3}, "entropy_weight"), ({"threshold_rate": 0.0}, "threshold_rate"),
    ({"threshold_rate": -0.1}, "threshold_rate"), ({"balance_loss": "importance_load"}, "balance_loss"),
    ({"balance_scope": "sequence"}, "balance_scope"), ({"k": E + 1}, "k"), ({"k": 0}, "k"),
    ({"pick_bound": 0.0}, "pick_bound"), ({"capacity_factor": -1.0}, "capacity_factor"),
])
def test_bad_options_name_the_argument(kwargs, name):
    with pytest.raises(InputError, match=f"^{name} must"):
        _router(**kwargs)


def test_the_router_is_registered_and_its_capacity_options_reach_it():
    assert routers.spec("top_p").allocation == "token"
    options = routers.spec("top_p").capacity_options(1.5, tokens=T, num_experts=E)
    router = routers.make_router("top_p", D, E, rngs=nnx.Rngs(0), **options)
    assert router.allocation == routers.TokenChoice(E, 1.5, min_score=0.0)
    assert router(_x(7)).routing.dispatch.shape[-1] == routing.capacity(T, E, 1.5)
