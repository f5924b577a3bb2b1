"""Chapter 9's token-level experiment trained to convergence (``subtasks-converged-*.json``, written by
:func:`mini_moe.subtasks.run_experiment`): the numbers its section "Why: the mechanisms" states.

:func:`mechanisms` reads them from the committed runs, so that the chapter shows its claims and the
checks of those claims, not the bookkeeping that finds each number. Nothing here trains.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mini_moe import study, subtasks


def capacity_bound_excess(runs: list[dict], base: subtasks.SubtaskConfig, *, groups: int = 32, seed: int = 10_000) -> float:
    """The largest amount by which a sparse router's final routing accuracy exceeds what an
    allocation with C = T/K slots per expert can route home on the same kind of groups: ``groups``
    test-like groups drawn with ``seed``, where a sub-task's tokens beyond T/K in a group must go
    elsewhere. Soft MoE, whose slots are not one token each, is left out. Positive would mean a run
    beat the bound."""
    excess = -np.inf
    for freq in subtasks.FREQUENCIES:
        _, _, task = subtasks.Teacher(dataclasses.replace(base, frequencies=freq)).sample(np.random.default_rng(seed), groups)
        counts = np.stack([(task == k).sum(-1) for k in range(base.tasks)], -1)
        exact = 1 - np.maximum(counts - base.group_tokens // base.tasks, 0).sum() / task.size
        for r in runs:
            if r["config"]["frequencies"] == freq and r["config"]["router"] != "soft_moe" \
                    and "routing_accuracy" in r["final"]:
                excess = max(excess, r["final"]["routing_accuracy"] - exact)
    return float(excess)


def allocation_text(t: dict) -> str:
    """:func:`mini_moe.study.allocation_vs_affinity`'s statistic, in words for the prose."""
    return (f"{t['difference']:+.4f} FVU (95 % CI {t['ci_low']:+.4f} to {t['ci_high']:+.4f}, "
            f"p = {t['p_value']:.2g} unadjusted, {t['pairs']} seeds; positive: the allocation moves FVU more)")


def allocation_statistic(results: dict, frequencies: str) -> dict:
    """Chapter 8's allocation-minus-affinity test (:func:`mini_moe.study.allocation_vs_affinity`), on FVU."""
    cells = [{"seed": r["config"]["seed"], "capacity": 1.0, "router": r["config"]["router"], "fvu": r["final"]["fvu"]}
             for r in results["runs"] if r["config"]["frequencies"] == frequencies]
    return study.allocation_vs_affinity(cells, metric="fvu")


def mechanisms(converged: dict, at_budget: dict, budget: int, bounds: dict) -> dict:
    """Every number of chapter 9's "Why: the mechanisms", from the committed runs.

    Args:
      converged: ``{"runs": [...]}``, every run at the step where it stopped (complete seeds only).
      at_budget: the same runs with ``final`` replaced by their evaluation at step ``budget``.
      budget: the first experiment's step count (800).
      bounds: per frequency setting, :func:`mini_moe.subtasks.balance_bound`.

    Returns a flat dict (the chapter glues each entry as ``ch09_<key>``): Softmax Token Choice's
    routing accuracy, unprocessed share and load CV at ``budget`` (``tc_early_*``) and at the end
    (``tc_*``); the median stopping steps of Token and Expert Choice; how many of Token Choice's
    uniform seeds were more than 5 points below the bound at ``budget`` (``collapsed_early`` of
    ``tc_seeds``); with skewed sub-tasks Token Choice's unprocessed share, load CV and FVU against
    the overflow the right routing must drop (one minus the bound) and the dense layer's FVU; the
    largest gap of an Expert Choice router (``ec_gap``) and of Sinkhorn Token Choice to the bound,
    the Expert Choice affinities' FVU spread, the largest move of a balanced allocation's routing
    accuracy between ``budget`` and the end; the allocation-minus-affinity statistics (as text) and
    the single switches they summarise; SVMoE's early routing and skewed FVU beside Sinkhorn's.
    """
    rows, early = subtasks.summary(converged), subtasks.summary(at_budget)
    table = {(r["frequencies"], r["router"]): r for r in rows}
    early_table = {(r["frequencies"], r["router"]): r for r in early}
    stop_steps: dict = {}
    for r in converged["runs"]:
        stop_steps.setdefault((r["config"]["frequencies"], r["config"]["router"]), []).append(r["steps"])

    tc, tc_early = table["uniform", "softmax_token_choice"], early_table["uniform", "softmax_token_choice"]
    tc_skewed = table["skewed", "softmax_token_choice"]
    tc_at_budget = [next(p for p in r["curve"] if p["step"] == budget) for r in converged["runs"]
                    if (r["config"]["router"], r["config"]["frequencies"]) == ("softmax_token_choice", "uniform")]
    ec_routers = [r for r in rows if r["frequencies"] == "uniform" and study.ALLOCATION.get(r["router"]) == "expert"]
    balanced = ec_routers + [table["uniform", "sinkhorn_token_choice"]]
    uniform_fvu = {r["router"]: r["fvu"] for r in rows if r["frequencies"] == "uniform"}
    conv, at_800 = allocation_statistic(converged, "uniform"), allocation_statistic(at_budget, "uniform")
    skewed = allocation_statistic(converged, "skewed")
    return {
        "tc_early_acc": tc_early["routing_accuracy"], "tc_early_unprocessed": tc_early["unprocessed"],
        "tc_early_cv": tc_early["processed_cv"],
        "tc_acc": tc["routing_accuracy"], "tc_unprocessed": tc["unprocessed"], "tc_cv": tc["processed_cv"],
        "tc_gap": bounds["uniform"] - tc["routing_accuracy"],
        "tc_steps": int(np.median(stop_steps["uniform", "softmax_token_choice"])),
        "ec_steps": int(np.median(stop_steps["uniform", "softmax_expert_choice"])),
        "collapsed_early": int(sum(p["routing_accuracy"] < bounds["uniform"] - 0.05 for p in tc_at_budget)),
        "tc_seeds": len(tc_at_budget),
        "tc_skewed_unprocessed": tc_skewed["unprocessed"], "overflow_skewed": 1 - bounds["skewed"],
        "tc_skewed_cv": tc_skewed["processed_cv"], "tc_skewed_fvu": tc_skewed["fvu"],
        "dense_skewed_fvu": table["skewed", "dense"]["fvu"],
        "ec_skewed_fvu": table["skewed", "softmax_expert_choice"]["fvu"],
        "sinkhorn_skewed_fvu": table["skewed", "sinkhorn_token_choice"]["fvu"],
        "ec_gap": max(bounds["uniform"] - r["routing_accuracy"] for r in ec_routers),
        "sinkhorn_gap": bounds["uniform"] - table["uniform", "sinkhorn_token_choice"]["routing_accuracy"],
        "ec_spread": max(r["fvu"] for r in ec_routers) - min(r["fvu"] for r in ec_routers),
        "balanced_early_move": max(abs(early_table["uniform", r["router"]]["routing_accuracy"] - r["routing_accuracy"])
                                   for r in balanced),
        "alloc_conv": allocation_text(conv), "alloc_early": allocation_text(at_800),
        "alloc_skewed": allocation_text(skewed),
        "alloc_conv_difference": conv["difference"], "alloc_early_difference": at_800["difference"],
        "alloc_skewed_difference": skewed["difference"],
        "alloc_softmax": uniform_fvu["softmax_token_choice"] - uniform_fvu["softmax_expert_choice"],
        "alloc_sinkhorn": uniform_fvu["sinkhorn_token_choice"] - uniform_fvu["sinkhorn_expert_choice"],
        "affinity_tc": uniform_fvu["softmax_token_choice"] - uniform_fvu["sinkhorn_token_choice"],
        "svmoe_early": early_table["uniform", "svmoe"]["routing_accuracy"],
        "sinkhorn_early": early_table["uniform", "sinkhorn_token_choice"]["routing_accuracy"],
        "svmoe_skewed": table["skewed", "svmoe"]["fvu"],
    }
