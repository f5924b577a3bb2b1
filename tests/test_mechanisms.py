"""The mechanisms of the router study (evaluate.mechanisms) and the controlled sub-task experiment."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from mini_moe import config as config_lib
from mini_moe import evaluate, modes, study, subtasks, train

TINY = dict(model_dim=16, model_depth=2, model_heads=2, model_mlp_dim=16, model_num_experts=4, model_group_images=4)


@pytest.fixture(scope="module")
def digits():
    return train.load_data(config_lib.get_config("quick", dataset="digits"))


def _model(router, capacity, **kw):
    cfg = study.cell_config(router, capacity, 0, dataset="digits", scale="quick", **{**TINY, **kw})
    model = train.make_model(cfg)
    # A random head, so predictions depend on the features (the trained-from-zero head would
    # predict class 0 everywhere).
    model.head.kernel[...] = jax.random.normal(jax.random.key(1), model.head.kernel.shape)
    return model


@pytest.mark.parametrize("router", ["softmax_token_choice", "softmax_expert_choice", "soft_moe"])
@pytest.mark.parametrize("capacity", [0.5, 2.0])
def test_mechanisms_invariants(digits, router, capacity):
    model = _model(router, capacity)
    images = digits[1].images[:96]  # a multiple of the batch's groups: no padding
    out = evaluate.mechanisms(model, images, batch_size=48, stability_images=32)
    assert len(out["layers"]) == 1 and 0 <= out["batch_dependence"] <= 1
    layer = out["layers"][0]
    e = model.cfg.num_experts
    if router == "soft_moe":  # every token reaches every expert; one image at a time
        assert layer["unprocessed"] == 0 and layer["experts_per_token"] == e and out["batch_dependence"] == 0
    elif router == "softmax_expert_choice":  # every expert fills its C = c T / E slots
        assert layer["processed_cv"] == 0 and layer["experts_per_token"] == pytest.approx(capacity)
        assert layer["dropped_routes"] is None
    else:
        k = 1 if capacity <= 1 else 2
        assert layer["dropped_routes"] == pytest.approx(1 - layer["experts_per_token"] / k)
        if capacity == 0.5:  # E * C = T / 2 slots: at least half the tokens get none
            assert layer["unprocessed"] >= 0.5
    assert 0 <= layer["stability_top2"] <= layer["stability_top1"] <= 1


def test_batch_dependence_is_zero_without_drops_and_positive_with_them(digits):
    images = digits[1].images[:192]
    # Token Choice with room for every token in one expert: each token's routing is its own.
    roomy = _model("softmax_token_choice", 1.0)
    for block in roomy.blocks:
        if block.use_moe:
            block.mlp.router.capacity_factor = float(roomy.cfg.num_experts)
    assert evaluate.mechanisms(roomy, images, batch_size=48, stability_images=16)["batch_dependence"] == 0
    # Expert Choice at c = 0.5: which tokens an expert takes depends on the other images.
    tight = _model("softmax_expert_choice", 0.5)
    assert evaluate.mechanisms(tight, images, batch_size=48, stability_images=16)["batch_dependence"] > 0


def test_dense_model_has_no_moe_layers_and_no_batch_dependence(digits):
    model = _model(None, 1.0)
    out = evaluate.mechanisms(model, digits[1].images[:64], batch_size=32, stability_images=16)
    assert out == {"batch_dependence": 0.0, "layers": []}


# ---------------------------------------------------------------- sub-task experiment


def _oracle(cfg):
    """A layer whose router sends each token to its sub-task's expert and whose experts are the
    teachers: the right routing, by construction."""
    teacher = subtasks.Teacher(cfg)
    layer = subtasks.SubtaskLayer(cfg, rngs=nnx.Rngs(0))
    layer.router.affinity.dense.kernel[...] = 10.0 * teacher.centres.T.astype(np.float32)
    layer.router.capacity_factor = float(cfg.tasks)  # room for every token: nothing dropped
    layer.experts.w1[...] = teacher.w1.astype(np.float32)
    layer.experts.b1[...] = teacher.b1.astype(np.float32)
    layer.experts.w2[...] = teacher.w2.astype(np.float32)
    return teacher, layer


def test_the_teachers_are_experts_so_the_right_routing_fits_exactly():
    cfg = subtasks.SubtaskConfig(router="softmax_token_choice", tasks=4, dim=8, hidden=8, group_tokens=64)
    teacher, layer = _oracle(cfg)
    x, y, task = teacher.sample(np.random.default_rng(0), 4)
    # Tokens sit around their sub-task's centre.
    assert np.allclose([x[task == k].mean(0) for k in range(4)], teacher.centres, atol=0.35)
    metrics = subtasks.evaluate_layer(layer, x, y, task, cfg.tasks)
    # The router sees x, not the sub-task: a token whose noise carries it nearer another centre
    # (separation 4: a gap of 4 standard deviations, P ~ 0.2% per other centre) goes astray.
    assert metrics["routing_accuracy"] >= 0.99 and metrics["unprocessed"] == 0
    assert metrics["fvu"] < 0.02
    # The matching makes the score blind to expert labels: permuting the experts changes nothing.
    perm = np.array([2, 0, 3, 1])
    layer.router.affinity.dense.kernel[...] = layer.router.affinity.dense.kernel[...][:, perm]
    for name in ("w1", "b1", "w2", "b2"):
        getattr(layer.experts, name)[...] = getattr(layer.experts, name)[...][perm]
    assert subtasks.evaluate_layer(layer, x, y, task, cfg.tasks) == pytest.approx(metrics)


def test_skewed_frequencies_are_zipf_and_configs_are_checked():
    p = subtasks.SubtaskConfig(frequencies="skewed", tasks=4).probabilities()
    assert p == pytest.approx(np.array([1, 1 / 2, 1 / 3, 1 / 4]) / (25 / 12))
    for bad, match in ((dict(router="nope"), "Unknown router"), (dict(frequencies="flat"), "frequencies"),
                       (dict(capacity=1.5), "capacity"), (dict(tasks=0), "tasks")):
        with pytest.raises(ValueError, match=match):
            subtasks.SubtaskConfig(**bad)


def test_a_short_run_learns_and_records_its_curve():
    cfg = subtasks.SubtaskConfig(router="softmax_expert_choice", tasks=4, dim=8, hidden=8, group_tokens=64,
                                 groups=4, steps=60, eval_every=30)
    out = subtasks.run(cfg, test_groups=8)
    assert [c["step"] for c in out["curve"]] == [30, 60] and out["final"] == out["curve"][-1]
    assert out["final"]["fvu"] < 1.0 and out["final"]["processed_cv"] == 0


def test_balance_bound_by_hand_and_no_hard_allocation_beats_it():
    # T = 4 tokens, K = 2 equally likely sub-tasks, C = 2 slots: n_1 ~ Bin(4, 1/2) and
    # E|n_1 - 2| = (2 + 4 + 0 + 4 + 2) / 16 = 0.75 tokens per group cannot stay home.
    cfg = subtasks.SubtaskConfig(tasks=2, group_tokens=4, dim=4, hidden=4)
    assert subtasks.balance_bound(cfg, groups=200_000) == pytest.approx(1 - 0.75 / 4, abs=0.003)
    # The bound on the very test groups holds for every hard allocation, trained or not.
    for router in ("softmax_token_choice", "sinkhorn_token_choice", "softmax_expert_choice",
                   "sparsity_constrained_expert_choice"):
        cfg = subtasks.SubtaskConfig(router=router, tasks=4, dim=8, hidden=8, group_tokens=32, frequencies="skewed")
        teacher, layer = _oracle(cfg)
        layer.router.capacity_factor = 1.0  # back to C = T / E: now the capacity binds
        x, y, task = teacher.sample(np.random.default_rng(1), 16)
        n = np.stack([(task == k).sum(-1) for k in range(4)], -1)  # [G, K]
        exact = 1 - np.maximum(n - 8, 0).sum() / task.size
        metrics = subtasks.evaluate_layer(layer, x, y, task, cfg.tasks)
        assert metrics["routing_accuracy"] <= exact + 1e-12
        weight, hits = subtasks.routing(layer, x)
        assert subtasks.assignment_counts(weight, hits, task, 4).sum() == task.size - round(
            metrics["unprocessed"] * task.size)


def test_slot_purity_is_one_for_sparse_routings_and_one_over_k_for_uniform_mixing():
    cfg = subtasks.SubtaskConfig(router="softmax_expert_choice", tasks=4, dim=8, hidden=8, group_tokens=32,
                                 frequencies="uniform")
    teacher, layer = _oracle(cfg)
    x, _, task = teacher.sample(np.random.default_rng(2), 4)
    assert subtasks.slot_purity(layer, x, task, 4) == 1.0
    soft = subtasks.SubtaskLayer(dataclasses.replace(cfg, router="soft_moe"), rngs=nnx.Rngs(0))
    soft.router.affinity.phi[...] = np.zeros_like(soft.router.affinity.phi[...])  # equal logits: every slot averages all tokens
    # Balanced groups (8 tokens of each sub-task): uniform mixing gives exactly 1/K.
    task = np.tile(np.repeat(np.arange(4), 8), (4, 1))
    assert subtasks.slot_purity(soft, x, task, 4) == pytest.approx(0.25)


def test_paired_and_pairwise_are_oriented_and_holm_adjusted():
    from scipy import stats

    def run(router, freq, seed, fvu):
        cfg = dataclasses.asdict(subtasks.SubtaskConfig(router=router, frequencies=freq, seed=seed))
        return {"config": cfg, "final": {"step": 1, "fvu": fvu}, "curve": []}

    a = [0.10, 0.12, 0.11, 0.13]
    b = [0.30, 0.25, 0.35, 0.28]
    d = [0.40, 0.41, 0.39, 0.42]
    results = {"runs": [run("softmax_expert_choice", "uniform", s, a[s]) for s in range(4)]
               + [run("softmax_token_choice", "uniform", s, b[s]) for s in range(4)]
               + [run("dense", "uniform", s, d[s]) for s in range(4)]}
    out = subtasks.paired(results, "softmax_expert_choice", "softmax_token_choice", frequencies="uniform")
    assert out["difference"] == pytest.approx(np.mean(np.array(b) - np.array(a)))  # positive: the first is better
    assert out["p_value"] == pytest.approx(stats.ttest_rel(b, a).pvalue)
    rows = subtasks.pairwise(results)
    assert [(r["better"], r["worse"]) for r in rows] == [
        ("softmax_expert_choice", "softmax_token_choice"), ("softmax_expert_choice", "dense"),
        ("softmax_token_choice", "dense")]
    from mini_moe import study
    assert [r["p_holm"] for r in rows] == pytest.approx(study.holm([r["p_value"] for r in rows]))
    with pytest.raises(ValueError, match="No seed"):
        subtasks.paired(results, "softmax_expert_choice", "soft_moe", frequencies="uniform")


# ------------------------------------------------------------------ group dependence


def _group_pool(num_images=16, patches=8, dim=16):
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(6, dim)) * 2
    return (centres[rng.integers(0, 6, (num_images, patches))] + rng.normal(size=(num_images, patches, dim))).astype(np.float32)


def test_group_dependence_known_cases():
    import mini_moe
    from mini_moe import layer

    pool = _group_pool()
    experts = layer.MlpExperts(4, 16, 16, rngs=nnx.Rngs(1))

    def dependence(name, group_images=4, **kw):
        router = mini_moe.make_router(name, 16, 4, rngs=nnx.Rngs(0), **kw)
        return evaluate.group_dependence(router, experts, pool, group_images=group_images, trials=6)

    # buffers that hold the whole group: Token Choice depends on nothing but the token itself
    assert dependence("softmax_token_choice", capacity_factor=4.0) == 0.0
    # ... and Expert Choice with C = T takes every token
    assert dependence("softmax_expert_choice", capacity_factor=4.0) == 0.0
    # the Sinkhorn plan couples the group even then
    assert dependence("sinkhorn_token_choice", capacity_factor=4.0) > 0.0
    # tight buffers make Token Choice depend on the group
    assert dependence("softmax_token_choice", capacity_factor=1.0) > 0.0
    # Soft MoE: every token changes when routed with other images, none when routed alone
    assert dependence("soft_moe") == 1.0
    assert dependence("soft_moe", group_images=1) == 0.0


def test_group_dependence_rejects_bad_arguments():
    import mini_moe
    from mini_moe import layer

    pool = _group_pool(num_images=4)
    router = mini_moe.make_router("softmax_token_choice", 16, 4, rngs=nnx.Rngs(0))
    experts = layer.MlpExperts(4, 16, 16, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="group_images must be"):
        evaluate.group_dependence(router, experts, pool, group_images=5)
    with pytest.raises(ValueError, match="trials must be"):
        evaluate.group_dependence(router, experts, pool, group_images=2, trials=1)
    with pytest.raises(ValueError, match="images must be token arrays"):
        evaluate.group_dependence(router, experts, pool[0], group_images=2)


@pytest.mark.parametrize("router", ["softmax_token_choice", "softmax_expert_choice", "soft_moe"])
def test_dispatch_mass(digits, router):
    model = _model(router, 1.0)
    images = digits[1].images[:40]
    (mass,) = evaluate.dispatch_mass(model, images, batch_size=16)  # padded last batch
    assert mass.shape == (40, model.cfg.num_patches) and np.all(mass >= 0)
    if router == "soft_moe":  # each image's slots take one unit of mass each: the mean share is 1 per image
        np.testing.assert_allclose(mass.mean(axis=1), 1.0, rtol=1e-5)
        assert mass.min() > 0
    else:  # the number of slots holding the patch, over E * C / T (= 1 at c = 1)
        (hits, _), = evaluate.predictions_and_routing(model, images)[1]
        np.testing.assert_allclose(mass, hits.sum(-1), atol=1e-6)


def test_mechanisms_with_one_expert(digits):
    model = _model("soft_moe", 1.0, model_num_experts=1)  # one expert, 16 slots: no top-2 to compare
    out = evaluate.mechanisms(model, digits[1].images[:32], batch_size=16, stability_images=16)
    (layer,) = out["layers"]
    assert layer["stability_top1"] == 1.0 and layer["stability_top2"] is None
    assert layer["experts_per_token"] == 1 and layer["unprocessed"] == 0


def test_perturbation_path(digits):
    images = digits[1].images
    model = _model("softmax_token_choice", 1.0)
    direction = np.random.default_rng(0).normal(size=images[0].shape).astype(np.float32)
    alphas = np.linspace(0, 2.0, 41)
    out = evaluate.perturbation_path(model, images[0], images[1:4], direction, alphas, batch_size=40)
    assert out["probs"].shape == (41, 10) and out["changes"].shape == (40,)
    np.testing.assert_allclose(out["probs"].sum(-1), 1.0, rtol=1e-5)
    assert out["changes"].any()  # noise of scale 2 moves some patch to another expert
    # point 0 is the clean image routed with its companions: the model's own prediction for it
    grouped = np.concatenate([images[:1], images[1:4]])
    model.eval()  # perturbation_path runs in eval mode (no router noise)
    clean = np.asarray(jax.nn.softmax(model(grouped).logits[0]))
    model.train()
    np.testing.assert_allclose(out["probs"][0], clean, rtol=1e-4, atol=1e-6)
    # no movement, no change
    still = evaluate.perturbation_path(model, images[0], images[1:4], 0 * direction, alphas[:5])
    assert not still["changes"].any() and np.ptp(still["probs"], axis=0).max() < 1e-6
    # Soft MoE processes every patch with every expert: its routing never changes
    soft = evaluate.perturbation_path(_model("soft_moe", 1.0), images[0], images[1:4], direction, alphas[:9])
    assert not soft["changes"].any()
    with pytest.raises(ValueError, match="companions must hold"):
        evaluate.perturbation_path(model, images[0], images[1:3], direction, alphas)


def test_correspondence_matrices_sum_to_E(digits):
    model = _model("softmax_token_choice", 1.0)
    (s,) = evaluate.correspondence_matrices(model, digits[1].images[:64], batch_size=32)
    e = model.cfg.num_experts
    assert s.shape == (e, e) and np.all(s >= 0)
    # every distribution sums to one, so sum_ij p1_i p2_j = 1 per pair and S sums to E
    np.testing.assert_allclose(s.sum(), e, rtol=1e-5)
    # diagonal mass is E times the chance that partners agree under independent draws
    assert 0 < np.trace(s) < e


def test_group_routing_is_the_first_group(digits):
    model = _model("softmax_expert_choice", 1.0)
    images = digits[1].images[:8]
    rt = evaluate.group_routing(model, images)
    g, p, e = model.cfg.group_images, model.cfg.num_patches, model.cfg.num_experts
    assert rt.dispatch.shape[:2] == (g * p, e)
    # Expert Choice at c = 1: every slot of every expert holds exactly one token
    np.testing.assert_array_equal(rt.dispatch.sum(0), 1.0)
    model.eval()
    full = model(images[:g], return_routing=True).routings[-1]
    model.train()
    np.testing.assert_array_equal(rt.dispatch, np.asarray(full.dispatch[0]))
    with pytest.raises(ValueError, match="at least one routing group"):
        evaluate.group_routing(model, images[:1])


def test_subtask_helpers_restore_the_mode_the_layer_was_in():
    cfg = subtasks.SubtaskConfig(router="softmax_token_choice", tasks=4, dim=8, hidden=8, group_tokens=64)
    teacher, layer = _oracle(cfg)
    x, y, task = teacher.sample(np.random.default_rng(0), 2)
    noisy = lambda: layer.router.affinity.deterministic is False  # noqa: E731 (train mode: noise on)
    for mode in ("eval", "train"):
        getattr(layer, mode)()
        before = noisy()
        subtasks.routing(layer, x)
        subtasks.evaluate_layer(layer, x, y, task, cfg.tasks)
        subtasks.slot_purity(layer, x, task, cfg.tasks)
        assert noisy() == before, mode


def test_model_bench_and_subtasks_share_one_moe_layer(monkeypatch):
    """A timing, a study and a chapter measure the same layer: the model's MoE blocks, the
    benchmark's module and the sub-task experiment's layer are all :class:`model.MoeLayer`."""
    from mini_moe import bench, model as model_lib

    cfg = config_lib.get_config("quick", dataset="digits", router="softmax_expert_choice")
    vmoe = model_lib.VisionMoE(cfg.model, rngs=nnx.Rngs(0))
    assert all(isinstance(b.mlp, model_lib.MoeLayer) for b in vmoe.blocks if b.use_moe)
    sub = subtasks.SubtaskLayer(subtasks.SubtaskConfig(router="soft_moe", tasks=4, dim=8, hidden=8,
                                                       group_tokens=64), rngs=nnx.Rngs(0))
    assert isinstance(sub, model_lib.MoeLayer)
    seen = []
    original = model_lib.MoeLayer.__call__
    monkeypatch.setattr(model_lib.MoeLayer, "__call__",
                        lambda self, x, mesh=None: seen.append(type(self)) or original(self, x, mesh))
    bench.moe_layer_ms("softmax_expert_choice", "quick", repeats=1)
    assert seen and all(t is model_lib.MoeLayer for t in seen)


def test_subtask_stopping_rule():
    best = [(100 * i, v) for i, v in enumerate([1.0, 0.5, 0.4, 0.399, 0.398, 0.397], start=1)]
    # At step 600 the best is 0.397; 300 steps earlier (step 300) it was 0.4: a 0.75 % gain < 1 %.
    assert subtasks._converged(best, 300, 0.01)
    assert not subtasks._converged(best, 300, 0.005)  # 0.75 % > 0.5 %
    assert not subtasks._converged(best[:3], 300, 0.01)  # no value 300 steps back yet
    assert not subtasks._converged(best, 500, 0.01)  # 1.0 -> 0.397 within 500 steps
    cfg = subtasks.SubtaskConfig(router="softmax_expert_choice", tasks=4, dim=8, hidden=8, group_tokens=32,
                                 groups=2, steps=3000, eval_every=50, patience=200, tolerance=0.5)
    result = subtasks.run(cfg, test_groups=4)
    vals = [entry["val_fvu"] for entry in result["curve"]]
    assert result["stopped"] and result["steps"] == result["curve"][-1]["step"] < cfg.steps
    best = [(e["step"], min(vals[:i + 1])) for i, e in enumerate(result["curve"])]
    assert subtasks._converged(best, 200, 0.5)  # it stopped because the rule fired ...
    assert not any(subtasks._converged(best[:i], 200, 0.5) for i in range(1, len(best)))  # ... not earlier
    with pytest.raises(ValueError, match="patience"):
        subtasks.SubtaskConfig(patience=150)  # not a multiple of eval_every=100


def test_subtask_curves_hold_a_stopped_run_at_its_last_values():
    """Runs stopped by the rule end at different steps; the plotted mean over seeds keeps each
    stopped run at its final value, so every point averages all seeds."""
    import matplotlib

    matplotlib.use("Agg")

    def run(seed, fvus):
        config = {"router": "softmax_expert_choice", "capacity": 1.0, "frequencies": "uniform", "seed": seed}
        return {"config": config, "curve": [{"step": 100 * (i + 1), "fvu": v} for i, v in enumerate(fvus)]}

    results = {"runs": [run(0, [0.8, 0.4]), run(1, [0.6, 0.3, 0.2, 0.1])]}
    fig = subtasks.plot_curves(results, frequencies="uniform", metrics=("fvu",))
    (line,) = fig.axes[0].get_lines()
    np.testing.assert_allclose(line.get_xdata(), [100, 200, 300, 400])
    np.testing.assert_allclose(line.get_ydata(), [0.7, 0.35, 0.3, 0.25])  # seed 0 holds 0.4 after step 200


@pytest.mark.parametrize("router", ["softmax_expert_choice", "softmax_token_choice"])
def test_routing_accuracy_is_the_best_matching_of_main_experts(router):
    """Against a brute force: every one of the 4! matchings of sub-tasks to experts, and each
    patch's main expert found slot by slot from the routing tensors."""
    import itertools

    cfg = study.cell_config(router, 1.0, 0, dataset="subtask_vote", scale="quick", **TINY)
    model = train.make_model(cfg)
    images = np.asarray(jax.random.uniform(jax.random.key(2), (24, 28, 28, 1)))
    tasks = np.asarray(jax.random.randint(jax.random.key(3), (24, 16), 0, 4))
    (got,) = evaluate.routing_accuracy(model, images, tasks, batch_size=8)
    with modes.eval_mode(model):
        rt = model(images, return_routing=True).routings[0]
    combine = np.asarray(rt.combine).reshape(24, 16, 4, -1)
    dispatch = np.asarray(rt.dispatch).reshape(24, 16, 4, -1)
    main = np.full((24, 16), -1)
    for n, p in itertools.product(range(24), range(16)):
        weights = [combine[n, p, e].sum() if dispatch[n, p, e].any() else -1.0 for e in range(4)]
        main[n, p] = int(np.argmax(weights)) if max(weights) >= 0 else -1
    best = max(np.mean(main == np.asarray(perm)[tasks]) for perm in itertools.permutations(range(4)))
    assert got["routing_accuracy"] == pytest.approx(best)
    assert got["unprocessed"] == pytest.approx(np.mean(main < 0))
    assert np.sum(got["counts"]) == np.sum(main >= 0)
    if router == "softmax_expert_choice":
        assert got["unprocessed"] > 0  # Expert Choice leaves some patches to no expert
    with pytest.raises(ValueError, match=r"tasks must be \[N, P\]"):
        evaluate.routing_accuracy(model, images, tasks[:, :4])


def test_dropless_evaluation_equals_the_dropless_model_and_ignores_grouping(digits):
    """evaluate.accuracy(..., dropless=True) on a model trained with capacity computes what the same
    weights compute in a model built with moe_path="dropless" (an independent construction), does
    not depend on how the images are grouped, and leaves the model's own path in place."""
    images, labels = digits[1].images[:96], digits[1].labels[:96]
    capped = _model("softmax_token_choice", 0.5)  # C = T / (2E): most tokens are dropped
    built = _model("softmax_token_choice", 0.5, model_moe_path="dropless")
    nnx.update(built, nnx.state(capped))
    dataset = dataclasses.replace(digits[1], images=images, labels=labels)
    with modes.dropless_mode(capped):
        logits = evaluate._collect(capped, images, "logits", 48)
        order = np.random.default_rng(0).permutation(len(images))  # other images in every group
        regrouped = evaluate._collect(capped, images[order], "logits", 48)
    np.testing.assert_allclose(logits, evaluate._collect(built, images, "logits", 48), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(regrouped, logits[order], rtol=1e-5, atol=1e-5)
    assert {b.mlp.path for b in capped.blocks if b.use_moe} == {"auto"}  # restored
    # with drops, the capped evaluation differs from the dropless one on these images
    assert not np.allclose(evaluate._collect(capped, images, "logits", 48), logits, atol=1e-3)
    assert evaluate.accuracy(capped, dataset, batch_size=48, dropless=True) == pytest.approx(
        float(np.mean(np.argmax(logits, -1) == labels)))
    with pytest.raises(ValueError, match="Token Choice"):
        evaluate.accuracy(_model("softmax_expert_choice", 1.0), dataset, dropless=True)


def test_slot_mixing_counts_the_tokens_a_soft_moe_slot_averages(digits):
    """1 / sum w^2 lies in [1, T]; a zero scale makes every slot a uniform average (exactly T, max
    weight 1/T), a huge scale makes each slot take one token (close to 1); the result matches a
    computation from the dispatch tensor; sparse routers are refused."""
    model = _model("soft_moe", 1.0)
    images = digits[1].images[:20]
    (mixing,) = evaluate.slot_mixing(model, images, batch_size=8)  # two batches and a padded one
    t = model.cfg.num_patches
    assert mixing["tokens"] == t and mixing["scale"] == 1.0 and 1 <= mixing["tokens_per_slot"] <= t
    assert mixing["slots"] == model.cfg.routed_experts * dict(model.cfg.router_kwargs).get("slots_per_expert", 1)
    with modes.eval_mode(model):  # the same 8-image program that slot_mixing compiled
        w = np.concatenate([np.asarray(evaluate._forward(model, batch, return_routing=True).routings[0].dispatch,
                                       np.float64) for batch in (images[:8], images[8:16])])
    (first16,) = evaluate.slot_mixing(model, images[:16], batch_size=8)
    np.testing.assert_allclose(first16["tokens_per_slot"], np.mean(1 / np.sum(w**2, axis=1)), rtol=1e-6)
    affinity = [b.mlp for b in model.blocks if b.use_moe][0].router.affinity
    affinity.scale[...] = 0.0
    (uniform,) = evaluate.slot_mixing(model, images, batch_size=8)
    np.testing.assert_allclose([uniform["tokens_per_slot"], uniform["max_weight"]], [t, 1 / t], rtol=1e-6)
    affinity.scale[...] = 1e4
    (sharp,) = evaluate.slot_mixing(model, images, batch_size=8)
    assert sharp["tokens_per_slot"] < 1.1 and sharp["max_weight"] > 0.95
    with pytest.raises(Exception, match="Soft MoE"):
        evaluate.slot_mixing(_model("softmax_expert_choice", 1.0), images, batch_size=8)


def test_subtask_experiment_records_every_run_with_its_machine_and_resumes(tmp_path, monkeypatch):
    """run_experiment: one run per (router, seed) in the plan, each with its config, final metrics and
    the machine it trained on, rewritten after every run; a second call trains nothing new."""
    small = dict(tasks=4, dim=8, hidden=8, group_tokens=32, groups=2, steps=2, eval_every=2)
    out = tmp_path / "runs.json"
    first = subtasks.run_experiment(out, routers=("dense", "softmax_token_choice_frozen"), frequencies=("uniform",),
                                    seeds=(0, 1), progress=False, **small)
    assert sorted((r["config"]["router"], r["config"]["seed"]) for r in first["runs"]) == [
        ("dense", 0), ("dense", 1), ("softmax_token_choice_frozen", 0), ("softmax_token_choice_frozen", 1)]
    assert all(r["machine"]["jax"] and "fvu" in r["final"] for r in first["runs"])
    monkeypatch.setattr(subtasks, "run", lambda cfg: pytest.fail(f"trained {cfg.router} again"))
    again = subtasks.run_experiment(out, routers=("dense", "softmax_token_choice_frozen"), frequencies=("uniform",),
                                    seeds=(0, 1), progress=False, **small)
    assert again["runs"] == first["runs"]
