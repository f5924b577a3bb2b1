"""Sparse upcycling and Drop-Upcycling (mini_moe.upcycle, issue 54 §1).

The dense ViT here stands in for a trained one: every parameter is its initial value plus noise
(a fresh model's layer norms are 1 and 0, its biases 0 and its head 0, so a copy of them could
not be told from a fresh MoE model's own initial values), and its head is live (tests/live_head.py).

Tolerance of the equalities. Where the formulation says the upcycled model computes the dense
model's function, the two differ only in float32 round-off: the experts are the same matmuls in
another order (an einsum over the expert axis, or a grouped matmul, against ``nnx.Linear``), and
the combine weights sum to 1 up to an ulp (normalised gates g1 / (g1 + g2) + g2 / (g1 + g2), a
softmax summed over E). Each of the 4 blocks adds a few ulp (float32 eps = 1.2e-7) of the residual
stream's size (O(1) after the layer norms); the largest error measured is 7e-7 on logits of size 5.
``ATOL = 1e-5`` (about 80 eps) leaves room for other CPUs and XLA flags, and is 5,000 times below
``MARGIN = 0.05``, the least difference asserted where equality cannot hold (measured there:
0.5-1.2 on the features and the logits).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from live_head import live_head
from mini_moe.model import ModelConfig, VisionMoE
from mini_moe.train import model_rngs
from mini_moe.upcycle import upcycle, upcycled_config
from mini_moe.validate import InputError

E = 4
ATOL = 1e-5
MARGIN = 0.05
# 8x8 images in 2x2 patches: 16 tokens per image; groups of 2 images (32 tokens) for sparse routers.
DENSE = ModelConfig(image_size=8, patch_size=2, dim=16, depth=4, heads=2, mlp_dim=32, router=None, num_experts=E,
                    group_images=2)


def trained_like(cfg: ModelConfig, seed: int = 7) -> VisionMoE:
    """A dense model whose every parameter is away from its initial value (see the docstring)."""
    model = VisionMoE(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    noisy = [(path, v[...] + 0.1 * rng.standard_normal(v.shape, np.float32))
             for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    nnx.update(model, nnx.from_flat_state(noisy))
    return live_head(model)


@pytest.fixture(scope="module")
def dense():
    return trained_like(DENSE)


@pytest.fixture(scope="module")
def images():
    return jax.random.normal(jax.random.key(1), (8, 8, 8, 1))


# Jitted: one compilation per model, faster than running the dropless path op by op.
forward = nnx.jit(lambda model, images: model(images, return_routing=True))
layer = nnx.jit(lambda mlp, x: mlp(x))


def flat(model) -> dict:
    """Every variable of ``model`` by path, as NumPy (random keys as their key data)."""
    values = {path: v[...] for path, v in nnx.to_flat_state(nnx.state(model))}
    return {path: np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for path, x in values.items()}


def moe_mlp(path, moe_blocks) -> bool:
    return path[0] == "blocks" and path[1] in moe_blocks and path[2] == "mlp"


# ------------------------------------------------------------------------ what is copied


@pytest.mark.parametrize("mlp_dim", [32, 16])  # D != H, and D = H (the study's shape: a transpose keeps it)
def test_experts_are_tiled_copies_of_the_dense_mlp(dense, mlp_dim):
    """vmoe's ExpandTileRule: ``tile(expand_dims(x, 0), (E, 1, ...))``, checked with NumPy."""
    source = dense if mlp_dim == DENSE.mlp_dim else trained_like(dataclasses.replace(DENSE, mlp_dim=mlp_dim))
    model = upcycle(source, router="softmax_token_choice", num_experts=E)
    assert model.cfg.moe_blocks() == (1, 3)
    for i in (1, 3):
        fc1, fc2, experts = source.blocks[i].mlp.fc1, source.blocks[i].mlp.fc2, model.blocks[i].mlp.experts
        expected = dict(w1=np.asarray(fc1.kernel[...]), b1=np.asarray(fc1.bias[...])[None],
                        w2=np.asarray(fc2.kernel[...]), b2=np.asarray(fc2.bias[...])[None])
        for name, w in expected.items():
            got = np.asarray(getattr(experts, name)[...])
            np.testing.assert_array_equal(got, np.tile(np.expand_dims(w, 0), (E, 1, 1)), err_msg=f"block {i} {name}")
        assert experts.w1.shape == (E, 16, mlp_dim) and experts.b1.shape == (E, 1, mlp_dim)


def test_every_other_variable_is_the_dense_models(dense):
    model = upcycle(dense, router="softmax_token_choice", num_experts=E, seed=3)
    before, after = flat(dense), flat(model)
    moe_blocks = model.cfg.moe_blocks()
    kept = {p for p in before if not moe_mlp(p, moe_blocks)}
    assert {p for p in after if not moe_mlp(p, moe_blocks)} == kept  # same places outside the MoE MLPs
    assert any(p[0] == "pos" for p in kept) and any("attn" in p for p in kept) and any(p[0] == "head" for p in kept)
    for path in kept:
        np.testing.assert_array_equal(after[path], before[path], err_msg=str(path))
    new = {p[3] for p in after if moe_mlp(p, moe_blocks)}
    assert new == {"router", "experts"}
    # copies, not shared variables: training the MoE model leaves the dense one alone
    model.blocks[0].attn.query.kernel[...] += 1.0
    model.blocks[1].mlp.experts.w1[...] += 1.0
    np.testing.assert_array_equal(np.asarray(dense.blocks[0].attn.query.kernel[...]),
                                  before[("blocks", 0, "attn", "query", "kernel")])
    np.testing.assert_array_equal(np.asarray(dense.blocks[1].mlp.fc1.kernel[...]),
                                  before[("blocks", 1, "mlp", "fc1", "kernel")])


@pytest.mark.parametrize("router", ["softmax_token_choice", "softmax_expert_choice", "sigmoid_loss_free"])
def test_router_is_initialised_from_seed(dense, router):
    """Komatsuzaki et al. 2023 initialise the router randomly: here the router of a model made from
    scratch with the same seed and configuration (every variable of it, for three routers)."""
    a = upcycle(dense, router=router, num_experts=E, seed=5)
    scratch = VisionMoE(a.cfg, rngs=model_rngs(5))
    b = upcycle(dense, router=router, num_experts=E, seed=6)
    for i in (1, 3):
        w = lambda m: np.asarray(m.blocks[i].mlp.router.affinity.dense.kernel[...])
        np.testing.assert_array_equal(w(a), w(scratch))
        assert not np.allclose(w(a), w(b))
    in_router = lambda model: {p: x for p, x in flat(model).items() if moe_mlp(p, (1, 3)) and p[3] == "router"}
    assert in_router(a).keys() == in_router(scratch).keys() and in_router(a)
    for path, x in in_router(a).items():
        np.testing.assert_array_equal(x, in_router(scratch)[path], err_msg=str(path))
    for (path, x), (_, y) in zip(flat(a).items(), flat(upcycle(dense, router=router, num_experts=E,
                                                                   seed=5)).items()):
        np.testing.assert_array_equal(x, y, err_msg=str(path))  # deterministic in the seed


def test_placement_and_config(dense):
    assert upcycle(dense, router="soft_moe", num_experts=E).cfg.moe_blocks() == (2, 3)  # Soft MoE's last2
    model = upcycle(dense, router="softmax_expert_choice", num_experts=2, placement="last1", group_images=4,
                    router_kwargs={"capacity_factor": 2.0})
    assert model.cfg.moe_blocks() == (3,) and model.cfg.group_images == 4
    assert model.cfg.router_kwargs == (("capacity_factor", 2.0),)
    assert model.blocks[3].mlp.experts.w1.shape == (2, 16, 32)
    assert model.cfg == upcycled_config(DENSE, router="softmax_expert_choice", num_experts=2, placement="last1",
                                        group_images=4, router_kwargs={"capacity_factor": 2.0})
    assert upcycle(dense).cfg.num_experts == DENSE.num_experts  # E defaults to the dense config's


# ------------------------------------------------------- what the copy computes at the start


@pytest.mark.parametrize("router, options", [
    ("softmax_token_choice", dict(k=1)),  # c = 1: some tokens dropped (s = 0), the rest s = p < 1
    ("softmax_expert_choice", dict(capacity_factor=1.0)),  # s = 0 for some tokens, > 1 expert for others
    ("sigmoid_loss_free", dict(k=2, capacity_factor=1.0)),  # normalised gates, but picks dropped at c = 1
])
def test_layer_is_the_dense_mlp_scaled_by_the_combine_sum(dense, router, options):
    """Eq. (2) with E identical experts: ``MoE(X)[t] = (sum_{e,c} C[t, e, c]) MLP(x_t)``."""
    model = upcycle(dense, router=router, num_experts=E, router_kwargs=options)
    model.eval()
    x = jax.random.normal(jax.random.key(2), (8, 16, 16))
    y, out = layer(model.blocks[1].mlp, x)
    s = out.routing.combine.sum((-2, -1)).reshape(8, 16)
    np.testing.assert_allclose(y, s[..., None] * layer(dense.blocks[1].mlp, x), atol=ATOL, rtol=0)
    assert float(jnp.max(jnp.abs(s - 1))) > MARGIN  # and these routers' s is not 1 everywhere


# Nothing may be dropped: the dropless path, or buffers of C = T (capacity factor E for Token
# Choice: every token can reach every expert once).
EQUAL = [
    ("sigmoid_loss_free", dict(k=2), dict(moe_path="dropless")),  # DeepSeek-V3's top-k gates, normalised
    ("group_limited", dict(k=2, capacity_factor=float(E)), {}),  # the same, in groups of experts
    ("hash", dict(k=1, capacity_factor=float(E)), {}),  # combine weight 1 / k = 1
    ("softmax_token_choice", dict(k=E), {}),  # k = E: the whole softmax, which sums to 1 (C = T by default)
    ("softmax_expert_choice", dict(capacity_factor=float(E)), {}),  # C = T: every expert takes every token
]


@pytest.mark.parametrize("router, options, overrides", EQUAL)
def test_output_equals_the_dense_models_where_combine_weights_sum_to_one(dense, images, router, options, overrides):
    model = upcycle(dense, router=router, num_experts=E, router_kwargs=options, **overrides)
    model.eval()
    out, ref = forward(model, images), forward(dense, images)
    for routing in out.routings:  # why: every token's combine weights sum to 1, nothing dropped
        np.testing.assert_allclose(routing.combine.sum((-2, -1)), 1.0, atol=1e-6)
    assert float(jnp.max(jnp.abs(ref.logits))) > 1  # a live head: the logits carry the features
    np.testing.assert_allclose(out.features, ref.features, atol=ATOL, rtol=0)
    np.testing.assert_allclose(out.logits, ref.logits, atol=ATOL, rtol=0)


DIFFERENT = [
    ("softmax_token_choice", dict(k=1), dict(moe_path="dropless")),  # output scaled by the gate p < 1
    ("softmax_token_choice", dict(k=1), {}),  # ... and c = 1 drops tokens
    ("softmax_expert_choice", dict(capacity_factor=1.0), {}),  # drops tokens, doubles others
    ("soft_moe", dict(slots_per_expert=1), {}),  # slots mix tokens before the experts
]


@pytest.mark.parametrize("router, options, overrides", DIFFERENT)
def test_output_differs_where_the_formulation_forbids_equality(dense, images, router, options, overrides):
    model = upcycle(dense, router=router, num_experts=E, router_kwargs=options, **overrides)
    model.eval()
    out, ref = forward(model, images), forward(dense, images)
    assert float(jnp.max(jnp.abs(out.features - ref.features))) > MARGIN
    assert float(jnp.max(jnp.abs(out.logits - ref.logits))) > MARGIN


# ------------------------------------------- Komatsuzaki et al.'s renormalised combine weights


# Nothing dropped: the renormalised model is the dense one, the plain upcycled model is not.
RENORMALISED_EQUAL = [
    ("softmax_token_choice", dict(k=1, capacity_factor=float(E)), {}),  # s = p_max < 1 without it
    ("softmax_token_choice", dict(k=2, capacity_factor=float(E)), dict(moe_path="einsum")),  # s = p1 + p2 < 1
    ("softmax_expert_choice", dict(capacity_factor=float(E)), {}),  # C = T, s = 1 already: unchanged
]


@pytest.mark.parametrize("router, options, overrides", RENORMALISED_EQUAL)
def test_renormalised_upcycled_model_is_the_dense_model_where_nothing_is_dropped(dense, images, router, options,
                                                                                  overrides):
    """Sec. 2.2 of Komatsuzaki et al. (vision): each token's combine weights renormalised to 1."""
    ref = forward(dense, images)
    plain = upcycle(dense, router=router, num_experts=E, router_kwargs=options, **overrides)
    renormalised = upcycle(dense, router=router, num_experts=E, router_kwargs=options, renormalize=True, **overrides)
    assert renormalised.cfg == plain.cfg  # the option changes the routers of this model only
    plain.eval(), renormalised.eval()
    out, before = forward(renormalised, images), forward(plain, images)
    for routing in out.routings:
        np.testing.assert_allclose(routing.combine.sum((-2, -1)), 1.0, atol=1e-6)
    np.testing.assert_allclose(out.features, ref.features, atol=ATOL, rtol=0)
    np.testing.assert_allclose(out.logits, ref.logits, atol=ATOL, rtol=0)
    if router == "softmax_token_choice":  # without the renormalisation the same model is not the dense one
        assert float(jnp.max(jnp.abs(before.logits - ref.logits))) > MARGIN
        assert all(float(jnp.max(jnp.abs(r.combine.sum((-2, -1)) - 1))) > MARGIN for r in before.routings)


@pytest.mark.parametrize("router, options, path", [
    ("softmax_expert_choice", dict(capacity_factor=1.0), "gather"),  # the paper's router, C = 1
    ("softmax_expert_choice", dict(capacity_factor=2.0), "gather"),  # the paper's C = 2
    ("softmax_expert_choice", dict(capacity_factor=1.0), "einsum"),
    ("softmax_token_choice", dict(k=1, capacity_factor=1.0), "gather"),  # c = 1: dropped tokens keep 0
])
def test_renormalised_layer_is_the_dense_mlp_for_every_token_an_expert_took(dense, router, options, path):
    """With renormalised weights s_t is 1 for each token some expert took and 0 otherwise, so the
    layer is ``1[s_t > 0] MLP(x_t)``; without it the same routing gives ``s_t MLP(x_t)``, s_t != 1."""
    x = jax.random.normal(jax.random.key(2), (8, 16, 16))
    mlp = layer(dense.blocks[1].mlp, x)
    for renormalize in (False, True):
        model = upcycle(dense, router=router, num_experts=E, router_kwargs=options, renormalize=renormalize,
                        moe_path=path)
        model.eval()
        y, out = layer(model.blocks[1].mlp, x)
        s = out.routing.combine.sum((-2, -1)).reshape(8, 16)
        np.testing.assert_allclose(y, s[..., None] * mlp, atol=ATOL, rtol=0)
        taken = np.asarray(s) > 0
        if renormalize:
            np.testing.assert_allclose(np.asarray(s)[taken], 1.0, atol=1e-6)
            assert taken.any()
            if options["capacity_factor"] == 1.0:  # at c = 1 some tokens reach no expert: they keep 0
                assert not taken.all()
        else:
            assert float(np.max(np.abs(np.asarray(s)[taken] - 1))) > MARGIN


# ------------------------------------------------------------------------- Drop-Upcycling


def _units_changed(model, dense_model, i):
    """Per expert, the hidden units whose w1 column, b1 entry or w2 row differ from the dense MLP's:
    three boolean arrays [E, H]."""
    mlp, experts = dense_model.blocks[i].mlp, model.blocks[i].mlp.experts
    w1 = np.any(np.asarray(experts.w1[...]) != np.asarray(mlp.fc1.kernel[...])[None], axis=1)
    b1 = np.asarray(experts.b1[...])[:, 0] != np.asarray(mlp.fc1.bias[...])[None]
    w2 = np.any(np.asarray(experts.w2[...]) != np.asarray(mlp.fc2.kernel[...])[None], axis=2)
    return w1, b1, w2


@pytest.fixture(scope="module")
def skewed():
    """A dense model whose MLP matrices have distinct means and spreads, so that re-initialised
    values drawn with the wrong statistics (another matrix's, the initialiser's) are told apart."""
    model = trained_like(DENSE, seed=11)
    rng = np.random.default_rng(100)
    normal = lambda mean, std, variable: mean + std * rng.standard_normal(variable.shape, np.float32)
    for block in model.blocks:
        block.mlp.fc1.kernel[...] = normal(0.3, 0.05, block.mlp.fc1.kernel)
        block.mlp.fc1.bias[...] = normal(0.5, 0.2, block.mlp.fc1.bias)
        block.mlp.fc2.kernel[...] = normal(-0.2, 0.1, block.mlp.fc2.kernel)
    return model


@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_drop_upcycling_reinitialises_round_r_h_units_per_expert(skewed, ratio):
    model = upcycle(skewed, num_experts=E, drop_ratio=ratio, seed=0)
    hidden = DENSE.mlp_dim
    subsets = []
    for i in (1, 3):
        w1, b1, w2 = _units_changed(model, skewed, i)
        np.testing.assert_array_equal(w1, b1)  # the same units in w1, b1 and w2
        np.testing.assert_array_equal(w1, w2)
        np.testing.assert_array_equal(w1.sum(1), round(ratio * hidden))  # exactly round(r H) per expert
        # a re-initialised unit is re-drawn whole: every entry of its column differs
        changed = np.asarray(model.blocks[i].mlp.experts.w1[...]) != np.asarray(skewed.blocks[i].mlp.fc1.kernel[...])
        assert changed.all(axis=1)[w1].all()
        np.testing.assert_array_equal(model.blocks[i].mlp.experts.b2[...],
                                      np.tile(np.asarray(skewed.blocks[i].mlp.fc2.bias[...])[None, None], (E, 1, 1)))
        subsets += [frozenset(np.flatnonzero(row)) for row in w1]
    # Different experts (and layers) draw different subsets: two equal subsets of 16 of 32 units
    # have probability 1 / C(32, 16) = 1.7e-9 per pair.
    assert len(set(subsets)) == len(subsets)


def test_drop_upcycling_draws_from_the_dense_matrices_statistics(skewed):
    """Re-initialised values ~ N(mean, std^2) of the dense matrix they replace. With n values the
    sample mean is within 5 std / sqrt(n) of it and the sample std within 5 std / sqrt(2 n) (normal
    sampling errors; 5 standard errors: a chance failure has probability about 6e-7, and the
    draws are fixed by the seed). n = E * D * r H = 1,024 for w1 and w2, E * r H = 64 for b1; the
    dense means (0.3, 0.5, -0.2) are 6-60 standard errors apart from each other and from 0."""
    model = upcycle(skewed, num_experts=E, drop_ratio=0.5, seed=1)
    for i in (1, 3):
        w1, b1, w2 = _units_changed(model, skewed, i)
        mlp, experts = skewed.blocks[i].mlp, model.blocks[i].mlp.experts
        pairs = [(np.asarray(experts.w1[...]).transpose(0, 2, 1)[w1], np.asarray(mlp.fc1.kernel[...])),
                 (np.asarray(experts.b1[...])[:, 0][b1], np.asarray(mlp.fc1.bias[...])),
                 (np.asarray(experts.w2[...])[w2], np.asarray(mlp.fc2.kernel[...]))]
        for fresh, original in pairs:
            n, mean, std = fresh.size, original.mean(), original.std()
            assert abs(fresh.mean() - mean) < 5 * std / np.sqrt(n), (i, fresh.shape)
            assert abs(fresh.std() - std) < 5 * std / np.sqrt(2 * n), (i, fresh.shape)


def test_drop_ratio_zero_copies_and_one_reinitialises_every_unit(skewed):
    plain = upcycle(skewed, num_experts=E, seed=2)
    zero = upcycle(skewed, num_experts=E, drop_ratio=0.0, seed=2)
    for (path, x), (_, y) in zip(flat(plain).items(), flat(zero).items()):
        np.testing.assert_array_equal(x, y, err_msg=str(path))
    whole = upcycle(skewed, num_experts=E, drop_ratio=1.0, seed=2)
    for i in (1, 3):
        for changed in _units_changed(whole, skewed, i):
            assert changed.all()
        w1 = np.asarray(whole.blocks[i].mlp.experts.w1[...])
        assert not np.allclose(w1[0], w1[1])  # each expert its own draw


def test_drop_upcycling_draws_follow_the_seed_on_their_own_stream(skewed):
    """The units and values re-drawn change with ``seed``, are the same for the same seed, and do
    not depend on the router (they come from ``seed`` folded with ``DROP_STREAM``, not from the
    model's initialisation, which the router's parameters consume)."""
    experts = lambda model: [np.asarray(getattr(model.blocks[i].mlp.experts, n)[...])
                             for i in (1, 3) for n in ("w1", "b1", "w2")]
    a = experts(upcycle(skewed, num_experts=E, drop_ratio=0.5, seed=3))
    again = experts(upcycle(skewed, num_experts=E, drop_ratio=0.5, seed=3))
    other_seed = experts(upcycle(skewed, num_experts=E, drop_ratio=0.5, seed=4))
    other_router = experts(upcycle(skewed, router="softmax_expert_choice", num_experts=E, drop_ratio=0.5, seed=3))
    for x, y, z, w in zip(a, again, other_seed, other_router):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(x, w)
        assert not np.array_equal(x, z)
    chosen = lambda seed: _units_changed(upcycle(skewed, num_experts=E, drop_ratio=0.5, seed=seed), skewed, 1)[0]
    assert not np.array_equal(chosen(3), chosen(4))  # the units chosen, not only the values drawn


# ---------------------------------------------------------------------------- bad input


def test_bad_input(dense):
    moe = VisionMoE(dataclasses.replace(DENSE, router="softmax_token_choice"), rngs=nnx.Rngs(0))
    cases = [
        (dict(dense_model=moe), "dense ViT"),
        (dict(dense_model="dense"), "dense ViT"),
        (dict(num_experts=0), "num_experts"),
        (dict(drop_ratio=-0.1), "drop_ratio"),
        (dict(drop_ratio=1.5), "drop_ratio"),
        (dict(drop_ratio=True), "drop_ratio"),
        (dict(drop_ratio="0.5"), "drop_ratio"),
        (dict(router="nope"), "Unknown router"),
        (dict(router=None), "Unknown router"),
        (dict(fine_grained=2), "fine-grained"),
        (dict(shared_experts=1), "fine-grained or shared"),
        (dict(dim=32), "cannot change"),
        (dict(placement="none"), "placement"),
        (dict(placement="last9"), "placement"),
        (dict(router_kwargs=[("k", 2)]), "router_kwargs"),
        (dict(seed=-1), "seed"),
        (dict(router="softmax_token_choice", router_kwargs={"k": E + 1}), "k must be"),
        (dict(renormalize=1), "renormalize"),
        (dict(router="soft_moe", renormalize=True), "renormalize=True needs"),
        (dict(router="sigmoid_loss_free", moe_path="dropless", renormalize=True), "dropless"),
    ]
    for kwargs, match in cases:
        model = kwargs.pop("dense_model", dense)
        with pytest.raises(InputError, match=match):
            upcycle(model, **{"num_experts": E, **kwargs})
