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


RATES = {arm: {1000: 2e-3, 2000: 2e-3} for arm in pv.CONFIRM_ARMS} | {"ec": {1000: 4e-3, 2000: 2e-3}}


def test_an_arm_whose_rate_differs_between_budgets_trains_one_run_per_rate():
    runs = pv.plan(RATES)
    assert len(runs) == len(pv.SEEDS) * (len(pv.CONFIRM_ARMS) + 1) and "dense" not in {r[1] for r in runs}
    ec = [r for r in runs if r[1] == "ec" and r[2] == 1]
    assert ec == [("conf-ec-lr0.004-s1", "ec", 1, 4e-3, (1000,)), ("conf-ec-lr0.002-s1", "ec", 1, 2e-3, (2000,))]
    last = pv.SEEDS[-1]
    assert [r for r in runs if r[1] == "tc" and r[2] == last] == [(f"conf-tc-lr0.002-s{last}", "tc", last, 2e-3,
                                                                    (1000, 2000))]
    assert [r[2] for r in runs] == sorted(r[2] for r in runs)  # seed by seed: finished seeds are complete pairs


def _study(accuracy, seeds=pv.SEEDS, drop=()):
    cells = []
    for name, arm, seed, rate, budgets in pv.plan(RATES):
        if seed not in seeds:
            continue
        status = "failed" if (arm, seed) in drop else "ok"
        layers = {"layers": [{"unprocessed": 0.1, "load_cv": 0.2}, {"unprocessed": 0.3, "load_cv": 0.2}]}
        cells.append({"name": name, "arm": arm, "seed": seed, "learning_rate": rate, "status": status,
                      "budgets": [{"budget": B, "test_accuracy": accuracy(arm, seed, B), **layers}
                                  for B in budgets] if status == "ok" else []})
    # a run at a rate the registration did not choose for a budget is never read
    cells.append({"name": "stray", "arm": "tc", "seed": 1, "learning_rate": 9e-3, "status": "ok",
                  "budgets": [{"budget": 2000, "test_accuracy": 0.0}]})
    return {"pilot": [], "cells": cells}


def test_the_analysis_is_paired_t_with_holm_over_eight_and_tost_for_the_frozen_contrasts():
    import numpy as np
    from scipy import stats

    rng = np.random.default_rng(0)
    noise = {(a, s, B): rng.normal(0, 0.004) for a in pv.CONFIRM_ARMS for s in pv.SEEDS for B in pv.BUDGETS}
    base = {"ec": 0.8, "ec_frozen": 0.78, "tc": 0.75, "tc_frozen": 0.75, "hash": 0.85}
    out = pv.analyse(_study(lambda a, s, B: base[a] + noise[a, s, B] + (0.05 if B == 2000 else 0)), RATES)
    assert out["complete"] and out["seeds"] == list(pv.SEEDS) and len(out["contrasts"]) == 8
    ps = []
    for row in out["contrasts"]:
        first, second = row["arms"]
        d = [100 * (base[first] - base[second] + noise[first, s, row["budget"]] - noise[second, s, row["budget"]])
             for s in pv.SEEDS]
        ref = stats.ttest_rel(d, np.zeros(len(d)))
        assert np.isclose(row["difference"], np.mean(d)) and np.isclose(row["p_value"], ref.pvalue) and row["df"] == len(pv.SEEDS) - 1
        ps.append(ref.pvalue)
    order = np.argsort(ps)  # Holm by hand
    adjusted = np.maximum.accumulate([min(1, (len(ps) - i) * ps[j]) for i, j in enumerate(order)])
    assert np.allclose([out["contrasts"][j]["p_holm"] for j in order], adjusted)
    tosts = {(r["name"], r["budget"]) for r in out["contrasts"] if "tost_p" in r}
    assert tosts == {("F1 ec - ec_frozen", 2000), ("F3 tc - tc_frozen", 2000)}
    f3 = next(r for r in out["contrasts"] if r["name"].startswith("F3") and r["budget"] == 2000)
    d = np.array([100 * (noise["tc", s, 2000] - noise["tc_frozen", s, 2000]) for s in pv.SEEDS])
    se = d.std(ddof=1) / np.sqrt(len(d))
    df = len(d) - 1
    assert np.isclose(f3["tost_p"], max(stats.t.sf((d.mean() + 0.5) / se, df), stats.t.cdf((d.mean() - 0.5) / se, df)))
    assert np.isclose(out["means"]["hash"][2000], 100 * np.mean([0.9 + noise["hash", s, 2000] for s in pv.SEEDS]))
    assert np.isclose(out["unprocessed"]["ec"][1000], 0.2) and set(out["unprocessed"]) == set(pv.CONFIRM_ARMS)


def test_a_seed_with_a_failed_arm_leaves_the_analysis_and_is_named():
    out = pv.analyse(_study(lambda a, s, B: 0.5 + 0.01 * s, drop={("hash", 3)}), RATES)
    assert 3 not in out["seeds"] and not out["complete"] and out["failed"] == ["conf-hash-lr0.002-s3"]
    assert all(r["pairs"] == len(pv.SEEDS) - 1 for r in out["contrasts"])


def test_the_registered_rates_are_the_pilots_rule_on_the_committed_pilot():
    rule = pv.rates(pv.load())
    assert rule["complete"]
    assert {arm: {int(B): lr for B, lr in v["rate"].items()} for arm, v in rule["arms"].items()
            if arm in pv.CONFIRM_ARMS} == pv.RATES


def test_the_study_refuses_to_start_without_registered_rates(monkeypatch):
    import pytest

    monkeypatch.setattr(pv, "RATES", {})
    with pytest.raises(SystemExit, match="RATES is not filled in"):
        pv.confirm()
