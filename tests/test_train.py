"""Model, configs, training (exact resume, NaN guard), evaluation, PRC loss and the CLI."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from sklearn.linear_model import Ridge

from mini_moe import __main__ as cli
from mini_moe import config as config_lib
from mini_moe import evaluate, losses, runs, train
from mini_moe.model import ModelConfig, VisionMoE, patchify

from live_head import live_head

TINY = dict(steps=6, batch_size=32, eval_every=3, checkpoint_every=3, eval_batch_size=64,
            model_dim=16, model_depth=2, model_heads=2, model_mlp_dim=16, model_num_experts=4,
            model_group_images=4)


@pytest.fixture(scope="module")
def digits():
    cfg = config_lib.get_config("quick", dataset="digits")
    return train.load_data(cfg)


def test_load_data_standardises_every_split_with_the_remaining_training_images(digits):
    """``load_data(cfg, validation=N)``: N training images held out (the same as
    ``data.validation_split``), and all three splits standardised with the statistics of the
    training images that remain, computed here independently."""
    from mini_moe import data

    cfg = config_lib.get_config("quick", dataset="digits")
    part, held, test = train.load_data(cfg, validation=300)
    raw_part, raw_held = data.validation_split(data.load("digits", "train"), 300)
    raw_test = data.load("digits", "test")
    mean, std = raw_part.images.mean(axis=(0, 1, 2)), raw_part.images.std(axis=(0, 1, 2))
    for got, raw in ((part, raw_part), (held, raw_held), (test, raw_test)):
        np.testing.assert_allclose(got.images, (raw.images - mean) / std, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got.labels, raw.labels)
    assert abs(float(part.images.mean())) < 1e-4 and abs(float(held.images.mean())) > 1e-4  # stats of part only
    assert (len(part), len(held)) == (len(raw_part), 300) and held.split == "validation"
    np.testing.assert_array_equal(train.load_data(cfg)[1].images, digits[1].images)  # default unchanged: 2 splits


def _cfg(router="softmax_token_choice", **kw):
    return config_lib.get_config("quick", dataset="digits", router=router, **{**TINY, **kw})


def _params(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


# -------------------------------------------------------------------------- model


def test_patchify_is_row_major_patches():
    images = np.arange(2 * 4 * 4 * 1, dtype=np.float32).reshape(2, 4, 4, 1)
    p = np.asarray(patchify(images, 2))
    assert p.shape == (2, 4, 4)
    np.testing.assert_array_equal(p[0, 1], images[0, 0:2, 2:4, 0].reshape(-1))  # top-right patch
    np.testing.assert_array_equal(p[1, 2], images[1, 2:4, 0:2, 0].reshape(-1))  # bottom-left


def test_moe_placement_and_dense_baseline():
    assert ModelConfig(depth=6, placement="every2").moe_blocks() == (1, 3, 5)
    assert ModelConfig(depth=6, placement="last2").moe_blocks() == (4, 5)
    assert ModelConfig(router=None).moe_blocks() == ()
    dense = VisionMoE(ModelConfig(router=None, image_size=8, patch_size=2, dim=16, heads=2, mlp_dim=16),
                      rngs=nnx.Rngs(0))
    out = dense(jnp.ones((3, 8, 8, 1)))
    assert out.logits.shape == (3, 10) and out.metrics == () and float(out.aux_loss) == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(image_size=30, patch_size=4), "divisible by patch_size"),
        (dict(router="top1"), "Unknown router"),
        (dict(placement="last9", depth=4), "placement"),
        (dict(dim=30, heads=4), "divisible by heads"),
        (dict(patch_size=0), "patch_size"),
    ],
)
def test_model_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_model_rejects_wrong_images_and_ragged_groups():
    cfg = ModelConfig(router="softmax_expert_choice", image_size=8, patch_size=2, dim=16, heads=2,
                      mlp_dim=16, num_experts=4, group_images=4)
    model = VisionMoE(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="images must have shape"):
        model(jnp.ones((4, 9, 9, 1)))
    with pytest.raises(ValueError, match="multiple of group_images"):
        model(jnp.ones((6, 8, 8, 1)))
    out = model(jnp.ones((8, 8, 8, 1)), return_routing=True)
    assert len(out.routings) == 2 and out.routings[0].dispatch.shape[:2] == (2, 4 * 16)  # 2 groups of 4 images
    assert out.probs[0].shape == (8, 16, 4)


def test_config_overrides_and_errors():
    cfg = config_lib.get_config("quick", dataset="fashion_mnist", router="soft_moe", model_num_experts=7, steps=10)
    assert cfg.model.num_experts == 7 and cfg.steps == 10 and cfg.warmup_steps == 1
    assert cfg.model.patch_size == 7 and cfg.model.dim == 128  # the quick Fashion-MNIST model
    assert dict(cfg.model.router_kwargs)["slots_per_expert"] == round(16 / 7)  # S = round(T / E)
    full = config_lib.get_config("full", dataset="fashion_mnist", router="soft_moe")
    assert full.model.patch_size == 4 and dict(full.model.router_kwargs)["slots_per_expert"] == round(49 / 16)
    with pytest.raises(ValueError, match="Unknown config field"):
        config_lib.get_config("quick", learning_rat=1.0)
    with pytest.raises(ValueError, match="Unknown dataset"):
        config_lib.get_config("quick", dataset="mnist")
    with pytest.raises(ValueError, match="scale"):
        config_lib.get_config("huge")
    with pytest.raises(ValueError, match="prc=True needs a sparse router"):
        config_lib.get_config("quick", router="soft_moe", prc=True)


def test_scale_switch(monkeypatch):
    monkeypatch.setenv("MINI_MOE_SCALE", "full")
    assert config_lib.default_scale() == "full"
    monkeypatch.setenv("MINI_MOE_SCALE", "tiny")
    with pytest.raises(ValueError, match="MINI_MOE_SCALE"):
        config_lib.default_scale()
    monkeypatch.delenv("MINI_MOE_SCALE")
    assert config_lib.default_scale() == ("quick" if jax.default_backend() == "cpu" else "full")


# ----------------------------------------------------------------------- training


def test_resume_ends_with_the_same_parameters(tmp_path, digits, monkeypatch):
    cfg = _cfg()  # noisy router: the noise RNG state must be checkpointed too
    train.train(cfg, tmp_path / "straight", progress=False, datasets=digits)
    straight, _ = train.load_trained(tmp_path / "straight")

    from interrupted import train_interrupted_then_resumed

    history = train_interrupted_then_resumed(cfg, tmp_path / "resumed", digits, monkeypatch)
    resumed, _ = train.load_trained(tmp_path / "resumed")
    for a, b in zip(_params(straight), _params(resumed)):
        np.testing.assert_array_equal(a, b)
    assert [r["step"] for r in history["eval"]] == [3, 6]
    saved = json.loads((tmp_path / "resumed" / "history.json").read_text())
    assert saved["eval"][-1]["step"] == 6
    with pytest.raises(ValueError, match="different configuration"):
        train.train(_cfg(learning_rate=0.5), tmp_path / "resumed", progress=False, datasets=digits)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, digits, monkeypatch):
    cfg = _cfg(router="soft_moe")
    real_batch = train.batch_at

    def poisoned(dataset, cfg, step):
        images, labels = real_batch(dataset, cfg, step)
        return (images * np.nan if step == 4 else images), labels

    monkeypatch.setattr(train, "batch_at", poisoned)
    with pytest.raises(ValueError, match=r"not finite at step 4.*last good checkpoint is step 3"):
        train.train(cfg, tmp_path, progress=False, datasets=digits)
    model, _ = train.load_trained(tmp_path)  # the step-3 checkpoint
    assert all(np.isfinite(p).all() for p in _params(model))


def test_training_learns_digits(tmp_path, digits):
    cfg = _cfg(router="sinkhorn_expert_choice", steps=120, eval_every=120, checkpoint_every=120,
               learning_rate=3e-3, model_dim=32, model_mlp_dim=32)
    history = train.train(cfg, tmp_path, progress=False, datasets=digits)
    assert history["eval"][-1]["test_accuracy"] > 0.4  # chance is 0.1
    assert history["train"][0]["loss"] > history["train"][-1]["loss"]


# --------------------------------------------------------------------- evaluation


def test_ridge_probe_equals_sklearn():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 6)), rng.integers(0, 4, 40)
    xt, yt = rng.normal(size=(30, 6)), rng.integers(0, 4, 30)
    ours = evaluate.ridge_probe(x, y, xt, yt, num_classes=4, l2=2.0)
    mean, std = x.mean(0), x.std(0) + 1e-6
    ridge = Ridge(alpha=2.0, fit_intercept=True).fit((x - mean) / std, np.eye(4)[y])
    expected = np.mean(ridge.predict((xt - mean) / std).argmax(1) == yt)
    assert ours == pytest.approx(expected)


def test_few_shot_uses_k_images_per_class(digits, monkeypatch):
    train_ds, test_ds = digits
    model = train.make_model(_cfg(router="soft_moe"))
    seen = {}
    real = evaluate.ridge_probe

    def spy(train_x, train_y, *args, **kwargs):
        seen["counts"] = np.bincount(train_y, minlength=10)
        return real(train_x, train_y, *args, **kwargs)

    monkeypatch.setattr(evaluate, "ridge_probe", spy)
    acc = evaluate.few_shot_accuracy(model, train_ds, test_ds, shots=10)
    np.testing.assert_array_equal(seen["counts"], 10)
    assert 0.0 <= acc <= 1.0
    with pytest.raises(ValueError, match="shots"):
        evaluate.few_shot_accuracy(model, train_ds, test_ds, shots=0)


@pytest.mark.parametrize("router", ["softmax_expert_choice", "softmax_token_choice", "soft_moe"])
def test_router_report_and_expert_maps(digits, router):
    _, test_ds = digits
    cfg = _cfg(router=router, model_router_kwargs={"k": 2} if "token" in router else {})
    model = train.make_model(cfg)
    images = test_ds.images[:24]
    report = evaluate.router_report(model, images, batch_size=8)
    layers = len(cfg.model.moe_blocks())  # every2: block 1; Soft MoE's last2: blocks 0, 1
    assert len(report) == layers == (2 if router == "soft_moe" else 1)
    layer = report[-1]
    conf = layer["confidence"]
    assert conf["top1"] >= conf["top2"] and conf["top1"] + conf["top2"] + conf["rest"] == pytest.approx(1.0, abs=1e-5)
    tokens = 4 * 16  # group of 4 images x 16 patches
    if router == "softmax_expert_choice":
        cap = (tokens + 2) // 4
        np.testing.assert_allclose(layer["tokens_per_expert"], cap)  # every buffer full
        assert layer["buffer_fill"] == pytest.approx(1.0)
    if router == "soft_moe":
        assert layer["dropped"] == 0.0
    maps = evaluate.expert_maps(model, images[:8])
    assert maps.shape == (layers, 8, 4, 4)
    assert maps.min() >= -1 and maps.max() < 4
    out = model(jnp.asarray(images[:8]), return_routing=True)
    for layer_maps, rt in zip(maps, out.routings):
        reached = np.asarray(rt.dispatch).reshape(8, 16, 4, -1).sum(axis=(-1, -2)) > 0
        np.testing.assert_array_equal(layer_maps.reshape(8, 16) >= 0, reached)  # -1 exactly where dropped
    fig = evaluate.plot_expert_maps(images[:8], maps, num_experts=4)
    assert len(fig.axes) == 16


def test_routing_stability_is_one_for_identical_views(digits):
    _, test_ds = digits
    model = train.make_model(_cfg(router="softmax_token_choice", model_router_kwargs={"k": 2}))
    same = evaluate.routing_stability(model, test_ds.images[:16], scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=False)
    assert same[0]["top1"] == 1.0 and same[0]["top2"] == 1.0 and same[0]["pairs"] == 16 * 16
    varied = evaluate.routing_stability(model, test_ds.images[:16], seed=1)
    r = varied[0]
    assert 0 <= r["top2"] <= r["top1"] <= 1 and r["top2"] <= r["top2_unordered"] <= 1 and r["pairs"] > 0


# ---------------------------------------------------------------------------- PRC


def test_prc_loss_known_values():
    e = 2
    probs = jnp.tile(jnp.array([1.0, 0.0]), (1, 3, 1))  # every patch: expert 0, one-hot
    index, valid = jnp.array([[0, 1, 2]]), jnp.ones((1, 3), bool)
    # S = E/|U| * sum r1 r2^T = 2 * [[1, 0], [0, 0]]: diag terms (1-2)^2 + (1-0)^2 = 2.
    loss = losses.pairwise_router_consistency(probs, probs, index, valid, lambda_diag=1.0, lambda_offdiag=1.0)
    assert float(loss) == pytest.approx(1.0 / e * 2)
    # Uniform distributions: S = 2 * 0.25 = 0.5 everywhere.
    uniform = jnp.full((1, 3, 2), 0.5)
    loss = losses.pairwise_router_consistency(uniform, uniform, index, valid, lambda_diag=1.0, lambda_offdiag=1.0)
    assert float(loss) == pytest.approx(0.5 * 2 * 0.25 + 1.0 / 2 * 2 * 0.25)
    # Invalid pairs are ignored; the partner is looked up through index.
    mixed = jnp.array([[[1.0, 0.0], [0.0, 1.0], [0.3, 0.7]]])
    loss_a = losses.pairwise_router_consistency(mixed[:, :2], mixed, jnp.array([[0, 1]]), jnp.ones((1, 2), bool))
    loss_b = losses.pairwise_router_consistency(mixed, mixed, jnp.array([[0, 1, 2]]), jnp.array([[True, True, False]]))
    assert float(loss_a) == pytest.approx(float(loss_b))
    with pytest.raises(ValueError, match="index and valid"):
        losses.pairwise_router_consistency(mixed, mixed, jnp.array([[0, 1]]), jnp.ones((1, 2), bool))


def test_prc_training_step_runs(tmp_path, digits):
    cfg = _cfg(prc=True, aux_loss_weight=0.0, steps=3, eval_every=3, checkpoint_every=3)
    history = train.train(cfg, tmp_path, progress=False, datasets=digits)
    assert history["eval"][-1]["step"] == 3
    v1, v2, labels, index, valid = train.batch_at(digits[0], cfg, 0)
    assert v1.shape == v2.shape == (32, 8, 8, 1) and index.shape == valid.shape == (32, 16)


# ---------------------------------------------------------------------------- CLI


def test_cli_help_lists_routers_and_datasets(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = capsys.readouterr().out
    for name in ["softmax_token_choice", "sparsity_constrained_expert_choice", "soft_moe", "svmoe", "dense",
                 "fashion_mnist", "cifar100"]:
        assert name in text


def test_cli_train_and_evaluate(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--router", "softmax_expert_choice", "--dataset", "digits", "--steps", "4", "--out", str(out)]
    for key, value in [("batch_size", 32), ("eval_every", 4), ("model_dim", 16), ("model_depth", 2),
                       ("model_heads", 2), ("model_mlp_dim", 16), ("model_group_images", 4)]:
        args += ["--set", f"{key}={value}"]
    cli.main(args)  # a table by default
    table = dict(line.split(None, 1) for line in capsys.readouterr().out.strip().splitlines()[-5:])
    assert table["step"] == "4" and table["out"] == str(out)
    cli.main(args + ["--json"])  # resumes the finished run, one JSON line
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 4
    cli.main(["evaluate", str(out), "--images", "64", "--json"])
    assert json.loads(capsys.readouterr().out)["test_accuracy"] == pytest.approx(
        json.loads((out / "evaluation.json").read_text())["test_accuracy"])
    result = json.loads((out / "evaluation.json").read_text())
    assert {"test_accuracy", "10_shot_accuracy", "routers", "stability"} <= set(result)
    assert (out / "expert_maps.png").exists()
    capsys.readouterr()
    assert cli.main(["train", "--dataset", "digits", "--set", "nonsense=1", "--out", str(tmp_path / "x")]) == 2
    assert "Unknown config field" in capsys.readouterr().err


def test_minutes_budget_sizes_the_schedule_and_resume_keeps_it(tmp_path, digits, monkeypatch):
    cfg = _cfg(steps=1000, max_seconds=3.0)
    steps = train.steps_for_budget(cfg, 3.0, datasets=digits, probe_steps=3)
    assert isinstance(steps, int) and steps >= 1
    with pytest.raises(ValueError, match="seconds must be > 0"):
        train.steps_for_budget(cfg, 0.0, datasets=digits)
    # A fresh run measures; a resumed run reuses the steps its config.json recorded.
    monkeypatch.setattr(train, "steps_for_budget", lambda cfg, seconds, datasets=None: 40)
    fresh = train.budget_config(cfg, 3.0, out_dir=tmp_path)
    assert fresh.steps == 40 and fresh.warmup_steps == 4 and fresh.eval_every <= 40 and fresh.max_seconds == 3.0
    (tmp_path / "config.json").write_text(json.dumps(train.config_to_json(fresh)))
    monkeypatch.setattr(train, "steps_for_budget", lambda cfg, seconds, datasets=None: 99)
    assert train.budget_config(cfg, 3.0, out_dir=tmp_path).steps == 40
    assert train.budget_config(cfg, 3.0).steps == 99


def test_time_budget_stops_training_and_a_spent_run_resumes_without_training(tmp_path, digits):
    cfg = _cfg(steps=20, max_seconds=1e-9)  # spent after the first step
    history = train.train(cfg, tmp_path, progress=False, datasets=digits)
    assert [e["step"] for e in history["eval"]] == [1]  # evaluated and checkpointed where it stopped
    again = train.train(cfg, tmp_path, resume=True, progress=False, datasets=digits)
    assert [e["step"] for e in again["eval"]] == [1] and again["seconds"] == history["seconds"]


def test_early_stopping_rule_by_hand():
    evals = [{"step": s, "test_accuracy": a} for s, a in ((100, 0.50), (200, 0.60), (300, 0.605), (400, 0.61))]
    assert not train.plateaued(evals[:1], 200, 0.01)  # nothing 200 steps old yet
    assert not train.plateaued(evals[:3], 200, 0.01)  # 0.605 vs the best at step <= 100 (0.50): improving
    assert train.plateaued(evals, 200, 0.02)  # 0.61 is not 0.02 above 0.60 (the best at step <= 200)
    assert not train.plateaued(evals, 200, 0.01)
    assert not train.plateaued(evals, 0, 0.5)  # patience 0: the rule is off
    with pytest.raises(ValueError, match="patience must be a multiple of eval_every=3"):
        _cfg(patience=4)
    with pytest.raises(ValueError, match="min_delta must be in"):
        _cfg(min_delta=-0.1)


def test_early_stopping_stops_checkpoints_and_a_stopped_run_resumes_without_training(tmp_path, digits):
    cfg = _cfg(steps=30, patience=3, min_delta=0.99)  # no run gains 99 points: it stops at its second evaluation
    history = train.train(cfg, tmp_path, progress=False, datasets=digits)
    assert [e["step"] for e in history["eval"]] == [3, 6]
    again = train.train(cfg, tmp_path, resume=True, progress=False, datasets=digits)
    assert [e["step"] for e in again["eval"]] == [3, 6] and again["seconds"] == history["seconds"]


def test_committed_results_are_packaged():
    from mini_moe import bench

    results = bench.committed("cpu-2core-epyc.json")
    assert {"machine", "command", "layer", "soft_moe_experts", "training"} <= set(results)
    assert results["soft_moe_experts"][0]["ratio_to_E8"] == 1.0
    with pytest.raises(ValueError, match="available: .*cpu-2core-epyc.json"):
        bench.committed("nope.json")
    with pytest.raises(ValueError, match="shape must be one of"):
        bench.moe_layer_ms("soft_moe", "huge")


def test_study_runs_every_cell_resumes_and_summarizes(tmp_path, capsys):
    from mini_moe import study

    cfg = study.cell_config("soft_moe", 2, 0, dataset="digits", scale="quick")
    assert dict(cfg.model.router_kwargs)["slots_per_expert"] == 2 * round(16 / 8)
    assert dict(study.cell_config("svmoe", 1, 0, dataset="digits", scale="quick").model.router_kwargs)["k"] == 1
    # The Figure 3 ablation: Sinkhorn Token Choice combining with the plan, at the cell's k.
    ablation = study.cell_config("sinkhorn_token_choice_plan_combine", 2, 0, dataset="digits", scale="quick")
    assert ablation.model.router == "sinkhorn_token_choice"
    assert dict(ablation.model.router_kwargs)["softmax_combine"] is False
    assert dict(ablation.model.router_kwargs)["k"] == 2
    with pytest.raises(ValueError, match="Unknown router"):
        study.cell_config("nope", 1, 0, dataset="digits")
    with pytest.raises(ValueError, match="capacity must be a number > 0"):
        study.cell_config("soft_moe", 0, 0, dataset="digits")
    tiny = {k: v for k, v in TINY.items() if k != "model_group_images"}
    args = ["study", "--dataset", "digits", "--routers", "soft_moe", "--capacities", "1", "2",
            "--seeds", "0", "--out", str(tmp_path)]
    args += [a for k, v in tiny.items() for a in ("--set", f"{k}={v}")]
    cli.main(args)
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["cells"]) == 3 and results["command"].startswith("python -m mini_moe study")
    assert results["wall_seconds"] >= sum(c["train_seconds"] for c in results["cells"]) > 0
    rows = {(r["router"], r["capacity"]): r for r in results["summary"]}
    assert set(rows) == {("dense", 1), ("soft_moe", 1), ("soft_moe", 2)}
    # Capacity 2 processes twice the slots: XLA counts more FLOPs.
    assert rows[("soft_moe", 2)]["train_flops"] > rows[("soft_moe", 1)]["train_flops"] > 0
    assert (tmp_path / "accuracy_vs_train_seconds.png").exists() and (tmp_path / "training_curves.png").exists()
    assert (tmp_path / "capacity_sweep.png").exists()
    # Resumable: a second run finds every result.json and trains nothing.
    (tmp_path / "soft_moe-c2-s0" / "result.json").unlink()
    before = (tmp_path / "dense-s0" / "result.json").stat().st_mtime
    cli.main(args)
    assert (tmp_path / "soft_moe-c2-s0" / "result.json").exists()
    assert (tmp_path / "dense-s0" / "result.json").stat().st_mtime == before
    # Every cell carries its mechanisms; Soft MoE and the dense ViT see one image at a time.
    results = json.loads((tmp_path / "results.json").read_text())
    assert all(c["mechanisms"]["batch_dependence"] == 0.0 for c in results["cells"])
    assert [len(c["mechanisms"]["layers"]) for c in results["cells"]] == [0, 1, 1]  # TINY: depth 2, Every-2
    # A fresh clone continues from committed results (--done): nothing is trained again.
    committed = tmp_path / "committed.json"
    committed.write_text((tmp_path / "results.json").read_text())
    fresh = tmp_path / "fresh"
    args_fresh = [a if a != str(tmp_path) else str(fresh) for a in args] + ["--done", str(committed)]
    cli.main(args_fresh)
    again = json.loads((fresh / "results.json").read_text())
    assert again["cells"] == results["cells"] and not (fresh / "dense-s0").exists()
    # Every comparison written carries its raw and Holm p-values, the effect and the pairs.
    assert again["comparisons"] and all({"difference", "pairs", "p_value"} <= set(row) for row in again["comparisons"])
    # Finished cells are reused only with the configuration they were made with: another
    # setting is refused, through --done (the study's settings) and in a cell's folder (its config.json).
    other = [a if a != "model_mlp_dim=16" else "model_mlp_dim=32" for a in args_fresh]
    assert cli.main(other) == 2
    assert "done= holds cells of a study made with other settings: overrides was" in capsys.readouterr().err
    changed = study.cell_config("soft_moe", 2, 0, dataset="digits", scale="quick", **{**tiny, "steps": 7})
    with pytest.raises(ValueError, match="different configuration.*differs in: steps"):
        study.run_cell(changed, tmp_path / "soft_moe-c2-s0", progress=False, capacity=2)


def test_step_flops_counts_every_study_router():
    """Every router's training step compiles for the FLOP count (also the noisy, RNG-carrying
    softmax Token Choice), and k = 2 costs more than k = 1: twice the expert buffer."""
    from mini_moe import study

    tiny = {k: v for k, v in TINY.items() if k != "model_group_images"}
    # The variants that only set a router's options compile as their router does; the one that
    # changes its combine weights is kept (tests/test_routing_controls.py checks the others' options).
    compiled = [r for r in study.STUDY_ROUTERS if r not in study.VARIANTS or r.endswith("plan_combine")]
    flops = {(r, c): study.step_flops(study.cell_config(r, c, 0, dataset="digits", scale="quick", **tiny))
             for r in compiled for c in (1, 2) if c == 1 or r == "softmax_token_choice"}
    assert all(math.isfinite(f) and f > 0 for f in flops.values()), flops
    assert flops[("softmax_token_choice", 2)] > flops[("softmax_token_choice", 1)]


def test_study_summary_is_mean_and_std_over_seeds():
    from mini_moe import study

    cells = [{"router": "soft_moe", "capacity": 1, "test_accuracy": a, "ten_shot_accuracy": a / 2,
              "train_seconds": 10.0 * a, "train_flops": 1e9} for a in (0.8, 0.9, 1.0)]
    cells.append({"router": "dense", "capacity": 1, "test_accuracy": 0.5, "ten_shot_accuracy": 0.4,
                  "train_seconds": 3.0, "train_flops": 2e9})
    rows = {r["router"]: r for r in study.summarize(cells)}
    assert rows["soft_moe"]["seeds"] == 3
    assert rows["soft_moe"]["test_accuracy"] == pytest.approx(0.9)
    assert rows["soft_moe"]["test_accuracy_std"] == pytest.approx(np.std([0.8, 0.9, 1.0], ddof=1))
    assert rows["dense"]["test_accuracy_std"] == 0.0 and rows["dense"]["train_flops"] == 2e9


def test_study_compare_is_paired_over_seed_and_capacity():
    from mini_moe import study

    def cell(router, capacity, seed, acc):
        return {"router": router, "capacity": capacity, "seed": seed, "test_accuracy": acc}

    cells = [cell("a", 1, 0, 0.80), cell("a", 1, 1, 0.90), cell("b", 1, 0, 0.70), cell("b", 1, 1, 0.86),
             cell("c", 1, 0, 0.74), cell("c", 1, 1, 0.88), cell("a", 2, 0, 0.95)]  # ("a", 2) has no partner
    out = study.compare(cells, "a", "b")
    assert out["pairs"] == 2 and out["difference"] == pytest.approx((0.10 + 0.04) / 2)
    assert out["stderr"] == pytest.approx(np.std([0.10, 0.04], ddof=1) / np.sqrt(2))
    # A group's cells are averaged before the difference is taken.
    grouped = study.compare(cells, "a", ["b", "c"])
    assert grouped["difference"] == pytest.approx(((0.80 - 0.72) + (0.90 - 0.87)) / 2)
    with pytest.raises(ValueError, match="No \\(seed, capacity\\)"):
        study.compare(cells, "a", "b", capacities=[2])


# ------------------------------------------------- fresh runs, weight decay, eval mode


def test_resume_false_replaces_the_run_in_out_dir(tmp_path, digits):
    """The chapters' pattern: train(cfg, out, resume=False) then load_trained(out). A second,
    shorter run with another seed and learning rate must replace the first one entirely."""
    train.train(_cfg(), tmp_path / "run", progress=False, datasets=digits)  # 6 steps, checkpoint at 6
    new = _cfg(steps=3, eval_every=3, checkpoint_every=3, seed=1, learning_rate=3e-3)
    history = train.train(new, tmp_path / "run", resume=False, progress=False, datasets=digits)
    train.train(new, tmp_path / "reference", progress=False, datasets=digits)  # the same run, fresh folder
    loaded, cfg = train.load_trained(tmp_path / "run")
    reference, _ = train.load_trained(tmp_path / "reference")
    assert cfg == new
    for a, b in zip(_params(loaded), _params(reference), strict=True):
        np.testing.assert_array_equal(a, b)
    assert runs.checkpoints(tmp_path / "run").all_steps() == [3]  # the old step-6 checkpoint is gone
    saved = json.loads((tmp_path / "run" / "history.json").read_text())
    assert [r["step"] for r in saved["eval"]] == [r["step"] for r in history["eval"]] == [3]
    assert evaluate.accuracy(loaded, digits[1]) == pytest.approx(history["eval"][-1]["test_accuracy"])


def test_save_checkpoint_raises_when_the_step_is_not_saved(tmp_path):
    cfg = _cfg()
    model = train.make_model(cfg)
    optimizer = train.make_optimizer(model, cfg)
    manager = runs.checkpoints(tmp_path)
    train.save_checkpoint(manager, 5, model, optimizer)
    with pytest.raises(RuntimeError, match="step 3"):  # Orbax skips a step at or below its latest
        train.save_checkpoint(manager, 3, model, optimizer)
    assert manager.all_steps() == [5]


def _path_names(model, leaves):
    paths = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    return {"/".join(str(getattr(k, "key", "")) for k in path if hasattr(k, "key")): x
            for (path, _), x in zip(paths, leaves, strict=True)}


@pytest.mark.parametrize("router", ["soft_moe", "softmax_token_choice"])
def test_weight_decay_only_on_weight_matrices(router):
    """One AdamW update with zero gradients moves only the decayed parameters, each by
    exactly -lr * weight_decay * param (decoupled decay); everything else stays put."""
    lr, wd = 0.01, 0.1
    cfg = _cfg(router=router, learning_rate=lr, weight_decay=wd, warmup_steps=0)  # lr(step 0) = lr
    model = train.make_model(cfg)
    nnx.update(model, jax.tree.map(lambda p: p + 0.5, nnx.state(model, nnx.Param)))  # no zeros (head, biases)
    optimizer = train.make_optimizer(model, cfg)
    before = _path_names(model, _params(model))
    optimizer.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)))
    after = _path_names(model, _params(model))
    decayed = {name for name in before if not np.array_equal(before[name], after[name])}
    for name in decayed:
        np.testing.assert_allclose(after[name], before[name] * (1 - lr * wd), rtol=1e-6, atol=1e-9)
    expected = {"embed/kernel", "head/kernel"}
    for i in range(2):
        expected |= {f"blocks/{i}/attn/{p}/kernel" for p in ("query", "key", "value", "out")}
        moe = i == 1 or router == "soft_moe"  # Soft MoE: last2; token choice: every2 (block 1)
        expected |= ({f"blocks/{i}/mlp/experts/w1", f"blocks/{i}/mlp/experts/w2"} if moe
                     else {f"blocks/{i}/mlp/fc1/kernel", f"blocks/{i}/mlp/fc2/kernel"})
        if moe and router != "soft_moe":
            expected.add(f"blocks/{i}/mlp/router/affinity/dense/kernel")  # the router's W
    assert decayed == expected, (sorted(decayed - expected), sorted(expected - decayed))
    kept = set(before) - decayed
    assert {"pos", "norm/scale", "norm/bias", "head/bias", "blocks/1/mlp/experts/b1"} <= kept
    if router == "soft_moe":
        assert {"blocks/0/mlp/router/affinity/scale", "blocks/0/mlp/router/affinity/phi"} <= kept


def _modes(model) -> dict:
    return {path: (m.deterministic, getattr(m, "use_running_average", None))
            for path, m in nnx.iter_graph(model) if isinstance(m, nnx.Module) and hasattr(m, "deterministic")}


_EVAL_HELPERS = {
    "features": lambda m, tr, te: evaluate.features(m, te.images[:16]),
    "accuracy": lambda m, tr, te: evaluate.accuracy(m, te),
    "few_shot_accuracy": lambda m, tr, te: evaluate.few_shot_accuracy(m, tr, te, shots=2, max_test=16),
    "router_report": lambda m, tr, te: evaluate.router_report(m, te.images[:16]),
    "expert_maps": lambda m, tr, te: evaluate.expert_maps(m, te.images[:8]),
    "routing_stability": lambda m, tr, te: evaluate.routing_stability(m, te.images[:16]),
}


@pytest.mark.parametrize("mode", ["eval", "train", "as_built"])
@pytest.mark.parametrize("helper", sorted(_EVAL_HELPERS))
def test_evaluation_helpers_leave_the_model_mode_as_they_found_it(digits, helper, mode):
    model = live_head(train.make_model(_cfg(model_router_kwargs={"k": 2})))  # noisy router in training mode
    if mode != "as_built":  # as built: the router is noisy, attention deterministic (mixed)
        getattr(model, mode)()
    modes = _modes(model)
    assert any(tuple(path[-2:]) == ("router", "affinity") for path in modes)  # the noisy affinity is among them
    _EVAL_HELPERS[helper](model, *digits)
    assert _modes(model) == modes
    if mode == "eval":  # still no router noise: the same input gives the same output
        images = jnp.asarray(digits[1].images[:8])
        np.testing.assert_array_equal(np.asarray(model(images).logits), np.asarray(model(images).logits))


def test_study_trains_prc_cells_without_a_dense_baseline(tmp_path):
    from mini_moe import study

    tiny = {k: v for k, v in TINY.items() if k != "model_group_images"}
    results = study.run_study(tmp_path, dataset="digits", routers=["softmax_token_choice"], capacities=(1.0,),
                              seeds=(0,), dense=False, progress=False, augment=True, prc=True, **tiny)
    (cell,) = results["cells"]
    assert cell["router"] == "softmax_token_choice" and cell["steps"] == TINY["steps"]
    with pytest.raises(ValueError, match="Nothing to run"):
        study.run_study(tmp_path / "empty", dataset="digits", routers=[], dense=False, progress=False)


@pytest.fixture
def user_router():
    """A router registered outside the package: the noisy V-MoE softmax with Expert Choice."""
    from mini_moe import routers

    @routers.register("noisy_expert_choice", allocation="expert")
    def noisy_expert_choice(dim, num_experts, *, capacity_factor=1.0, rngs):
        return routers.Router(routers.NoisySoftmax(dim, num_experts, rngs=rngs), routers.ExpertChoice(capacity_factor))

    yield "noisy_expert_choice"
    del routers.ROUTERS["noisy_expert_choice"]


def test_a_router_registered_outside_the_package_trains_studies_and_benchmarks(user_router, tmp_path, digits):
    from mini_moe import bench, study

    # model + train: its declared facts reach the config (groups of images, Every-2 placement)
    cfg = config_lib.get_config("quick", dataset="digits", router=user_router, **TINY)
    assert cfg.model.placement == "every2" and cfg.model.router == user_router
    history = train.train(cfg, tmp_path / "run", progress=False, datasets=digits)
    assert len(history["train"]) >= 1 and np.isfinite(history["train"][-1]["loss"])
    # study: its capacity option comes from the registration
    cell = study.cell_config(user_router, 2, 0, dataset="digits", scale="quick")
    assert dict(cell.model.router_kwargs) == {"capacity_factor": 2.0}
    tiny = {k: v for k, v in TINY.items() if k != "model_group_images"}
    results = study.run_study(tmp_path / "study", dataset="digits", routers=[user_router], capacities=[1],
                              seeds=[0], dense=False, scale="quick", progress=False, **tiny)
    assert [c["router"] for c in results["cells"]] == [user_router]
    assert results["cells"][0]["mechanisms"]["layers"][0]["unprocessed"] is not None
    # bench: its MoE layer is timed like the others
    assert bench.moe_layer_ms(user_router, "quick", repeats=1) > 0


@pytest.fixture
def variable_router():
    """A router registered outside the package whose picks vary per token: every expert whose
    probability is above the uniform 1/E (``TokenChoice(k=E, min_score=0)`` makes exactly those
    picks), with one line per fact the library reads (``pick_rule``; ``per_token`` is inherited)."""
    from mini_moe import routers

    class AboveUniform(routers.Affinity):
        pick_rule = "above-uniform"

        def __call__(self, x, budget):
            probs = jax.nn.softmax(self.logits(x), axis=-1)
            return routers.Affinities(jnp.where(probs > 1 / self.num_experts, probs, 0.0), probs=probs)

    @routers.register("above_uniform", allocation="token")
    def above_uniform(dim, num_experts, *, capacity_factor=None, rngs):
        return routers.Router(AboveUniform(dim, num_experts, rngs=rngs),
                              routers.TokenChoice(num_experts, capacity_factor, min_score=0.0))

    yield "above_uniform"
    del routers.ROUTERS["above_uniform"]


def test_a_variable_pick_router_registered_outside_the_package_runs_everywhere(variable_router, tmp_path, digits):
    """Adding a router is one file: a router whose number of picks varies trains, and evaluate,
    diagnose, inference and the explorer run on it from what it reports (its picks) and declares."""
    from mini_moe import diagnose, evaluate, explorer, inference, modes

    cfg = config_lib.get_config("quick", dataset="digits", router=variable_router,
                                **{**TINY, "model_router_kwargs": {"capacity_factor": 4.0}})
    train.train(cfg, tmp_path / "run", progress=False, datasets=digits)
    model = train.make_model(cfg)
    images = digits[1].images[:32]
    preds, layers = evaluate.routing_record(model, images, batch_size=32)
    (layer,) = layers
    # C = T slots: every pick made is kept, so the picks reported are the experts that process each patch
    np.testing.assert_array_equal(layer["picks"], layer["hits"].sum(-1))
    assert 1 <= layer["picks"].max() < model.cfg.routed_experts  # the number varies, below E
    assert evaluate.mechanisms(model, images, stability_images=8)["layers"][0]["dropped_routes"] == 0.0
    report = diagnose.diagnose(model, images)
    assert report["family"] == "above-uniform c=4" and report["batch_invariant"]["invariant"]
    assert modes.invariance(model)[0]  # per token, and C >= T
    mismatch = inference.precision_mismatch(model, images, batch_size=32)
    assert 0.0 <= mismatch[0]["isolated"] <= 1.0
    rows = inference.capacity_sweep(model, dataclasses.replace(digits[1], images=images, labels=digits[1].labels[:32]),
                                    [1.0, 4.0], regroupings=2)
    assert rows[1]["dropped_routes"] == [0.0]
    view = explorer.routing_view(model, images, image=1)
    assert view["experts_per_patch"].max() == layer["picks"][1].max()


def _full_model(router, *, abstract=False):
    """The full configuration's model and optimizer; ``abstract``: built by ``nnx.eval_shape`` (shapes
    and dtypes, no parameter drawn: a concrete build compiles every initialiser op by op)."""
    cfg = config_lib.get_config("full", dataset="cifar10", router=router, steps=2, batch_size=8)
    assert (cfg.model.dim, cfg.model.depth, cfg.model.num_experts) == (192, 8, 16)

    def build():
        model = train.make_model(cfg)
        return model, train.make_optimizer(model, cfg)

    model, optimizer = nnx.eval_shape(build) if abstract else build()
    return cfg, model, optimizer


FULL_BATCH = (jax.random.normal(jax.random.key(0), (8, 32, 32, 3)), jnp.arange(8) % 10)


@pytest.mark.parametrize("router", [None] + sorted(n for n, s in config_lib.routers_lib.ROUTERS.items() if s.data is None))
def test_full_configuration_builds_and_traces_a_training_step(router):
    """The configuration readers run on a GPU/TPU (CIFAR-10, ``full``: D=192, depth 8, 16 experts)
    cannot rot on a CPU-only CI: each router's model is built at that size and its AdamW step is
    traced (``jax.eval_shape``: every shape and dtype of the step is computed, nothing is compiled)
    on one routing group; the step hands back a state of the same structure, shapes and dtypes, and
    a float32 loss. Three of them also run (the next test); that a step moves every parameter of
    every router is tests/test_routers.py's, at the quick size."""
    cfg, model, optimizer = _full_model(router, abstract=True)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, images, labels):
        model, optimizer = nnx.merge(graphdef, state)
        stats = train.train_step(model, optimizer, images, labels, aux_weight=cfg.aux_loss_weight)
        return stats, nnx.state((model, optimizer))

    stats, after = jax.eval_shape(step, state, *FULL_BATCH)
    assert stats["loss"].shape == () and stats["loss"].dtype == jnp.float32
    assert jax.tree.structure(after) == jax.tree.structure(state)
    assert all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(state)))


@pytest.mark.parametrize("router", [None, "softmax_token_choice", "sinkhorn_token_choice"])
def test_full_configuration_takes_two_training_steps(router):
    """The dense ViT, Token Choice and a transport plan at the full size run two AdamW steps: the
    loss stays finite and every trained parameter moves (compiling each step takes most of a
    minute on two cores, so the other routers are traced, above)."""
    cfg, model, optimizer = _full_model(router)
    before = jax.tree.leaves(nnx.state(model, nnx.Param))
    for _ in range(2):
        stats = train.train_step(model, optimizer, *FULL_BATCH, aux_weight=cfg.aux_loss_weight)
        assert np.isfinite(float(stats["loss"])) and np.isfinite(float(stats["aux_loss"]))
    after = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(not np.array_equal(a, b) for a, b in zip(before, after))


def test_a_second_run_of_the_same_configuration_compiles_no_new_training_step(tmp_path):
    """Runs that differ only in seed (a study's paired cells, a resume) share the compiled training
    step: the optimizer's structure, by which nnx.jit caches it, holds one optax transformation per
    set of hyperparameters (train._transform). A new transformation per run recompiled the step every
    time (9 s of a 10 s tiny run on a 2-core EPYC)."""
    import logging

    tiny = dict(steps=2, batch_size=32, eval_every=2, checkpoint_every=2, eval_batch_size=64, model_dim=16,
                model_depth=2, model_heads=2, model_mlp_dim=16, model_num_experts=4, model_group_images=4)
    cfg = config_lib.get_config("quick", dataset="digits", router="softmax_token_choice", **tiny)
    data = train.load_data(cfg)
    train.train(cfg, tmp_path / "first", progress=False, datasets=data)
    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect()
    logging.getLogger("jax").addHandler(handler)
    try:
        with jax.log_compiles(True):
            other = config_lib.get_config("quick", dataset="digits", router="softmax_token_choice", seed=7, **tiny)
            train.train(other, tmp_path / "second", progress=False, datasets=data)
            assert not [m for m in messages if m.startswith("Compiling") and "train_step" in m]
            train._transform.cache_clear()  # the mutant: a new transformation, so a new structure
            train.train(other, tmp_path / "third", progress=False, datasets=data)
            assert [m for m in messages if m.startswith("Compiling") and "train_step" in m]
    finally:
        logging.getLogger("jax").removeHandler(handler)


def test_learning_rate_schedules_warm_up_then_decay_or_hold():
    """``schedule="cosine"`` ends at 1 % of the rate, ``"constant"`` holds it after the warmup
    (issue 51's budgets are evaluations of one constant-rate run); both warm up linearly."""
    import numpy as np
    cosine = train.learning_rate_schedule(2e-3, 100, 1000, "cosine")
    constant = train.learning_rate_schedule(2e-3, 100, 1000, "constant")
    for rate in (cosine, constant):
        np.testing.assert_allclose([float(rate(0)), float(rate(50)), float(rate(100))], [0.0, 1e-3, 2e-3], rtol=1e-6)
    np.testing.assert_allclose(float(cosine(1000)), 2e-5, rtol=1e-5)
    assert float(cosine(550)) < 2e-3 * 0.6
    np.testing.assert_allclose([float(constant(s)) for s in (101, 550, 1000, 5000)], 2e-3, rtol=1e-6)
    with pytest.raises(ValueError, match="schedule must be one of"):
        config_lib.get_config("quick", schedule="linear")


def test_kept_checkpoints_give_the_model_at_each_budget(tmp_path, digits):
    """``keep_every`` keeps the checkpoints at its multiples (issue 51 measures one constant-rate
    run at several budgets): the model loaded at step 4 of an 8-step run equals the final model
    of the same run trained for 4 steps, and an unkept step is refused with the steps that exist."""
    long = _cfg(steps=8, eval_every=2, checkpoint_every=2, keep_every=4, schedule="constant", warmup_steps=1)
    short = dataclasses.replace(long, steps=4, keep_every=0)
    train.train(long, tmp_path / "long", progress=False, datasets=digits)
    train.train(short, tmp_path / "short", progress=False, datasets=digits)
    at4, _ = train.load_trained(tmp_path / "long", step=4)
    final4, _ = train.load_trained(tmp_path / "short")
    for a, b in zip(_params(at4), _params(final4)):
        np.testing.assert_array_equal(a, b)
    final8, _ = train.load_trained(tmp_path / "long")
    assert any(not np.array_equal(a, b) for a, b in zip(_params(at4), _params(final8)))
    with pytest.raises(ValueError, match=r"step=2 is not among the checkpoints kept .*\[4, 6, 8\]"):
        train.load_trained(tmp_path / "long", step=2)
    with pytest.raises(ValueError, match="keep_every must be a multiple of checkpoint_every"):
        _cfg(checkpoint_every=2, keep_every=3)


def test_each_seed_has_noise_and_parameter_streams_of_its_own():
    """Code review B8: ``noise=seed + 1`` gave seed s the noise base key of seed s + 1's
    parameters. The noise base key of every seed differs from every seed's parameter base key
    and from the first draws of its own parameter stream (which folds in a draw counter)."""
    def key_data(key):
        return tuple(np.asarray(jax.random.key_data(key)).ravel().tolist())

    seeds = range(16)
    params = {key_data(train.model_rngs(s).params.key[...]) for s in seeds}
    noise = {key_data(train.model_rngs(s).noise.key[...]) for s in seeds}
    assert len(params) == len(noise) == len(seeds)
    assert not params & noise
    for s in seeds:
        base = train.model_rngs(s).params.key[...]
        draws = {key_data(jax.random.fold_in(base, c)) for c in range(256)}
        assert key_data(train.model_rngs(s).noise.key[...]) not in draws
    # the model of a config draws its routers' noise from seed 3's noise stream: each noisy
    # router forks the next key of that stream
    model = train.make_model(config_lib.TrainConfig(model=ModelConfig(router="softmax_token_choice"), seed=3))
    forked = {key_data(m.rngs.key[...]) for _, m in nnx.iter_graph(model) if hasattr(m, "noise_std")}
    noise_base = train.model_rngs(3).noise.key[...]
    assert forked and forked == {key_data(jax.random.fold_in(noise_base, c)) for c in range(len(forked))}


# ------------------------------------------------------------- a run that starts from given weights


def _flat(model) -> dict:
    return train._flat_values(nnx.state(model))


@pytest.fixture(scope="module")
def upcycled_start(tmp_path_factory, digits):
    """A dense run of 6 steps, its model upcycled to Token Choice (E = 4), and the configuration of
    an MoE run that continues it from step 6 to 12 (issue 54)."""
    from mini_moe.upcycle import upcycle

    folder = tmp_path_factory.mktemp("dense")
    train.train(_cfg(router=None), folder, progress=False, datasets=digits)
    dense, _ = train.load_trained(folder)
    moe = upcycle(dense, router="softmax_token_choice", num_experts=4, seed=3)
    cfg = dataclasses.replace(_cfg(steps=12, schedule="constant", warmup_steps=1), model=moe.cfg)
    return folder, dense, moe, cfg


def test_a_run_from_given_weights_starts_with_them_and_resumes_exactly(tmp_path, digits, upcycled_start, monkeypatch):
    """``init_from`` + ``start_step``: at its start the model holds exactly the given weights (all of
    its variables); it trains on the batches from ``start_step`` on; history records the start; an
    interrupted run resumes to the same parameters as an uninterrupted one."""
    import functools

    _, _, moe, cfg = upcycled_start
    seen = {}

    def measure(step, model):
        seen[step] = _flat(model)

    history = train.train(cfg, tmp_path / "straight", progress=False, datasets=digits, init_from=moe, start_step=6,
                          measure=measure, measure_at={6, 9})
    assert sorted(seen) == [6, 9]
    want = _flat(moe)
    assert seen[6].keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(seen[6][name], value, err_msg=name)
    assert any(not np.array_equal(seen[9][n], want[n]) for n in want)  # it trained
    assert history["start"]["step"] == 6 and history["start"]["fingerprint"] == train.state_fingerprint(nnx.state(moe))
    assert history["start"]["from"]["model"]["router"] == "softmax_token_choice"
    assert [r["step"] for r in history["eval"]] == [9, 12] and [r["step"] for r in history["train"]] == [12]

    from interrupted import train_interrupted_then_resumed

    monkeypatch.setattr(train, "train", functools.partial(train.train, init_from=moe, start_step=6))
    resumed = train_interrupted_then_resumed(cfg, tmp_path / "resumed", digits, monkeypatch)
    monkeypatch.undo()
    assert resumed["start"] == history["start"] and [r["step"] for r in resumed["eval"]] == [9, 12]
    a, _ = train.load_trained(tmp_path / "straight")
    b, _ = train.load_trained(tmp_path / "resumed")
    for x, y in zip(_params(a), _params(b)):
        np.testing.assert_array_equal(x, y)


def test_a_run_from_given_weights_refuses_other_checkpoints_and_other_shapes(tmp_path, digits, upcycled_start):
    """Never a silent reuse: a folder whose checkpoints started otherwise (other weights, another
    step, or a plain run) is refused, either way; weights of another shape are an InputError that
    names the variable, raised before ``out_dir`` is touched."""
    from mini_moe.upcycle import upcycle

    dense_dir, dense, moe, cfg = upcycled_start
    train.train(cfg, tmp_path / "up", progress=False, datasets=digits, init_from=moe, start_step=6)
    other = upcycle(dense, router="softmax_token_choice", num_experts=4, seed=4)
    for kwargs in ({}, dict(init_from=other, start_step=6), dict(init_from=moe, start_step=3)):
        with pytest.raises(train.InputError, match="holds checkpoints of a run that started at step"):
            train.train(cfg, tmp_path / "up", progress=False, datasets=digits, **kwargs)
    train.train(cfg, tmp_path / "plain", progress=False, datasets=digits)
    with pytest.raises(train.InputError, match="started from cfg.seed's initialisation at step 0"):
        train.train(cfg, tmp_path / "plain", progress=False, datasets=digits, init_from=moe, start_step=6)
    # shapes: two experts where the configuration has four; a dense run folder for an MoE model
    two = upcycle(dense, router="softmax_token_choice", num_experts=2, seed=3)
    with pytest.raises(train.InputError, match=r"init_from's blocks\.1\.mlp\.experts\.b1 has shape \(2, 1, 16\)"):
        train.train(cfg, tmp_path / "bad", progress=False, datasets=digits, init_from=two)
    with pytest.raises(train.InputError, match=r"init_from has no variable blocks\.1\.mlp\.experts"):
        train.train(cfg, tmp_path / "bad", progress=False, datasets=digits, init_from=dense_dir)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(train.InputError, match="start_step > 0 needs init_from"):
        train.train(cfg, tmp_path / "bad", progress=False, datasets=digits, start_step=2)
    # a run folder as the source: its newest checkpoint, recorded by folder and step
    history = train.train(_cfg(router=None, steps=9), tmp_path / "dense2", progress=False, datasets=digits,
                          init_from=dense_dir, start_step=6)
    assert history["start"]["from"] == {"run": str(dense_dir.resolve()), "step": 6}
