"""The runner of issue 54 §2's registered compute-per-patch comparison
(mini_moe/results/compute_per_patch.py): its plan against the registration, its ``smoke`` plan end
to end (digits, a tiny model, every arm), the refusal to train before the registration and the
runner are committed, the analysis against a hand computation, and the per-patch measurement
against the routing rules computed again in NumPy from the routers' weights."""

import importlib.util
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from mini_moe import modes, train
from mini_moe.model import patchify
from mini_moe.validate import InputError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_runner():
    spec = importlib.util.spec_from_file_location("compute_per_patch_runner",
                                                  ROOT / "mini_moe/results/compute_per_patch.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


cpp = _load_runner()


def _numbers(obj):
    """Every number in a JSON-like object."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return []
    if isinstance(obj, (int, float)):
        return [obj]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _numbers(v)]
    return [x for v in obj for x in _numbers(v)]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    runs = tmp_path_factory.mktemp("compute_per_patch")
    cpp.main(["smoke", "--runs", str(runs)])
    return runs, json.loads(cpp.results_path(cpp.SMOKE, runs).read_text())


# ------------------------------------------------------------------------------ the registration


def test_the_plan_follows_the_registration():
    plan = cpp.REGISTERED
    assert (plan.dataset, plan.steps, plan.control, plan.seeds) == ("fashion_mnist", 2000, (500, 2000),
                                                                    tuple(range(310, 318)))
    assert (plan.measure_batch, plan.regroupings) == (512, 4)
    assert list(cpp.ARMS) == ["tc_k2", "ec_c2", "adamoe", "longcat", "longcat_frozen", "top_p", "remoe"]
    cfgs = {arm: cpp.config(arm, 310, plan) for arm in cpp.ARMS}
    for arm, cfg in cfgs.items():
        m = cfg.model
        assert (cfg.steps, cfg.eval_every, cfg.schedule, cfg.warmup_steps, cfg.learning_rate, cfg.batch_size,
                cfg.weight_decay, cfg.grad_clip, cfg.aux_loss_weight, cfg.seed) == (
            2000, 500, "cosine", 100, 2e-3, 128, 1e-4, 1.0, 0.01, 310), arm
        assert (m.dim, m.mlp_dim, m.depth, m.heads, m.patch_size, m.num_experts, m.group_images, m.placement,
                m.dtype, m.num_patches) == (64, 64, 4, 4, 7, 8, 8, "every2", "float32", 16), arm
        assert m.moe_path == ("auto" if arm == "ec_c2" else "dropless"), arm
    kwargs = {arm: dict(cfg.model.router_kwargs) for arm, cfg in cfgs.items()}
    assert cfgs["tc_k2"].model.router == "softmax_token_choice" and kwargs["tc_k2"]["k"] == 2
    assert cfgs["ec_c2"].model.router == "softmax_expert_choice" and kwargs["ec_c2"] == {"capacity_factor": 2.0}
    for arm in ("adamoe", "longcat", "longcat_frozen"):
        assert cfgs[arm].model.null_experts == ("zero",) * 8 and kwargs[arm]["k"] == 4
    assert kwargs["longcat"] | {"frozen": True} == kwargs["longcat_frozen"]
    assert (kwargs["longcat"]["target_real"], kwargs["longcat"]["bias_rate"]) == (2.0, 0.1)
    assert (kwargs["top_p"]["target_k"], kwargs["top_p"]["pick_bound"]) == (2.0, 4.0)
    assert (kwargs["remoe"]["k"], kwargs["remoe"]["active_bound"]) == (2, 2.0)
    rows = cpp.contrasts(plan)
    assert [r[1:5] for r in rows] == [("adamoe", 2000, "tc_k2", 2000), ("longcat", 2000, "tc_k2", 2000),
                                      ("top_p", 2000, "tc_k2", 2000), ("remoe", 2000, "tc_k2", 2000),
                                      ("ec_c2", 2000, "tc_k2", 2000), ("longcat", 2000, "longcat_frozen", 2000),
                                      ("tc_k2", 2000, "tc_k2", 500)]


# ------------------------------------------------------------------------------------ the smoke run


def test_the_smoke_run_records_every_cell_with_finite_numbers(smoke):
    runs, record = smoke
    plan = cpp.SMOKE
    cells = {(r["arm"], r["seed"]): r for r in record["runs"]}
    assert set(cells) == {(arm, seed) for arm in cpp.ARMS for seed in plan.seeds}
    for (arm, seed), cell in cells.items():
        assert "failed" not in cell, cell
        assert all(math.isfinite(x) for x in _numbers(cell)), arm
        assert set(cell["test_accuracy"]) == {"10", "20"} and cell["measured_at"] == 20
        assert "source_commit" in cell and cell["config"]["model"]["moe_path"] == cpp.ARMS[arm].path
        row = cell["secondary"]
        assert row["images"] == 300  # the digits test split
        assert len(row["layers"]) == 1 and row["layers"][0]["block"] == 1  # Every-2 in 2 blocks
        layer = row["layers"][0]
        assert len(layer["by_position"]) == 4 and len(layer["by_position"][0]) == 4
        assert len(layer["distribution"]) == 9 and sum(layer["distribution"]) == pytest.approx(1.0)
        assert layer["none"] == layer["distribution"][0]
        assert layer["mean"] == pytest.approx(np.dot(np.arange(9), layer["distribution"]))
        assert layer["mean"] == pytest.approx(np.mean(layer["by_position"]))
        assert row["reached_mean"] == layer["mean"] and row["matched"] == (abs(layer["mean"] - 2) <= 0.25)
        assert row["expert_flops_per_image"]["mean"] == pytest.approx(layer["mean"] * 16 * 2 * 2 * 16 * 16)
        assert set(row["batch_dependence"]) >= {"regroup", "permute"}
        with np.load(runs / f"{arm}-s{seed}" / "real_experts.npz") as f:
            assert f["layer_0"].shape == (row["images"], 16) and f["layer_0"].mean() == pytest.approx(layer["mean"])
    tc = cells["tc_k2", 0]["secondary"]["layers"][0]
    assert tc["distribution"][2] == 1.0 and tc["spearman_variance"] is None  # dropless k = 2: every patch 2
    assert cells["tc_k2", 0]["secondary"]["batch_dependence"]["regroup"]["mean"] == 0.0  # dropless: batch-invariant
    # E C = 2 T slots per group, all full (the padded last batch's copies hold some of them)
    assert cells["ec_c2", 0]["secondary"]["layers"][0]["mean"] == pytest.approx(2.0, abs=0.1)
    assert record["machine"]["cpu"] and record["plan"] == "smoke"


def test_the_routing_control_keeps_its_router_at_initialisation(smoke):
    """``longcat_frozen``'s router weights are those of its initialisation after training, while
    ``longcat``'s moved; in both the controller moved the real experts' bias."""
    runs, _ = smoke
    for arm, frozen in (("longcat", False), ("longcat_frozen", True)):
        model, cfg = train.load_trained(runs / f"{arm}-s0")
        start = train.make_model(cfg)
        for block, first in zip(model.blocks, start.blocks):
            if block.use_moe:
                affinity = block.mlp.router.affinity
                same = np.array_equal(affinity.dense.kernel[...], first.mlp.router.affinity.dense.kernel[...])
                assert same == frozen, arm
                assert np.any(np.asarray(affinity.bias[...])[:8] != 0) and np.all(np.asarray(affinity.bias[...])[8:] == 0)


def test_a_second_invocation_trains_nothing(smoke, monkeypatch):
    runs, record = smoke

    def refuse(*args, **kwargs):
        raise AssertionError("a finished cell was trained again")

    monkeypatch.setattr(cpp, "run_cell", refuse)
    cpp.main(["smoke", "--runs", str(runs)])
    assert json.loads(cpp.results_path(cpp.SMOKE, runs).read_text())["runs"] == record["runs"]


def test_a_cell_resumed_after_its_last_checkpoint_is_measured_from_it(smoke, tmp_path):
    """A cell stopped between its last checkpoint and its measurement: the rerun trains nothing
    and measures the checkpoint, which gives what the live model gave (router state included:
    top-p's threshold)."""
    runs, record = smoke
    copy = tmp_path / "runs"
    shutil.copytree(runs, copy)
    (copy / "top_p-s0" / "secondary.json").unlink()
    out = cpp.results_path(cpp.SMOKE, copy)
    out.write_text(json.dumps({**record, "runs": [r for r in record["runs"] if r["arm"] != "top_p"]}))
    cpp.main(["smoke", "--runs", str(copy)])
    again = next(r for r in json.loads(out.read_text())["runs"] if r["arm"] == "top_p")
    first = next(r for r in record["runs"] if r["arm"] == "top_p")
    assert again["secondary"] == first["secondary"] and again["test_accuracy"] == first["test_accuracy"]
    assert again["train_log"] == first["train_log"]


# ---------------------------------------------------------------------------- refusal before commit


RUNNER_FILES = ["mini_moe/results/compute-per-patch-preregistration.md", "mini_moe/results/compute_per_patch.py",
                "mini_moe/results/compute_per_patch.sh"]


def _git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def _script_files():
    """The files compute_per_patch.sh requires committed (its PREREG and RUNNER)."""
    text = (ROOT / "mini_moe/results/compute_per_patch.sh").read_text()
    runner = re.search(r'^RUNNER="([^"]*)"', text, re.M)[1].split()
    return ["mini_moe/results/compute-per-patch-preregistration.md"] + runner


def test_the_script_refuses_to_train_before_the_registration_and_runner_are_committed(tmp_path):
    """In a scratch repository: nothing committed, then all but the runner, then the runner
    changed after its commit: each time exit status 2 and the file named, before any pinning.
    With everything committed it goes on to pin the last commit of those files (and stops there,
    as the scratch checkout has no importable mini_moe)."""
    files = _script_files()
    assert set(RUNNER_FILES) <= set(files) and "mini_moe/routers/adaptive.py" in files
    repo = tmp_path / "repo"
    (repo / "mini_moe/results").mkdir(parents=True)
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@t")
    _git(repo, "config", "user.name", "t")
    for f in ("mini_moe/results/compute_per_patch.sh", "mini_moe/results/commit_result.sh"):
        shutil.copy(ROOT / f, repo / f)
    for f in files:
        if not (repo / f).exists():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            (repo / f).write_text("placeholder\n")
    env = {**os.environ, "PY": "false", "MACHINE": "test"}

    def run():
        return subprocess.run(["bash", "mini_moe/results/compute_per_patch.sh", "310"], cwd=repo, env=env,
                              capture_output=True, text=True)

    result = run()
    assert result.returncode == 2 and "commit mini_moe/results/compute-per-patch-preregistration.md" in result.stderr
    _git(repo, "add", *[f for f in files if f != "mini_moe/results/compute_per_patch.py"],
         "mini_moe/results/commit_result.sh")
    _git(repo, "commit", "-q", "-m", "all but the runner")
    result = run()
    assert result.returncode == 2 and "commit mini_moe/results/compute_per_patch.py" in result.stderr
    _git(repo, "add", "mini_moe/results/compute_per_patch.py")
    _git(repo, "commit", "-q", "-m", "the runner")
    (repo / "mini_moe/results/compute_per_patch.py").write_text("changed\n")
    result = run()
    assert result.returncode == 2 and "commit mini_moe/results/compute_per_patch.py" in result.stderr
    assert not (repo / "runs").exists()
    _git(repo, "checkout", "-q", "--", "mini_moe/results/compute_per_patch.py")
    result = run()
    assert result.returncode == 2 and "does not import from" in result.stderr  # past the check, at the pin
    assert _git(repo / "runs/compute-per-patch-source", "rev-parse", "HEAD") == _git(repo, "rev-parse", "HEAD")


def test_confirm_refuses_without_the_pinned_source(tmp_path, monkeypatch):
    monkeypatch.delenv("SOURCE", raising=False)
    with pytest.raises(SystemExit, match="needs SOURCE"):
        cpp.main(["confirm", "310", "--runs", str(tmp_path)])
    monkeypatch.setattr(cpp, "RESULTS", tmp_path)
    with pytest.raises(InputError, match="not the pinned"):
        cpp.run_study(cpp.REGISTERED, [310], tmp_path / "runs", source="0" * 40)
    assert not (tmp_path / "runs").exists() and not cpp.results_path(cpp.REGISTERED, tmp_path).exists()
    with pytest.raises(SystemExit, match="not in the plan"):
        cpp.run_study(cpp.REGISTERED, [300], tmp_path / "runs", source="0" * 40)


# -------------------------------------------------------------------------------------- analysis


def _synthetic(seeds, *, failed=()):
    """A results file's cells: accuracies from a fixed random draw, secondary rows whose reached
    means are 2 except for ``remoe`` (2.5: not matched)."""
    rng = np.random.default_rng(5)
    runs = []
    for seed in seeds:
        for i, arm in enumerate(cpp.ARMS):
            if (arm, seed) in failed:
                runs.append({"arm": arm, "seed": seed, "failed": "loss is not finite at step 7"})
                continue
            late = 0.85 + 0.002 * i + 0.004 * rng.standard_normal()
            mean = 2.5 if arm == "remoe" else 2.0
            layer = {"mean": mean, "none": 0.1}
            runs.append({"arm": arm, "seed": seed,
                         "test_accuracy": {"500": late - 0.03 + 0.004 * rng.standard_normal(), "2000": late},
                         "secondary": {"layers": [layer, layer], "expert_flops_per_image": {"mean": 1.0},
                                       "batch_dependence": {"regroup": {"mean": 0.0}}}})
    return runs


def _holm(p):
    """Holm's adjustment, written out: the i-th smallest (from 0) times m - i, running maximum, capped at 1."""
    order = np.argsort(p, kind="stable")
    adjusted, running = np.empty(len(p)), 0.0
    for i, j in enumerate(order):
        running = max(running, min(1.0, (len(p) - i) * p[j]))
        adjusted[j] = running
    return adjusted


def test_the_analysis_matches_a_hand_computation(tmp_path):
    plan = cpp.REGISTERED
    out = tmp_path / "results.json"
    runs = _synthetic(plan.seeds, failed={("adamoe", 313)})
    out.write_text(json.dumps({"runs": runs}))
    analysis = cpp.analyze(plan, out)["analysis"]
    assert cpp.analysis({"runs": runs}, plan) == analysis  # the file's analysis is the pure function's
    acc = {(r["arm"], r["seed"]): r.get("test_accuracy") for r in runs}
    # contrast 1, adamoe - tc_k2 at 2,000: seed 313 drops out (its adamoe cell failed)
    seeds = [s for s in plan.seeds if s != 313]
    d = np.array([acc["adamoe", s]["2000"] - acc["tc_k2", s]["2000"] for s in seeds])
    n, mean, sd = len(d), d.mean(), d.std(ddof=1)
    t = mean / (sd / math.sqrt(n))
    p = 2 * stats.t.sf(abs(t), n - 1)
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    row = analysis["rows"][0]
    assert row["seeds"] == seeds and row["df"] == 6
    assert (row["difference"], row["t"], row["p_value"]) == pytest.approx((mean, t, p), rel=1e-9)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((mean - half, mean + half), rel=1e-9)
    # contrast 7, tc_k2 at 2,000 - its own evaluation at 500, on all eight seeds
    d7 = [acc["tc_k2", s]["2000"] - acc["tc_k2", s]["500"] for s in plan.seeds]
    assert analysis["rows"][6]["differences"] == pytest.approx(d7) and analysis["rows"][6]["df"] == 7
    holm = _holm(np.array([r["p_value"] for r in analysis["rows"]]))
    assert [r["p_holm"] for r in analysis["rows"]] == pytest.approx(list(holm), rel=1e-12)
    assert holm[6] < 0.05 and np.mean(d7) > 0  # the synthetic control holds
    assert analysis["positive_control_holds"] and not analysis["uninformative"]
    assert analysis["rows"][3]["not_matched"] == ["remoe"] and analysis["rows"][0]["not_matched"] == []
    assert analysis["arms"]["remoe"]["reached_mean_per_layer"] == [2.5, 2.5]
    assert analysis["complete_seeds"] == list(plan.seeds) and not analysis["exploratory"]
    assert analysis["power"] == pytest.approx(0.815, abs=0.005)  # the registration's 0.82 at n = 8
    if holm[0] >= 0.05:
        assert row["verdict"].startswith("no detectable difference (")
    else:
        assert row["verdict"].startswith(("higher by", "lower by"))


def test_the_analysis_waits_for_every_planned_seed(tmp_path):
    plan = cpp.REGISTERED
    out = tmp_path / "results.json"
    runs = [r for r in _synthetic(plan.seeds) if not (r["seed"] == 317 and r["arm"] == "remoe")]
    out.write_text(json.dumps({"runs": runs}))
    with pytest.raises(SystemExit, match="7/8 seeds complete"):
        cpp.analyze(plan, out)
    analysis = cpp.analyze(plan, out, stopped=True)["analysis"]
    assert analysis["complete_seeds"] == list(range(310, 317)) and analysis["stopped"]
    assert all(317 not in r["seeds"] for r in analysis["rows"])


# -------------------------------------------------------------------- the per-patch measurement


def _tiny(router, capacity, **overrides):
    """An untrained tiny digits model (4 blocks: two MoE layers; 16 patches) and its config."""
    cfg = cpp.study.cell_config(router, capacity, 3, dataset="digits", scale="quick", model_dim=16, model_mlp_dim=16,
                                model_heads=2, model_depth=4, **overrides)
    return train.make_model(cfg), cfg


def _router_inputs(model, images, *, calls):
    """What each MoE layer's router sees, ``[B, N, D]`` per layer, from the model's own modules,
    the images in ``calls`` equal calls (a pick bound makes a layer's output depend on its call)."""
    per_layer = []
    with modes.eval_mode(model):
        for chunk in np.split(images, calls):
            x = model.embed(patchify(chunk, model.cfg.patch_size)) + model.pos[...]
            out = []
            for block in model.blocks:
                if block.use_moe:
                    out.append(np.asarray(block.norm2(x + block.attn(block.norm1(x))), np.float64))
                x, _ = block(x)
            per_layer.append(out)
    return [np.concatenate(layer) for layer in zip(*per_layer)]


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def _numpy_counts(kind, model, inputs, *, calls, options):
    """Real experts per patch ``[B, N]`` per layer, by the registered routers' rules in NumPy from
    each router's weight ``W`` (and state), the images routed in ``calls`` equal calls."""
    cfg = model.cfg
    g, e = cfg.group_images, cfg.num_experts
    counts = []
    for x, block in zip(inputs, [b for b in model.blocks if b.use_moe]):
        affinity = block.mlp.router.affinity
        w = np.asarray(affinity.dense.kernel[...], np.float64)
        b, n, _ = x.shape
        logits = x.reshape(b // g, g * n, -1) @ w  # [groups, T, columns]
        if kind == "ec":
            probs = _softmax(logits)
            t = probs.shape[1]
            c = min(t, int(round(options["capacity_factor"] * t / e)))
            made = np.zeros(probs.shape, bool)
            np.put_along_axis(made, np.argsort(-probs, 1)[:, :c, :], True, 1)
        elif kind == "longcat":
            selection = _softmax(logits) + np.asarray(affinity.bias[...], np.float64)
            picked = np.zeros(selection.shape, bool)
            np.put_along_axis(picked, np.argsort(-selection, -1)[..., :options["k"]], True, -1)
            made = picked[..., :e]
        else:
            if kind == "top_p":  # the paper's rule: the fewest top experts whose mass reaches p
                gates = _softmax(logits)
                ranked = np.sort(gates, -1)[..., ::-1]
                before = np.cumsum(ranked, -1) - ranked
                keep_ranked = before < float(affinity.threshold[...])
                made = np.zeros(gates.shape, bool)
                np.put_along_axis(made, np.argsort(-gates, -1, kind="stable"), keep_ranked, -1)
            else:  # ReMoE: every positive ReLU gate
                gates = np.maximum(logits, 0)
                made = gates > 0
            bound = options["bound"]  # picks per token, on average over a call
            per_call = made.shape[0] // calls
            for i in range(calls):  # the bound keeps a call's picks of largest gate
                part, values = made[i * per_call:(i + 1) * per_call], gates[i * per_call:(i + 1) * per_call]
                m = math.ceil(bound * part.shape[0] * part.shape[1])
                if part.sum() > m:
                    threshold = np.sort(values[part])[::-1][m - 1]
                    part &= values >= threshold
        counts.append(made.sum(-1).reshape(b, n))
    return counts


# kind, router, capacity factor, extra config, rule options. (Dropless Token Choice with k = 2, every
# patch 2, is the smoke run's.) The bounds are set to bind: every call drops picks.
CASES = {
    "ec_c2": ("ec", "softmax_expert_choice", 2.0, {}, {"capacity_factor": 2.0}),
    "longcat": ("longcat", "longcat", 4.0, dict(model_moe_path="dropless", model_null_experts=("zero",) * 8,
                                                  model_router_kwargs={"target_real": 2.0}), {"k": 4}),
    "top_p_bound": ("top_p", "top_p", 2.0, dict(model_moe_path="dropless", model_router_kwargs={
        "target_k": 2.0, "pick_bound": 1.5, "threshold": 0.6}), {"bound": 1.5}),
    "remoe_bound": ("remoe", "remoe", 2.0, dict(model_moe_path="dropless", model_router_kwargs={"active_bound": 0.5}),
                    {"bound": 1.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_real_experts_per_patch_match_the_routing_rules_in_numpy(case):
    kind, router, capacity, extra, options = CASES[case]
    model, cfg = _tiny(router, capacity, **extra)
    if kind == "longcat":  # a bias the controller could have reached: the selection is not the plain top-k
        for block in model.blocks:
            if block.use_moe:
                bias = block.mlp.router.affinity.bias
                bias[...] = np.linspace(-0.05, 0.05, bias[...].shape[0]).astype(np.float32) * (np.arange(16) < 8)
    images = train.load_data(cfg)[1].images[:96]
    counts, scalars = cpp.real_experts(model, images, batch_size=32)  # three calls of 32 images
    inputs = _router_inputs(model, images, calls=3)
    want = _numpy_counts(kind, model, inputs, calls=3, options=options)
    assert len(counts) == 2
    for got, expected in zip(counts, want):
        assert got.shape == (96, 16)
        np.testing.assert_array_equal(got, expected)
    if case.endswith("_bound"):  # the bound binds in every call, and the layer's overflow metric agrees
        unbounded = _numpy_counts(kind, model, inputs, calls=3, options={**options, "bound": 100.0})
        for layer, s in enumerate(scalars):
            made = unbounded[layer].reshape(3, -1).sum(1)  # per call
            kept = counts[layer].reshape(3, -1).sum(1)
            assert np.all(made > kept) and np.all(kept == math.ceil(options["bound"] * 32 * 16))
            assert s["overflow"] == pytest.approx(np.mean((made - kept) / made), rel=1e-5)


def test_the_descriptive_measures_against_direct_computations():
    rng = np.random.default_rng(0)
    images = rng.random((5, 28, 28, 1)).astype(np.float32)
    images[:, :7, :7] = 0.25  # a blank corner patch
    var = cpp.patch_variance(images, 7)
    direct = np.array([[images[i, r * 7:(r + 1) * 7, c * 7:(c + 1) * 7].astype(np.float64).var()
                        for r in range(4) for c in range(4)] for i in range(5)])
    np.testing.assert_allclose(var, direct, rtol=1e-12)
    assert np.all(var[:, 0] == 0.0)
    dist = cpp.centre_distance(28, 7)
    assert dist.shape == (16,) and dist[0] == pytest.approx(math.hypot(10.5, 10.5))
    assert dist[5] == pytest.approx(math.hypot(3.5, 3.5)) and dist[3] == dist[12] == dist[0]
    counts = rng.integers(0, 9, (5, 16))
    profile = cpp.layer_profile(counts, var, dist, num_experts=8)
    assert profile["spearman_variance"] == pytest.approx(stats.spearmanr(counts.ravel(), var.ravel()).statistic)
    assert profile["spearman_centre_distance"] == pytest.approx(
        stats.spearmanr(counts.ravel(), np.tile(dist, 5)).statistic)
    assert profile["distribution"] == pytest.approx([np.mean(counts == j) for j in range(9)])
    np.testing.assert_allclose(profile["by_position"], counts.mean(0).reshape(4, 4))
    assert profile["matched"] == (abs(counts.mean() - 2) <= 0.25)
    assert cpp.layer_profile(np.full((5, 16), 2), var, dist, num_experts=8)["spearman_variance"] is None
    flops = cpp.expert_flops([counts, 2 * counts], 64, 64)
    np.testing.assert_array_equal(flops, 3 * counts.sum(1) * 4 * 64 * 64)
    assert patchify(images, 7).shape == (5, 16, 49)
