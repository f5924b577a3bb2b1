"""The statistics of the router study: paired t-test over seeds, confidence interval, Holm."""

import math

import numpy as np
import pytest
from scipy import stats

from mini_moe import study


def _cell(router, capacity, seed, acc):
    return {"router": router, "capacity": capacity, "seed": seed, "test_accuracy": acc}


def test_paired_t_matches_scipy_ttest_rel():
    better = np.array([0.831, 0.829, 0.836, 0.828, 0.833])
    worse = np.array([0.826, 0.830, 0.829, 0.824, 0.827])
    out = study.paired_t(better - worse)
    reference = stats.ttest_rel(better, worse)  # independent computation, two-sided
    assert out["pairs"] == 5 and out["df"] == 4
    assert out["t"] == pytest.approx(reference.statistic)
    assert out["p_value"] == pytest.approx(reference.pvalue)
    low, high = reference.confidence_interval(0.95)
    assert (out["ci_low"], out["ci_high"]) == (pytest.approx(low), pytest.approx(high))
    # By hand: mean -+ t_{0.975, 4} * s / sqrt(n), t_{0.975, 4} = 2.776445...
    d = better - worse
    half = 2.7764451051977987 * d.std(ddof=1) / math.sqrt(5)
    assert out["ci_low"] == pytest.approx(d.mean() - half) and out["ci_high"] == pytest.approx(d.mean() + half)


def test_paired_t_three_pairs_is_not_three_standard_errors_significant():
    # The review's example: t = -3.43 with 2 degrees of freedom is p ~ 0.075, not p < 0.01.
    diffs = [-0.0087 + e for e in (-0.004, 0.0005, 0.0035)]
    out = study.paired_t(diffs)
    assert out["df"] == 2
    assert out["p_value"] == pytest.approx(2 * stats.t.sf(abs(out["t"]), 2))
    assert out["p_value"] == pytest.approx(stats.ttest_1samp(diffs, 0.0).pvalue)
    assert 0.05 < out["p_value"] < 0.1 and abs(out["t"]) > 3


def test_paired_t_edge_cases():
    assert study.paired_t([0.01, 0.01])["p_value"] == 0.0 and study.paired_t([0.01, 0.01])["t"] == math.inf
    assert study.paired_t([0.0, 0.0])["p_value"] == 1.0
    single = study.paired_t([0.02])
    assert single["difference"] == 0.02 and math.isnan(single["p_value"]) and math.isnan(single["ci_low"])
    with pytest.raises(ValueError):
        study.paired_t([])
    with pytest.raises(ValueError, match="level"):
        study.paired_t([0.1, 0.2], level=95)


def test_holm_against_hand_computation():
    p = [0.01, 0.04, 0.03, 0.005]
    # Sorted: 0.005 (x4 = 0.02), 0.01 (x3 = 0.03), 0.03 (x2 = 0.06), 0.04 (x1 = 0.04 -> 0.06, monotone).
    assert study.holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert study.holm([0.5, 0.6, 0.2]) == pytest.approx([1.0, 1.0, 0.6])  # capped at 1
    assert study.holm([]) == []
    assert study.holm([0.03]) == pytest.approx([0.03])
    with pytest.raises(ValueError):
        study.holm([0.1, 1.5])


def test_holm_is_between_raw_and_bonferroni():
    rng = np.random.default_rng(0)
    p = rng.uniform(0, 0.2, size=12)
    adjusted = np.array(study.holm(p))
    assert np.all(adjusted >= p - 1e-15) and np.all(adjusted <= np.minimum(1, 12 * p) + 1e-15)
    assert np.all(np.diff(adjusted[np.argsort(p)]) >= 0)


def test_compare_pairs_by_seed_and_averages_capacities_within_a_seed():
    cells = [_cell("a", 1, 0, 0.80), _cell("b", 1, 0, 0.70), _cell("a", 2, 0, 0.90), _cell("b", 2, 0, 0.86),
             _cell("a", 1, 1, 0.82), _cell("b", 1, 1, 0.80), _cell("a", 2, 1, 0.85), _cell("b", 2, 1, 0.81),
             _cell("a", 1, 2, 0.81), _cell("b", 1, 2, 0.79)]  # seed 2 has capacity 1 only
    per_seed = [((0.80 - 0.70) + (0.90 - 0.86)) / 2, ((0.82 - 0.80) + (0.85 - 0.81)) / 2, 0.81 - 0.79]
    out = study.compare(cells, "a", "b")
    reference = study.paired_t(per_seed)
    assert out["pairs"] == 3 and out == pytest.approx(reference)
    # Independently: scipy's paired test on each router's per-seed mean accuracy.
    means = {r: [np.mean([c["test_accuracy"] for c in cells if c["router"] == r and c["seed"] == s])
                 for s in range(3)] for r in "ab"}
    assert out["t"] == pytest.approx(stats.ttest_rel(means["a"], means["b"]).statistic)
    assert out["p_value"] == pytest.approx(stats.ttest_rel(means["a"], means["b"]).pvalue)
    only_1 = study.compare(cells, "a", "b", capacities=[1])
    assert only_1["pairs"] == 3 and only_1["difference"] == pytest.approx(np.mean([0.10, 0.02, 0.02]))
    with pytest.raises(ValueError, match="No \\(seed, capacity\\)"):
        study.compare(cells, "a", "c")
