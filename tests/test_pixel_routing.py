"""Issue 65's runner: the rate pilot's rule applied to a record (no training here; the cooldown
branches it trains are tested in tests/test_cooldown.py)."""

import itertools

import pytest

from mini_moe.results import pixel_routing as pr

SETTING = "subtask_vote_d8_h16"


def _record(accuracy, failed=()):
    """A pilot record where run (arm, rate) reaches accuracy(arm, rate, budget) at each budget."""
    runs = []
    for arm, lr in itertools.product(pr.PILOT_ARMS, pr.PILOT_RATES):
        ok = (arm, lr) not in failed
        runs.append({"name": f"pilot-{arm}-{lr}", "dataset": SETTING, "arm": arm, "seed": 0, "learning_rate": lr,
                     "status": "ok" if ok else "failed",
                     "budgets": [{"budget": B, "validation_accuracy": accuracy(arm, lr, B)} for B in pr.BUDGETS]
                     if ok else []})
    return {"pilot": runs}


def test_each_arm_takes_its_best_rate_at_2000_steps_and_states_what_disagrees():
    def accuracy(arm, lr, B):
        if arm == "dense":  # 4e-3 best everywhere: an end of the grid
            return 0.5 + lr * 10
        if arm == "learned":  # 2e-3 best at 2,000; 1e-3 best at 3,000
            return {1e-3: 0.80, 2e-3: 0.82, 4e-3: 0.70}[lr] + (0.05 if (lr, B) == (1e-3, 3000) else 0)
        if arm == "oracle":  # 2e-3 and 4e-3 within 0.1 point at every budget: the lower one
            return {1e-3: 0.80, 2e-3: 0.9000, 4e-3: 0.9009}[lr]
        return {1e-3: 0.6, 2e-3: 0.7, 4e-3: 0.65}[lr]

    out = pr.pilot_rates(_record(accuracy), SETTING)
    assert out["complete"]
    arms = out["arms"]
    assert arms["dense"]["rate"] == 4e-3 and arms["dense"]["limitations"] == ["the chosen rate 0.004 is at an end of the grid"]
    assert arms["learned"]["rate"] == 2e-3
    assert arms["learned"]["best"]["3000"] == 1e-3
    assert arms["learned"]["limitations"] == ["best rate at 3000 steps is 0.001, not 0.002"]
    assert arms["oracle"]["rate"] == 2e-3 and arms["oracle"]["limitations"] == []
    assert arms["blind"]["rate"] == 2e-3 and arms["frozen"]["rate"] == 2e-3


def test_a_failed_run_loses_at_its_rate_and_a_missing_one_leaves_the_pilot_incomplete():
    out = pr.pilot_rates(_record(lambda arm, lr, B: 0.5 + lr * 10, failed={("learned", 4e-3)}), SETTING)
    assert out["arms"]["learned"]["rate"] == 2e-3
    assert out["arms"]["learned"]["accuracy"]["0.004"]["2000"] == float("-inf")
    record = _record(lambda arm, lr, B: 0.5)
    record["pilot"] = [r for r in record["pilot"] if not (r["arm"] == "blind" and r["learning_rate"] == 1e-3)]
    out = pr.pilot_rates(record, SETTING)
    assert not out["complete"] and out["arms"]["blind"]["rate"] is None
    assert out["arms"]["oracle"]["rate"] == 1e-3  # every rate tied: the lowest


def test_the_registered_analysis_is_paired_t_with_holm_over_four_and_a_tost_on_the_error_ratio():
    """``analyse`` on a record built so that oracle - blind = 10 points +- 1 by seed, learned =
    oracle exactly, learned - frozen = 2 points +- 1: each contrast is SciPy's paired t on the seeds
    where every arm finished, Holm over the four, and C3's TOST finds the equal errors equivalent."""
    import math

    from scipy import stats

    from mini_moe import stats as stats_lib

    jitter = [0.3, -0.5, 0.8, -1.0, 0.1, 0.6, -0.3]
    acc = {"oracle": [0.60 + j / 100 for j in jitter], "blind": [0.50 + 0.5 * j / 100 for j in jitter],
           "dense": [0.45] * 7}
    acc["learned"] = list(acc["oracle"])
    acc["frozen"] = [a - 0.02 - j / 200 for a, j in zip(acc["learned"], jitter[::-1])]
    cells = [{"arm": arm, "seed": seed, "status": "ok", "budgets": [{"budget": 2000, "test_accuracy": acc[arm][i]}]}
             for arm in pr.CONFIRM_ARMS for i, seed in enumerate(pr.SEEDS)]
    cells.append({"arm": "dense", "seed": 8, "status": "ok", "budgets": [{"budget": 2000, "test_accuracy": 0.9}]})
    out = pr.analyse({"cells": cells}, 2000)
    assert out["seeds"] == list(pr.SEEDS)
    rows = {r["name"][:2]: r for r in out["contrasts"]}
    for key, first, second in (("C1", "oracle", "blind"), ("C2", "learned", "blind"), ("C4", "learned", "frozen")):
        diffs = [100 * (a - b) for a, b in zip(acc[first], acc[second])]
        assert rows[key]["difference"] == pytest.approx(sum(diffs) / 7)
        assert rows[key]["df"] == 6 and rows[key]["p_value"] == pytest.approx(stats.ttest_rel(
            [100 * a for a in acc[first]], [100 * b for b in acc[second]]).pvalue)
    assert rows["C3"]["difference"] == 0 and rows["C3"]["p_value"] == 1.0 and rows["C3"]["tost_p"] == 0.0
    assert [r["p_holm"] for r in out["contrasts"]] == stats_lib.holm([r["p_value"] for r in out["contrasts"]])
    assert rows["C1"]["p_holm"] < 0.05 and math.isclose(out["means"]["dense"], 45.0)
    missing = pr.analyse({"cells": [c for c in cells if not (c["arm"] == "blind" and c["seed"] == 3)]}, 2000)
    assert missing["seeds"] == [1, 2, 4, 5, 6, 7] and missing["contrasts"][0]["df"] == 5
