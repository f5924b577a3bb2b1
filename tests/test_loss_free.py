"""Routing since 2024 (issue 26): sigmoid gates with auxiliary-loss-free balancing (DeepSeek-V3,
arXiv 2412.19437, Sec. 2.1.2), group-limited routing, the sequence-wise balance loss (eq. 17-20)
and the global-batch balance loss (Qwen, arXiv 2501.11873), each against its paper's definition
computed independently in NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mini_moe as mm
from mini_moe import config as config_lib
from mini_moe import losses, routers, train

D, E, T, G = 8, 8, 32, 2


def _x(seed=0, shape=(G, T, D)):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _sigmoid(z):
    return 1 / (1 + np.exp(-np.asarray(z, np.float64)))


def _reference(router, x, k, num_groups=1, top_groups=1):
    """DeepSeek-V3's gating in NumPy: s = sigmoid(xW); groups scored by the sum of their two best
    s + b, the top_groups kept; top-k of s + b inside them; gates s / sum of the chosen s."""
    s = _sigmoid(x @ np.asarray(router.affinity.dense.kernel[...], np.float64))  # [G, T, E]
    biased = s + np.asarray(router.affinity.bias[...], np.float64)
    size = router.num_experts // num_groups
    allowed = np.ones_like(biased, bool)
    if num_groups > 1:
        grouped = np.sort(biased.reshape(*biased.shape[:-1], num_groups, size), -1)[..., -min(2, size):].sum(-1)
        best = np.argsort(-grouped, -1)[..., :top_groups]
        allowed = np.zeros(grouped.shape, bool)
        np.put_along_axis(allowed, best, True, -1)
        allowed = np.repeat(allowed, size, -1)
    picks = np.argsort(-np.where(allowed, biased, -np.inf), -1)[..., :k]
    chosen = np.zeros_like(s)
    np.put_along_axis(chosen, picks, 1.0, -1)
    gates = s * chosen / (s * chosen).sum(-1, keepdims=True)
    return s, chosen, gates


@pytest.mark.parametrize("name, groups", [("sigmoid_loss_free", (1, 1)), ("group_limited", (2, 1)),
                                          ("group_limited", (4, 2))])
def test_gates_are_normalised_unbiased_sigmoid_scores_of_the_biased_top_k(name, groups):
    num_groups, top_groups = groups
    router = mm.make_router(name, D, E, k=2, capacity_factor=float(E), num_groups=num_groups, top_groups=top_groups,
                            rngs=nnx.Rngs(0))
    router.affinity.bias[...] = jnp.asarray(np.random.default_rng(1).normal(size=E) * 0.1, jnp.float32)
    router.eval()  # no bias update during this call
    x = _x()
    out = router(x)
    s, chosen, gates = _reference(router, x, 2, num_groups, top_groups)
    dispatch = np.asarray(out.routing.dispatch).sum(-1)  # [G, T, E]: capacity E * T: nothing dropped
    np.testing.assert_array_equal(dispatch, chosen)
    # float32 sigmoid and a sum of two terms against float64: a few ulps of numbers below 1
    np.testing.assert_allclose(np.asarray(out.routing.combine).sum(-1), gates, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out.routing.combine).sum((-1, -2)), 1.0, rtol=1e-5)
    if num_groups > 1:  # every token's experts lie in at most top_groups groups
        used = chosen.reshape(G, T, num_groups, E // num_groups).any(-1).sum(-1)
        assert used.max() <= top_groups


@pytest.mark.parametrize("bias_mean", [-1.5, 0.0, 3.0])
def test_group_limited_routing_equals_deepseek_v3s_gate_whatever_the_level_of_the_bias(bias_mean):
    """Issue 35 (review 2026-11-25, item 8): the experts outside a token's kept groups were filled
    with -1.0 for the allocation's top-k, so once the bias drifted below -1 (the sign update is not
    zero-sum: the level of b drifts) an allowed expert ranked below the excluded ones, and the token
    went to an excluded expert with gate 0 (15 of 256 tokens in the review's check, combine sums
    down to 0.77). DeepSeek-V3's ``Gate`` masks them with -inf; so must we, at any bias level."""
    experts, tokens = 16, 128
    router = mm.make_router("group_limited", D, experts, k=4, capacity_factor=float(experts), num_groups=4,
                            top_groups=2, rngs=nnx.Rngs(0))
    bias = np.random.default_rng(2).normal(bias_mean, 0.1, size=experts)
    router.affinity.bias[...] = jnp.asarray(bias, jnp.float32)
    router.eval()
    x = _x(3, (G, tokens, D))
    out = router(x)
    _, chosen, gates = _reference(router, x, 4, 4, 2)
    np.testing.assert_array_equal(np.asarray(out.routing.dispatch).sum(-1), chosen)
    np.testing.assert_allclose(np.asarray(out.routing.combine).sum(-1), gates, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out.routing.combine).sum((-1, -2)), 1.0, rtol=1e-5)
    # the load the metric reads is the load of the picks made
    load = chosen.reshape(-1, experts).sum(0)
    np.testing.assert_allclose(float(out.metrics["max_violation"]), load.max() / load.mean() - 1, rtol=1e-5)


def test_bias_moves_overloaded_experts_down_and_only_in_training():
    """One training-mode call: b_e += u * sign(mean load - load_e), the load counted over every
    group of the batch; eval mode leaves b alone."""
    u = 0.01
    router = mm.make_router("sigmoid_loss_free", D, E, k=2, bias_rate=u, rngs=nnx.Rngs(0))
    kernel = np.zeros((D, E), np.float32)
    kernel[:, 0], kernel[:, 1] = 5.0, 2.0  # experts 0 and 1 win for tokens with positive coordinates
    router.affinity.dense.kernel[...] = jnp.asarray(kernel)
    x = np.abs(_x())
    _, chosen, _ = _reference(router, x, 2)
    load = chosen.reshape(-1, E).sum(0)
    router.train()
    router(x)
    expected = u * np.sign(load.mean() - load)
    np.testing.assert_allclose(np.asarray(router.affinity.bias[...]), expected, atol=1e-9)
    assert router.affinity.bias[...][0] < 0 and router.affinity.bias[...][1] < 0  # the overloaded two go down
    router.eval()
    before = np.asarray(router.affinity.bias[...])
    router(x)
    np.testing.assert_array_equal(np.asarray(router.affinity.bias[...]), before)


def test_bias_is_not_a_parameter_moves_in_training_and_resumes_exactly(tmp_path, monkeypatch):
    """The bias gets no gradient and no weight decay (not an nnx.Param), moves during training,
    is saved in the checkpoint, and resuming reproduces it exactly."""
    tiny = dict(steps=6, batch_size=32, eval_every=3, checkpoint_every=3, eval_batch_size=64, model_dim=16,
                model_depth=2, model_heads=2, model_mlp_dim=16, model_num_experts=4, model_group_images=4)
    cfg = config_lib.get_config("quick", dataset="digits", router="sigmoid_loss_free", **tiny)
    model = train.make_model(cfg)
    router = next(b.mlp.router for b in model.blocks if b.use_moe)
    params = nnx.state(model, nnx.Param)
    assert not any("bias" == str(path[-1]) and "affinity" in map(str, path)
                   for path, _ in nnx.to_flat_state(params))
    assert len(nnx.to_flat_state(nnx.state(model, routers.ExpertBias))) == 1
    data = train.load_data(cfg)
    train.train(cfg, tmp_path / "straight", progress=False, datasets=data)
    straight, _ = train.load_trained(tmp_path / "straight")
    bias = np.asarray(next(b.mlp.router for b in straight.blocks if b.use_moe).affinity.bias[...])
    assert np.abs(bias).max() > 0 and router.affinity.bias[...].sum() == 0  # moved by training only
    # Interrupted after the step-3 checkpoint and resumed: the same bias at step 6.
    from interrupted import train_interrupted_then_resumed

    train_interrupted_then_resumed(cfg, tmp_path / "resumed", data, monkeypatch)
    resumed, _ = train.load_trained(tmp_path / "resumed")
    again = next(b.mlp.router for b in resumed.blocks if b.use_moe).affinity.bias[...]
    np.testing.assert_array_equal(np.asarray(again), bias)  # same process: bit for bit


def test_sequence_balance_loss_by_hand():
    """eq. (17)-(20): f_i = E / (k T) * picks of i, P_i = mean_t s_it / sum_j s_jt, L = sum f_i P_i."""
    rng = np.random.default_rng(0)
    s = rng.uniform(0.1, 0.9, size=(3, T, E))
    picks = np.argsort(-s, -1)[..., :2]
    chosen = np.zeros_like(s)
    np.put_along_axis(chosen, picks, 1.0, -1)
    f = E / (2 * T) * chosen.sum(-2)
    p = (s / s.sum(-1, keepdims=True)).mean(-2)
    expected = (f * p).sum(-1).mean()
    got = float(losses.sequence_balance_loss(jnp.asarray(s, jnp.float32), jnp.asarray(chosen, jnp.float32)))
    assert got == pytest.approx(expected, rel=1e-5)
    picks = np.stack([np.eye(E), np.roll(np.eye(E), 1, 1)]).sum(0)[None]  # each token 2 picks, uniform load
    assert float(losses.sequence_balance_loss(jnp.ones((1, E, E)), jnp.asarray(picks))) == pytest.approx(1.0)


def test_the_routers_sequence_balance_counts_the_unbiased_top_k():
    """Issue 35 (review item 11): V3's eq. 18 counts f_i on Topk(s_t, K_r), the unbiased scores;
    the bias (and the group limit) only select. A bias large enough to change the picks must not
    change the loss."""
    router = mm.make_router("sigmoid_loss_free", D, E, k=2, seq_balance=1.0, rngs=nnx.Rngs(0))
    x = _x()
    router.eval()
    plain = float(router(x).metrics["sequence_balance_loss"])
    router.affinity.bias[...] = jnp.asarray(np.linspace(-3.0, 3.0, E), jnp.float32)  # other picks
    out = router(x)
    s, chosen, _ = _reference(router, x, 2)
    unbiased = np.zeros_like(s)
    np.put_along_axis(unbiased, np.argsort(-s, -1)[..., :2], 1.0, -1)
    assert np.any(unbiased != chosen)  # the bias did change the picks
    p = (s / s.sum(-1, keepdims=True)).mean(-2)
    expected = (E / (2 * T) * unbiased.sum(-2) * p).sum(-1).mean()
    biased = (E / (2 * T) * chosen.sum(-2) * p).sum(-1).mean()
    assert float(out.metrics["sequence_balance_loss"]) == pytest.approx(expected, rel=1e-5) == pytest.approx(plain)
    assert abs(expected - biased) > 1e-3
    assert float(out.aux_loss) == pytest.approx(expected, rel=1e-5)  # seq_balance = 1: the loss itself


def test_the_batch_wise_balance_loss_counts_every_token_of_the_batch():
    """``balance_scope="batch"`` (V3's batch-wise auxiliary loss, Sec. 4.5.3): f_i and P_i over
    all G*T tokens at once, checked against NumPy; with groups routed differently it differs from
    the group-wise (sequence-wise) loss, the mean of the per-group values; its gradient reaches W."""
    x = _x(3)
    group = mm.make_router("sigmoid_loss_free", D, E, k=2, seq_balance=1.0, rngs=nnx.Rngs(0))
    batch = mm.make_router("sigmoid_loss_free", D, E, k=2, seq_balance=1.0, balance_scope="batch", rngs=nnx.Rngs(0))
    for router in (group, batch):
        router.eval()
    s, _, _ = _reference(batch, x, 2)
    unbiased = np.zeros_like(s)
    np.put_along_axis(unbiased, np.argsort(-s, -1)[..., :2], 1.0, -1)
    p = s / s.sum(-1, keepdims=True)
    per_group = (E / (2 * T) * unbiased.sum(-2) * p.mean(-2)).sum(-1)  # [G]
    whole = (E / (2 * G * T) * unbiased.sum((0, 1)) * p.mean((0, 1))).sum()
    assert abs(whole - per_group.mean()) > 1e-3  # the two scopes differ on this batch
    assert float(group(x).aux_loss) == pytest.approx(per_group.mean(), rel=1e-5)
    assert float(batch(x).aux_loss) == pytest.approx(whole, rel=1e-5)
    grad = nnx.grad(lambda r: r(x).aux_loss)(batch)
    assert float(jnp.abs(grad.affinity.dense.kernel[...]).sum()) > 0
    with pytest.raises(ValueError, match="balance_scope must be one of"):
        mm.make_router("sigmoid_loss_free", D, E, balance_scope="sequence", rngs=nnx.Rngs(0))


def test_global_batch_balance_counts_the_whole_batch():
    """Two groups, each sending every token to its own expert: each group alone is as unbalanced
    as possible (loss about E), the batch spreads over the two experts it uses (loss about E / 2):
    over the batch f = (1/2, 1/2, 0, 0) and P_0 = P_1 = (0.997 + 0.001) / 2."""
    probs = np.full((2, T, 4), 1e-3)
    probs[0, :, 0] = probs[1, :, 1] = 1 - 3e-3
    probs = jnp.asarray(probs, jnp.float32)
    assert float(losses.switch_loss(probs, k=1, scope="group")) == pytest.approx(4 * (1 - 3e-3), rel=1e-5)
    assert float(losses.switch_loss(probs, k=1, scope="batch")) == pytest.approx(4 * (0.5 * 0.499 + 0.5 * 0.499), rel=1e-5)
    router = mm.make_router("softmax_token_choice", D, 4, balance_loss="switch", balance_scope="batch",
                            rngs=nnx.Rngs(0))
    router.eval()
    out = router(_x(shape=(2, T, D)))
    expected = losses.switch_loss(out.probs, k=1, scope="batch")
    assert float(out.aux_loss) == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.parametrize("options, match", [
    (dict(num_groups=3), "num_groups must divide"),
    (dict(num_groups=2, top_groups=3), "top_groups <= num_groups"),
    (dict(k=5, num_groups=2, top_groups=1), "do not fit"),
    (dict(bias_rate=-1.0), "bias_rate"),
])
def test_bad_options_name_the_argument(options, match):
    with pytest.raises(ValueError, match=match):
        mm.make_router("sigmoid_loss_free", D, E, rngs=nnx.Rngs(0), **options)
    with pytest.raises(ValueError, match="balance_scope"):
        mm.make_router("softmax_token_choice", D, E, balance_scope="world", rngs=nnx.Rngs(0))


def test_bias_update_runs_under_jit_and_grad():
    """The update happens inside the traced training step (as BatchNorm's statistics do)."""
    router = mm.make_router("sigmoid_loss_free", D, E, rngs=nnx.Rngs(0))
    router.train()

    @nnx.jit
    def step(router, x):
        return nnx.grad(lambda r: jnp.sum(r(x).routing.combine ** 2))(router)

    grads = step(router, jnp.asarray(_x()))
    assert np.abs(np.asarray(router.affinity.bias[...])).max() > 0
    assert float(jnp.abs(grads.affinity.dense.kernel[...]).sum()) > 0  # k = 2: the gates carry a gradient
    assert not any("bias" in map(str, path) for path, _ in nnx.to_flat_state(nnx.state(grads)))


def test_at_k1_the_gate_is_the_chosen_score_and_the_router_learns_from_the_task():
    """With k = 1 the gate normalised over the one chosen expert would be exactly 1 whatever the
    scores, and the task would send the router's weights no gradient (code review B7; chapter 12
    measured what that cost). At k = 1 the gate is the chosen expert's sigmoid score itself, as in
    Megatron-LM's sigmoid router: the router gets a task gradient as large as at k = 2's order."""
    x = jnp.asarray(_x())
    grads = {}
    for k in (1, 2):
        router = mm.make_router("sigmoid_loss_free", D, E, k=k, capacity_factor=float(E), deterministic=True,
                                rngs=nnx.Rngs(0))
        if k == 1:
            scores = np.asarray(jax.nn.sigmoid(x @ router.affinity.dense.kernel[...]))
            gate = np.asarray(router(x).routing.combine).sum((-2, -1))  # per token: its one gate (no drops)
            np.testing.assert_allclose(gate, scores.max(-1), rtol=1e-6)
        grads[k] = nnx.grad(lambda r: jnp.sum(jnp.sin(r(x).routing.combine)))(router)
    g1, g2 = (float(jnp.abs(grads[k].affinity.dense.kernel[...]).max()) for k in (1, 2))
    assert g1 > 0.1 * g2 and g2 > 1e-3, (g1, g2)
