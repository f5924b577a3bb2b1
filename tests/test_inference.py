"""Routing at inference (issue 53): batch dependence, the batch-invariant modes, the filler
attack, ties and the router's precision."""

import dataclasses

import numpy as np
import pytest

from mini_moe import config as config_lib
from mini_moe import evaluate, explorer, inference, modes, stats, train
from mini_moe.validate import InputError

from live_head import live_head

SMALL = dict(model_dim=16, model_depth=2, model_heads=2, model_mlp_dim=16, model_num_experts=4, model_group_images=4)


@pytest.fixture(scope="module")
def digits():
    return train.load_data(config_lib.get_config("quick", dataset="digits"))


def _model(router, **kw):
    """A fresh model with a live head (a zero head predicts class 0 for every image)."""
    cfg = config_lib.get_config("quick", dataset="digits", router=router, **{**SMALL, **kw})
    return live_head(train.make_model(cfg), scale=2.0)


def _logits(model, images, order):
    """Logits of ``images`` routed in ``order``, indexed like ``images``."""
    out = np.empty((len(images), model.cfg.num_classes), np.float32)
    out[order] = evaluate._collect(model, images[order], "logits", 64)
    return out


def _block_shuffle(n, group, rng):
    """A within-group permutation written here, not with the library's helper: each block of
    ``group`` consecutive places shuffled in place."""
    return np.concatenate([start + rng.permutation(min(group, n - start)) for start in range(0, n, group)])


def _max_change(model, images, seed=0, orders=3):
    """The largest change of any logit over ``orders`` random regroupings and as many within-group
    permutations (blocks of the configured group)."""
    rng = np.random.default_rng(seed)
    reference = _logits(model, images, np.arange(len(images)))
    group = model.cfg.group_images
    shuffles = [f(len(images)) for _ in range(orders)
                for f in (rng.permutation, lambda n: _block_shuffle(n, group, rng))]
    return max(float(np.abs(_logits(model, images, o) - reference).max()) for o in shuffles)


# A capacity small enough that groups of 4 images drop tokens.
CAPACITY_ROUTERS = [("softmax_token_choice", {"capacity_factor": 0.5}), ("softmax_expert_choice", {"capacity_factor": 0.5}),
                    ("softmax_token_choice", {"capacity_factor": 0.5, "batch_priority": True}),
                    ("sinkhorn_token_choice", {"capacity_factor": 4.0})]


@pytest.mark.parametrize("router, kwargs", CAPACITY_ROUTERS)
def test_the_default_modes_depend_on_the_batch_and_per_image_groups_do_not(router, kwargs, digits):
    images = digits[1].images[:32]
    model = _model(router, model_router_kwargs=kwargs)
    assert not modes.invariance(model)[0]
    assert _max_change(model, images) > 1e-3  # another group, another output
    with modes.batch_invariant(model, "per_image"):
        assert modes.invariance(model)[0]
        assert _max_change(model, images) < 1e-5  # float round-off at most
        assert modes.group_images(model) == 1
    assert modes.group_images(model) == 4  # restored
    assert not modes.invariance(model)[0]


@pytest.mark.parametrize("router, kwargs", [("softmax_token_choice", {"capacity_factor": 0.5, "k": 2}),
                                            ("sigmoid_loss_free", {"capacity_factor": 0.5})])
def test_dropless_evaluation_is_batch_invariant_over_a_per_token_affinity(router, kwargs, digits):
    images = digits[1].images[:32]
    model = _model(router, model_router_kwargs=kwargs)
    assert _max_change(model, images) > 1e-3
    with modes.batch_invariant(model, "dropless"):
        assert modes.invariance(model)[0]
        assert _max_change(model, images) < 1e-5


def test_dropless_is_refused_where_it_would_stay_batch_dependent(digits):
    # Sinkhorn balances its plan over the group: dropless or not, the group decides the routing
    model = _model("sinkhorn_token_choice", model_router_kwargs={"capacity_factor": 4.0})
    with pytest.raises(InputError, match="per_image"):
        with modes.batch_invariant(model, "dropless"):
            pass
    assert model.blocks[1].mlp.path != "dropless"  # restored after the refusal
    with pytest.raises(InputError, match="mode must be one of"):
        with modes.batch_invariant(model, "sorted"):
            pass
    # ReMoE's opt-in pick bound is decided over the whole call; its default (no bound) keeps every pick
    remoe = _model("remoe", model_moe_path="dropless", model_router_kwargs={"active_bound": 2.0})
    ok, why = modes.invariance(remoe)
    assert not ok and "pick bound" in why
    assert modes.invariance(_model("remoe", model_moe_path="dropless"))[0]


def test_soft_moe_is_batch_invariant_as_trained(digits):
    model = _model("soft_moe")
    assert modes.invariance(model) == (True, "every MoE layer routes each image (or each token) on its own")
    dependence = evaluate.batch_dependence(model, digits[1].images[:40], regroupings=2)
    assert dependence["regroup"]["mean"] == dependence["permute"]["mean"] == 0.0
    assert _max_change(model, digits[1].images[:32]) < 1e-5


def test_batch_dependence_counts_changed_predictions_against_an_independent_computation(digits):
    images = digits[1].images[:48]
    model = _model("softmax_token_choice", model_router_kwargs={"capacity_factor": 0.5})
    got = evaluate.batch_dependence(model, images, regroupings=3, seed=7)
    rng = np.random.default_rng(7)
    reference = _logits(model, images, np.arange(48)).argmax(-1)
    regroup = [np.mean(_logits(model, images, rng.permutation(48)).argmax(-1) != reference) for _ in range(3)]
    permute = [np.mean(_logits(model, images, _block_shuffle(48, 4, rng)).argmax(-1) != reference)
               for _ in range(3)]
    assert got["regroup"]["shares"] == pytest.approx(regroup)
    assert got["permute"]["shares"] == pytest.approx(permute)
    assert got["regroup"]["mean"] > 0  # a live head and dropped tokens change some predictions
    low, mean, high = (got["regroup"][k] for k in ("low", "mean", "high"))
    assert low <= mean <= high
    # the t interval of three shares, by hand
    half = 4.302652729911275 * np.std(regroup, ddof=1) / np.sqrt(3)  # t(0.975, 2)
    assert high == pytest.approx(min(1.0, np.mean(regroup) + half))
    # the bootstrap over images: each image's share of changed draws, resampled
    changed = np.mean([_logits(model, images, o).argmax(-1) != reference
                       for o in [np.random.default_rng(7).permutation(48)]], 0)
    one = evaluate.batch_dependence(model, images, regroupings=1, permutations=0, seed=7)
    assert one["regroup"]["mean"] == pytest.approx(changed.mean()) and one["regroup"]["low"] is None
    assert one["regroup"]["image_low"] == pytest.approx(stats.bootstrap_mean(changed, seed=7)[0])
    assert one["permute"] is None
    with pytest.raises(InputError, match="regroupings"):
        evaluate.batch_dependence(model, images, regroupings=0)


def test_within_group_permutation_keeps_the_groups_and_moves_images():
    order = evaluate.within_group_permutation(10, 4, np.random.default_rng(0))
    assert sorted(order) == list(range(10))
    for start in (0, 4, 8):
        assert sorted(order[start:start + 4]) == list(range(start, min(start + 4, 10)))
    orders = [evaluate.within_group_permutation(64, 8, np.random.default_rng(s)) for s in range(3)]
    assert all(np.mean(o != np.arange(64)) > 0.5 for o in orders)  # most images move (an identity moves none)


def test_capacity_sweep_drops_nothing_at_a_capacity_of_every_token(digits):
    model = _model("softmax_token_choice", model_router_kwargs={"capacity_factor": 1.0})
    test = digits[1]
    small = dataclasses.replace(test, images=test.images[:64], labels=test.labels[:64])
    rows = inference.capacity_sweep(model, small, [0.25, 4.0], regroupings=2)
    assert [r["capacity_factor"] for r in rows] == [0.25, 4.0]
    # k = 1 and C = round(4 T / E) >= T: every token finds room, and nothing depends on the group
    assert rows[1]["unprocessed"] == [0.0] and rows[1]["dropped_routes"] == [0.0]
    assert rows[1]["batch_dependence"]["mean"] == 0.0
    with modes.capacity(model, 4.0):
        assert modes.invariance(model)[0]  # C = round(4 T / 4) = T slots: nothing can be refused
    with modes.capacity(model, 2.0):
        assert not modes.invariance(model)[0]  # C = T / 2: a popular expert refuses picks
    assert rows[0]["unprocessed"][0] > 0.5  # a quarter of the tokens fit at most
    for row in rows:
        with modes.capacity(model, row["capacity_factor"]):
            assert row["accuracy"] == pytest.approx(float(np.mean(evaluate.predictions(model, small.images) == small.labels)))
    assert modes.trained_capacity(model) == 1.0  # restored
    soft = inference.capacity_sweep(_model("soft_moe"), small, [0.5, 1.0], regroupings=2)
    assert [r["capacity_factor"] for r in soft] == [None]


def test_choose_fillers_prefers_the_images_that_want_the_victims_experts():
    victim = np.array([[0.9, 0.1, 0.0], [0.8, 0.2, 0.0], [0.1, 0.9, 0.0], [0.7, 0.3, 0.0]])  # top-1: 0, 0, 1, 0
    pool = np.stack([np.full((4, 3), [0.0, 0.0, 1.0]),   # wants expert 2 only: score 0
                     np.full((4, 3), [1.0, 0.0, 0.0]),   # expert 0: 4 x 0.75 = 3
                     np.full((4, 3), [0.0, 1.0, 0.0]),   # expert 1: 4 x 0.25 = 1
                     np.full((4, 3), [0.5, 0.5, 0.0])])  # 4 x 0.5 = 2
    assert inference.choose_fillers(victim, pool, 3).tolist() == [1, 3, 2]


def test_wilson_interval_known_values():
    # Wilson (1927) score interval, z = 1.96: 5 of 10 -> [0.2366, 0.7634]; 0 of 20 -> [0, 0.1611]
    assert stats.wilson(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-4)
    assert stats.wilson(0, 20) == pytest.approx((0.0, 0.16113), abs=1e-4)
    # exactly 0 (1) at zero (full) counts, so a fully mitigated attack's interval starts at its rate
    assert stats.wilson(0, 24)[0] == 0.0 and stats.wilson(24, 24)[1] == 1.0
    assert stats.wilson(0, 300)[0] == 0.0


def test_the_filler_attack_takes_the_victims_slots_and_per_image_groups_stop_it(digits):
    model = _model("softmax_token_choice", model_router_kwargs={"capacity_factor": 1.0, "noise_std": 0.0})
    kernel = modes.moe_layers(model)[0].router.affinity.dense.kernel
    kernel[...] = kernel[...] * 20  # a confident router, as trained ones are: what a patch wants, it picks
    victims, pool = digits[1].images[:24], digits[1].images[24:120]
    # the mechanism, in the first MoE layer: the victim, last in the attacker's group, keeps fewer
    # of its patches than at a random place among random images
    g = modes.group_images(model)
    vp, pp = inference._router_probs(model, victims)[0], inference._router_probs(model, pool)[0]
    rng = np.random.default_rng(0)
    kept = {"attacked": [], "benign": []}
    for v in range(len(victims)):
        for kind, members, place in (("attacked", inference.choose_fillers(vp[v], pp, g - 1), g - 1),
                                     ("benign", rng.choice(len(pool), g - 1, replace=False), int(rng.integers(g)))):
            group = list(pool[members])
            group.insert(place, victims[v])
            _, layers = evaluate.routing_record(model, np.stack(group), batch_size=g)
            kept[kind].append(layers[0]["hits"][place].any(-1).mean())
    assert np.mean(kept["attacked"]) < np.mean(kept["benign"]) - 0.1
    result = inference.filler_attack(model, victims, pool)
    assert 0 <= result["flip_interval"][0] <= result["flip_rate"] <= result["flip_interval"][1] <= 1
    for rate, interval in (("flip_rate", "flip_interval"), ("control_rate", "control_interval"),
                           ("benign_change", "benign_interval")):  # each interval is its own share's
        assert result[interval] == stats.wilson(round(result[rate] * result["victims"]), result["victims"])
    assert result["victims"] == 24 and result["group_images"] == g
    # the library's own record of the mechanism: the chosen fillers take more of the victim's slots
    # than random fillers with the victim in the same (last) place, which take more than a random place
    dropped = result["victim_dropped"]
    assert dropped["attacked"] > dropped["control"] + 0.05 and dropped["control"] > dropped["benign"]
    preds = result["predictions"]
    flips = np.array(preds["attacked"]) != preds["benign"]
    control = np.array(preds["control"]) != preds["benign"]
    assert result["control_rate"] == control.mean()
    assert result["excess"]["mean"] == pytest.approx(flips.mean() - control.mean())
    assert result["excess"]["low"] <= result["excess"]["mean"] <= result["excess"]["high"]
    twice = inference.filler_attack(model, victims, pool, run_twice=True)
    for key in ("flagged_attacked", "flagged_benign"):
        assert twice[key] == np.mean(np.array(twice["predictions"][key.split("_")[1]])
                                     != twice["predictions"][key.split("_")[1] + "_twice"])
    guarded = inference.filler_attack(model, victims, pool, mitigation="per_image")
    assert guarded["flip_rate"] == guarded["benign_change"] == 0.0 and guarded["group_images"] == 1
    assert inference.filler_attack(model, victims, pool, mitigation="bpr")["mitigation"] == "bpr"
    assert model.blocks[1].mlp.router.allocation.batch_priority is False  # restored
    with pytest.raises(InputError, match="mitigation must be one of"):
        inference.filler_attack(model, victims, pool, mitigation="pray")
    with pytest.raises(InputError, match="Token Choice"):
        inference.filler_attack(_model("softmax_expert_choice"), victims, pool, mitigation="bpr")


@pytest.mark.parametrize("router", ["softmax_token_choice", "softmax_expert_choice"])
def test_identical_patches_meet_different_fates_by_position_only(router, digits):
    """Equal scores: Token Choice serves the earlier token first; Expert Choice's top_k takes the
    lower index first. So a patch of the later copy is never kept where the earlier copy's is not."""
    model = _model(router, model_router_kwargs={"capacity_factor": 0.5, **({"noise_std": 0.0} if "token" in router else {})})
    images = digits[1].images
    fates = inference.twin_fates(model, images[0], images[1:3])
    first, second = fates[0]["first"], fates[0]["second"]
    assert not np.any(second & ~first)
    assert fates[0]["differ"] == pytest.approx(np.mean(first != second)) and fates[0]["differ"] > 0
    with pytest.raises(InputError, match="different positions"):
        inference.twin_fates(model, images[0], images[1:3], first=1, second=1)


def _router_inputs(model, images):
    """Each MoE layer's router input ``[N, P, D]`` in eval mode, recorded from an eager forward pass."""
    seen = []

    class Recorder:
        def __init__(self, router):
            self.router = router

        def __getattr__(self, name):
            return getattr(self.router, name)

        def __call__(self, x, **kwargs):
            seen.append(np.asarray(x))
            return self.router(x, **kwargs)

    mlps = modes.moe_layers(model)
    with modes._swapped([(m, "router", Recorder(m.router)) for m in mlps], raw=True), modes.eval_mode(model):
        model(np.asarray(images))
    return [x.reshape(len(images), model.cfg.num_patches, -1) for x in seen]


def _bf16(x):
    import jax.numpy as jnp

    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


def test_precision_mismatch_equals_a_direct_bfloat16_computation(digits):
    """Near-tied routers (every expert's column close to one shared column): bfloat16 logits change
    some top-1 picks. Each layer's ``isolated`` share equals a direct computation from that
    layer's float32 input (input and kernel rounded to bfloat16, the exact products summed, the
    sum rounded once), and in the second layer it differs from ``cascade``, whose input the first
    layer's changed picks moved: a bfloat16 mode that rounded every router for ``isolated`` fails."""
    model = _model("softmax_token_choice", model_depth=4, model_router_kwargs={"k": 1, "noise_std": 0.0})
    for mlp in modes.moe_layers(model):
        kernel = mlp.router.affinity.dense.kernel
        kernel[...] = kernel[...][:, :1] + 0.03 * kernel[...]  # logits within a few bfloat16 steps of each other
    images = digits[1].images[:128]
    same = inference.precision_mismatch(model, images, dtype="float32")
    assert all(r == {"isolated": 0.0, "cascade": 0.0} for r in same)
    rows = inference.precision_mismatch(model, images)
    inputs = _router_inputs(model, images)
    for row, x, mlp in zip(rows, inputs, modes.moe_layers(model)):
        w = np.asarray(mlp.router.affinity.dense.kernel[...], np.float32)
        exact = x @ w
        rounded = _bf16(_bf16(x).astype(np.float64) @ _bf16(w).astype(np.float64))
        expected = np.mean(exact.argmax(-1) != rounded.argmax(-1))
        assert row["isolated"] == pytest.approx(expected, abs=1 / x[..., 0].size)  # one patch of slack
    assert rows[0]["isolated"] > 0 and rows[0]["isolated"] == rows[0]["cascade"]  # nothing below layer 1 changes
    assert abs(rows[1]["cascade"] - rows[1]["isolated"]) > 1 / inputs[1][..., 0].size
    assert type(model.blocks[1].mlp.router.affinity.dense).__name__ == "Linear"  # restored
    assert set(inference.precision_mismatch(_model("soft_moe"), images)) == {None}


BIASED = [("sigmoid_loss_free", {"k": 2, "capacity_factor": 4.0}), ("top_p", {"capacity_factor": 4.0}),
          ("longcat", {"capacity_factor": 4.0}), ("remoe", {"capacity_factor": 4.0})]


@pytest.mark.parametrize("router, kwargs", BIASED)
def test_the_sets_compared_are_the_picks_the_router_made(router, kwargs, digits):
    """With buffers that refuse nothing (C >= T), the experts that process a patch are exactly the
    real picks its router made, so the sets :func:`precision_mismatch` compares must equal the
    dispatch tensor's, also with a balancing bias of trained size (std 0.05) and for top-p."""
    extra = {"model_null_experts": ("zero", "zero")} if router == "longcat" else {}
    model = _model(router, model_router_kwargs=kwargs, **extra)
    rng = np.random.default_rng(0)
    for mlp in modes.moe_layers(model):
        bias = getattr(mlp.router.affinity, "bias", None)
        if bias is not None:
            bias[...] = np.asarray(rng.normal(0, 0.05, bias[...].shape), np.float32)
    images = digits[1].images[:32]
    real = model.cfg.routed_experts
    sets = inference._chosen_sets(model, images, 32)
    _, layers = evaluate.routing_record(model, images, batch_size=32)
    for chosen, layer in zip(sets, layers):
        np.testing.assert_array_equal(chosen[..., :real], layer["hits"])
        np.testing.assert_array_equal(layer["picks"], layer["hits"].sum(-1))


def test_a_recorded_routing_replays_bit_for_bit_and_is_what_the_layers_use(digits):
    model = _model("softmax_token_choice", model_depth=4,
                   model_router_kwargs={"capacity_factor": 0.5, "noise_std": 0.0, "k": 2})
    images = digits[1].images[:16]
    recorded = inference.record_routing(model, images)
    reference = inference.replay_routing(model, images, None)
    for variant in ("selection", "full"):  # same ops, same bits
        assert np.array_equal(inference.replay_routing(model, images, recorded, variant=variant), reference)
    with modes.router_dtype(model, "bfloat16"):
        live = inference.replay_routing(model, images, None)
        full = inference.replay_routing(model, images, recorded, variant="full")
        selection = inference.replay_routing(model, images, recorded)
    assert np.array_equal(full, reference)  # the recorded gates: the live router changes nothing
    # the selection replayed, the gates recomputed by the bfloat16 router: close, not bit-equal
    assert 0 < np.abs(selection - reference).max() <= np.abs(live - reference).max()
    # the layers compute with the replayed tensors: another group's routing gives other logits
    other = inference.record_routing(model, digits[1].images[16:32])
    assert np.abs(inference.replay_routing(model, images, other) - reference).max() > 1e-3
    assert type(model.blocks[1].mlp.router).__name__ == "Router"  # restored
    with pytest.raises(InputError, match="one routing per MoE layer"):
        inference.replay_routing(model, images, recorded + recorded)
    dropless = _model("softmax_token_choice", model_moe_path="dropless")
    with pytest.raises(InputError, match="dropless"):
        inference.record_routing(dropless, images)


def test_attack_group_puts_the_chosen_fillers_around_the_victim(digits):
    model = _model("softmax_token_choice", model_router_kwargs={"capacity_factor": 1.0, "noise_std": 0.0})
    victim, pool = digits[1].images[0], digits[1].images[24:120]
    group, position = inference.attack_group(model, victim, pool)
    assert position == 3 and group.shape == (4,) + victim.shape
    np.testing.assert_array_equal(group[position], victim)
    fillers = inference.choose_fillers(inference._router_probs(model, victim[None])[0][0],
                                       inference._router_probs(model, pool)[0], 3)
    np.testing.assert_array_equal(group[:3], pool[fillers])
    view = explorer.routing_view(model, group, image=position)
    side = model.cfg.image_size // model.cfg.patch_size
    assert view["expert"].shape == (side, side) and view["load"].shape == (4,)


def _token_router_models():
    """Every registered Token Choice router on the dropless path, as a tiny model."""
    from mini_moe import routers

    out = []
    for name, spec in sorted(routers.ROUTERS.items()):
        if spec.allocation != "token" or spec.data is not None:  # raw_oracle: subtask_vote only
            continue
        extra = {"model_null_experts": ("zero", "identity")} if name in ("adamoe", "longcat") else {}
        out.append(pytest.param(name, extra, id=name))
    return out


@pytest.mark.parametrize("router, extra", _token_router_models())
def test_the_dropless_verdict_comes_from_the_affinity_and_matches_a_measured_regrouping(router, extra, digits):
    """For every registered Token Choice router, ``invariance`` on the dropless path says what the
    affinity declares (``per_token``), and a measured regrouping agrees: no logit moves beyond
    float round-off where it says invariant, some logit moves where it says not. (Top-p scores
    each token alone, so it is invariant; the list of class names it once depended on left it out.)"""
    model = _model(router, model_moe_path="dropless", **extra)
    invariant, why = modes.invariance(model)
    assert invariant == modes.moe_layers(model)[0].router.affinity.per_token, why
    change = _max_change(model, digits[1].images[:32])
    assert change < 1e-5 if invariant else change > 1e-4


def test_the_capacity_rule_is_c_at_least_e_whatever_k(digits):
    """C = round(c T / E) slots per expert: no pick can be refused exactly when C >= T, that is
    c >= E, also for k = 2 (c = E / k leaves T / k slots: a popular expert refuses picks)."""
    model = _model("softmax_token_choice", model_router_kwargs={"k": 2, "capacity_factor": 2.0, "noise_std": 0.0})
    images = digits[1].images[:32]
    experts = model.cfg.routed_experts
    with modes.capacity(model, experts / 2):  # c = E / k
        assert not modes.invariance(model)[0]
        assert _max_change(model, images) > 1e-4
    with modes.capacity(model, experts):  # c = E
        assert modes.invariance(model)[0]
        assert _max_change(model, images) < 1e-5


def test_per_image_groups_switch_every_moe_layer(digits):
    """Two MoE layers: the per-image mode changes both (a mode applied to the first alone would
    leave the second batch-dependent), with several orders."""
    model = _model("softmax_token_choice", model_depth=4, model_router_kwargs={"capacity_factor": 0.5})
    assert len(modes.moe_layers(model)) == 2
    images = digits[1].images[:32]
    assert _max_change(model, images) > 1e-3
    with modes.batch_invariant(model, "per_image"):
        assert [m.group_images for m in modes.moe_layers(model)] == [1, 1]
        assert _max_change(model, images, orders=4) < 1e-5
    assert [m.group_images for m in modes.moe_layers(model)] == [4, 4]


def test_the_explorer_draws_what_the_model_routes_inside_a_mode(digits):
    """One source for the group size: inside the per-image mode the explorer routes one image per
    group, as the model does (it once read the configuration's 4 and crashed)."""
    model = _model("softmax_token_choice", model_router_kwargs={"capacity_factor": 1.0, "noise_std": 0.0})
    images = digits[1].images[:8]
    with modes.batch_invariant(model, "per_image"):
        view = explorer.routing_view(model, images, image=5)
        alone = explorer.routing_view(model, images[5:6], image=0)
    assert np.array_equal(view["expert"], alone["expert"]) and view["load"].sum() == alone["load"].sum()
    assert view["load"].sum() <= model.cfg.num_patches  # one image's patches, k = 1


def test_mechanisms_and_diagnose_measure_batch_dependence_as_evaluate_does(digits):
    from mini_moe import diagnose

    model = _model("softmax_token_choice", model_router_kwargs={"capacity_factor": 0.5})
    images = digits[1].images[:64]
    one = evaluate.batch_dependence(model, images, regroupings=1, permutations=0, seed=3)["regroup"]["mean"]
    assert one > 0
    assert evaluate.mechanisms(model, images, seed=3, stability_images=16)["batch_dependence"] == one
    assert diagnose.diagnose(model, images, seed=3)["batch_dependence"] == one


def test_no_module_reaches_into_evaluate_or_decides_by_router_class():
    """The evaluation pass has one public door (``forward_batches``), and what a router did or is
    comes from the router's declarations, not from its class."""
    import pathlib
    import re

    root = pathlib.Path(evaluate.__file__).parent
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if path.name != "evaluate.py":
            assert not re.search(r"evaluate\._(?!_)", text), f"{path.name} uses a private name of evaluate"
        if path.name in ("inference.py", "diagnose.py", "evaluate.py", "explorer.py", "modes.py"):
            assert not re.search(r"isinstance\([^)]*routers(_lib)?\.|__name__ ==", text), path.name


def test_selection_replay_lets_gradients_reach_the_router_and_full_replay_does_not(digits):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    model = _model("softmax_token_choice", model_router_kwargs={"capacity_factor": 1.0, "noise_std": 0.0})
    images = jnp.asarray(digits[1].images[:8])
    recorded = inference.record_routing(model, images)

    def kernel_grad(variant):
        def loss(m):
            with modes.replay(m, recorded, variant), modes.eval_mode(m):
                return jnp.sum(m(images).logits ** 2)

        grads = nnx.grad(loss)(model)
        leaves = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]
                  if "router" in jax.tree_util.keystr(path)]
        assert leaves  # the router's kernel is a parameter of the model
        return np.concatenate([np.ravel(leaf) for leaf in leaves])

    assert np.abs(kernel_grad("selection")).max() > 0
    assert np.abs(kernel_grad("full")).max() == 0


def test_fixed_shape_serving_is_bit_identical_across_batch_sizes(digits):
    """Per-image groups make a prediction depend on its image alone in exact arithmetic, but the
    serving batch's shape still changes the last bits; padding every batch to one shape removes
    that, here at batch sizes 1, 8 and 64."""
    model = _model("softmax_token_choice", model_router_kwargs={"capacity_factor": 1.0, "noise_std": 0.0})
    images = digits[1].images[:64]
    with modes.batch_invariant(model, "per_image"):
        rows = inference.serving_difference(model, images, (1, 8, 64), reference=64, fixed_batch=64)
        free = inference.serving_difference(model, images, (1, 8), reference=64)
    assert [r["max_logit_difference"] for r in rows] == [0.0, 0.0, 0.0]
    assert all(r["changed_predictions"] == 0 and r["changed_picks"] == [0.0] for r in rows)
    assert all(r["max_logit_difference"] < 1e-4 for r in free)  # round-off at most, whatever the size


@pytest.mark.parametrize("old, new", [
    ("mini_moe.evaluate:eval_mode", "mini_moe.modes:eval_mode"),
    ("mini_moe.evaluate:dropless_mode", "mini_moe.modes:dropless_mode"),
    ("mini_moe.explorer:capacity", "mini_moe.modes:capacity"),
    ("mini_moe.explorer:trained_capacity", "mini_moe.modes:trained_capacity"),
    ("mini_moe.inference:batch_dependence", "mini_moe.evaluate:batch_dependence"),
    ("mini_moe.inference:invariance", "mini_moe.modes:invariance"),
    ("mini_moe.inference:batch_invariant", "mini_moe.modes:batch_invariant"),
    ("mini_moe.inference:router_dtype", "mini_moe.modes:router_dtype"),
    ("mini_moe.inference:group_size", "mini_moe.modes:group_images"),
])
def test_a_moved_name_still_works_for_one_release_with_a_warning(old, new):
    import importlib

    (old_module, old_name), (new_module, new_name) = (x.split(":") for x in (old, new))
    with pytest.warns(DeprecationWarning, match=f"{old_name} moved to {new_module}.{new_name}"):
        value = getattr(importlib.import_module(old_module), old_name)
    assert value is getattr(importlib.import_module(new_module), new_name)
    with pytest.raises(AttributeError):
        importlib.import_module(old_module).no_such_name
