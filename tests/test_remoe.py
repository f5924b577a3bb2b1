"""ReMoE (arXiv 2412.14711) as affinity x allocation: ReLU gates, every positive gate a pick,
a load-balanced L1 penalty whose weight a controller moves towards the target sparsity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mini_moe import routers, routing
from mini_moe.modes import eval_mode
from mini_moe.layer import MlpExperts
from mini_moe.model import MoeLayer

D, E, T = 16, 4, 32


@pytest.mark.parametrize("capacity, batch_priority", [(32, False), (6, False), (6, True), (3, False)])
def test_threshold_token_choice_equals_the_loop(capacity, batch_priority):
    scores = np.asarray(jax.random.normal(jax.random.key(0), (T, E)))  # about half are <= 0
    rt = routing.token_choice(scores, capacity=capacity, k=E, batch_priority=batch_priority, min_score=0.0)
    dispatch, combine = routing.token_choice_loop(scores, capacity=capacity, k=E, batch_priority=batch_priority,
                                                  min_score=0.0)
    np.testing.assert_array_equal(np.asarray(rt.dispatch), dispatch)
    np.testing.assert_allclose(np.asarray(rt.combine), combine, rtol=1e-6)
    reached = dispatch.any(-1)
    assert not (reached & (scores <= 0)).any()  # no pick at a non-positive score
    if capacity == T:  # ample buffers: exactly the positive scores
        np.testing.assert_array_equal(reached, scores > 0)


def _router(**kw):
    return routers.make_router("remoe", D, E, rngs=nnx.Rngs(0), **kw)


def test_gates_are_relu_and_the_combine_weights():
    router = _router(k=2, capacity_factor=float(E), deterministic=True)
    x = jax.random.normal(jax.random.key(1), (2, T, D))
    out = router(x)
    gates = np.maximum(np.asarray(x @ router.affinity.dense.kernel[...]), 0)
    reached = np.asarray(out.routing.dispatch).any(-1)
    np.testing.assert_array_equal(reached, gates > 0)
    np.testing.assert_allclose(np.asarray(out.routing.combine).sum(-1), gates, rtol=1e-5, atol=1e-7)
    # The number of experts per token varies.
    per_token = reached.sum(-1)
    assert per_token.min() < per_token.max()
    np.testing.assert_allclose(float(out.metrics["active_experts"]), per_token.mean(), rtol=1e-6)


def test_penalty_is_load_balanced_l1_times_lambda():
    router = _router(k=1, l1_init=0.5, deterministic=True)
    x = jax.random.normal(jax.random.key(2), (2, T, D))
    out = router(x)
    gates = np.maximum(np.asarray(x @ router.affinity.dense.kernel[...]), 0).reshape(-1, E)
    f = E * (gates > 0).sum(0) / (1 * gates.shape[0])
    np.testing.assert_allclose(float(out.aux_loss), 0.5 * np.mean((gates * f).sum(-1)), rtol=1e-5)


def test_controller_moves_lambda_towards_the_target_sparsity():
    x = jax.random.normal(jax.random.key(3), (2, T, D))
    dense = _router(k=3, l1_init=1e-3, l1_rate=1.5, l1_scope="layer")  # target 1 - 3/4: gates are sparser
    dense(x)
    assert float(dense.affinity.l1_weight[...]) == pytest.approx(1e-3 / 1.5)  # too sparse: less penalty
    sparse = _router(k=1, l1_init=1e-3, l1_rate=1.5, l1_scope="layer")  # target 3/4 zeros: about half now
    sparse(x)
    assert float(sparse.affinity.l1_weight[...]) == pytest.approx(1e-3 * 1.5)  # not sparse enough: more
    frozen = _router(k=1, l1_init=1e-3, deterministic=True, l1_scope="layer")
    frozen(x)
    assert float(frozen.affinity.l1_weight[...]) == pytest.approx(1e-3)
    alone = _router(k=1, l1_init=1e-3, l1_rate=1.5)  # the default, ReMoE's model-level lambda: the model moves it
    alone(x)
    assert float(alone.affinity.l1_weight[...]) == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="l1_scope must be one of"):
        _router(l1_scope="block")
    # Not a parameter: no gradient, no optimizer, no weight decay.
    assert "l1_weight" not in nnx.state(sparse, nnx.Param)["affinity"]
    assert isinstance(sparse.affinity.l1_weight, routers.L1Weight)


def test_dropless_remoe_equals_gather_with_ample_buffers():
    x = jax.random.normal(jax.random.key(4), (2, T, D))

    def layer(path, factor):
        router = _router(k=1, capacity_factor=factor, deterministic=True)
        return MoeLayer(router, MlpExperts(E, D, 8, rngs=nnx.Rngs(1)), path=path)

    gather, dropless = layer("gather", float(E)), layer("dropless", 1.0)
    y_gather, out = gather(x)
    assert float(out.metrics["dropped"]) > 0  # tokens whose every gate is zero reach no expert
    y_dropless, out_dropless = dropless(x)
    np.testing.assert_allclose(y_dropless, y_gather, rtol=1e-5, atol=1e-5)
    tight, _ = layer("gather", 1.0)(x)
    assert float(jnp.abs(tight - y_gather).max()) > 1e-3  # at c = k the buffers overflow
    np.testing.assert_allclose(float(out_dropless.metrics["active_experts"]), float(out.metrics["active_experts"]))


def test_bad_options():
    with pytest.raises(ValueError, match="target_k"):
        _router(k=5)
    with pytest.raises(ValueError, match="l1_rate"):
        _router(l1_rate=1.0)


@pytest.mark.parametrize("scope", ["model", "layer"])
def test_one_lambda_for_the_model_moved_by_the_mean_sparsity_of_its_layers(scope):
    """ReMoE's reference keeps one lambda for the model and moves it by the sparsity averaged
    over all MoE layers (issue 35 item 4); ``l1_scope="layer"`` moves each by its own."""
    from mini_moe import config as config_lib
    from mini_moe import train

    cfg = config_lib.get_config("quick", dataset="digits", router="remoe", model_depth=4, model_placement="every2",
                                model_router_kwargs={"l1_init": 1e-3, "l1_rate": 1.5, "l1_scope": scope})
    model = train.make_model(cfg)
    gates = [block.mlp.router.affinity for block in model.blocks if block.use_moe]
    assert len(gates) == 2
    images = jax.random.uniform(jax.random.key(0), (16, 8, 8, 1))
    out = model(images)  # training mode
    sparsity = [float(m["sparsity"]) for m in out.metrics]
    target = gates[0].target_sparsity
    moved = [float(g.l1_weight[...]) for g in gates]
    if scope == "model":
        expected = 1e-3 * 1.5 ** np.sign(target - np.mean(sparsity))
        np.testing.assert_allclose(moved, [expected, expected], rtol=1e-6)
    else:
        np.testing.assert_allclose(moved, [1e-3 * 1.5 ** np.sign(target - s) for s in sparsity], rtol=1e-6)
    with eval_mode(model):  # evaluation moves nothing
        model(images)
    assert [float(g.l1_weight[...]) for g in gates] == moved


def test_dropless_relu_routing_computes_only_the_positive_picks(monkeypatch):
    """Review item 3 (issue 35): with min_score = 0, a pick with a zero ReLU gate is sorted past
    every expert's rows, in no group, so the grouped matmuls see only the picks made; the output
    is the same as with all E picks per token (whose zero gates add nothing)."""
    from mini_moe import layer

    x = jax.random.normal(jax.random.key(7), (2, T, D))
    scores = jax.nn.relu(jax.random.normal(jax.random.key(8), (2, T, E)))  # about half are zero
    experts = MlpExperts(E, D, 8, rngs=nnx.Rngs(1), kernel="blocked")
    seen = []
    original = layer.grouped_matmul

    def recording(rows, weights, group_sizes, **kwargs):
        seen.append(int(jnp.sum(group_sizes)))
        return original(rows, weights, group_sizes, **kwargs)

    monkeypatch.setattr(layer, "grouped_matmul", recording)
    positive = layer.moe_sorted(x, scores, experts, k=E, min_score=0.0)
    made = int(jnp.sum(scores > 0))
    assert seen == [made, made] and made < 2 * T * E * 0.7
    every = layer.moe_sorted(x, scores, experts, k=E)
    assert seen[2:] == [2 * T * E] * 2
    np.testing.assert_allclose(positive, every, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", ["blocked", "ragged_dot", "megablox"])
def test_relu_routing_is_finite_and_equals_all_picks_on_every_kernel(kernel):
    """Issue 52 (review N1): the picks a ReLU gate does not make go to rows outside every group,
    which a grouped matmul need not write; megablox (here under Pallas' interpreter, which fills
    unwritten memory with NaN) leaves them so. Those rows must be selected away, not multiplied
    by a zero gate: outputs and gradients (tokens, the gates' logits before the ReLU, expert
    weights) are finite and equal to the computation with all E picks per token, whose zero gates
    add nothing."""
    from mini_moe import layer

    x = jax.random.normal(jax.random.key(7), (2, T, D))
    logits = jax.random.normal(jax.random.key(8), (2, T, E))
    assert 0.3 < float(jnp.mean(logits > 0)) < 0.7
    experts = MlpExperts(E, D, 8, rngs=nnx.Rngs(1), kernel=kernel)
    graph, params = nnx.split(experts)

    def loss(x, logits, params, min_score):
        out = layer.moe_sorted(x, jax.nn.relu(logits), nnx.merge(graph, params), k=E, min_score=min_score)
        return jnp.sum(jnp.sin(out)), out

    (_, positive), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, logits, params, 0.0)
    (_, every), reference = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, logits, params, None)
    assert bool(jnp.isfinite(positive).all())
    np.testing.assert_allclose(positive, every, rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)):
        assert bool(jnp.isfinite(got).all())
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_chapter_9s_one_layer_model_moves_remoes_lambda_as_the_vit_does():
    """Code review B2 (issue 52 §1): the model-level lambda has one home, routers.after_forward,
    which every model holding MoE layers calls; chapter 9's SubtaskLayer (``remoe`` is in its
    router list) used not to, so lambda never moved there. One training step moves it by exactly
    one controller step, toward the target; an evaluation call does not."""
    from mini_moe import subtasks

    cfg = subtasks.SubtaskConfig(router="remoe", tasks=4, dim=8, hidden=8, group_tokens=32, groups=2, steps=1,
                                 eval_every=1, seed=0)
    layer = subtasks.SubtaskLayer(cfg, rngs=nnx.Rngs(0))
    gates = layer.router.affinity
    before = float(gates.l1_weight[...])
    x = jax.random.normal(jax.random.key(1), (2, 32, 8))
    _, out = layer(x)
    sparsity = float(out.metrics["sparsity"])
    target = 1 - gates.target_k / 4
    assert float(gates.l1_weight[...]) == pytest.approx(before * gates.l1_rate ** np.sign(target - sparsity), rel=1e-6)
    moved = float(gates.l1_weight[...])
    with eval_mode(layer):
        layer(x)
    assert float(gates.l1_weight[...]) == moved


def test_a_bound_on_the_picks_keeps_relu_routing_sparse_and_drops_the_smallest_gates():
    """Issue 52 §1 (review N2): with ``max_picks`` = M, moe_sorted sorts, stores and computes M
    rows instead of every token's E picks. Within the bound the output equals the unbounded
    layer's (and its gradients); beyond it, the M picks of largest gate are kept: the result equals
    the unbounded layer on gates whose smaller entries are zeroed, and overflow() reports the share
    dropped."""
    from mini_moe import layer

    x = jax.random.normal(jax.random.key(7), (2, T, D))
    logits = jax.random.normal(jax.random.key(8), (2, T, E))
    made = int(jnp.sum(logits > 0))
    experts = MlpExperts(E, D, 8, rngs=nnx.Rngs(1), kernel="blocked")
    seen = []
    original = layer.grouped_matmul

    def recording(rows, weights, group_sizes, **kwargs):
        seen.append(rows.shape[0])
        return original(rows, weights, group_sizes, **kwargs)

    def run(logits, bound):
        return layer.moe_sorted(x, jax.nn.relu(logits), experts, k=E, min_score=0.0, max_picks=bound)

    every = run(logits, None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layer, "grouped_matmul", recording)
        within = run(logits, made + 3)
    assert seen == [made + 3, made + 3]  # M rows, not 2 T E = 256
    np.testing.assert_allclose(within, every, rtol=1e-5, atol=1e-6)
    grad = lambda bound: jax.grad(lambda l: jnp.sum(jnp.sin(run(l, bound))))(logits)
    np.testing.assert_allclose(grad(made + 3), grad(None), rtol=1e-4, atol=1e-6)
    assert float(layer.overflow(jax.nn.relu(logits), k=E, min_score=0.0, max_picks=made + 3)) == 0.0
    # beyond the bound: the smallest positive gates are the ones dropped
    bound = made // 2
    threshold = jnp.sort(jnp.where(logits > 0, logits, jnp.inf).reshape(-1))[made - bound - 1]
    kept = jnp.where(logits > threshold, logits, -1.0)
    assert int(jnp.sum(kept > 0)) == bound
    np.testing.assert_allclose(run(logits, bound), run(kept, None), rtol=1e-5, atol=1e-6)
    assert float(layer.overflow(jax.nn.relu(logits), k=E, min_score=0.0, max_picks=bound)) == pytest.approx(
        (made - bound) / made)
    with pytest.raises(ValueError, match="max_picks must be an int >= 1"):
        run(logits, 0)


def test_remoes_dropless_layer_is_bounded_by_active_bound_and_reports_its_overflow():
    """The ``remoe`` router's ``active_bound`` (opt-in; default None) becomes the dropless layer's
    static bound, ``ceil(active_bound * k * tokens)`` picks per call; the layer's ``overflow``
    metric is the share of picks made beyond it. With None, every pair is kept and nothing is
    reported."""
    from mini_moe import layer

    x = jax.random.normal(jax.random.key(4), (2, T, D))
    experts = MlpExperts(E, D, 8, rngs=nnx.Rngs(1), kernel="blocked")
    make = lambda bound: MoeLayer(_router(k=1, deterministic=True, active_bound=bound), experts, path="dropless")
    scores = _router(k=1, deterministic=True)(x).affinities.scores
    made = int(jnp.sum(scores > 0))
    tight = 0.5  # half a pick per token: half of the 2 T tokens' picks at most, fewer than those made
    assert made > tight * 2 * T
    y, out = make(tight)(x)
    want = layer.moe_sorted(x, scores, experts, k=E, min_score=0.0, max_picks=int(tight * 2 * T))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    assert float(out.metrics["overflow"]) == pytest.approx((made - tight * 2 * T) / made)
    y_all, out_all = make(None)(x)
    np.testing.assert_allclose(y_all, layer.moe_sorted(x, scores, experts, k=E, min_score=0.0), rtol=1e-5, atol=1e-6)
    assert "overflow" not in out_all.metrics
    assert routers.make_router("remoe", D, E, rngs=nnx.Rngs(0)).allocation.max_picks(100) is None  # the default
    assert routers.make_router("remoe", D, E, active_bound=2.0, rngs=nnx.Rngs(0)).allocation.max_picks(100) == 200
    with pytest.raises(ValueError, match="active_bound must be > 0"):
        _router(active_bound=0.0)


def test_remoes_default_keeps_every_positive_gate_and_does_not_depend_on_the_other_tokens():
    """Review F1 of 2026-11-28: by default (``active_bound=None``, ReMoE's paper and reference code)
    the dropless layer keeps every positive gate, even when the gates are nearly dense as in ReMoE's
    first steps: its output equals the computation with all E picks per token (the zero gates add
    nothing), it reports no overflow, and a group's output is the same whatever other group shares
    the call. The opt-in bound, on the same dense gates, drops picks and makes the output depend on
    the companion group."""
    from mini_moe import layer

    x = jax.random.normal(jax.random.key(11), (1, T, D))
    small = 0.1 * jax.random.normal(jax.random.key(12), (1, T, D))
    big = 3.0 * jax.random.normal(jax.random.key(13), (1, T, D))
    experts = MlpExperts(E, D, 8, rngs=nnx.Rngs(1), kernel="blocked")
    default = MoeLayer(_router(k=1, deterministic=True), experts, path="dropless")
    both = jnp.concatenate([x, big])
    scores = default.router(both).affinities.scores
    made = int(jnp.sum(scores > 0))
    assert made > 1.5 * (2 * T)  # dense: well above the k = 1 target of one pick per token
    y, out = default(both)
    assert "overflow" not in out.metrics
    every = layer.moe_sorted(both, scores, experts, k=E)  # all E pairs of every token, zero gates included
    np.testing.assert_allclose(y, every, rtol=1e-5, atol=1e-6)
    alone, _ = default(jnp.concatenate([x, small]))
    np.testing.assert_allclose(alone[0], y[0], rtol=1e-5, atol=1e-6)  # the companion group does not matter
    # an opt-in bound of k picks per token on the same gates: picks dropped, and the output of x moves
    bounded = MoeLayer(_router(k=1, deterministic=True, active_bound=1.0), experts, path="dropless")
    y_big, out_big = bounded(both)
    y_small, _ = bounded(jnp.concatenate([x, small]))
    assert float(out_big.metrics["overflow"]) == pytest.approx((made - 2 * T) / made)
    assert float(jnp.max(jnp.abs(y_big[0] - y_small[0]))) > 1e-3
