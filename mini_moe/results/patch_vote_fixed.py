"""Issue 65 §4: on chapter 8's capacity task, does learning the router matter against a *fixed*
assignment, each arm at its own rate, at 1,000 and 2,000 steps?

Usage (from the repository root, one process per core)::

    COMMIT=1 CORE=1 taskset -c 1 .venv/bin/python mini_moe/results/patch_vote_fixed.py pilot
    .venv/bin/python mini_moe/results/patch_vote_fixed.py rates     # each arm's rate per budget, by the rule
    COMMIT=1 CORE=1 taskset -c 1 .venv/bin/python mini_moe/results/patch_vote_fixed.py confirm
    .venv/bin/python mini_moe/results/patch_vote_fixed.py analyse   # the registered family, from the JSON

Why (the study audit of 2026-11-28, M6, and issue 65 §4). Chapter 8's "frozen" arm holds the
router's weights, not the assignment: the layers below it train and can steer the patches through
the fixed projection (chapter 9's registered study measured exactly that on pixels). On
`patch_vote` the patches recur, 4,096 of them, so a hash of the raw patch *is* a fixed assignment,
Hash Layers' control (`raw_blind`: a 32-bit hash of the standardised patch quantised in steps of
0.5, the same expert for every copy of a vocabulary patch, in every MoE layer). Chapter 8's
pilot, with each arm at its own best rate, found the learned Expert Choice router 3-5 points ahead
of its frozen self up to 1,000 steps and level at 2,000. And no chapter has a frozen Token Choice
arm. This study asks both questions with annealed budgets.

Arms (chapter 8's `patch_vote` model at scale `quick`: ViT of width 64, depth 4, 7x7 patches, MLPs
of 64 units, MoE layers in blocks 2 and 4 with 8 experts of 64 units, groups of 8 images, c = 1):

* ``dense``: the dense ViT (the MoE arms' activated FLOPs);
* ``ec`` / ``ec_frozen``: Softmax Expert Choice, learned / its router's weights held at
  initialisation (``frozen=True``);
* ``tc`` / ``tc_frozen``: Softmax Token Choice, k = 1 (the library's defaults: V-MoE's noise and
  importance + load losses), learned / frozen;
* ``hash``: ``raw_blind``, Token Choice k = 1 at c = 1 with gates of 1.

The confounds, stated before any run: the hash arm's gates are 1, the softmax arms' the probability
of the pick; the Token Choice arms drop the tokens that overflow an expert's C slots (a hash does
not balance a group, so it drops its overflow; a learned router can learn to spread it), and Expert
Choice processes exactly C tokens per expert. The fraction of tokens no expert processes is recorded
for every routed arm and budget, so the reader sees that difference next to the accuracies.

Training: batch 128, AdamW (weight decay 1e-4, clipping 1.0), 100 warm-up steps, then the arm's
constant rate for 2,000 steps, checkpoints kept every 400 steps, validation accuracy (10,000
held-out training images, `routing_pilot.splits`) every 250 steps. Each budget B in 1,000 and 2,000
is *annealed*: a branch from the checkpoint at 0.8 B whose rate falls linearly to 0 over the last
0.2 B steps (`pixel_routing.annealed`, `train.train(branch_from=...)`).

**The rate pilot** (``pilot``; this docstring is committed before its first run, 2026-11-29): seed 0,
every arm at 1e-3, 2e-3 and 4e-3 (18 runs). **Rule** (``rates``): for each arm *and each budget*,
the rate with the highest annealed validation accuracy at that budget (ties within 0.1 point: the
lower rate); a best rate at an end of the grid is stated as a limitation, the grid is not extended.
A run that stops on a non-finite loss counts as failed at that rate and is recorded. The pilot's
numbers are exploratory; its seed is never reused. The confirmatory study's registration
(`patch_vote-fixed-preregistration.md`) is written and committed after the pilot and before its
first cell, with the rates this rule gives.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time
import traceback

from mini_moe import bench, study
from mini_moe.results import pixel_routing, routing_pilot

MACHINE = os.environ.get("MACHINE", "cpu-2core-epyc")
OUT = pathlib.Path(os.environ.get("FIXED_OUT", f"mini_moe/results/patch_vote-fixed-{MACHINE}.json"))
RUNS = pathlib.Path(os.environ.get("FIXED_RUNS", "runs/patch-vote-fixed"))
DATASET = "patch_vote"
#: name -> (router, router options)
ARMS = {"dense": (None, {}), "ec": ("softmax_expert_choice", {}), "ec_frozen": ("softmax_expert_choice", {"frozen": True}),
        "tc": ("softmax_token_choice", {}), "tc_frozen": ("softmax_token_choice", {"frozen": True}),
        "hash": ("raw_blind", {})}
PILOT_RATES = (1e-3, 2e-3, 4e-3)
BUDGETS = (1000, 2000)
TRAINING = dict(steps=2000, eval_every=250, schedule="constant", keep_every=400, checkpoint_every=200)


def arm_config(arm: str, seed: int, learning_rate: float):
    """The :class:`~mini_moe.config.TrainConfig` of one run (module docstring)."""
    router, options = ARMS[arm]
    extra = {"model_router_kwargs": options} if options else {}
    return study.cell_config(router, 1.0, seed, dataset=DATASET, scale="quick", learning_rate=learning_rate,
                             **TRAINING, **extra)


def load() -> dict:
    if OUT.exists():
        return json.loads(OUT.read_text())
    return {"what": "issue 65 §4: learned against fixed routing on patch_vote (rate pilot, then the registered study)",
            "machine": bench.machine(), "pilot": [], "cells": []}


def measure(out_dir, test) -> dict:
    """Test accuracy of a trained run, and per MoE layer the fraction of test tokens no expert
    processes and the load's coefficient of variation (the router's own balance)."""
    from mini_moe import evaluate, train

    model, _ = train.load_trained(out_dir)
    row = {"test_accuracy": evaluate.accuracy(model, test)}
    if model.cfg.router is not None:
        _, layers = evaluate.routing_record(model, test.images)
        row["layers"] = [{k: evaluate.routing_summary(layer)[k] for k in ("unprocessed", "load_cv")} for layer in layers]
    return row


def train_run(arm: str, seed: int, rate: float, name: str, budgets=BUDGETS, *, trim: bool = False) -> dict:
    """One constant-rate run and its annealed ``budgets``, measured (validation and test). With
    ``trim``, the constant phase stops at the last branch point, 0.8 times the largest budget: under
    a constant rate its first steps do not depend on how long it runs, so the branches are the same
    as from the 2,000-step run (the registered study's runs, which need fewer steps)."""
    from mini_moe import train

    cfg = arm_config(arm, seed, rate)
    if trim:
        cfg = dataclasses.replace(cfg, steps=round((1 - pixel_routing.COOLDOWN) * max(budgets)))
    train_part, validation, test = routing_pilot.splits(cfg)
    history = train.train(cfg, RUNS / name, progress=False, datasets=(train_part, validation))
    entry = {"config": json.loads(json.dumps(dataclasses.asdict(cfg), default=list)),
             "train_seconds": round(history["seconds"], 2),
             "constant": [{"step": e["step"], "validation_accuracy": e["test_accuracy"]} for e in history["eval"]],
             "budgets": []}
    for budget in budgets:
        out, h, cooldown = pixel_routing.annealed(cfg, name, budget, (train_part, validation), runs=RUNS)
        entry["budgets"].append({"budget": budget, "branch_from": budget - cooldown,
                                 "validation_accuracy": h["eval"][-1]["test_accuracy"],
                                 "train_seconds": round(h["seconds"], 2), **measure(out, test)})
    return entry


def record_run(kind: str, name: str, arm: str, seed: int, rate: float, command: str, budgets=BUDGETS, *,
               trim: bool = False) -> None:
    """Train one run unless it is recorded ``ok``; record it (failed ones too) and, with
    ``COMMIT=1``, commit the record."""
    if any(r["name"] == name and r["status"] == "ok" for r in load()[kind]):
        return
    tick = time.perf_counter()
    entry = {"name": name, "arm": arm, "seed": seed, "learning_rate": rate, "status": "ok"}
    try:
        entry |= train_run(arm, seed, rate, name, budgets, trim=trim)
    except Exception as e:  # recorded (a non-finite loss too); the group goes on
        entry |= {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
    entry |= {"wall_seconds": round(time.perf_counter() - tick, 1), "command": command,
              "source_commit": pixel_routing._commit(), "source_dirty": pixel_routing._dirty()}
    record = load()
    record[kind] = [r for r in record[kind] if r["name"] != name] + [entry]
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{name}: {entry['status']} {[(b['budget'], round(b['validation_accuracy'], 4)) for b in entry.get('budgets', [])]}"
          f" ({entry['wall_seconds']} s)", flush=True)
    if os.environ.get("COMMIT") == "1":
        import subprocess

        subprocess.run(["bash", "-c", f'source mini_moe/results/commit_result.sh && commit_result {OUT} '
                        f'"issue 65 §4 {kind}: {name}"'], check=False)


def pilot(seed: int = 0) -> None:
    """The rate pilot (module docstring), rate by rate; ``ARMS_ONLY`` splits it between cores."""
    arms = [a for a in ARMS if a in os.environ.get("ARMS_ONLY", ",".join(ARMS)).split(",")]
    command = (f"COMMIT=1 CORE={os.environ.get('CORE', '1')} taskset -c {os.environ.get('CORE', '1')} "
               f".venv/bin/python mini_moe/results/patch_vote_fixed.py pilot")
    for rate in PILOT_RATES:
        for arm in arms:
            record_run("pilot", f"pilot-{arm}-lr{rate:g}-s{seed}", arm, seed, rate, command)


def rates(record: dict, seed: int = 0) -> dict:
    """The pilot's rule: per arm and budget, the annealed validation accuracy at each rate, the
    chosen rate (ties within 0.1 point to the lower) and the limitations; ``complete`` is False
    while a run is missing."""
    runs = {(r["arm"], r["learning_rate"]): r for r in record["pilot"] if r["seed"] == seed}
    out = {"complete": all((a, lr) in runs for a in ARMS for lr in PILOT_RATES), "arms": {}}
    for arm in ARMS:
        acc = pixel_routing.rate_table(runs, arm, PILOT_RATES, BUDGETS)
        chosen, limitations = {}, []
        if len(acc) == len(PILOT_RATES):
            for B in BUDGETS:
                top = max(acc[lr][B] for lr in PILOT_RATES)
                chosen[B] = min(lr for lr in PILOT_RATES if acc[lr][B] >= top - 0.001)
                if chosen[B] in (PILOT_RATES[0], PILOT_RATES[-1]):
                    limitations.append(f"at {B} steps the chosen rate {chosen[B]:g} is at an end of the grid")
        out["arms"][arm] = {"accuracy": {f"{lr:g}": {str(B): a for B, a in v.items()} for lr, v in acc.items()},
                            "rate": {str(B): lr for B, lr in chosen.items()}, "limitations": limitations}
    return out


# ------------------------------------------------------------------ the registered study

#: patch_vote-fixed-preregistration.md: paired seeds, each arm's rate per budget (the pilot's rule,
#: ``rates``), fixed by the registration's commit before the first cell.
SEEDS = (1, 2, 3, 4, 5, 6)
#: The routed arms: the dense ViT is in the pilot (exploratory) but not in the registered study,
#: whose contrasts do not use it (the registration says why: the issue's compute budget).
CONFIRM_ARMS = ("ec", "ec_frozen", "tc", "tc_frozen", "hash")
RATES: dict = {"ec": {1000: 2e-3, 2000: 4e-3}, "ec_frozen": {1000: 2e-3, 2000: 4e-3},
               "tc": {1000: 2e-3, 2000: 4e-3}, "tc_frozen": {1000: 2e-3, 2000: 4e-3},
               "hash": {1000: 4e-3, 2000: 4e-3}}
#: The family, Holm over its eight (each at both budgets): (name, first, second); positive favours the first.
FAMILY = (("F1 ec - ec_frozen", "ec", "ec_frozen"), ("F2 ec - hash", "ec", "hash"),
          ("F3 tc - tc_frozen", "tc", "tc_frozen"), ("F4 tc - hash", "tc", "hash"))
EQUIVALENCE = 0.5  # points: F1 and F3 at 2,000 steps are "level" when the TOST rejects at this bound
TOST_AT = 2000


def plan(rates_by_arm: dict) -> list[tuple]:
    """The runs of the registered study: ``(name, arm, seed, rate, budgets)``, seed by seed (so that
    finished seeds are complete pairs); an arm whose rate differs between the budgets trains one
    constant-rate run per rate, each branched only at its own budgets."""
    runs = []
    for seed in SEEDS:
        for arm in CONFIRM_ARMS:
            by_rate: dict = {}
            for budget in BUDGETS:
                by_rate.setdefault(rates_by_arm[arm][budget], []).append(budget)
            for rate, budgets in by_rate.items():
                runs.append((f"conf-{arm}-lr{rate:g}-s{seed}", arm, seed, rate, tuple(budgets)))
    return runs


def confirm() -> None:
    """Every run of :func:`plan` not yet recorded ``ok``; ``SEEDS_ONLY`` ("1,2") and ``ARMS_ONLY``
    split the work between cores."""
    if set(RATES) != set(CONFIRM_ARMS):
        sys.exit("RATES is not filled in: the registration fixes each arm's rate per budget before any cell")
    seeds = os.environ.get("SEEDS_ONLY", ",".join(map(str, SEEDS))).split(",")
    arms = os.environ.get("ARMS_ONLY", ",".join(CONFIRM_ARMS)).split(",")
    command = (f"COMMIT=1 CORE={os.environ.get('CORE', '1')} taskset -c {os.environ.get('CORE', '1')} "
               f".venv/bin/python mini_moe/results/patch_vote_fixed.py confirm")
    for name, arm, seed, rate, budgets in plan(RATES):
        if str(seed) in seeds and arm in arms:
            record_run("cells", name, arm, seed, rate, command, budgets, trim=True)


def test_accuracy(record: dict, rates_by_arm: dict) -> dict:
    """``{(arm, seed): {budget: test accuracy}}`` of the recorded ``ok`` runs, each budget read from
    the run at that arm's registered rate for it."""
    out: dict = {}
    for run in record["cells"]:
        if run["status"] != "ok":
            continue
        for b in run["budgets"]:
            if rates_by_arm[run["arm"]][b["budget"]] == run["learning_rate"]:
                out.setdefault((run["arm"], run["seed"]), {})[b["budget"]] = b["test_accuracy"]
    return out


def analyse(record: dict, rates_by_arm: dict | None = None) -> dict:
    """The registration's analysis: on the seeds where every arm has both budgets, each contrast of
    :data:`FAMILY` at each budget as the mean paired difference in test accuracy (points), Student's
    t with df = seeds - 1 and its 95 % CI; Holm over the eight; F1 and F3 at 2,000 steps also a TOST
    at +-0.5 points. Descriptive: each arm's mean and per arm and budget the mean fraction of test
    tokens no expert processed (over MoE layers)."""
    import math

    from mini_moe import confirm as confirm_lib
    from mini_moe import stats

    rates_by_arm = RATES if rates_by_arm is None else rates_by_arm
    acc = test_accuracy(record, rates_by_arm)
    seeds = [s for s in SEEDS if all(set(acc.get((a, s), {})) >= set(BUDGETS) for a in CONFIRM_ARMS)]
    rows = []
    for budget in BUDGETS:
        for name, first, second in FAMILY:
            diffs = [100 * (acc[first, s][budget] - acc[second, s][budget]) for s in seeds]
            row = {"name": name, "budget": budget, "arms": [first, second], "pairs": len(diffs)}
            if diffs:
                row |= stats.paired_t(diffs)
            if budget == TOST_AT and first + "_frozen" == second and len(diffs) >= 2:
                row["tost_p"] = confirm_lib.tost(diffs, EQUIVALENCE)
            rows.append(row)
    if len(seeds) >= 2:
        for row, adjusted in zip(rows, stats.holm([r["p_value"] for r in rows])):
            row["p_holm"] = adjusted
    means = {a: {B: 100 * sum(acc[a, s][B] for s in seeds) / len(seeds) for B in BUDGETS}
             for a in CONFIRM_ARMS} if seeds else {}
    unprocessed: dict = {}
    for run in record["cells"]:
        if run["status"] == "ok" and run["seed"] in seeds:
            for b in run["budgets"]:
                if "layers" in b and rates_by_arm[run["arm"]][b["budget"]] == run["learning_rate"]:
                    unprocessed.setdefault(run["arm"], {}).setdefault(b["budget"], []).append(
                        sum(layer["unprocessed"] for layer in b["layers"]) / len(b["layers"]))
    unprocessed = {a: {B: sum(v) / len(v) for B, v in per.items()} for a, per in unprocessed.items()}
    return {"seeds": seeds, "means": means, "contrasts": rows,
            "unprocessed": unprocessed, "complete": seeds == list(SEEDS), "alpha": 0.05,
            "failed": [r["name"] for r in record["cells"] if r["status"] != "ok"],
            "note": None if not any(math.isnan(r.get("p_value", 0.0)) for r in rows) else "fewer than two seeds"}


if __name__ == "__main__":
    groups = sys.argv[1:]
    if not groups or any(g not in ("pilot", "rates", "confirm", "analyse") for g in groups):
        sys.exit("usage: patch_vote_fixed.py pilot | rates | confirm | analyse")
    if "pilot" in groups:
        pilot()
    if "confirm" in groups:
        confirm()
    if "analyse" in groups:
        print(json.dumps(analyse(load()), indent=1, default=str))
    else:
        print(json.dumps(rates(load()), indent=1))
