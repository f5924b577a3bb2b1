"""The dropless layer path (issue 26): Token Choice with buffers T deep, computed by sorting and
grouped matmuls. Equal to the gather path (outputs and gradients) whenever the gather path drops
nothing; drops nothing when the gather path would; refused where it does not apply."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mini_moe import config as config_lib
from mini_moe import evaluate, routers, train
from mini_moe.layer import MlpExperts
from mini_moe.model import ModelConfig, MoeLayer

from live_head import live_head

DIM, EXPERTS, TOKENS = 16, 4, 32
TOKEN_ROUTERS = [("softmax_token_choice", {"k": 1, "deterministic": True}),
                 ("softmax_token_choice", {"k": 2, "deterministic": True}),
                 ("sigmoid_loss_free", {"k": 2, "deterministic": True}),
                 ("sinkhorn_token_choice", {"k": 1}),
                 ("svmoe", {"k": 2})]


def _layer(name, kwargs, path, capacity_factor):
    router = routers.make_router(name, DIM, EXPERTS, rngs=nnx.Rngs(0), capacity_factor=capacity_factor, **kwargs)
    return MoeLayer(router, MlpExperts(EXPERTS, DIM, 8, rngs=nnx.Rngs(1)), path=path)


def _output_and_grads(layer, x):
    def loss(layer):
        y, out = layer(x)
        return jnp.sum(jnp.sin(y)) + out.aux_loss, y

    (_, y), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layer)  # one compile, not op by op
    return y, grads


@pytest.mark.parametrize("name, kwargs", TOKEN_ROUTERS, ids=lambda v: str(v))
def test_dropless_equals_gather_when_gather_drops_nothing(name, kwargs):
    x = jax.random.normal(jax.random.key(2), (3, TOKENS, DIM))
    gather = _layer(name, kwargs, "gather", float(EXPERTS))  # C = T: room for every pick
    dropless = _layer(name, kwargs, "dropless", 1.0)  # the same parameters, the usual buffers
    _, out = gather(x)
    assert float(out.metrics["dropped"]) == 0 and float(out.metrics["experts_per_token"]) == kwargs["k"]
    y_gather, g_gather = _output_and_grads(gather, x)
    y_dropless, g_dropless = _output_and_grads(dropless, x)
    np.testing.assert_allclose(y_dropless, y_gather, rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), g_dropless, g_gather)
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(g_dropless))


@pytest.mark.parametrize("k", [1, 2])
def test_dropless_drops_nothing_where_gather_does(k):
    # Scores that send most tokens to expert 0: at c = k its buffer overflows.
    x = jax.random.normal(jax.random.key(3), (2, TOKENS, DIM)) + 3.0
    kwargs = {"k": k, "deterministic": True}
    tight = _layer("softmax_token_choice", kwargs, "gather", float(k))
    tight.router.affinity.dense.kernel[...] = jnp.zeros((DIM, EXPERTS)).at[:, 0].set(1.0)
    _, out = tight(x)
    assert float(out.metrics["dropped"]) > 0.2  # the gather path drops tokens
    dropless = _layer("softmax_token_choice", kwargs, "dropless", float(k))
    nnx.update(dropless, nnx.state(tight))
    y, out = dropless(x)
    assert float(out.metrics["dropped"]) == 0 and float(out.metrics["experts_per_token"]) == k
    roomy = _layer("softmax_token_choice", kwargs, "gather", float(EXPERTS))
    nnx.update(roomy, nnx.state(tight))
    np.testing.assert_allclose(y, roomy(x)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("router", ["softmax_expert_choice", "soft_moe", "sinkhorn_expert_choice"])
def test_dropless_needs_token_choice(router):
    with pytest.raises(ValueError, match="dropless"):
        ModelConfig(router=router, moe_path="dropless")
    built = routers.make_router(router, DIM, EXPERTS, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="dropless"):
        MoeLayer(built, MlpExperts(EXPERTS, DIM, 8, rngs=nnx.Rngs(1)), path="dropless")


def test_unknown_path_is_named():
    with pytest.raises(ValueError, match="moe_path must be one of"):
        ModelConfig(router="softmax_token_choice", moe_path="sorted")


def test_a_dropless_model_trains_and_is_diagnosed(tmp_path):
    # a small model: the property (nothing dropped, one expert per token) does not need the quick size
    cfg = config_lib.get_config("quick", dataset="digits", router="softmax_token_choice", steps=3, eval_every=3,
                                checkpoint_every=3, model_moe_path="dropless", batch_size=32, eval_batch_size=64,
                                model_dim=16, model_depth=2, model_heads=2, model_mlp_dim=16, model_num_experts=4,
                                model_group_images=4)
    train.train(cfg, tmp_path / "run", progress=False)
    model, _ = train.load_trained(tmp_path / "run")
    datasets = train.load_data(cfg)
    mech = evaluate.mechanisms(model, datasets[1].images[:64], stability_images=16)
    assert mech["layers"]
    for layer in mech["layers"]:
        assert layer["unprocessed"] == 0 and layer["experts_per_token"] == 1


@pytest.mark.parametrize("m, k, n", [(37, 16, 24), (300, 64, 130), (256, 200, 96)])
def test_megablox_kernel_equals_ragged_dot(m, k, n):
    """The TPU kernel (megablox gmm, run here by Pallas' interpreter) against ragged_dot: outputs
    and gradients, with an empty group and a row count that is no multiple of the tile."""
    from mini_moe.layer import grouped_matmul

    rows = jax.random.normal(jax.random.key(0), (m, k))
    weights = jax.random.normal(jax.random.key(1), (4, k, n))
    sizes = jnp.array([m // 3, 0, m - m // 3 - m // 5, m // 5], jnp.int32)

    def loss(kernel):
        return lambda r, w: jnp.sum(jnp.sin(grouped_matmul(r, w, sizes, kernel=kernel)))

    np.testing.assert_allclose(grouped_matmul(rows, weights, sizes, kernel="megablox"),
                               grouped_matmul(rows, weights, sizes, kernel="ragged_dot"), rtol=1e-5, atol=1e-4)
    for a, b in zip(jax.grad(loss("megablox"), (0, 1))(rows, weights), jax.grad(loss("ragged_dot"), (0, 1))(rows, weights)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-3)
    with pytest.raises(ValueError, match="kernel must be one of"):
        grouped_matmul(rows, weights, sizes, kernel="cutlass")


@pytest.mark.parametrize("m, k, n, block", [(37, 16, 24, 4), (300, 64, 130, 32), (256, 200, 96, 128), (9, 3, 5, 1)])
def test_blocked_kernel_equals_ragged_dot(m, k, n, block):
    """The plain-JAX block-sparse kernel against ragged_dot: outputs and gradients (its own VJP),
    under jit, with an empty group, blocks that do not divide the groups, and rows past the last
    group (their output is 0)."""
    from mini_moe.layer import block_layout, grouped_matmul

    rows = jax.random.normal(jax.random.key(0), (m, k))
    weights = jax.random.normal(jax.random.key(1), (4, k, n))
    sizes = jnp.array([m // 3, 0, m - m // 3 - m // 5 - 2, m // 5], jnp.int32)  # two rows in no group

    def loss(kernel):
        return lambda r, w: jnp.sum(jnp.sin(grouped_matmul(r, w, sizes, kernel=kernel, block=block)))

    blocked = jax.jit(lambda r, w: grouped_matmul(r, w, sizes, kernel="blocked", block=block))(rows, weights)
    np.testing.assert_allclose(blocked, grouped_matmul(rows, weights, sizes, kernel="ragged_dot"), rtol=1e-5, atol=1e-4)
    assert float(jnp.abs(blocked[-2:]).max()) == 0
    for a, b in zip(jax.grad(loss("blocked"), (0, 1))(rows, weights), jax.grad(loss("ragged_dot"), (0, 1))(rows, weights)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-3)
    # the layout: each group's rows in its own blocks, in order, padded to whole blocks
    dest, block_group, num_blocks = block_layout(sizes, m, block)
    dest, block_group = np.asarray(dest), np.asarray(block_group)
    group_of_row = np.repeat(np.arange(4), np.asarray(sizes))
    assert np.all(block_group[dest[:len(group_of_row)] // block] == group_of_row)
    assert np.all(np.diff(dest[:len(group_of_row)]) > 0) and np.all(dest[len(group_of_row):] == num_blocks * block)
    used = int(np.sum(-(-np.asarray(sizes) // block)))
    assert np.all(block_group[:used] < 4) and np.all(block_group[used:] == 4)
    with pytest.raises(ValueError, match="block must be"):
        grouped_matmul(rows, weights, sizes, kernel="blocked", block=0)


@pytest.mark.parametrize("variant", [dict(router="softmax_token_choice", router_kwargs=(("k", 1),)),
                                     dict(router="softmax_token_choice", router_kwargs=(("k", 2),)),
                                     dict(router="softmax_token_choice", fine_grained=2),
                                     dict(router="softmax_token_choice", fine_grained=2, shared_experts=1),
                                     dict(router="remoe")], ids=["tc_k1", "tc_k2", "fine", "fine_shared", "remoe"])
def test_a_dropless_model_is_the_same_with_the_blocked_kernel(variant):
    """Token Choice k = 1 and 2, fine-grained, fine-grained + shared and ReMoE's variable k: the
    whole dropless model's logits and gradients with the blocked kernel equal those with ragged_dot,
    with a live head, so the experts' and the router's gradients are not zero."""
    import dataclasses

    cfg = config_lib.get_config("quick", dataset="digits", router=variant["router"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_path="dropless", depth=2, placement="last1",
                                                             **{k: v for k, v in variant.items() if k != "router"}))
    images = jax.random.normal(jax.random.key(5), (cfg.model.group_images * 2, 8, 8, 1))

    def logits_and_grads(kernel):
        model = live_head(train.make_model(cfg))  # a zero head would hide the experts' and router's gradients
        experts = [m for _, m in nnx.iter_graph(model) if isinstance(m, MlpExperts)]
        assert experts
        for m in experts:
            m.kernel = kernel
        model.eval()

        def loss(model):
            out = model(images)
            return jnp.sum(jnp.sin(out.logits) * jnp.arange(out.logits.shape[-1])) + out.aux_loss, out.logits

        (_, logits), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)  # one compile, not op by op
        return logits, grads

    ragged, blocked = logits_and_grads("ragged_dot"), logits_and_grads("blocked")
    np.testing.assert_allclose(blocked[0], ragged[0], rtol=1e-5, atol=1e-5)
    # Gradients of a live head reach |g| ~ 1e2, and an entry near 0 is a sum of such terms that
    # cancel: float32 round-off there is ~sqrt(n) u max|g| (n ~ 1e2 terms, u = 6e-8), a few 1e-5
    # (3e-5 measured on the floors' jaxlib), so the absolute tolerance scales with the leaf's
    # largest entry; a wrong VJP (2 d_weights, d_rows = 0) is off by O(max|g|).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(b).max()))),
                 blocked[1], ragged[1])
    expert_grads = [g for path, g in nnx.to_flat_state(blocked[1]) if "experts" in map(str, path)]
    assert expert_grads and all(float(jnp.abs(g[...]).max()) > 0 for g in expert_grads)  # the kernel's VJP is seen


def test_the_block_sweep_measures_each_block_it_names(monkeypatch):
    """bench's block sweep at a tiny shape: half, once and twice the default block for k = 1, 2,
    each point's padding equal to the picks per expert rounded up to whole blocks (counted here from
    the router's own top-k), and an MlpExperts with an explicit block computing the same layer."""
    from flax import nnx

    from mini_moe import bench, layer as layer_lib
    from mini_moe.model import MoeLayer

    monkeypatch.setattr(bench, "LAYER_SHAPES", {"tiny": (2, 40, 2, 16, 32, 4)})
    monkeypatch.setattr(bench, "_SHAPES", {"tiny": (2, 40, 2, 16, 32, 4)})
    rows = bench.dropless_block_sweep(1)
    for k in (1, 2):
        default = layer_lib.default_block(160 * k, 4)
        mine = [r for r in rows if r["k"] == k]
        assert [r["block"] for r in mine] == sorted({max(4, default // 2), default, 2 * default})
        assert [r["default"] for r in mine] == [r["block"] == default for r in mine]
        router, x = bench._router_and_tokens("softmax_token_choice", "tiny", nnx.Rngs(0), k=k)
        router.eval()  # as the bench runs it: no noise
        scores = np.asarray(router(x, dropless=True).affinities.scores).reshape(-1, 4)
        load = np.bincount(np.argsort(-scores, axis=-1)[:, :k].ravel(), minlength=4)
        for r in mine:
            assert r["padding"] == round(np.sum(-(-load // r["block"])) * r["block"] / (160 * k) - 1, 4)
            assert r["time_ratio"] > 0 and r["flop_ratio"] > 0
    rng = nnx.Rngs(0)
    router, x = bench._router_and_tokens("softmax_token_choice", "tiny", rng, k=2)
    router.eval()
    experts = layer_lib.MlpExperts(4, 16, 32, rngs=rng, kernel="blocked")
    default_out, _ = MoeLayer(router, experts, path="dropless")(x)
    experts.block = 4
    np.testing.assert_allclose(MoeLayer(router, experts, path="dropless")(x)[0], default_out, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="block must be None or an int >= 1"):
        layer_lib.MlpExperts(4, 16, 32, rngs=rng, block=0)
