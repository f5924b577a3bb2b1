"""Routing at inference (issue 53): batch dependence, the batch-invariant modes, the filler
attack, ties and the router's precision."""

import dataclasses

import numpy as np
import pytest

from mini_moe import config as config_lib
from mini_moe import evaluate, explorer, inference, train
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


def _max_change(model, images, seed=0):
    """The largest change of any logit under a random regrouping and under a within-group permutation."""
    rng = np.random.default_rng(seed)
    reference = _logits(model, images, np.arange(len(images)))
    orders = [rng.permutation(len(images)), inference.within_group_permutation(len(images), 4, rng)]
    return max(float(np.abs(_logits(model, images, o) - reference).max()) for o in orders)


# A capacity small enough that groups of 4 images drop tokens.
CAPACITY_ROUTERS = [("softmax_token_choice", {"capacity_factor": 0.5}), ("softmax_expert_choice", {"capacity_factor": 0.5}),
                    ("softmax_token_choice", {"capacity_factor": 0.5, "batch_priority": True}),
                    ("sinkhorn_token_choice", {"capacity_factor": 4.0})]


@pytest.mark.parametrize("router, kwargs", CAPACITY_ROUTERS)
def test_the_default_modes_depend_on_the_batch_and_per_image_groups_do_not(router, kwargs, digits):
    images = digits[1].images[:32]
    model = _model(router, model_router_kwargs=kwargs)
    assert not inference.invariance(model)[0]
    assert _max_change(model, images) > 1e-3  # another group, another output
    with inference.batch_invariant(model, "per_image"):
        assert inference.invariance(model)[0]
        assert _max_change(model, images) < 1e-5  # float round-off at most
        assert inference.group_size(model) == 1
    assert inference.group_size(model) == 4  # restored
    assert not inference.invariance(model)[0]


@pytest.mark.parametrize("router, kwargs", [("softmax_token_choice", {"capacity_factor": 0.5, "k": 2}),
                                            ("sigmoid_loss_free", {"capacity_factor": 0.5})])
def test_dropless_evaluation_is_batch_invariant_over_a_per_token_affinity(router, kwargs, digits):
    images = digits[1].images[:32]
    model = _model(router, model_router_kwargs=kwargs)
    assert _max_change(model, images) > 1e-3
    with inference.batch_invariant(model, "dropless"):
        assert inference.invariance(model)[0]
        assert _max_change(model, images) < 1e-5


def test_dropless_is_refused_where_it_would_stay_batch_dependent(digits):
    # Sinkhorn balances its plan over the group: dropless or not, the group decides the routing
    model = _model("sinkhorn_token_choice", model_router_kwargs={"capacity_factor": 4.0})
    with pytest.raises(InputError, match="per_image"):
        with inference.batch_invariant(model, "dropless"):
            pass
    assert model.blocks[1].mlp.path != "dropless"  # restored after the refusal
    with pytest.raises(InputError, match="mode must be one of"):
        with inference.batch_invariant(model, "sorted"):
            pass
    # ReMoE's opt-in pick bound is decided over the whole call; its default (no bound) keeps every pick
    remoe = _model("remoe", model_moe_path="dropless", model_router_kwargs={"active_bound": 2.0})
    ok, why = inference.invariance(remoe)
    assert not ok and "pick bound" in why
    assert inference.invariance(_model("remoe", model_moe_path="dropless"))[0]


def test_soft_moe_is_batch_invariant_as_trained(digits):
    model = _model("soft_moe")
    assert inference.invariance(model) == (True, "every MoE layer routes each image (or each token) on its own")
    dependence = inference.batch_dependence(model, digits[1].images[:40], regroupings=2)
    assert dependence["regroup"]["mean"] == dependence["permute"]["mean"] == 0.0
    assert _max_change(model, digits[1].images[:32]) < 1e-5


def test_batch_dependence_counts_changed_predictions_against_an_independent_computation(digits):
    images = digits[1].images[:48]
    model = _model("softmax_token_choice", model_router_kwargs={"capacity_factor": 0.5})
    got = inference.batch_dependence(model, images, regroupings=3, seed=7)
    rng = np.random.default_rng(7)
    reference = _logits(model, images, np.arange(48)).argmax(-1)
    regroup = [np.mean(_logits(model, images, rng.permutation(48)).argmax(-1) != reference) for _ in range(3)]
    permute = [np.mean(_logits(model, images, inference.within_group_permutation(48, 4, rng)).argmax(-1) != reference)
               for _ in range(3)]
    assert got["regroup"]["shares"] == pytest.approx(regroup)
    assert got["permute"]["shares"] == pytest.approx(permute)
    assert got["regroup"]["mean"] > 0  # a live head and dropped tokens change some predictions
    low, mean, high = (got["regroup"][k] for k in ("low", "mean", "high"))
    assert low <= mean <= high
    # the t interval of three shares, by hand
    half = 4.302652729911275 * np.std(regroup, ddof=1) / np.sqrt(3)  # t(0.975, 2)
    assert high == pytest.approx(min(1.0, np.mean(regroup) + half))
    with pytest.raises(InputError, match="regroupings"):
        inference.batch_dependence(model, images, regroupings=1)


def test_within_group_permutation_keeps_the_groups():
    order = inference.within_group_permutation(10, 4, np.random.default_rng(0))
    assert sorted(order) == list(range(10))
    for start in (0, 4, 8):
        assert sorted(order[start:start + 4]) == list(range(start, min(start + 4, 10)))


def test_capacity_sweep_drops_nothing_at_a_capacity_of_every_token(digits):
    model = _model("softmax_token_choice", model_router_kwargs={"capacity_factor": 1.0})
    test = digits[1]
    small = dataclasses.replace(test, images=test.images[:64], labels=test.labels[:64])
    rows = inference.capacity_sweep(model, small, [0.25, 4.0], regroupings=2)
    assert [r["capacity_factor"] for r in rows] == [0.25, 4.0]
    # k = 1 and C = round(4 T / E) >= T: every token finds room, and nothing depends on the group
    assert rows[1]["unprocessed"] == [0.0] and rows[1]["dropped_routes"] == [0.0]
    assert rows[1]["batch_dependence"]["mean"] == 0.0
    with explorer.capacity(model, 4.0):
        assert inference.invariance(model)[0]  # C = round(4 T / 4) = T slots: nothing can be refused
    with explorer.capacity(model, 2.0):
        assert not inference.invariance(model)[0]  # C = T / 2: a popular expert refuses picks
    assert rows[0]["unprocessed"][0] > 0.5  # a quarter of the tokens fit at most
    for row in rows:
        with explorer.capacity(model, row["capacity_factor"]):
            assert row["accuracy"] == pytest.approx(float(np.mean(inference.predictions(model, small.images) == small.labels)))
    assert explorer.trained_capacity(model) == 1.0  # restored
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
    assert inference._wilson(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-4)
    assert inference._wilson(0, 20) == pytest.approx((0.0, 0.16113), abs=1e-4)


def test_the_filler_attack_takes_the_victims_slots_and_per_image_groups_stop_it(digits):
    model = _model("softmax_token_choice", model_router_kwargs={"capacity_factor": 1.0, "noise_std": 0.0})
    victims, pool = digits[1].images[:24], digits[1].images[24:120]
    # the mechanism, in the first MoE layer: the victim, last in the attacker's group, keeps fewer
    # of its patches than at a random place among random images
    g = inference.group_size(model)
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
    assert result["victims"] == 24 and result["group_images"] == g
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


def test_precision_mismatch_isolated_equals_cascade_in_the_first_layer(digits):
    model = _model("softmax_token_choice", model_depth=4, model_router_kwargs={"k": 2})
    images = digits[1].images[:64]
    same = inference.precision_mismatch(model, images, dtype="float32")
    assert all(r == {"isolated": 0.0, "cascade": 0.0} for r in same)
    rows = inference.precision_mismatch(model, images)
    assert len(rows) == 2
    # nothing below the first MoE layer changes, so its two measures are the same computation
    assert rows[0]["isolated"] == rows[0]["cascade"]
    assert all(0.0 <= r[m] <= 1.0 for r in rows for m in r)
    assert type(model.blocks[1].mlp.router.affinity.dense).__name__ == "Linear"  # restored
    assert set(inference.precision_mismatch(_model("soft_moe"), images)) == {None}


def test_a_recorded_routing_replays_bit_for_bit_and_is_what_the_layers_use(digits):
    model = _model("softmax_token_choice", model_router_kwargs={"capacity_factor": 0.5, "noise_std": 0.0})
    images = digits[1].images[:16]
    recorded = inference.record_routing(model, images)
    reference = inference.replay_routing(model, images, None)
    assert np.array_equal(inference.replay_routing(model, images, recorded), reference)  # same ops, same bits
    with inference.router_dtype(model, "bfloat16"):
        assert np.array_equal(inference.replay_routing(model, images, recorded), reference)
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
