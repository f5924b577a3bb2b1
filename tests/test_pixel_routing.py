"""Issue 65's runner: the rate pilot's rule applied to a record (no training here; the cooldown
branches it trains are tested in tests/test_cooldown.py)."""

import itertools

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
