"""The pre-registered confirmatory study (mini_moe.confirm): its design matches the issue and the
pre-registration, TOST equals two one-sided t-tests computed independently, and the analysis and
bookkeeping (comparisons, collect, todo) do what the results file promises."""

import json
import pathlib
import random

import pytest
from scipy import stats

from mini_moe import confirm, study

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_design_is_what_issue_25_asks_for():
    arms = [("dense" if r is None else r, c) for r, c in confirm.ARMS]
    assert arms[0] == ("dense", 1.0) and len(arms) - 1 <= 6 and len(set(arms)) == len(arms)
    assert len(confirm.SEEDS) >= 8 and not set(confirm.SEEDS) & {0, 1, 2}  # fresh seeds, not the pilot's
    assert len(confirm.CONTRASTS) <= 6
    names = [c[0] for c in confirm.CONTRASTS]
    assert names[0] == "positive_control" and confirm.CONTRASTS[0][4] == ("dense", 1.0)
    for *_, first, second in confirm.CONTRASTS:
        assert first in arms and second in arms and first != second
    cells = confirm.plan()
    assert len(cells) == len(arms) * len(confirm.SEEDS) == len(confirm.cell_names())
    assert [s for *_, s in cells[:len(arms)]] == [confirm.SEEDS[0]] * len(arms)  # seed-major: paired seeds first
    # Every arm trains with the same schedule: only the router options differ.
    configs = [confirm.config(r, c, confirm.SEEDS[0]) for r, c in confirm.ARMS]
    for cfg in configs:
        assert (cfg.steps, cfg.learning_rate, cfg.warmup_steps, cfg.batch_size, cfg.dataset) == (
            configs[0].steps, configs[0].learning_rate, configs[0].warmup_steps, configs[0].batch_size, "patch_vote")
        assert (cfg.model.dim, cfg.model.mlp_dim, cfg.model.num_experts) == (64, 64, 8)


def test_preregistration_states_the_design_in_code():
    text = (ROOT / confirm.PREREGISTRATION).read_text()
    for name, *_ in confirm.CONTRASTS:
        assert f"`{name}`" in text
    assert f"{confirm.SEEDS[0]}-{confirm.SEEDS[-1]}" in text and f"{len(confirm.SEEDS)} seeds" in text.lower().replace(
        "ten paired seeds", f"{len(confirm.SEEDS)} seeds")
    assert f"+-{100 * confirm.BOUND:g} accuracy points" in text
    assert f"{confirm.OVERRIDES['steps']:,} steps" in text and "Holm" in text


@pytest.mark.parametrize("diffs, bound", [
    ([0.001, -0.002, 0.0, 0.001, 0.002], 0.005),
    ([0.02, 0.025, 0.018, 0.03], 0.005),
    ([-0.004, 0.006, -0.001, 0.003, 0.0, 0.002, -0.005, 0.004], 0.005),
])
def test_tost_is_the_larger_of_two_one_sided_t_tests(diffs, bound):
    lower = stats.ttest_1samp([d + bound for d in diffs], 0.0, alternative="greater").pvalue  # H0: mean <= -bound
    upper = stats.ttest_1samp([d - bound for d in diffs], 0.0, alternative="less").pvalue  # H0: mean >= +bound
    assert confirm.tost(diffs, bound) == pytest.approx(max(lower, upper), rel=1e-9)


def test_tost_edge_cases():
    assert confirm.tost([0.001], 0.005) != confirm.tost([0.001], 0.005)  # NaN: one pair has no spread
    assert confirm.tost([0.001, 0.001], 0.005) == 0.0 and confirm.tost([0.01, 0.01], 0.005) == 1.0
    narrow, wide = confirm.tost([0.001, 0.003, -0.002], 0.003), confirm.tost([0.001, 0.003, -0.002], 0.01)
    assert wide < narrow  # a wider bound is easier to show


def _fake_cells(seeds, effect=None, sd=0.005, rng_seed=0):
    """Cells with per-arm means (``effect``: arm -> accuracy) plus a seed effect and noise."""
    rng = random.Random(rng_seed)
    effect = effect or {}
    cells = []
    for seed in seeds:
        shift = rng.gauss(0, 0.01)  # shared by every arm of the seed: what pairing removes
        for router, capacity in confirm.ARMS:
            arm = ("dense" if router is None else router, capacity)
            cells.append({"router": arm[0], "capacity": capacity, "seed": seed,
                          "test_accuracy": effect.get(arm, 0.8) + shift + rng.gauss(0, sd),
                          "ten_shot_accuracy": 0.7, "train_seconds": 100.0, "train_flops": 1e12})
    return cells


def test_comparisons_on_complete_seeds_with_the_first_arm_first():
    effect = {("dense", 1.0): 0.72, ("softmax_expert_choice", 1.0): 0.92}
    cells = _fake_cells(confirm.SEEDS, effect, sd=0.001)
    cells = [c for c in cells if not (c["seed"] == confirm.SEEDS[-1] and c["router"] == "soft_moe")]  # incomplete
    seeds, rows = confirm.comparisons(cells)
    assert seeds == list(confirm.SEEDS[:-1])
    assert [r["name"] for r in rows] == [c[0] for c in confirm.CONTRASTS]
    control = rows[0]
    acc = {(c["router"], c["capacity"], c["seed"]): c["test_accuracy"] for c in cells}
    expected = [acc[("softmax_expert_choice", 1.0, s)] - acc[("dense", 1.0, s)] for s in seeds]
    assert control["differences"] == pytest.approx(expected)
    assert control["difference"] == pytest.approx(sum(expected) / len(expected)) and control["difference"] > 0.15
    assert control["pairs"] == len(seeds) and control["df"] == len(seeds) - 1
    assert control["p"] == pytest.approx(study.paired_t(expected)["p_value"])
    assert control["verdict"].startswith("+") and "softmax_expert_choice (c = 1) higher" in control["verdict"]
    for row in rows:
        assert row["p_holm"] >= row["p"] and row["tost_p_holm"] >= row["tost_p"]
        assert row["arms"][0]["router"] in ("softmax_expert_choice", "sinkhorn_token_choice", "soft_moe")
    # Arms with the same mean and little noise: equivalent within the bound, not "higher".
    sinkhorn = rows[[r["name"] for r in rows].index("sinkhorn_vs_softmax")]
    assert "equivalent within +-0.5 points" in sinkhorn["verdict"] and "higher" not in sinkhorn["verdict"]


def test_comparisons_need_two_complete_seeds():
    assert confirm.comparisons(_fake_cells(confirm.SEEDS[:1])) == ([confirm.SEEDS[0]], [])


def test_collect_keeps_committed_cells_and_adds_finished_ones(tmp_path):
    out, dest = tmp_path / "runs", tmp_path / "results.json"
    cells = _fake_cells(confirm.SEEDS[:3])
    names = list(confirm.cell_names())
    for name, cell in zip(names, cells[:12]):  # the first two seeds finished in an earlier session
        (out / name).mkdir(parents=True)
        (out / name / "result.json").write_text(json.dumps(cell | {"steps": 2000, "unused": 1}))
    first = confirm.collect(out, dest, command="test")
    assert first["finished_cells"] == 12 and first["complete_seeds"] == list(confirm.SEEDS[:2])
    assert "unused" not in first["cells"][0] and first["cells"][0]["steps"] == 2000
    # A fresh clone: no runs folder, one more cell finished there; the committed cells stay.
    fresh = tmp_path / "fresh"
    (fresh / names[12]).mkdir(parents=True)
    (fresh / names[12] / "result.json").write_text(json.dumps(cells[12]))
    second = confirm.collect(fresh, dest)
    assert second["finished_cells"] == 13 and second["command"] == "test"
    assert json.loads(dest.read_text())["cells"] == second["cells"]
    assert [confirm._key(c) for c in second["cells"]] == [confirm._key(c) for c in cells[:13]]  # plan order


def test_todo_lists_what_is_missing(tmp_path, capsys):
    dest = tmp_path / "results.json"
    dest.write_text(json.dumps({"cells": _fake_cells(confirm.SEEDS[:1])}))
    assert confirm.main(["todo", "--dest", str(dest)]) == 0
    todo = capsys.readouterr().out.split()
    assert todo == list(confirm.cell_names())[len(confirm.ARMS):]


def test_unknown_cell_is_a_clear_error(tmp_path, capsys):
    assert confirm.main(["run", "nope-s1", "--out", str(tmp_path)]) == 2
    assert "Unknown cell 'nope-s1'" in capsys.readouterr().err


def test_a_confirmatory_cell_needs_the_pinned_commit_and_a_clean_checkout(monkeypatch):
    """Issue 34 §4: the runner refuses a cell trained by code other than the pinned commit."""
    import subprocess

    from mini_moe import confirm

    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert confirm.source_state()["commit"] == head  # this checkout
    answers = {}
    monkeypatch.setattr(confirm, "_git", lambda *args, cwd=None: answers[args[0]])
    answers.update({"rev-parse": "a1b2c3d4e5f6" + "0" * 28, "status": ""})
    assert confirm.require_pinned("a1b2c3d4e5f6") == {"commit": answers["rev-parse"], "dirty": False}
    with pytest.raises(ValueError, match="not the pinned 0123456789ab"):
        confirm.require_pinned("0123456789ab")
    answers["status"] = " M mini_moe/routers.py"
    with pytest.raises(ValueError, match="uncommitted changes"):
        confirm.require_pinned("a1b2c3d4e5f6")
    answers.update({"rev-parse": None, "status": None})
    with pytest.raises(ValueError, match="commit is unknown"):
        confirm.require_pinned("a1b2c3d4e5f6")


def test_locked_update_creates_keeps_and_returns_the_record(tmp_path):
    """The registered runners' shared results file: a missing file starts as {"runs": []}, each
    update sees the previous one's cells (two processes, one per core, append in turn), and the
    file on disk is what the call returns."""
    path = tmp_path / "cells.json"
    confirm.locked_update(path, lambda rec: rec["runs"].append({"arm": "a", "seed": 1}))
    record = confirm.locked_update(path, lambda rec: rec["runs"].append({"arm": "b", "seed": 1}))
    assert record["runs"] == [{"arm": "a", "seed": 1}, {"arm": "b", "seed": 1}]
    assert json.loads(path.read_text()) == record and path.with_suffix(".lock").exists()
