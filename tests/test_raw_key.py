"""The raw-key routers (issue 65 §1): ``raw_oracle``, ``raw_blind`` and ``raw_lsh`` route each
patch by a fixed key of its raw pixels (:class:`mini_moe.routers.RawKey`), which the model hands
to the MoE layers before its embedding, so no training can steer them.

Measured on the whole test split of ``subtask_vote_d8_h16`` (160,000 patches, standardised with
the training split's statistics, as ``train.load_data`` does; and the same on ``subtask_vote``
and ``subtask_vote_d8_h16_s1``): the oracle's key is the patch's sub-task for every patch (0
differ); the blind hash agrees with it for 0.124 of them (chance: 1/8); the random projection
for 0.19 (0.39 once its experts are matched to sub-tasks). Here a slice of 500 test images is
checked against those levels with margins stated at each assertion."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mini_moe import config as config_lib
from mini_moe import data, evaluate, modes, parallel, routers, train
from mini_moe.model import patchify
from mini_moe.validate import InputError

DATASET = "subtask_vote_d8_h16"
OPTIONS = data.subtask_vote_options(DATASET)
RAW = ["raw_oracle", "raw_blind", "raw_lsh"]
TINY = dict(model_dim=16, model_depth=2, model_heads=2, model_mlp_dim=16, model_group_images=4, batch_size=32,
            eval_batch_size=64)


@pytest.fixture(scope="module")
def sv():
    """500 standardised test images of ``subtask_vote_d8_h16`` with their patches' sub-tasks, and
    500 training images (their statistics standardise both, as the whole split's do in
    ``train.load_data``; the training step trains on them)."""
    train_set = data.subtask_vote("train", num_train=500, **OPTIONS)
    test_set = data.subtask_vote("test", num_test=500, **OPTIONS)
    train_images, mean, std = data.normalize(train_set.images)
    images = data.normalize(test_set.images, mean, std)[0]
    tasks = data.subtask_vote_tasks("test", num_test=500, **OPTIONS)[0]
    return dict(images=images, tasks=tasks, patches=np.asarray(patchify(images, 7)),
                train=dataclasses.replace(train_set, images=train_images))


def _cfg(router, **overrides):
    return config_lib.get_config("quick", dataset=DATASET, router=router, **{**TINY, **overrides})


def _keys(router, patches):
    """Each patch's top-1 expert under ``router`` alone (no capacity)."""
    return np.asarray(jnp.argmax(router.affinity.logits(jnp.asarray(patches)), -1))


def _forward(model, images, field="picks"):
    """``field`` of the model's output for ``images``, in eval mode, run op by op in batches of 32:
    every test here runs the same shapes, so the compiled operations are shared (a compiled model
    would cost more than this file's whole run). ``picks`` and ``probs``: the first MoE layer's."""
    parts = []
    with modes.eval_mode(model):
        for start in range(0, len(images), 32):
            out = model(jnp.asarray(images[start:start + 32]), return_routing=True)
            parts.append(np.asarray(getattr(out, field)[0] if field in ("picks", "probs") else getattr(out, field)))
    return np.concatenate(parts)


def _routing_accuracy(model, sv, n=256):
    """:func:`mini_moe.evaluate.routing_accuracy` of the first MoE layer on ``n`` test images."""
    with jax.disable_jit():  # op by op, as _forward
        return evaluate.routing_accuracy(model, sv["images"][:n], sv["tasks"][:n], batch_size=32)[0]


# ------------------------------------------------------------------------------------ ORACLE


def test_the_oracle_key_is_the_sub_task_of_essentially_every_patch(sv):
    router = routers.make_router("raw_oracle", 49, 8, dataset=DATASET, rngs=nnx.Rngs(0))
    agreement = np.mean(_keys(router, sv["patches"]) == sv["tasks"])
    # 0 of the split's 160,000 patches differ (module docstring); the grey level's offset after
    # standardisation is about 0.1 against a margin of 0.6 or more. >= 0.999 allows 8 of these 8,000.
    assert agreement >= 0.999, agreement
    # the key reads the standardised pixels: the raw ones, centred on the grey level 0.5, give the same
    raw = np.asarray(patchify(data.subtask_vote("test", num_test=500, **OPTIONS).images, 7)) - 0.5
    assert np.mean(_keys(router, raw) == sv["tasks"]) >= 0.999


def test_a_model_with_the_oracle_routes_every_patch_home(sv):
    cfg = _cfg("raw_oracle", model_router_kwargs={"capacity_factor": 8.0})  # C = T: nothing dropped
    assert dict(cfg.model.router_kwargs)["dataset"] == DATASET  # the configuration passes its dataset
    model = train.make_model(cfg)
    accuracy = _routing_accuracy(model, sv)  # >= 0.999: at most 4 of these 4,096 patches elsewhere
    assert accuracy["routing_accuracy"] >= 0.999 and accuracy["unprocessed"] == 0, accuracy
    with modes.capacity(model, 1.0):  # C = T/E: about 0.91 home (the review's capacity bound)
        tight = _routing_accuracy(model, sv)["routing_accuracy"]
    assert 0.85 < tight < 0.95, tight


# ------------------------------------------------------------------------------------- BLIND


def test_blind_sends_copies_of_a_patch_to_one_expert_whatever_surrounds_them(sv):
    router = routers.make_router("raw_blind", 49, 8, rngs=nnx.Rngs(0))
    patches = sv["patches"].reshape(-1, 49)[:256]
    copies = np.concatenate([patches, patches[::-1]])  # each patch twice, at other positions, in one group
    keys = _keys(router, copies)
    assert np.array_equal(keys[:256], keys[256:][::-1])
    # a copy moved within its quantisation bin (default width 0.5) keeps its expert too
    bins = np.floor(patches / 0.5)
    nudged = (bins + np.random.default_rng(0).uniform(0.1, 0.9, patches.shape)) * 0.5
    assert np.array_equal(_keys(router, nudged), keys[:256])
    # ... and a different patch is a fresh draw: about 7/8 of patches moved by one bin change expert
    moved = patches.copy()
    moved[:, 0] += 0.5
    assert np.mean(_keys(router, moved) != keys[:256]) > 0.75


def test_blind_spreads_fresh_patches_evenly_and_routes_at_chance(sv):
    router = routers.make_router("raw_blind", 49, 8, rngs=nnx.Rngs(1))
    for patches in (sv["patches"].reshape(-1, 49),  # 8,000 subtask_vote patches, none recurring
                    np.random.default_rng(0).standard_normal((20_000, 49), np.float32)):
        n = len(patches)
        share = np.bincount(_keys(router, patches).ravel(), minlength=8) / n
        bound = 4.5 * np.sqrt(1 / 8 * 7 / 8 / n)  # 4.5 binomial SDs: p < 1e-4 for any of 8 experts
        assert np.all(np.abs(share - 1 / 8) < bound), (share, bound)
    home = np.mean(_keys(router, sv["patches"]) == sv["tasks"])
    assert abs(home - 1 / 8) < 4.5 * np.sqrt(1 / 8 * 7 / 8 / sv["tasks"].size), home
    model = train.make_model(_cfg("raw_blind", model_router_kwargs={"capacity_factor": 8.0}))
    accuracy = _routing_accuracy(model, sv)["routing_accuracy"]
    # matching sub-tasks to experts (Hungarian) lifts chance: 0.13 measured on 32,000 patches, here
    # 4,096 patches (cells of about 64 +- 8) give about 0.15
    assert 0.11 < accuracy < 0.19, accuracy


# --------------------------------------------------------------------------------------- LSH


def test_lsh_routes_each_patch_by_itself_unlike_the_group_centred_hash(sv):
    x = jax.random.normal(jax.random.key(0), (4, 64, 49))
    other = x.at[:, 1:].set(jax.random.normal(jax.random.key(1), (4, 63, 49)) + 3.0)  # new neighbours
    lsh = routers.make_router("raw_lsh", 49, 8, rngs=nnx.Rngs(0))
    assert lsh.affinity.per_token and not lsh.affinity.learned
    assert np.array_equal(_keys(lsh, x)[:, 0], _keys(lsh, other)[:, 0])
    hashed = routers.make_router("hash", 49, 8, rngs=nnx.Rngs(0))  # centred on its group: the test can fail
    assert not np.array_equal(_keys(hashed, x)[:, 0], _keys(hashed, other)[:, 0])
    # partly right on subtask_vote: above chance, far below the oracle (0.19 on the whole split)
    home = np.mean(_keys(lsh, sv["patches"]) == sv["tasks"])
    assert 0.1 < home < 0.6, home


# ------------------------------------------------------------------------------- unsteerable


def test_training_moves_a_learned_routing_but_never_a_raw_key(sv):
    """Real training steps (``train._step``, the step ``train.train`` runs) on a model whose four
    MoE layers route by the three raw keys and, as the contrast, by a learned softmax of the raw
    patch: one model, so one compiled step."""
    cfg = _cfg("raw_oracle", model_depth=4, model_placement="last4", steps=5, warmup_steps=0, learning_rate=1e-2)
    model = train.make_model(cfg)
    mlps = modes.moe_layers(model)
    mlps[1].router = routers.make_router("raw_blind", 49, 8, rngs=nnx.Rngs(1))
    mlps[2].router = routers.make_router("raw_lsh", 49, 8, rngs=nnx.Rngs(2))
    mlps[3].router = routers.Router(routers.Softmax(49, 8, rngs=nnx.Rngs(3)), routers.TokenChoice(1, 8.0))
    optimizer = train.make_optimizer(model, cfg)
    images = sv["images"][:64]

    def picks():
        with modes.eval_mode(model):
            return [np.concatenate([np.asarray(model(jnp.asarray(images[i:i + 32]), return_routing=True).picks[j])
                                    for i in (0, 32)]) for j in range(4)]

    before, embed = picks(), np.asarray(model.embed.kernel[...])
    for step in range(cfg.steps):
        train._step(model, optimizer, train.batch_at(sv["train"], cfg, step), cfg)
    after = picks()
    assert not np.array_equal(np.asarray(model.embed.kernel[...]), embed)  # the layers below trained
    for mlp, old, new in zip(mlps[:3], before, after):
        assert mlp.reads == "pixels" and not jax.tree.leaves(nnx.state(mlp.router, nnx.Param))  # nothing to learn
        assert np.array_equal(new, old)  # bit for bit
    assert not np.array_equal(after[3], before[3])  # the learned router's routing moved


# --------------------------------------------------------------------- every path of the layer


def test_every_path_and_mode_routes_by_the_raw_patch(sv):
    images = sv["images"][:32]
    model = train.make_model(_cfg("raw_oracle", model_router_kwargs={"capacity_factor": 8.0}))
    mlp = model.blocks[1].mlp
    assert mlp.reads == "pixels" and mlp.router.dim == 49  # p*p*C, not the width 16
    with modes.eval_mode(model):
        out = model(jnp.asarray(images), return_routing=True)
    assert np.array_equal(np.argmax(np.asarray(out.picks[0]), -1), sv["tasks"][:32])
    logits = np.asarray(out.logits)
    close = dict(rtol=1e-5, atol=1e-6)
    for path in ("einsum", "gather"):
        mlp.path = path
        np.testing.assert_allclose(_forward(model, images, "logits"), logits, **close)
    mlp.path = "auto"
    with modes.dropless_mode(model):  # the router called on the pixels, the picks sorted
        np.testing.assert_allclose(_forward(model, images, "logits"), logits, **close)
    with modes.eval_mode(model):  # the expert-parallel layer (all_to_all over one device)
        np.testing.assert_allclose(np.asarray(model(jnp.asarray(images), mesh=parallel.make_mesh(1, 1)).logits),
                                   logits, **close)
    with modes.per_image_groups(model):  # groups of one image: the same keys
        assert np.array_equal(_forward(model, images), np.asarray(out.picks[0]))
    assert modes.invariance(model)[0]  # per-token keys with C = T: nothing depends on the batch
    with modes.replay(model, out.routings, "full"):
        np.testing.assert_array_equal(_forward(model, images, "logits"), logits)
    with pytest.raises(InputError, match="patches"):  # the layer alone needs the raw patches
        mlp(jnp.zeros((4, 16, 16)))


def test_the_raw_routers_are_registered_as_fixed_token_choice_controls():
    for name in RAW:
        spec = routers.spec(name)
        assert (spec.allocation, spec.reads) == ("token", "pixels")
        assert spec.data == ("subtask_vote" if name == "raw_oracle" else None)  # built for any shape but the oracle
        assert spec.capacity_options(2.0, tokens=64, num_experts=8) == {"k": 2, "capacity_factor": 2.0}
        kwargs = {"dataset": DATASET} if name == "raw_oracle" else {}
        router = routers.make_router(name, 49, 8, k=2, rngs=nnx.Rngs(0), **kwargs)
        out = router(jnp.asarray(np.random.default_rng(0).standard_normal((2, 32, 49)), jnp.float32))
        gates = np.asarray(out.probs)
        assert set(np.unique(gates)) == {0.0, 0.5} and np.allclose(gates.sum(-1), 1.0)  # gates 1/k, not a softmax
        assert isinstance(router.affinity, routers.RawKey) and not jax.tree.leaves(nnx.state(router, nnx.Param))
    assert routers.spec("hash").reads == "representation"


# -------------------------------------------------------------------------------- bad input


def test_bad_input_names_the_argument():
    rngs = nnx.Rngs(0)
    with pytest.raises(InputError, match="num_experts must be 8"):
        routers.make_router("raw_oracle", 49, 4, dataset=DATASET, rngs=rngs)
    with pytest.raises(InputError, match="dataset"):
        routers.make_router("raw_oracle", 49, 8, dataset="patch_vote", rngs=rngs)
    with pytest.raises(InputError, match="dataset"):
        routers.make_router("raw_oracle", 49, 8, rngs=rngs)  # none named
    with pytest.raises(InputError, match="dim must be 49"):
        routers.make_router("raw_oracle", 16, 8, dataset=DATASET, rngs=rngs)
    with pytest.raises(InputError, match="key must be one of"):
        routers.RawKey(49, 8, key="oracl", rngs=rngs)
    with pytest.raises(InputError, match="bin_width"):
        routers.make_router("raw_blind", 49, 8, bin_width=0.0, rngs=rngs)
    with pytest.raises(InputError, match="dataset applies to key='oracle'"):
        routers.RawKey(49, 8, key="lsh", dataset=DATASET, rngs=rngs)
    with pytest.raises(InputError, match="reads must be one of"):
        routers.register("never_registered", allocation="token", reads="logits")
    with pytest.raises(InputError, match="dataset"):  # a configuration on other data: refused at build
        train.make_model(config_lib.get_config("quick", dataset="digits", router="raw_oracle", **TINY))


# ------------------------------------------------------------------- the steering test's pieces


def test_router_inputs_route_to_the_models_own_picks(sv):
    """:func:`mini_moe.evaluate.router_inputs` is what the MoE layer's router reads: routing it
    with the layer's router gives the picks of the model's own forward, patch for patch."""
    model = train.make_model(_cfg("softmax_token_choice", model_depth=1, model_placement="last1"))
    images = sv["images"][:64]
    with jax.disable_jit():
        [inputs] = evaluate.router_inputs(model, images, batch_size=32)
        own = evaluate._picked_expert([b for b in model.blocks if b.use_moe][0].mlp.router, inputs,
                                      model.cfg.group_images)
    assert inputs.shape == (64, 16, 16)
    np.testing.assert_array_equal(own, _forward(model, images).argmax(-1))


def test_fresh_routers_are_other_draws_and_the_own_router_is_measured_as_routing_accuracy(sv):
    """On an untrained trunk, the layer's own router and fresh draws of it are all projections of
    the same inputs: the own one's accuracy is the Hungarian-matched agreement of its picks with
    the sub-tasks (computed here by hand), and the fresh draws differ from it and from each other."""
    from scipy.optimize import linear_sum_assignment

    cfg = _cfg("softmax_token_choice", model_depth=1, model_placement="last1", model_router_kwargs={"frozen": True})
    model = train.make_model(cfg)
    images, tasks = sv["images"][:64], sv["tasks"][:64]
    with jax.disable_jit():
        got = evaluate.fresh_router_accuracy(model, images, tasks, draws=3)
        own = _forward(model, images).argmax(-1)
    counts = np.zeros((8, 8))
    np.add.at(counts, (tasks.ravel(), own.ravel()), 1)
    rows, cols = linear_sum_assignment(-counts)
    assert got["own"] == pytest.approx(counts[rows, cols].sum() / tasks.size)
    assert len(got["fresh"]) == 3 and len(set(got["fresh"]) | {got["own"]}) > 1, got
    with pytest.raises(ValueError, match="reads the raw patches"):
        evaluate.fresh_router_accuracy(train.make_model(_cfg("raw_blind", model_depth=1, model_placement="last1")),
                                       images, tasks)
