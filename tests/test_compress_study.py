"""Issue 67 §2's runner (mini_moe/results/compress_study.py): each model's configuration and the
registered analysis on a made-up record, against scipy and Holm by hand (no training here; a smoke
run of every arm is in the commit that added the runner)."""

import numpy as np
import pytest
from scipy import stats

from mini_moe import stats as mm_stats
from mini_moe.results import compress_study as cs


def test_the_models_are_the_registered_ones():
    for dataset in cs.REGISTERED.datasets:
        cfg = cs.config(dataset, 3, cs.REGISTERED)
        m, kwargs = cfg.model, dict(cfg.model.router_kwargs)
        assert (cfg.dataset, cfg.seed, cfg.steps, cfg.learning_rate, cfg.warmup_steps) == (dataset, 3, 2000, 2e-3, 100)
        assert (m.router, m.num_experts, m.dim, m.mlp_dim, m.depth, m.placement) == (
            "softmax_token_choice", 8, 64, 64, 4, "every2")
        assert (kwargs["k"], kwargs["capacity_factor"]) == (2, 2.0)
        assert cs.config(dataset, 3, cs.REGISTERED, num_experts=4).model.num_experts == 4
    assert cs.REGISTERED.seeds == (1, 2, 3, 4, 5) and cs.REGISTERED.removed == (2, 4, 6)
    assert (cs.REGISTERED.primary, cs.REGISTERED.reference_experts, cs.REGISTERED.calibration) == (4, 4, 1024)


def _record(accuracy, drop=()):
    plan = {"datasets": ["patch_vote", "fashion_mnist"], "seeds": [1, 2, 3, 4, 5], "primary": 4, "reference_experts": 4}
    cells = []
    for dataset in plan["datasets"]:
        for seed in plan["seeds"]:
            arms = [{"arm": a, "removed": r, "test_accuracy": accuracy(dataset, a, r, seed)}
                    for a in cs.PRUNE + cs.MERGE for r in (2, 4, 6) if (dataset, a, seed) not in drop]
            cells.append({"kind": "model", "dataset": dataset, "seed": seed, "arms": arms,
                          "none": {"test_accuracy": accuracy(dataset, "none", 0, seed)}})
            cells.append({"kind": "reference", "dataset": dataset, "seed": seed, "test_accuracy": 0.5})
    cells.append({"kind": "model", "dataset": "patch_vote", "seed": 9, "failed": "RuntimeError: boom"})
    return {"plan": plan, "cells": cells}


def test_the_family_is_paired_t_with_holm_over_eight():
    rng = np.random.default_rng(0)
    noise = {(d, a, r, s): rng.normal(0, 0.01) for d in ("patch_vote", "fashion_mnist") for a in cs.PRUNE + cs.MERGE
             + ("none",) for r in (0, 2, 4, 6) for s in range(1, 6)}
    base = {"reap": 0.8, "random": 0.6, "frequency": 0.78, "mc_smoe": 0.7, "hc_smoe": 0.81, "gate": 0.7,
            "ean": 0.75, "none": 0.9}
    out = cs.analyse(_record(lambda d, a, r, s: base[a] + noise[d, a, r, s]))
    assert out["removed"] == 4 and len(out["contrasts"]) == 8
    ps = []
    for row in out["contrasts"]:
        first, second = row["arms"]
        d = [100 * (base[first] - base[second] + noise[row["dataset"], first, 4, s] - noise[row["dataset"], second, 4, s])
             for s in range(1, 6)]
        ref = stats.ttest_rel(d, np.zeros(5))
        assert np.isclose(row["difference"], np.mean(d)) and np.isclose(row["p_value"], ref.pvalue) and row["df"] == 4
        ps.append(ref.pvalue)
    order = np.argsort(ps)
    adjusted = np.maximum.accumulate([min(1, (8 - i) * ps[j]) for i, j in enumerate(order)])
    assert np.allclose([out["contrasts"][j]["p_holm"] for j in order], adjusted)
    table = cs.accuracy_table(_record(lambda d, a, r, s: base[a]))
    assert table["patch_vote", "retrained", 4, 2] == 0.5 and table["fashion_mnist", "none", 0, 5] == 0.9


def test_the_secondary_contrasts_are_the_registered_ones_unadjusted():
    """The registration's secondary list: the four at 25 % and 75 %, and retrained, gate and EAN
    against REAP at 50 %, each Student's paired t over its seeds (scipy), with no Holm."""
    rng = np.random.default_rng(1)
    acc = {(d, a, r, s): rng.uniform(0.5, 0.9) for d in ("patch_vote", "fashion_mnist")
           for a in cs.PRUNE + cs.MERGE + ("none",) for r in (0, 2, 4, 6) for s in range(1, 6)}
    record = _record(lambda d, a, r, s: acc[d, a, r, s])
    record["plan"]["removed"] = [2, 4, 6]
    rows = cs.secondary(record)
    got = {(r["dataset"], r["removed"], *r["arms"]) for r in rows}
    want = {(d, r, a, b) for d in ("patch_vote", "fashion_mnist") for r in (2, 6) for _, a, b in cs.FAMILY}
    want |= {(d, 4, a, "reap") for d in ("patch_vote", "fashion_mnist") for a in ("retrained", "gate", "ean")}
    assert got == want and len(rows) == len(want)
    for row in rows:
        (first, second), d = row["arms"], row["dataset"]
        one = lambda arm, s: 0.5 if arm == "retrained" else acc[d, arm, row["removed"], s]
        diffs = [100 * (one(first, s) - one(second, s)) for s in range(1, 6)]
        assert row["seeds"] == [1, 2, 3, 4, 5] and "p_holm" not in row
        assert np.isclose(row["difference"], np.mean(diffs))
        assert np.isclose(row["p_value"], stats.ttest_rel(diffs, np.zeros(5)).pvalue)


def test_a_seed_missing_an_arm_leaves_that_datasets_family_and_a_failed_cell_is_skipped():
    out = cs.analyse(_record(lambda d, a, r, s: 0.5 + 0.01 * s + (0.02 if a == "reap" else 0),
                             drop={("patch_vote", "hc_smoe", 2)}))
    rows = {(r["dataset"], r["name"]): r for r in out["contrasts"]}
    assert rows["patch_vote", "P1 reap - random"]["seeds"] == [1, 3, 4, 5]
    assert rows["fashion_mnist", "P1 reap - random"]["seeds"] == [1, 2, 3, 4, 5]


def test_the_per_image_record_packs_exactly_and_gives_the_crossed_interval_of_a_contrast():
    rng = np.random.default_rng(1)
    for n in (1, 7, 8, 10_000):
        correct = rng.random(n) < 0.7
        assert np.array_equal(cs.unpack(cs.pack(correct), n), correct)
    bits = {(a, s): rng.random(50) < p for a, p in (("reap", 0.8), ("random", 0.6)) for s in range(1, 6)}

    def arm(a, s):
        return {"arm": a, "removed": 4, "test_accuracy": bits[a, s].mean(), "test_images": 50, "correct": cs.pack(bits[a, s])}
    record = {"plan": {"datasets": ["patch_vote"], "seeds": [1, 2, 3, 4, 5], "primary": 4, "reference_experts": 4},
              "cells": [{"kind": "model", "dataset": "patch_vote", "seed": s, "none": {"test_accuracy": 0.9},
                         "arms": [arm(a, s) for a in ("reap", "random")]} for s in range(1, 6)]}
    diff = np.stack([bits["reap", s].astype(float) - bits["random", s] for s in range(1, 6)])
    low, high = cs.interval(record, "patch_vote", "reap", 4, "random")
    assert (low, high) == pytest.approx(tuple(100 * x for x in mm_stats.crossed_bootstrap(diff)))
    assert low < 100 * diff.mean() < high
    assert cs.interval(record, "patch_vote", "reap", 4, "mc_smoe") is None  # no per-image record: no interval
