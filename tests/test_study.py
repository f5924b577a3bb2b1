"""The statistics of the router study: paired t-test over seeds, confidence interval, Holm."""

import math

import numpy as np
import pytest
from scipy import stats

from mini_moe import confirm, study
from mini_moe import stats as mm_stats


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


# ----------------------------------------------------------- study design (issue 12)


@pytest.mark.parametrize("capacity", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("router", sorted(study.ALLOCATION))
def test_every_router_gets_round_c_T_over_E_slots_per_expert_in_every2(router, capacity):
    cfg = study.cell_config(router, capacity, 0, dataset="fashion_mnist", scale="quick")
    m = cfg.model
    assert m.moe_blocks() == (1, 3)  # Every-2 for every router, Soft MoE included (paper 000 Sec. 3.1)
    from flax import nnx
    from mini_moe.routers import make_router
    r = make_router(router, m.dim, m.num_experts, rngs=nnx.Rngs(0), **dict(m.router_kwargs))
    # T: the tokens one router call sees: a group of images, or one image for Soft MoE.
    tokens = m.num_patches * (1 if router == "soft_moe" else m.group_images)
    x = np.random.default_rng(0).normal(size=(2, tokens, m.dim)).astype(np.float32)
    out = r(x)
    assert out.routing.dispatch.shape[-2:] == (m.num_experts, int(np.floor(capacity * tokens / m.num_experts + 0.5)))
    if study.ALLOCATION[router] == "token":
        assert r.allocation.k == (1 if capacity <= 1 else int(capacity))


def test_bad_capacities_are_rejected_with_the_reason():
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="capacity"):
            study.cell_config("softmax_token_choice", bad, 0, dataset="digits")
    assert study.cell_name("svmoe", 0.5, 3) == "svmoe-c0.5-s3" and study.cell_name("svmoe", 2.0, 1) == "svmoe-c2-s1"


def test_paired_power_matches_known_values_and_simulation():
    # Textbook values (Cohen 1988; G*Power, one-sample/paired t, two-sided alpha 0.05, power 0.8):
    # effect size d = 1 needs 10 pairs, d = 0.5 needs 34.
    assert study.seeds_for_power(1.0, 1.0) == 10 and study.seeds_for_power(1.0, 0.5) == 34
    # Bonferroni over m comparisons needs more pairs.
    assert study.seeds_for_power(1.0, 1.0, comparisons=10) > 10
    # Monte Carlo: the fraction of simulated studies with p < alpha.
    rng = np.random.default_rng(0)
    sims = rng.normal(0.5, 0.4, size=(4000, 6))
    p = stats.ttest_1samp(sims, 0.0, axis=1).pvalue
    assert study.paired_power(6, 0.4, 0.5) == pytest.approx(np.mean(p < 0.05), abs=0.02)
    with pytest.raises(ValueError, match="pairs"):
        study.paired_power(1, 0.4, 0.5)


# The grid on which scipy 1.17's nct.sf / nct.cdf return NaN at many points (the study audit):
# 4 to 12 pairs, standardized effects 0.33 to 6.7, alpha = 0.05 over 17 comparisons.
POWER_GRID = [(n, d) for n in (4, 6, 8, 12) for d in np.geomspace(0.33, 6.7, 20)]


def test_paired_power_is_finite_and_a_probability_on_the_audit_grid():
    power = [study.paired_power(n, 1.0, d, alpha=0.05 / 17) for n, d in POWER_GRID]
    assert all(math.isfinite(v) and 0 <= v <= 1 for v in power)
    for n in (4, 6, 8, 12):  # more effect, more power; more pairs, more power
        row = [study.paired_power(n, 1.0, d, alpha=0.05 / 17) for d in np.geomspace(0.33, 6.7, 20)]
        assert all(a <= b + 1e-12 for a, b in zip(row, row[1:]))
    assert study.paired_power(12, 1.0, 6.7, alpha=0.05 / 17) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("pairs", [4, 6, 8, 12])
def test_paired_power_equals_a_simulated_paired_t_test_on_the_audit_grid(pairs):
    """20,000 simulated studies per point: the fraction with p < alpha is within 0.02 of the
    computed power (the simulation's standard error is at most 0.0035)."""
    alpha = 0.05 / 17
    rng = np.random.default_rng(pairs)
    for effect in np.geomspace(0.33, 6.7, 20)[::3]:
        sims = rng.normal(effect, 1.0, size=(20_000, pairs))
        p = stats.ttest_1samp(sims, 0.0, axis=1).pvalue
        assert study.paired_power(pairs, 1.0, effect, alpha=alpha) == pytest.approx(np.mean(p < alpha), abs=0.02)


@pytest.mark.parametrize("pairs,sd,difference", [(4, 0.3, 0.0), (6, 0.25, 0.1), (10, 0.8, 0.0), (6, 0.05, 0.45)])
def test_tost_power_equals_simulated_tost(pairs, sd, difference):
    """The fraction of 40,000 simulated studies in which confirm.tost finds equivalence within
    +-0.5 at alpha = 0.05 (the simulation's standard error is at most 0.0025): the computed power
    is within 0.01 of it."""
    rng = np.random.default_rng(pairs)
    sims = rng.normal(difference, sd, size=(40_000, pairs))
    mean, se = sims.mean(1), sims.std(1, ddof=1) / np.sqrt(pairs)
    critical = stats.t.ppf(0.95, pairs - 1)
    simulated = np.mean((mean - critical * se > -0.5) & (mean + critical * se < 0.5))
    # the same rule as confirm.tost's p-value < alpha, checked on the first 200 studies
    assert all((confirm.tost(row, 0.5) < 0.05) == ok for row, ok in zip(
        sims[:200], ((mean - critical * se > -0.5) & (mean + critical * se < 0.5))[:200]))
    assert study.tost_power(pairs, sd, 0.5, difference=difference) == pytest.approx(simulated, abs=0.01)


def test_tost_power_limits_and_errors():
    assert study.tost_power(30, 0.01, 0.5) == pytest.approx(1.0, abs=1e-6)  # tiny spread: always equivalent
    assert study.tost_power(2, 5.0, 0.5) < 0.01  # one degree of freedom, large spread: almost never
    assert study.tost_power(8, 0.5, 0.5) < study.tost_power(16, 0.5, 0.5)  # more pairs, more power
    with pytest.raises(ValueError, match="pairs"):
        study.tost_power(1, 0.5, 0.5)
    with pytest.raises(ValueError, match="bound"):
        study.tost_power(6, 0.5, 0.0)


def _grid(accuracy, seeds=(0, 1, 2), capacities=(1.0,)):
    return [_cell(r, c, s, accuracy(r, c, s)) for s in seeds for c in capacities for r in study.ALLOCATION]


def test_allocation_vs_affinity_by_hand():
    # Expert Choice routers 2 points above Token Choice routers; within an allocation the
    # affinities differ by at most 0.6 point (0.3 point per place in this order).
    order = {r: [x for x in sorted(study.ALLOCATION) if study.ALLOCATION[x] == study.ALLOCATION[r]].index(r)
             for r in study.ALLOCATION}
    noise = {0: 0.0, 1: 0.001, 2: -0.002}

    def accuracy(r, c, s):
        return 0.80 + 0.02 * (study.ALLOCATION[r] == "expert") + 0.003 * order[r] + noise[s] * order[r]

    cells = _grid(accuracy)
    per_seed = []
    for s in (0, 1, 2):
        acc = {r: accuracy(r, 1.0, s) for r in study.ALLOCATION}
        alloc = np.mean([abs(acc[a] - acc[b]) for a, b in study.ALLOCATION_PAIRS])
        affin = np.mean([abs(acc[a] - acc[b]) for a, b in study.AFFINITY_PAIRS])
        per_seed.append(alloc - affin)
    out = study.allocation_vs_affinity(cells)
    assert out == pytest.approx(study.paired_t(per_seed))
    assert out["difference"] > 0


def test_claims_family_is_holm_adjusted_and_skips_missing_routers():
    rng = np.random.default_rng(1)
    bonus = {"soft_moe": 0.01, "dense": -0.01}
    seed_effect = rng.normal(0, 0.01, size=8)
    cells = [_cell(r, c, s, 0.85 + bonus.get(r, 0) + seed_effect[s] + rng.normal(0, 0.002))
             for s in range(8) for r in sorted(study.ALLOCATION) for c in study.CAPACITIES]
    cells += [_cell("dense", 1.0, s, 0.84 + seed_effect[s] + rng.normal(0, 0.002)) for s in range(8)]
    rows = study.claims(cells)
    assert len(rows) == 2 + 6 + 1 + 1 + 7
    assert [r["p_holm"] for r in rows] == pytest.approx(study.holm([r["p_value"] for r in rows]))
    soft = [r for r in rows if r["claim"].startswith("Soft MoE beats")]
    assert all(r["difference"] > 0 and r["p_holm"] < 0.05 for r in soft)
    paper3 = next(r for r in rows if r["source"] == "paper 003")
    ec = [c["test_accuracy"] for c in cells if (c["router"], c["capacity"]) == ("softmax_expert_choice", 0.5)]
    tc = [c["test_accuracy"] for c in cells if (c["router"], c["capacity"]) == ("softmax_token_choice", 1.0)]
    assert paper3["p_value"] == pytest.approx(stats.ttest_rel(ec, tc).pvalue)
    partial = study.claims([c for c in cells if c["router"] in ("softmax_token_choice", "dense")])
    assert [r["claim"] for r in partial] == ["softmax_token_choice at c = 1 beats the dense ViT"]


def _mech(unprocessed, dropped=None):
    layer = {"unprocessed": unprocessed, "dropped_routes": dropped, "experts_per_token": 1 - unprocessed,
             "load_cv": 0.5, "processed_cv": 0.0, "stability_top1": 0.5, "stability_top2": 0.25}
    return {"batch_dependence": unprocessed / 10, "layers": [layer, dict(layer, unprocessed=3 * unprocessed)]}


def test_mechanism_summary_means_over_seeds_and_layers():
    cells = [dict(_cell("softmax_token_choice", 0.5, s, 0.8 + s / 100), mechanisms=_mech(0.1 * (s + 1), 0.2))
             for s in range(2)]
    cells += [dict(_cell("soft_moe", 1.0, 0, 0.85), mechanisms=_mech(0.0))]
    rows = {(r["router"], r["capacity"]): r for r in study.mechanism_summary(cells)}
    tc = rows["softmax_token_choice", 0.5]
    # layers: (0.1, 0.3) for seed 0 and (0.2, 0.6) for seed 1
    assert tc["unprocessed"] == pytest.approx(np.mean([0.1, 0.3, 0.2, 0.6])) and tc["seeds"] == 2
    assert tc["batch_dependence"] == pytest.approx(np.mean([0.01, 0.02])) and tc["dropped_routes"] == 0.2
    assert rows["soft_moe", 1.0]["dropped_routes"] is None


def test_ranking_agreement_is_kendall_tau_against_the_final_ranking():
    def cell(router, seed, curve):
        return {"router": router, "capacity": 1.0, "seed": seed, "test_accuracy": curve[-1],
                "eval": [{"step": 100 * (i + 1), "test_accuracy": a} for i, a in enumerate(curve)]}

    cells = [cell("a", 0, [0.1, 0.5, 0.9]), cell("b", 0, [0.3, 0.4, 0.8]), cell("c", 0, [0.2, 0.3, 0.7])]
    out = study.ranking_agreement(cells)
    assert [r["step"] for r in out] == [100, 200, 300]
    assert out[0]["tau"] == pytest.approx(stats.kendalltau([0.1, 0.3, 0.2], [0.9, 0.8, 0.7]).statistic)
    assert out[1]["tau"] == pytest.approx(1.0) and out[2]["tau"] == pytest.approx(1.0)


def test_verdict_words():
    row = {"difference": 0.0052, "ci_low": 0.0021, "ci_high": 0.0083, "p_holm": 0.004}
    assert study.verdict(row, unit=" points", scale=100) == "higher by 0.52 points (95 % CI [+0.21, +0.83], p_Holm = 0.004)"
    worse = row | {"difference": -0.0052, "ci_low": -0.0083, "ci_high": -0.0021}
    assert study.verdict(worse, unit=" points", scale=100, higher="better", lower="worse").startswith("worse by 0.52 points")
    unclear = row | {"p_holm": 0.3, "difference": 0.0012}
    assert study.verdict(unclear, unit=" points", scale=100) == "no detectable difference (+0.12 points, p_Holm = 0.3)"
    assert study.verdict(row | {"p_holm": 0.05}).startswith("no detectable difference")  # alpha is exclusive
    assert study.verdict({"difference": 0.0123, "ci_low": 0.01, "ci_high": 0.015, "p_holm": 0.01}, what="FVU ", digits=3,
                         higher="lower", lower="higher").startswith("FVU lower by 0.012")
    with pytest.raises(ValueError, match="p_holm"):
        study.verdict({"difference": 0.1})


def test_the_v2_family_is_the_registered_paired_t_with_holm_and_refuses_missing_runs():
    """routing_2024.contrasts_v2 against scipy's paired t-test and a Holm adjustment done by hand."""
    from mini_moe.results import routing_2024 as r24

    rng = np.random.default_rng(3)
    arms = sorted({arm for pair in r24.CONTRASTS_V2 for arm in pair})
    shift = {arm: 0.01 * i for i, arm in enumerate(arms)}
    runs = [{"arm": arm, "seed": seed, "test_accuracy": 0.9 + shift[arm] + 0.004 * rng.standard_normal()}
            for arm in arms for seed in r24.SEEDS_V2]
    rows = r24.contrasts_v2(runs)
    acc = {(x["arm"], x["seed"]): x["test_accuracy"] for x in runs}
    p_values = []
    for row, (a, b) in zip(rows, r24.CONTRASTS_V2):
        first, second = [acc[a, s] for s in r24.SEEDS_V2], [acc[b, s] for s in r24.SEEDS_V2]
        reference = stats.ttest_rel(first, second)
        assert row["df"] == len(r24.SEEDS_V2) - 1
        np.testing.assert_allclose(row["difference"], np.mean(np.subtract(first, second)), rtol=1e-12)
        np.testing.assert_allclose(row["p_value"], reference.pvalue, rtol=1e-9)
        p_values.append(reference.pvalue)
    order = np.argsort(p_values)
    m, running, expected = len(p_values), 0.0, [0.0] * len(p_values)
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        expected[i] = running
    np.testing.assert_allclose([row["p_holm"] for row in rows], expected, rtol=1e-9)
    assert all(row["verdict"].endswith("after 2,000 steps") for row in rows)
    with pytest.raises(ValueError, match="missing 1 run"):
        r24.contrasts_v2(runs[1:])


def test_the_v2_descriptive_numbers_are_means_over_the_arms_runs():
    from mini_moe.results import routing_2024 as r24

    def run(seed, acc, loss, ept, dropped):
        log = [{"step": s, "loss": loss + (1.0 if s < 1900 else 0.0), "router/max_violation": 0.5,
                "router/experts_per_token": ept, "router/dropped": dropped} for s in range(100, 2001, 100)]
        return {"arm": "tc_switch_k2", "router": "softmax_token_choice", "seed": seed, "test_accuracy": acc,
                "steps": 2000, "train_log": log, "step_flops": 2e9,
                "config": {"model": {"router_kwargs": [["k", 2], ["capacity_factor", 2.0]]}},
                "mechanisms": {"layers": [{"unprocessed": dropped, "experts_per_token": ept}] * 2}}

    out = r24.descriptive_v2([run(10, 0.90, 0.2, 1.5, 0.1), run(11, 0.94, 0.4, 1.9, 0.0)], "tc_switch_k2")
    assert out["seeds"] == [10, 11] and out["step_flops"] == 2e9
    np.testing.assert_allclose(out["test_accuracy"], 0.92)
    np.testing.assert_allclose(out["test_sd"], np.std([0.90, 0.94], ddof=1))
    np.testing.assert_allclose(out["train_loss"], 0.3)  # only the rows of steps 1,900 and 2,000
    np.testing.assert_allclose(out["dropped_picks"], np.mean([1 - 1.5 / 2, 1 - 1.9 / 2]))
    np.testing.assert_allclose(out["experts_per_token"], [1.7, 1.7])
    np.testing.assert_allclose(out["no_expert"], [0.05, 0.05])
    fine = run(10, 0.9, 0.2, 2.7, 0.0) | {"arm": "fine_shared"}
    fine["config"] = {"model": {"router_kwargs": [["k", 1]], "fine_grained": 4, "shared_experts": 1}}
    np.testing.assert_allclose(r24.descriptive_v2([fine], "fine_shared")["dropped_picks"], 1 - 2.7 / 3)  # 3 routed picks
    with pytest.raises(ValueError, match="no run of arm"):
        r24.descriptive_v2([], "remoe")


def test_capacity_amendment_rule_and_family_holm(monkeypatch):
    """capacity_converged: the learning-rate rule (highest mean validation accuracy over the pilot's
    seeds, ties to the smaller rate, an incomplete pilot refused) and the contrasts, against scipy's
    paired t-test and Holm done by hand over the whole family of eight (the token-level study's five
    p-values, these three)."""
    from mini_moe.results import capacity_converged as cc

    def pilot_run(arm, lr, seed, acc):
        router, extra = cc.ARMS[arm]
        return {"group": f"capacity_s{seed}", "inputs": "standardised", "status": "ok", "seed": seed,
                "router": router or "dense", "overrides": {"learning_rate": lr, **extra}, "validation_accuracy": acc}

    best = {"dense": 4e-3, "softmax_expert_choice": 2e-3, "dense_mlp256": 8e-3, "softmax_expert_choice_frozen": 2e-3}
    runs = [pilot_run(arm, lr, seed, 0.9 + (0.05 if lr == best[arm] else 0.0) + 0.001 * seed)
            for arm in cc.ARMS for lr in cc.LEARNING_RATES for seed in (0, 1)]
    # a tie: the frozen arm at 4e-3 equals its best, 2e-3, in mean; the smaller rate wins
    runs = [r | {"validation_accuracy": 0.95 + 0.001 * r["seed"]} if (r["router"], r["overrides"]["learning_rate"])
            == ("softmax_expert_choice_frozen", 4e-3) else r for r in runs]
    assert cc.chosen_learning_rates(runs) == best
    runs_unstandardised = [r | {"inputs": None} if r["router"] == "dense" else r for r in runs]
    with pytest.raises(ValueError, match="incomplete"):
        cc.chosen_learning_rates(runs_unstandardised)

    seeds = (200, 201, 202, 203, 204, 205)
    monkeypatch.setattr(cc, "SEEDS", seeds)
    rng = np.random.default_rng(5)
    shift = {"dense": -0.015, "softmax_expert_choice": 0.0, "dense_mlp256": 0.001, "softmax_expert_choice_frozen": -0.0005}
    cells = [{"arm": arm, "seed": s, "test_accuracy": 0.98 + shift[arm] + 0.002 * rng.standard_normal()}
             for arm in cc.ARMS for s in seeds]
    token_p = [1e-9, 1e-12, 2e-11, 0.02, 3e-7]
    complete, rows = cc.comparisons(cells, token_p)
    assert complete == list(seeds)
    acc = {(c["arm"], c["seed"]): c["test_accuracy"] for c in cells}
    p_values = list(token_p)
    for row, (_, a, b) in zip(rows, cc.CONTRASTS):
        reference = stats.ttest_rel([acc[a, s] for s in seeds], [acc[b, s] for s in seeds])
        np.testing.assert_allclose(row["p"], reference.pvalue, rtol=1e-9)
        p_values.append(reference.pvalue)
    order = np.argsort(p_values)
    running, expected = 0.0, [0.0] * 8
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (8 - rank) * p_values[i]))
        expected[i] = running
    np.testing.assert_allclose([row["p_holm"] for row in rows], expected[5:], rtol=1e-9)
    assert rows[0]["verdict"] == "softmax_expert_choice higher test accuracy"  # 1.5 points, SD 0.3
    assert rows[2]["verdict"] == "equivalent within +-0.5 points"  # the registered TOST (0.05 points apart, SD 0.3)
    monkeypatch.setattr(cc, "TOST_CONTRASTS", ())
    _, rows = cc.comparisons(cells, token_p)
    assert rows[2]["verdict"] == "no detectable difference (no equivalence test made)"
    # with TOST registered for the last two: their TOST p-values, Holm over those two
    monkeypatch.setattr(cc, "TOST_CONTRASTS", ("capacity_ec_vs_dense_equal_params", "capacity_learned_vs_frozen_ec"))
    _, rows = cc.comparisons(cells, token_p)
    tost = [confirm.tost(row["differences"], cc.BOUND) for row in rows[1:]]
    assert [row["tost_p"] for row in rows[1:]] == tost and "tost_p" not in rows[0]
    np.testing.assert_allclose([row["tost_p_holm"] for row in rows[1:]], study.holm(tost), rtol=1e-12)
    assert rows[2]["verdict"] == "equivalent within +-0.5 points"
    # a seed missing an arm is left out of every contrast
    _, partial = cc.comparisons([c for c in cells if (c["arm"], c["seed"]) != ("dense", 205)], token_p)
    assert len(partial[0]["differences"]) == 5


def test_chapter_13s_v1_reading_is_paired_t_with_holm_and_reads_no_dropped_picks_for_remoe():
    """routing_2024.analysis_v1 on the committed v1 record, against scipy's paired t-test and Holm by
    hand; ReMoE's superseded dropped_routes (the record's errata) is reported, never read as drops."""
    from mini_moe import bench
    from mini_moe.results import routing_2024 as r24

    record = bench.committed("routing_2024-cpu-2core-xeon.json")
    v1 = r24.analysis_v1(record)
    acc = {(r["arm"], r["seed"]): r["test_accuracy"] for r in record["runs"]}
    p_values = []
    for row, (a, b) in zip(v1["contrasts"], r24.CONTRASTS_V1):
        assert (row["a"], row["b"]) == (a, b)
        first, second = [acc[a, s] for s in v1["seeds"]], [acc[b, s] for s in v1["seeds"]]
        np.testing.assert_allclose(row["p_value"], stats.ttest_rel(first, second).pvalue, rtol=1e-9)
        p_values.append(row["p_value"])
    order, running, expected = np.argsort(p_values), 0.0, [0.0] * len(p_values)
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        expected[i] = running
    np.testing.assert_allclose([row["p_holm"] for row in v1["contrasts"]], expected, rtol=1e-9)
    assert v1["arms"]["remoe"]["dropped_picks"] is None and v1["remoe_superseded_dropped_routes"] > 0.8
    assert [e["field"] for e in record["errata"]] == ["runs[arm == 'remoe'].mechanisms.layers[].dropped_routes"]
    assert all(0 <= p <= 1 for arm in r24.ARMS_V1_CH13 if arm != "remoe" for p in v1["arms"][arm]["dropped_picks"])


def test_crossed_bootstrap_is_the_mean_of_resampled_rows_and_columns():
    rng = np.random.default_rng(3)
    values = rng.normal(size=(4, 30))
    low, high = mm_stats.crossed_bootstrap(values, resamples=300, seed=5)
    # an independent computation with the same draws: index the sub-table and average it
    draws = np.random.default_rng(5)
    rows = draws.integers(0, 4, (300, 4))
    cols = draws.integers(0, 30, (300, 30))
    means = [values[r][:, c].mean() for r, c in zip(rows, cols)]
    assert (low, high) == pytest.approx((np.quantile(means, 0.025), np.quantile(means, 0.975)), abs=1e-12)
    # image-level noise widens the interval beyond one over seeds alone (rows that differ only in
    # their mean give the same interval whatever the columns)
    seeds_only = np.repeat(values.mean(1, keepdims=True), 30, axis=1)
    narrow = mm_stats.crossed_bootstrap(seeds_only, resamples=300, seed=5)
    assert high - low > narrow[1] - narrow[0]
    with pytest.raises(ValueError, match="values must be a table"):
        mm_stats.crossed_bootstrap(values[0])
