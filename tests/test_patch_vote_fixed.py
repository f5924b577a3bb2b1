"""Issue 65 §4's runner: the rate pilot's rule (a rate per arm and budget) applied to a record, and
every arm's configuration (no training here; a 20-step smoke run of all six arms is in the commit
that added the runner)."""

import itertools

from mini_moe.results import patch_vote_fixed as pv


def _record(accuracy, failed=(), missing=()):
    runs = []
    for arm, lr in itertools.product(pv.ARMS, pv.PILOT_RATES):
        if (arm, lr) in missing:
            continue
        ok = (arm, lr) not in failed
        runs.append({"name": f"pilot-{arm}-{lr}", "arm": arm, "seed": 0, "learning_rate": lr,
                     "status": "ok" if ok else "failed",
                     "budgets": [{"budget": B, "validation_accuracy": accuracy(arm, lr, B)} for B in pv.BUDGETS]
                     if ok else []})
    return {"pilot": runs, "cells": []}


def test_each_arm_takes_its_best_rate_at_each_budget():
    def accuracy(arm, lr, B):
        if arm == "ec":  # 4e-3 best at 1,000 steps, 2e-3 at 2,000
            return {1e-3: 0.7, 2e-3: 0.8 if B == 2000 else 0.75, 4e-3: 0.78}[lr]
        if arm == "tc":  # 2e-3 and 4e-3 within 0.1 point: the lower
            return {1e-3: 0.7, 2e-3: 0.8000, 4e-3: 0.8009}[lr]
        return 0.5 + lr * 10  # the top of the grid everywhere

    out = pv.rates(_record(accuracy))
    assert out["complete"]
    assert out["arms"]["ec"]["rate"] == {"1000": 4e-3, "2000": 2e-3}
    assert out["arms"]["ec"]["limitations"] == ["at 1000 steps the chosen rate 0.004 is at an end of the grid"]
    assert out["arms"]["tc"]["rate"] == {"1000": 2e-3, "2000": 2e-3} and out["arms"]["tc"]["limitations"] == []
    assert out["arms"]["hash"]["rate"] == {"1000": 4e-3, "2000": 4e-3} and len(out["arms"]["hash"]["limitations"]) == 2


def test_a_failed_run_loses_and_a_missing_one_leaves_the_pilot_incomplete():
    out = pv.rates(_record(lambda arm, lr, B: 0.5 + lr * 10, failed={("tc", 4e-3)}))
    assert out["arms"]["tc"]["rate"] == {"1000": 2e-3, "2000": 2e-3}
    assert out["arms"]["tc"]["accuracy"]["0.004"]["2000"] == float("-inf")
    out = pv.rates(_record(lambda arm, lr, B: 0.5, missing={("hash", 1e-3)}))
    assert not out["complete"] and out["arms"]["hash"]["rate"] == {}
    assert out["arms"]["dense"]["rate"] == {"1000": 1e-3, "2000": 1e-3}  # all tied: the lowest


def test_every_arm_is_chapter_8s_model_with_its_router():
    for arm, (router, options) in pv.ARMS.items():
        cfg = pv.arm_config(arm, 3, 2e-3)
        m = cfg.model
        assert (cfg.dataset, cfg.seed, cfg.learning_rate, cfg.steps, cfg.schedule) == ("patch_vote", 3, 2e-3, 2000, "constant")
        assert (m.depth, m.dim, m.mlp_dim, m.num_experts, m.patch_size) == (4, 64, 64, 8, 7)
        assert m.router == router and all(dict(m.router_kwargs)[k] == v for k, v in options.items())
        if router is not None:
            assert m.placement == "every2" and dict(m.router_kwargs)["capacity_factor"] == 1.0
    assert dict(pv.arm_config("hash", 0, 1e-3).model.router_kwargs).get("k", 1) == 1
