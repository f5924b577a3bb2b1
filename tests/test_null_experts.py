"""Null experts in the router's choice set (issue 54 §2): AdaMoE, MoE++'s kinds, LongCat-Flash's
controller. Each test checks a property the derivation promises, against an independent
computation (plain loops, NumPy, XLA's own FLOP count)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from live_head import live_head
from mini_moe import losses, model, modes, routers, routing, train
from mini_moe.layer import MlpExperts, NullExperts
from mini_moe.validate import InputError

D, E, H = 16, 4, 32


def _layer(kinds=("zero",) * 4, *, name="adamoe", path="gather", k=2, seed=0, **kwargs):
    rngs = nnx.Rngs(seed)
    router = routers.make_router(name, D, E, null_experts=len(kinds), k=k, rngs=rngs, **kwargs)
    return model.MoeLayer(router, MlpExperts(E, D, H, rngs=rngs), path=path, null=NullExperts(kinds, D, rngs=rngs))


def _loop_reference(scores, combine, *, k, capacity, real, batch_priority=False):
    """The rule of TokenChoice(null_experts=Z) for one group, in loops: each token's picks are its
    top k of all E + Z scores; its real picks, by decreasing score, are placed round by round
    (Algorithm 1) into buffers of C; its null picks get their weights with no buffer."""
    scores, combine = np.asarray(scores, np.float64), np.asarray(combine, np.float64)
    tokens = scores.shape[0]
    ranked = [list(np.argsort(-scores[t], kind="stable")[:k]) for t in range(tokens)]
    real_picks = [[e for e in r if e < real] for r in ranked]
    order = range(tokens)
    if batch_priority:
        masked = [max((scores[t, e] for e in real_picks[t]), default=-np.inf) for t in range(tokens)]
        order = np.argsort(-np.asarray(masked), kind="stable")
    dispatch = np.zeros((tokens, real, capacity))
    weights = np.zeros((tokens, real, capacity))
    for i in range(k):
        for t in order:
            if i < len(real_picks[t]):
                e = real_picks[t][i]
                c = int(dispatch[:, e].sum())
                if c < capacity:
                    dispatch[t, e, c], weights[t, e, c] = 1, combine[t, e]
    null = np.zeros((tokens, scores.shape[1] - real))
    for t in range(tokens):
        for e in ranked[t]:
            if e >= real:
                null[t, e - real] = combine[t, e]
    return dispatch, weights, null


@pytest.mark.parametrize("k,capacity,bpr", [(1, 1, False), (2, 2, False), (3, 1, True), (4, 3, False), (2, 5, True)])
def test_token_choice_with_null_experts_equals_loops(k, capacity, bpr):
    rng = np.random.default_rng(k * 10 + capacity)
    scores = jax.nn.softmax(jnp.asarray(rng.normal(size=(3, 12, 7)) * 2, jnp.float32), axis=-1)  # E = 4, Z = 3
    combine = jnp.asarray(rng.uniform(size=(3, 12, 7)), jnp.float32)
    alloc = routers.TokenChoice(k, capacity_factor=1.0, batch_priority=bpr, null_experts=3)
    a = routers.Affinities(scores, combine=combine)
    rt = alloc(a, routers.Budget(k, capacity))
    gates = alloc.null_gates(a)
    for g in range(3):
        dispatch, weights, null = _loop_reference(scores[g], combine[g], k=k, capacity=capacity, real=4,
                                                  batch_priority=bpr)
        np.testing.assert_array_equal(np.asarray(rt.dispatch[g]), dispatch)
        np.testing.assert_allclose(np.asarray(rt.combine[g]), weights, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(gates[g]), null, rtol=1e-6)


def test_null_picks_take_no_slot_and_are_never_dropped():
    """At one slot per expert, every null pick keeps its weight; every token's k picks are its
    real picks (placed or dropped) plus its null picks."""
    layer = _layer(k=3)
    x = jax.random.normal(jax.random.key(1), (2, 16, D))
    layer.router.allocation = dataclasses.replace(layer.router.allocation, capacity_factor=0.25)  # C = 1
    out = layer.router(x)
    assert out.routing.dispatch.shape[-1] == 1
    probs = np.asarray(out.probs)
    top = np.argsort(-probs, axis=-1, kind="stable")[..., :3]
    null_picked = top >= E
    np.testing.assert_allclose(np.asarray(out.null_gates).sum(-1),
                               np.where(null_picked, np.take_along_axis(probs, top, -1), 0).sum(-1), rtol=1e-6)
    assert float(out.metrics["real_picks"] + out.metrics["null_picks"]) == pytest.approx(3.0)


def test_combine_weights_keep_their_invariants():
    x = jax.random.normal(jax.random.key(2), (2, 16, D))
    for renormalize in (False, True):
        layer = _layer(k=3, renormalize=renormalize)
        layer.router.allocation = dataclasses.replace(layer.router.allocation, capacity_factor=16.0)  # no drops
        out = layer.router(x)
        real = np.asarray(out.routing.combine).sum((-1, -2))  # [G, T]
        null = np.asarray(out.null_gates).sum(-1)
        assert (np.asarray(out.routing.combine) >= 0).all() and (np.asarray(out.null_gates) >= 0).all()
        assert (np.asarray(out.routing.combine)[np.asarray(out.routing.dispatch) == 0] == 0).all()
        has_real = np.asarray(out.routing.dispatch).sum((-1, -2)) > 0
        if renormalize:  # AdaMoE's code: a token's real weights sum to 1
            np.testing.assert_allclose(real[has_real], 1.0, rtol=1e-5)
        else:  # the probabilities of the k picks: at most 1, and what the top k of the softmax hold
            topk = np.sort(np.asarray(out.probs), -1)[..., -3:].sum(-1)
            np.testing.assert_allclose(real + null, topk, rtol=1e-5)
            assert (real + null <= 1 + 1e-6).all()


def _flops(fn, *args):
    return jax.jit(fn).lower(*args).compile().cost_analysis().get("flops", 0.0)


def test_a_zero_expert_costs_no_flops():
    """XLA's count: zero experts compute nothing (the null branch is absent), while identity and
    constant experts cost O(T D), and an MLP expert in their place O(T D H)."""
    x = jax.random.normal(jax.random.key(3), (2, 16, D))
    gates = jax.random.uniform(jax.random.key(4), (2, 16, 4))
    zero = NullExperts(("zero",) * 4, D, rngs=nnx.Rngs(0))
    assert zero(x, gates) is None
    identity = NullExperts(("identity",) * 4, D, rngs=nnx.Rngs(0))
    constant = NullExperts(("constant",) * 4, D, rngs=nnx.Rngs(0))
    t = 2 * 16
    assert 0 < _flops(lambda a, g: identity(a, g), x, gates) < 4 * t * D
    assert 0 < _flops(lambda a, g: constant(a, g), x, gates) < 40 * t * D
    # The whole layer: with 4 zero experts it costs what the layer without them costs, plus only
    # the router's 4 extra logit columns and their softmax / top-k bookkeeping (far below one
    # expert's 2 D H per token).
    with_null = _layer(("zero",) * 4, name="adamoe", k=1)
    plain = model.MoeLayer(routers.make_router("softmax_token_choice", D, E, k=1, noise_std=0.0, balance_loss="switch",
                                               rngs=nnx.Rngs(0)),
                           MlpExperts(E, D, H, rngs=nnx.Rngs(0)), path="gather")
    for layer in (with_null, plain):
        layer.router.allocation = dataclasses.replace(layer.router.allocation, capacity_factor=1.0)
    graph_n, state_n = nnx.split(with_null)
    graph_p, state_p = nnx.split(plain)
    cost_null = _flops(lambda s, a: nnx.merge(graph_n, s)(a)[0], state_n, x)
    cost_plain = _flops(lambda s, a: nnx.merge(graph_p, s)(a)[0], state_p, x)
    extra_logits = 2 * t * D * 4
    one_expert = 2 * 2 * D * H * routing.capacity(16, E, 1.0) * 2  # one expert's two matmuls over its slots
    assert cost_null - cost_plain < extra_logits + one_expert / 4, (cost_null, cost_plain)


def test_identity_expert_is_the_identity_and_constant_expert_is_moe_plus_plus():
    x = jax.random.normal(jax.random.key(5), (2, 8, D))
    gates = jax.random.uniform(jax.random.key(6), (2, 8, 3))
    mixed = NullExperts(("identity", "zero", "constant"), D, rngs=nnx.Rngs(1))
    mixed.constant_gate[...] = jax.random.normal(jax.random.key(7), mixed.constant_gate.shape)
    got = np.asarray(mixed(x, gates))
    xs, g = np.asarray(x, np.float64), np.asarray(gates, np.float64)
    w, v = np.asarray(mixed.constant_gate[...], np.float64)[0], np.asarray(mixed.constant[...], np.float64)[0]
    logits = xs @ w  # [2, 8, 2]
    a = np.exp(logits - logits.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    want = g[..., :1] * xs + g[..., 2:3] * (a[..., :1] * xs + a[..., 1:2] * v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # A layer whose every token picks the identity expert alone returns gate * x.
    layer = _layer(("identity",), name="adamoe", k=1)
    # logits: 0 for every column; make the identity column win by a margin through the input
    layer.router.affinity.dense.kernel[...] = jnp.zeros((D, E + 1)).at[0, E].set(50.0)
    xin = jnp.abs(x) + 0.1
    y, out = layer(xin)
    p = np.asarray(out.probs)[..., E:]
    np.testing.assert_allclose(np.asarray(y), p * np.asarray(xin), rtol=1e-5)
    assert float(out.metrics["real_picks"]) == 0.0


@pytest.mark.parametrize("kinds", [("zero",) * 3, ("identity", "zero", "constant")])
def test_dropless_equals_gather_without_drops(kinds):
    x = jax.random.normal(jax.random.key(8), (2, 16, D))
    gather = _layer(kinds, k=3, path="gather")
    dropless = _layer(kinds, k=3, path="dropless")
    for layer in (gather, dropless):
        layer.router.allocation = dataclasses.replace(layer.router.allocation, capacity_factor=16.0)
        layer.experts.b1[...] = 0.1 * jax.random.normal(jax.random.key(9), layer.experts.b1.shape)
    np.testing.assert_allclose(np.asarray(gather(x)[0]), np.asarray(dropless(x)[0]), rtol=2e-5, atol=2e-6)


def test_null_aware_loss_pools_the_null_experts():
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(10), (3, 20, 7)) * 2, axis=-1)
    # Z = 0 is the Switch loss
    np.testing.assert_allclose(losses.null_aware_switch_loss(probs, k=2, null_experts=0),
                               losses.switch_loss(probs, k=2), rtol=1e-6)
    # NumPy: f and P of the 3 null columns replaced by their mean
    p = np.asarray(probs, np.float64)
    top = np.argsort(-p, -1, kind="stable")[..., :2]
    f = np.stack([(top == e).any(-1).mean(-1) for e in range(7)], -1) / 2
    pm = p.mean(-2)
    f[..., 4:], pm[..., 4:] = f[..., 4:].mean(-1, keepdims=True), pm[..., 4:].mean(-1, keepdims=True)
    np.testing.assert_allclose(losses.null_aware_switch_loss(probs, k=2, null_experts=3),
                               np.mean(7 * (f * pm).sum(-1)), rtol=1e-5)
    # how the null share splits among the null experts does not change the loss (Z = 3 pooled),
    # but it does change the plain Switch loss
    skew = p.copy()
    skew[..., 4] += skew[..., 5] * 0.9
    skew[..., 5] *= 0.1
    a = losses.null_aware_switch_loss(jnp.asarray(p), k=7, null_experts=3)
    b = losses.null_aware_switch_loss(jnp.asarray(skew), k=7, null_experts=3)
    np.testing.assert_allclose(a, b, rtol=1e-6)
    assert abs(float(losses.switch_loss(jnp.asarray(p), k=1)) - float(losses.switch_loss(jnp.asarray(skew), k=1))) > 1e-3


@pytest.mark.parametrize("target", [0.5, 1.0, 1.5])
def test_the_controller_reaches_its_target_count(target):
    """LongCat-Flash's controller, with no gradient at all: calls in training mode on batches of
    one token distribution move the real experts' bias until a token uses ``target`` real
    experts on average; a fresh batch in eval mode then shows it within 0.05."""
    router = routers.make_router("longcat", D, E, null_experts=4, k=2, target_real=target, bias_rate=0.2,
                                 rngs=nnx.Rngs(11))
    step = nnx.jit(lambda r, a: r(a).metrics["real_picks"])
    for i in range(400):
        step(router, jax.random.normal(jax.random.key(100 + i), (4, 64, D)))
    router.eval()  # deterministic: no update
    picks = [float(router(jax.random.normal(jax.random.key(9000 + i), (4, 64, D))).metrics["real_picks"])
             for i in range(5)]
    assert abs(np.mean(picks) - target) < 0.05, picks
    before = np.asarray(router.affinity.bias[...]).copy()
    router(jax.random.normal(jax.random.key(1), (4, 64, D)))
    np.testing.assert_array_equal(np.asarray(router.affinity.bias[...]), before)  # eval mode: no step
    assert (np.asarray(router.affinity.bias[...])[E:] == 0).all()  # the null experts' bias never moves


def test_the_controller_steps_once_per_accumulated_step():
    router = routers.make_router("longcat", D, E, null_experts=4, k=2, target_real=1.0, rngs=nnx.Rngs(12))
    whole = routers.make_router("longcat", D, E, null_experts=4, k=2, target_real=1.0, rngs=nnx.Rngs(12))
    routers.defer_updates(router)
    xs = [jax.random.normal(jax.random.key(i), (2, 32, D)) for i in range(3)]
    metrics = [router(x).metrics for x in xs]
    assert (np.asarray(router.affinity.bias[...]) == 0).all()  # deferred: no call moved it
    router.affinity.deferred_update(metrics)
    whole(jnp.concatenate(xs))  # one call on the whole batch: the same step
    np.testing.assert_allclose(np.asarray(router.affinity.bias[...]), np.asarray(whole.affinity.bias[...]),
                               rtol=1e-6, atol=1e-9)
    assert np.abs(np.asarray(router.affinity.bias[...])).max() > 0


def test_a_null_expert_model_trains_and_its_head_sees_the_routing():
    """Three steps of a V-MoE with null experts: finite loss; with a live head the null kinds
    change the logits (zero vs identity), so the model-level path is not inert."""
    cfg = train.TrainConfig(model=model.ModelConfig(router="longcat", null_experts=("zero",) * 4, dim=16,
                                                    mlp_dim=16, depth=2, heads=2, image_size=8, patch_size=4,
                                                    router_kwargs=(("k", 2), ("target_real", 1.0))),
                            dataset="digits", steps=3, batch_size=16, eval_every=3, warmup_steps=1)
    images = jax.random.uniform(jax.random.key(13), (16, 8, 8, 1))
    zero = live_head(model.VisionMoE(cfg.model, rngs=nnx.Rngs(0)))
    ident = live_head(model.VisionMoE(dataclasses.replace(cfg.model, null_experts=("identity",) * 4),
                                      rngs=nnx.Rngs(0)))
    zero.eval(), ident.eval()
    assert np.abs(np.asarray(zero(images).logits) - np.asarray(ident(images).logits)).max() > 1e-4
    m = train.make_model(cfg)
    opt = train.make_optimizer(m, cfg)
    labels = jnp.arange(16) % 10
    for _ in range(3):
        step = train.train_step(m, opt, images, labels, cfg.aux_loss_weight)
    assert np.isfinite(float(step["loss"])) and float(step["router"]["real_picks"]) > 0


def test_bad_input_names_the_argument():
    with pytest.raises(InputError, match="null_experts"):
        model.ModelConfig(router="softmax_token_choice", null_experts=("zero",))
    assert model.ModelConfig(router="adamoe").null_experts == ("zero",) * 4  # the router's default count
    assert model.ModelConfig(router="longcat", router_kwargs=(("null_experts", 2),)).null_experts == ("zero",) * 2
    with pytest.raises(InputError, match="null_experts"):
        model.ModelConfig(router="adamoe", null_experts=("void",))
    with pytest.raises(InputError, match="null_experts"):
        routers.TokenChoice(2, null_experts=-1)
    with pytest.raises(InputError, match="null_experts"):
        routers.Router(routers.Softmax(D, 4, rngs=nnx.Rngs(0)), routers.TokenChoice(1, null_experts=4))
    with pytest.raises(InputError, match="target_real"):
        routers.make_router("longcat", D, E, null_experts=2, k=2, target_real=3.0, rngs=nnx.Rngs(0))
    with pytest.raises(InputError, match="null"):
        model.MoeLayer(routers.make_router("adamoe", D, E, null_experts=2, rngs=nnx.Rngs(0)),
                       MlpExperts(E, D, H, rngs=nnx.Rngs(0)))
    with pytest.raises(InputError, match="gates"):
        NullExperts(("identity",), D, rngs=nnx.Rngs(0))(jnp.zeros((2, 3, D)), jnp.zeros((2, 3, 2)))


def test_the_config_round_trips_through_json():
    cfg = train.TrainConfig(model=model.ModelConfig(router="adamoe", null_experts=("zero", "identity")))
    import json
    back = train.config_from_json(json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert back == cfg


def test_dropless_null_experts_are_batch_invariant_and_capacity_makes_them_dependent():
    """Null picks take no slot, so on the dropless path a token's routing is its own (the
    derivation's rule, ``modes.invariance``): logits unchanged when the batch is reordered.
    With buffers that can refuse picks, the rule says it is not invariant."""
    cfg = model.ModelConfig(router="longcat", null_experts=("zero", "identity") * 2, dim=16, mlp_dim=16, depth=2,
                            heads=2, image_size=8, patch_size=4, group_images=4, moe_path="dropless",
                            router_kwargs=(("k", 2), ("target_real", 1.0)))
    m = live_head(model.VisionMoE(cfg, rngs=nnx.Rngs(3)))
    m.eval()
    assert modes.invariance(m)[0]
    images = jax.random.uniform(jax.random.key(14), (16, 8, 8, 1))
    perm = np.random.default_rng(0).permutation(16)
    a = np.asarray(m(images).logits)[perm]
    b = np.asarray(m(images[perm]).logits)
    assert np.abs(a - b).max() < 1e-5
    capped = model.VisionMoE(dataclasses.replace(cfg, moe_path="gather",
                                                 router_kwargs=cfg.router_kwargs + (("capacity_factor", 0.5),)),
                             rngs=nnx.Rngs(3))
    capped.eval()
    ok, why = modes.invariance(capped)
    assert not ok and "capacity factor 0.5" in why


@pytest.mark.parametrize("router,options,kinds", [("longcat", (("k", 3), ("target_real", 1.0)), ("zero",) * 4),
                                                  ("top_p", (("threshold", 0.5),), ())])
def test_routing_record_counts_the_picks_the_router_made(router, options, kinds):
    """``evaluate.routing_record``'s picks per patch (what diagnose counts dropped picks against)
    are the router's own: the real picks of a null-expert router (its ``real_picks`` metric), the
    experts top-p selected (its ``active_experts``); the dropless path, so every pick is a hit."""
    from mini_moe import evaluate

    cfg = model.ModelConfig(router=router, null_experts=kinds, dim=16, mlp_dim=16, depth=2, heads=2, image_size=8,
                            patch_size=4, group_images=4, moe_path="dropless", router_kwargs=options)
    m = model.VisionMoE(cfg, rngs=nnx.Rngs(4))
    images = np.asarray(jax.random.uniform(jax.random.key(15), (8, 8, 8, 1)))
    m.eval()
    out = m(jnp.asarray(images))
    _, layers = evaluate.routing_record(m, images, batch_size=8)
    metric = "real_picks" if kinds else "active_experts"
    assert layers[0]["picks"].mean() == pytest.approx(float(out.metrics[0][metric]), rel=1e-6)
    np.testing.assert_array_equal(layers[0]["picks"], layers[0]["hits"].sum(-1))
    assert layers[0]["top1"].max() < cfg.num_experts  # a real expert
