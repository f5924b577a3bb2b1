"""Chapter 9's mechanisms numbers (mini_moe/results/subtasks_converged.py) against a direct reading of
the committed converged runs, and the capacity-bound check against a run doctored to beat it."""

import copy

import numpy as np

from mini_moe import bench, subtasks
from mini_moe.results import subtasks_converged as sc

FILES = ["subtasks-converged-cpu-2core-epyc.json", "subtasks-converged-cpu-2core-xeon.json"]


def _runs():
    return {"runs": [r for name in FILES for r in bench.committed(name)["runs"]]}


def test_the_numbers_are_the_runs_read_directly():
    converged = _runs()
    budget = 800
    at_budget = {"runs": [dict(r, final=next(p for p in r["curve"] if p["step"] == budget)) for r in converged["runs"]]}
    bounds = {"uniform": 0.9, "skewed": 0.7}
    m = sc.mechanisms(converged, at_budget, budget, bounds)

    def pick(results, router, freq, key):
        return np.mean([r["final"][key] for r in results["runs"]
                        if (r["config"]["router"], r["config"]["frequencies"]) == (router, freq)])

    assert np.isclose(m["tc_acc"], pick(converged, "softmax_token_choice", "uniform", "routing_accuracy"))
    assert np.isclose(m["tc_early_cv"], pick(at_budget, "softmax_token_choice", "uniform", "processed_cv"))
    assert np.isclose(m["overflow_skewed"], 0.3) and np.isclose(m["tc_gap"], 0.9 - m["tc_acc"])
    tc_steps = [r["steps"] for r in converged["runs"]
                if (r["config"]["router"], r["config"]["frequencies"]) == ("softmax_token_choice", "uniform")]
    assert m["tc_steps"] == int(np.median(tc_steps)) and m["tc_seeds"] == len(tc_steps)
    ec = [pick(converged, r, "uniform", "routing_accuracy") for r in
          ("softmax_expert_choice", "sinkhorn_expert_choice", "sparsity_constrained_expert_choice")]
    assert np.isclose(m["ec_gap"], 0.9 - min(ec))
    assert np.isclose(m["alloc_softmax"], pick(converged, "softmax_token_choice", "uniform", "fvu")
                      - pick(converged, "softmax_expert_choice", "uniform", "fvu"))
    assert m["alloc_conv"].startswith(f"{m['alloc_conv_difference']:+.4f} FVU (95 % CI")


def test_a_run_above_the_capacity_bound_is_caught():
    converged = _runs()
    base = subtasks.SubtaskConfig()
    assert sc.capacity_bound_excess(converged["runs"], base) <= 1e-9
    doctored = copy.deepcopy(converged["runs"])
    run = next(r for r in doctored if r["config"]["router"] == "softmax_expert_choice")
    run["final"]["routing_accuracy"] = 1.0
    assert sc.capacity_bound_excess(doctored, base) > 0.01
