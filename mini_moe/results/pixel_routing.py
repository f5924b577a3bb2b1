"""Issue 65: does learned routing matter on pixels? Step 0 (per token, no ViT), the ViT
calibration, and the rate pilot.

Usage (from the repository root, pinned to one core)::

    COMMIT=1 taskset -c 1 .venv/bin/python mini_moe/results/pixel_routing.py step0
    .venv/bin/python mini_moe/results/pixel_routing.py choose     # the decision, from the record
    COMMIT=1 taskset -c 1 .venv/bin/python mini_moe/results/pixel_routing.py calibrate
    .venv/bin/python mini_moe/results/pixel_routing.py targets    # T1-T3 and the setting kept
    COMMIT=1 taskset -c 1 .venv/bin/python mini_moe/results/pixel_routing.py pilot
    .venv/bin/python mini_moe/results/pixel_routing.py rates      # each arm's rate, by the pilot's rule

``step0`` asks whether a *collision* costs on :func:`mini_moe.data.subtask_vote` before any ViT is
trained (the design of the 2026-11-28 study audit, §4.4). One GELU MLP of the experts' width (64
hidden units, :func:`mini_moe.results.routing_pilot.token_probe`: 49 raw pixels -> 64 -> 10, 3,000
Adam steps, batch 512) learns the value of single patches drawn from 1, 2 or 8 sub-tasks, for
content dimensions d in {8, 12, 16} and teacher widths h in {16, 64}, separation s = 4 (s moves
only random projections, never a learned map: see ``data.subtask_vote``): 18 probes. Each probe's
record (value accuracy on 20,000 fresh patches, seconds, the command, the commit) goes into
``mini_moe/results/pixel-routing-calibration-<MACHINE>.json`` as it finishes, so the group
resumes where it stopped.

The decision (written here before the first probe ran, 2026-11-28, and applied by ``choose``):

* a setting (d, h) **passes** when acc(1) >= 0.85 (one expert-sized MLP learns one sub-task),
  acc(1) - acc(2) >= 0.10 (two sub-tasks in one expert cost at least 10 points: a collision
  costs) and acc(8) <= 0.55 (one MLP cannot hold all eight: the dense arm is far behind);
* the calibration of the ViT runs on the **two** passing settings with the largest collision
  cost acc(1) - acc(2) (ties: the smaller d, then the smaller h; one setting if only one passes);
* if no setting passes, the calibration stops before any ViT: no tested setting makes a
  collision cost on this generator at this expert width, and chapter 9 says so with these numbers.

The probes are exploratory (seed 0 of the probe's own stream); no probe number is a result of
the study.

``calibrate`` (written before its first run, 2026-11-28) trains the ViT of the audit's design on
each chosen setting: depth 1 with its one MLP an MoE layer (``model_depth=1``,
``model_placement="last1"``), so the experts are the only per-patch nonlinearity; 3,000 steps at a
constant rate of 2e-3 after 100 warmup steps, validation accuracy (10,000 held-out training images)
every 250 steps; seeds 0 and 1; four arms:

* ``dense``: the same ViT with a dense MLP of the experts' width (equal activated FLOPs);
* ``learned``: softmax Token Choice, k = 1, c = 1 (V-MoE's router on the representation), the
  allocation the fixed arms use, so that only the affinity and the gates differ;
* ``oracle``: ``raw_oracle`` (the argmax of the raw patch's projection on the sub-task
  signatures; the right routing), Token Choice k = 1, c = 1, gates of 1;
* ``blind``: ``raw_blind`` (a hash of the quantised raw patch), the same allocation and gates.

The confound, stated before the runs: the fixed arms' gates are 1, the learned arm's the softmax
probability of its pick. Targets, per setting (validation accuracy, points):

* T1: oracle - blind >= 5 at both 2,000 and 3,000 steps, in each seed (the right routing pays);
* T2: the best routed arm - dense >= 10 at 2,000 steps, mean over the seeds;
* T3: the best arm < 95 % at 3,000 steps, mean over the seeds.

Stop rule: if T1 fails in both settings, stop: at this scale the right routing does not pay on
pixels, so no learned-routing study can find anything there, and chapter 9 says so. Otherwise the
study goes on with the setting that meets T1, T2 and T3 with the largest mean oracle - blind at
2,000 steps; if no setting meeting T1 also meets T2 and T3, with the one meeting T1 with the
largest mean oracle - blind, the targets it misses stated as limitations in registration v3.

The rate pilot (``pilot``; written before its first run, 2026-11-29), on the setting the
calibration chose (``subtask_vote_d8_h16``), seed 0, the audit's design with one deviation:

* five arms: the calibration's four and ``frozen`` (``learned`` with its router's weights held at
  their initialisation; descriptive in the study); three rates, 1e-3, 2e-3 and 4e-3. The audit
  takes 2e-3 from the calibration; here it is trained again, because the calibration kept no
  checkpoints to branch from and had no frozen arm, so that all three rates come from one commit
  and one procedure;
* each run: 3,000 steps at its constant rate after 100 warmup steps, checkpoints kept every 400
  steps, validation accuracy every 250 steps (the constant-rate curve, descriptive);
* each budget B in 500, 1,000, 2,000 and 3,000 is *annealed*: a branch from the checkpoint at
  0.8 B (400, 800, 1,600, 2,400) whose rate falls linearly to 0 over the last 0.2 B steps
  (``train.train(branch_from=...)``, ``cooldown_steps``); its validation accuracy at B is the
  budget's number, and the routed arms' layer-1 routing accuracy on the test images is recorded
  with it;
* **rule**: each arm's rate in the confirmatory study is the rate with the highest annealed
  validation accuracy at B = 2,000 (ties within 0.1 point: the lower rate). The best rate at
  each other budget is recorded; where it differs, registration v3 states it as a limitation, no
  run is repeated. A best rate at an end of the grid (1e-3 or 4e-3) is stated as a limitation too
  (the optimum may lie outside it); the grid is not extended. A run that stops on a non-finite
  loss counts as failed at that rate and is recorded;
* the pilot's numbers are exploratory, on the validation split; none is a result of the study.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from mini_moe import bench, study
from mini_moe.results import routing_pilot

MACHINE = os.environ.get("MACHINE", "cpu-2core-epyc")
OUT = pathlib.Path(os.environ.get("PIXEL_OUT", f"mini_moe/results/pixel-routing-calibration-{MACHINE}.json"))
WIDTH = 64  # the quick model's expert width (mlp_dim 64): "one expert-sized MLP"
SETTINGS = [(d, h) for d in (8, 12, 16) for h in (16, 64)]
TASKS = (1, 2, 8)
#: The step-0 targets (the audit's §4.4): acc(1) at least, acc(1) - acc(2) at least, acc(8) at most.
TARGETS = {"one": 0.85, "collision_cost": 0.10, "eight": 0.55}


def probe_name(d: int, h: int, tasks: int) -> str:
    return f"probe-d{d}-h{h}-tasks{tasks}-width{WIDTH}"


#: The calibration's arms: name -> (router, extra router options).
ARMS = {"dense": (None, {}), "learned": ("softmax_token_choice", {}), "oracle": ("raw_oracle", {"dataset": None}),
        "blind": ("raw_blind", {})}
#: The rate pilot's arms (the calibration's and the frozen control), rates and annealed budgets.
PILOT_ARMS = {**ARMS, "frozen": ("softmax_token_choice", {"frozen": True})}
PILOT_RATES = (1e-3, 2e-3, 4e-3)
BUDGETS = (500, 1000, 2000, 3000)
COOLDOWN = 0.2  # the annealed share of each budget
CALIBRATION = dict(steps=3000, eval_every=250, schedule="constant", learning_rate=2e-3, model_depth=1)
RUNS = pathlib.Path(os.environ.get("PIXEL_RUNS", "runs/pixel-routing"))


def arm_config(arm: str, dataset: str, seed: int, **overrides):
    """The :class:`~mini_moe.config.TrainConfig` of one calibration run (see the module docstring)."""
    router, options = PILOT_ARMS[arm]
    options = {k: dataset if k == "dataset" else v for k, v in options.items()}
    extra = {"model_placement": "none" if router is None else "last1"}
    if options:
        extra["model_router_kwargs"] = options
    return study.cell_config(router, 1.0, seed, dataset=dataset, scale="quick", **(CALIBRATION | extra | overrides))


# A run from a pinned worktree (PYTHONPATH=WORKTREE, the record and the runs in this checkout) says
# which commit trained it: SOURCE_COMMIT (and SOURCE_DIRTY=0/1); ARMS_ONLY="dense,learned" and
# SETTINGS_ONLY="subtask_vote_d8_h16" train only those arms and settings.
def _commit() -> str:
    return os.environ.get("SOURCE_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                             text=True).stdout.strip()


def _dirty() -> bool:
    if "SOURCE_DIRTY" in os.environ:
        return os.environ["SOURCE_DIRTY"] == "1"
    return bool(subprocess.run(["git", "status", "--porcelain", "--", "mini_moe"], capture_output=True,
                               text=True).stdout.strip())


def _commit_record(message: str) -> None:
    """With ``COMMIT=1``, commit the record alone (``commit_result.sh``), as each run finishes."""
    if os.environ.get("COMMIT") == "1":
        subprocess.run(["bash", "-c", f'source mini_moe/results/commit_result.sh && commit_result {OUT} "{message}"'],
                       check=False)


def load() -> dict:
    if OUT.exists():
        return json.loads(OUT.read_text())
    return {"what": "issue 65 calibration (exploratory): step 0, per-token probes of subtask_vote; then the "
                    "ViT calibration runs", "machine": bench.machine(), "targets": TARGETS, "probes": []}


def step0() -> None:
    """Run the 18 probes not yet recorded, recording each as it finishes."""
    for d, h in SETTINGS:
        for tasks in TASKS:
            name = probe_name(d, h, tasks)
            if any(p["name"] == name for p in load()["probes"]):
                continue
            result = routing_pilot.token_probe(d, h, tasks, WIDTH)
            entry = {"name": name, "content": d, "teacher": h, "tasks": tasks, "width": WIDTH, "separation": 4.0,
                     "steps": 3000, "seed": 0, **result,
                     "command": "COMMIT=1 taskset -c 1 .venv/bin/python mini_moe/results/pixel_routing.py step0",
                     "source_commit": _commit(), "source_dirty": _dirty()}
            record = load()
            record["probes"].append(entry)
            OUT.write_text(json.dumps(record, indent=1) + "\n")
            print(f"{name}: value accuracy {result['value_accuracy']:.3f} ({result['seconds']} s)", flush=True)
            _commit_record(f"issue 65 step 0: {name}")


def choose(record: dict) -> dict:
    """The step-0 decision of the module docstring, from ``record``: per setting its three
    accuracies, the collision cost and whether it passes; ``chosen``: the settings the ViT
    calibration runs (an empty list: stop)."""
    acc = {(p["content"], p["teacher"], p["tasks"]): p["value_accuracy"] for p in record["probes"]}
    settings = []
    for d, h in SETTINGS:
        if not all((d, h, t) in acc for t in TASKS):
            settings.append({"content": d, "teacher": h, "complete": False})
            continue
        one, two, eight = (acc[d, h, t] for t in TASKS)
        settings.append({"content": d, "teacher": h, "complete": True, "one": one, "two": two, "eight": eight,
                         "collision_cost": one - two,
                         "passes": one >= TARGETS["one"] and one - two >= TARGETS["collision_cost"]
                         and eight <= TARGETS["eight"]})
    passing = sorted((s for s in settings if s.get("passes")),
                     key=lambda s: (-s["collision_cost"], s["content"], s["teacher"]))
    return {"settings": settings, "complete": all(s["complete"] for s in settings),
            "chosen": [f"subtask_vote_d{s['content']}_h{s['teacher']}" for s in passing[:2]]}


def calibrate(settings: list[str], seeds=(0, 1)) -> None:
    """Train the calibration runs not yet recorded (settings x seeds x :data:`ARMS`), each recorded
    as it finishes (validation curve, layer-1 routing accuracy on the test images; no test accuracy:
    the test split is the confirmatory study's)."""
    import dataclasses
    import time
    import traceback

    from mini_moe import data, evaluate, train

    for dataset in settings:
        for seed in seeds:
            for arm in [a for a in ARMS if a in os.environ.get("ARMS_ONLY", ",".join(ARMS)).split(",")]:
                name = f"cal-{dataset}-{arm}-s{seed}"
                if any(r["name"] == name and r["status"] == "ok" for r in load().get("calibration", [])):
                    continue
                entry = {"name": name, "dataset": dataset, "arm": arm, "seed": seed, "status": "ok",
                         "command": f"COMMIT=1 taskset -c {os.environ.get('CORE', '1')} .venv/bin/python "
                                    f"mini_moe/results/pixel_routing.py calibrate",
                         "source_commit": _commit(), "source_dirty": _dirty()}
                tick = time.perf_counter()
                try:
                    cfg = arm_config(arm, dataset, seed)
                    entry["config"] = json.loads(json.dumps(dataclasses.asdict(cfg), default=list))
                    train_part, validation, test = routing_pilot.splits(cfg)
                    result = study.run_cell(cfg, RUNS / name, progress=False, label=arm, capacity=1.0,
                                            datasets=(train_part, validation))
                    entry |= {"steps": result["steps"], "train_seconds": result["train_seconds"],
                              "eval": [{"step": e["step"], "validation_accuracy": e["test_accuracy"]}
                                       for e in result["eval"]]}
                    if cfg.model.router is not None:
                        model, _ = train.load_trained(RUNS / name)
                        tasks, _ = data.subtask_vote_tasks("test", **data.subtask_vote_options(dataset))
                        entry["routing"] = [{k: v for k, v in layer.items() if k != "counts"}
                                            for layer in evaluate.routing_accuracy(model, test.images, tasks)]
                except Exception as e:  # recorded; the calibration goes on
                    entry |= {"status": "failed", "error": f"{type(e).__name__}: {e}",
                              "traceback": traceback.format_exc()[-2000:]}
                entry["wall_seconds"] = round(time.perf_counter() - tick, 1)
                record = load()
                record["calibration"] = [r for r in record.get("calibration", []) if r["name"] != name] + [entry]
                OUT.write_text(json.dumps(record, indent=1) + "\n")
                at = {e["step"]: e["validation_accuracy"] for e in entry.get("eval", [])}
                print(f"{name}: {entry['status']} validation at 2000/3000: {at.get(2000)}/{at.get(3000)} "
                      f"routing {[round(r['routing_accuracy'], 3) for r in entry.get('routing', [])]} "
                      f"({entry['wall_seconds']} s)", flush=True)
                _commit_record(f"issue 65 calibration: {name}")


def _routing(out_dir, dataset: str, test) -> list[dict]:
    """Layer-1 routing accuracy of the run in ``out_dir`` against the sub-task of each test patch."""
    from mini_moe import data, evaluate, train

    model, _ = train.load_trained(out_dir)
    tasks, _ = data.subtask_vote_tasks("test", **data.subtask_vote_options(dataset))
    return [{k: v for k, v in layer.items() if k != "counts"}
            for layer in evaluate.routing_accuracy(model, test.images, tasks)]


def annealed(cfg, name: str, budget: int, datasets, runs: pathlib.Path | None = None):
    """Budget ``budget`` of the constant-rate run ``runs / name`` (default :data:`RUNS`), annealed: a
    branch from its kept checkpoint at ``(1 - COOLDOWN) * budget`` whose rate falls linearly to 0 at
    ``budget``, trained (or resumed) into ``runs / f"{name}-B{budget}"``. Returns ``(folder,
    history, cooldown steps)``. Also the annealed budgets of ``patch_vote_fixed.py``."""
    import dataclasses

    from mini_moe import train

    runs = RUNS if runs is None else runs
    cooldown = round(COOLDOWN * budget)
    branch = dataclasses.replace(cfg, steps=budget, cooldown_steps=cooldown, keep_every=0,
                                 checkpoint_every=cooldown, eval_every=budget)
    out = runs / f"{name}-B{budget}"
    history = train.train(branch, out, progress=False, datasets=datasets, branch_from=(runs / name, budget - cooldown))
    return out, history, cooldown


def pilot(dataset: str, seed: int = 0) -> None:
    """The rate pilot of the module docstring: every (arm, rate) not yet recorded, its constant run
    and its four cooldown branches, recorded (and with ``COMMIT=1`` committed) as each finishes."""
    import dataclasses
    import time
    import traceback

    from mini_moe import train

    arms = [a for a in PILOT_ARMS if a in os.environ.get("ARMS_ONLY", ",".join(PILOT_ARMS)).split(",")]
    for rate in PILOT_RATES:
        for arm in arms:
            name = f"pilot-{dataset}-{arm}-lr{rate:g}-s{seed}"
            if any(r["name"] == name and r["status"] == "ok" for r in load().get("pilot", [])):
                continue
            entry = {"name": name, "dataset": dataset, "arm": arm, "seed": seed, "learning_rate": rate,
                     "status": "ok", "command": f"COMMIT=1 taskset -c {os.environ.get('CORE', '1')} .venv/bin/python "
                                                f"mini_moe/results/pixel_routing.py pilot",
                     "source_commit": _commit(), "source_dirty": _dirty()}
            tick = time.perf_counter()
            try:
                cfg = arm_config(arm, dataset, seed, learning_rate=rate, keep_every=400, checkpoint_every=200)
                entry["config"] = json.loads(json.dumps(dataclasses.asdict(cfg), default=list))
                train_part, validation, test = routing_pilot.splits(cfg)
                history = train.train(cfg, RUNS / name, progress=False, datasets=(train_part, validation))
                entry |= {"train_seconds": round(history["seconds"], 2),
                          "constant": [{"step": e["step"], "validation_accuracy": e["test_accuracy"]}
                                       for e in history["eval"]], "budgets": []}
                for budget in BUDGETS:
                    out, h, cooldown = annealed(cfg, name, budget, (train_part, validation))
                    row = {"budget": budget, "branch_from": budget - cooldown, "cooldown_steps": cooldown,
                           "validation_accuracy": h["eval"][-1]["test_accuracy"], "train_seconds": round(h["seconds"], 2)}
                    if cfg.model.router is not None:
                        row["routing"] = _routing(out, dataset, test)
                    entry["budgets"].append(row)
            except Exception as e:  # recorded (a non-finite loss too); the pilot goes on
                entry |= {"status": "failed", "error": f"{type(e).__name__}: {e}",
                          "traceback": traceback.format_exc()[-2000:]}
            entry["wall_seconds"] = round(time.perf_counter() - tick, 1)
            record = load()
            record["pilot"] = [r for r in record.get("pilot", []) if r["name"] != name] + [entry]
            OUT.write_text(json.dumps(record, indent=1) + "\n")
            print(f"{name}: {entry['status']} annealed validation "
                  f"{[(b['budget'], round(b['validation_accuracy'], 4)) for b in entry.get('budgets', [])]} "
                  f"({entry['wall_seconds']} s)", flush=True)
            _commit_record(f"issue 65 rate pilot: {name}")


def rate_table(runs: dict, arm: str, rates, budgets) -> dict:
    """``{rate: {budget: annealed validation accuracy}}`` of ``arm``'s pilot runs ``runs[arm, rate]``:
    a failed run scores -inf at every budget, a missing one is left out (so a rule can tell that the
    pilot is incomplete). Also ``patch_vote_fixed.rates``'s table."""
    table = {}
    for lr in rates:
        r = runs.get((arm, lr))
        if r is not None:
            got = {b["budget"]: b["validation_accuracy"] for b in r.get("budgets", [])} if r["status"] == "ok" else {}
            table[lr] = {B: got.get(B, float("-inf")) for B in budgets}
    return table


def pilot_rates(record: dict, dataset: str, seed: int = 0) -> dict:
    """The pilot's rule (module docstring): per arm, the annealed validation accuracy at each rate
    and budget, the best rate at each budget, the chosen rate (best at 2,000 steps, ties within 0.1
    point to the lower rate) and the limitations; ``complete`` False while a run is missing."""
    runs = {(r["arm"], r["learning_rate"]): r for r in record.get("pilot", [])
            if r["dataset"] == dataset and r["seed"] == seed}
    out = {"dataset": dataset, "complete": all((a, lr) in runs for a in PILOT_ARMS for lr in PILOT_RATES), "arms": {}}
    for arm in PILOT_ARMS:
        acc = rate_table(runs, arm, PILOT_RATES, BUDGETS)
        best = {}
        for B in BUDGETS:
            if len(acc) == len(PILOT_RATES):
                top = max(acc[lr][B] for lr in PILOT_RATES)
                best[B] = min(lr for lr in PILOT_RATES if acc[lr][B] >= top - 0.001)
        chosen = best.get(2000)
        limitations = [f"best rate at {B} steps is {best[B]:g}, not {chosen:g}" for B in BUDGETS
                       if chosen is not None and best[B] != chosen]
        if chosen in (PILOT_RATES[0], PILOT_RATES[-1]):
            limitations.append(f"the chosen rate {chosen:g} is at an end of the grid")
        out["arms"][arm] = {"accuracy": {f"{lr:g}": {str(B): a for B, a in v.items()} for lr, v in acc.items()},
                            "best": {str(B): lr for B, lr in best.items()}, "rate": chosen, "limitations": limitations}
    return out


# ------------------------------------------------------------------ the confirmatory study (registration v3)

#: mini_moe/results/pixel-routing-preregistration.md: seeds, arms, each arm's rate (the pilot's rule).
SEEDS = (1, 2, 3, 4, 5, 6, 7)
CONFIRM_ARMS = ("learned", "frozen", "oracle", "blind", "dense")
#: Each arm's rate, by the pilot's rule (`pixel_routing.py rates`), fixed by the registration's commit.
RATES = {"learned": 4e-3, "frozen": 4e-3, "oracle": 4e-3, "blind": 4e-3, "dense": 4e-3}
TARGET = 0.45  # steps to this validation accuracy on the constant-rate curve (secondary, descriptive)
CONFIRM_OUT = pathlib.Path(os.environ.get("PIXEL_CONFIRM_OUT",
                                          f"mini_moe/results/pixel-routing-confirmatory-{MACHINE}.json"))
#: The family (Holm over these four): (name, first, second); a positive difference favours the first.
FAMILY = (("C1 oracle - blind (routing positive control)", "oracle", "blind"),
          ("C2 learned - blind", "learned", "blind"), ("C3 learned - oracle", "learned", "oracle"),
          ("C4 learned - frozen", "learned", "frozen"))
EQUIVALENCE = 1.25  # C3's TOST: the error ratio learned / oracle within [1/1.25, 1.25]


def load_confirm() -> dict:
    if CONFIRM_OUT.exists():
        return json.loads(CONFIRM_OUT.read_text())
    return {"what": "issue 65 registration v3: the confirmatory study (mini_moe/results/pixel-routing-preregistration.md)",
            "machine": bench.machine(), "cells": []}


def confirm_cell(dataset: str, arm: str, seed: int) -> dict:
    """Train one cell of the registration (its constant run and four cooldown branches) and measure
    it: test accuracy at every budget, layer-1 routing accuracy of the routed arms, the steering test
    of the learned and frozen arms, and the constant-rate validation curve."""
    import dataclasses

    from mini_moe import evaluate, train

    name = f"conf-{dataset}-{arm}-s{seed}"
    cfg = arm_config(arm, dataset, seed, learning_rate=RATES[arm], keep_every=400, checkpoint_every=200)
    train_part, validation, test = routing_pilot.splits(cfg)
    history = train.train(cfg, RUNS / name, progress=False, datasets=(train_part, validation))
    curve = [{"step": e["step"], "validation_accuracy": e["test_accuracy"]} for e in history["eval"]]
    reached = [e["step"] for e in curve if e["validation_accuracy"] >= TARGET]
    entry = {"name": name, "dataset": dataset, "arm": arm, "seed": seed, "learning_rate": RATES[arm],
             "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=list)),
             "constant": curve, "steps_to_target": reached[0] if reached else None,
             "train_seconds": round(history["seconds"], 2), "budgets": []}
    tasks = None
    for budget in BUDGETS:
        out, h, _ = annealed(cfg, name, budget, (train_part, validation))
        model, _ = train.load_trained(out)
        row = {"budget": budget, "test_accuracy": evaluate.accuracy(model, test),
               "validation_accuracy": h["eval"][-1]["test_accuracy"], "train_seconds": round(h["seconds"], 2)}
        if cfg.model.router is not None:
            row["routing"] = _routing(out, dataset, test)
        if arm in ("learned", "frozen"):
            if tasks is None:
                from mini_moe import data

                tasks, _ = data.subtask_vote_tasks("test", **data.subtask_vote_options(dataset))
            row["steering"] = evaluate.fresh_router_accuracy(model, test.images, tasks, draws=5, seed=1000)
        entry["budgets"].append(row)
    return entry


def confirm(dataset: str) -> None:
    """Every cell of the registration not yet recorded, seed by seed (so that finished seeds are
    complete pairs), each recorded and (``COMMIT=1``) committed as it finishes; ``SEEDS_ONLY``
    ("1,2") and ``ARMS_ONLY`` split the work between cores."""
    import time
    import traceback

    if set(RATES) != set(CONFIRM_ARMS):
        sys.exit("RATES is not filled in: the registration fixes each arm's rate before any cell")
    seeds = [s for s in SEEDS if str(s) in os.environ.get("SEEDS_ONLY", ",".join(map(str, SEEDS))).split(",")]
    arms = [a for a in CONFIRM_ARMS if a in os.environ.get("ARMS_ONLY", ",".join(CONFIRM_ARMS)).split(",")]
    for seed in seeds:
        for arm in arms:
            name = f"conf-{dataset}-{arm}-s{seed}"
            if any(c["name"] == name and c["status"] == "ok" for c in load_confirm()["cells"]):
                continue
            tick = time.perf_counter()
            try:
                entry = confirm_cell(dataset, arm, seed) | {"status": "ok"}
            except Exception as e:  # recorded; the study goes on (a failed cell is reported, never dropped)
                entry = {"name": name, "dataset": dataset, "arm": arm, "seed": seed, "status": "failed",
                         "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
            entry |= {"wall_seconds": round(time.perf_counter() - tick, 1),
                      "command": f"COMMIT=1 taskset -c {os.environ.get('CORE', '1')} .venv/bin/python "
                                 f"mini_moe/results/pixel_routing.py confirm", "source_commit": _commit(),
                      "source_dirty": _dirty()}
            record = load_confirm()
            record["cells"] = [c for c in record["cells"] if c["name"] != name] + [entry]
            CONFIRM_OUT.write_text(json.dumps(record, indent=1) + "\n")
            print(f"{name}: {entry['status']} test accuracy "
                  f"{[(b['budget'], round(b['test_accuracy'], 4)) for b in entry.get('budgets', [])]} "
                  f"({entry['wall_seconds']} s)", flush=True)
            if os.environ.get("COMMIT") == "1":
                subprocess.run(["bash", "-c", f'source mini_moe/results/commit_result.sh && commit_result '
                                f'{CONFIRM_OUT} "issue 65 confirmatory: {name}"'], check=False)


def analyse(record: dict, budget: int = 2000) -> dict:
    """The registration's analysis at ``budget`` (2,000: the primary endpoint): on the seeds where
    every arm finished, each contrast of :data:`FAMILY` as the mean paired difference in test
    accuracy (points) with Student's t (df = seeds - 1) and its 95 % CI, Holm over the four, and
    C3's TOST on the log error ratio within [-log 1.25, log 1.25]."""
    import math

    from mini_moe import confirm as confirm_lib
    from mini_moe import stats

    acc = {(c["arm"], c["seed"]): {b["budget"]: b["test_accuracy"] for b in c["budgets"]}
           for c in record["cells"] if c["status"] == "ok"}
    seeds = [s for s in SEEDS if all((a, s) in acc for a in CONFIRM_ARMS)]
    rows = []
    for name, first, second in FAMILY:
        diffs = [100 * (acc[first, s][budget] - acc[second, s][budget]) for s in seeds]
        rows.append({"name": name, "arms": [first, second], **stats.paired_t(diffs)} if len(diffs) else
                    {"name": name, "arms": [first, second], "pairs": 0})
    ps = [r.get("p_value", math.nan) for r in rows]
    if len(seeds) >= 2:
        for r, adjusted in zip(rows, stats.holm(ps)):
            r["p_holm"] = adjusted
        ratio = [math.log((1 - acc["learned", s][budget]) / (1 - acc["oracle", s][budget])) for s in seeds]
        rows[2]["log_error_ratio"] = stats.paired_t(ratio)
        rows[2]["tost_p"] = confirm_lib.tost(ratio, math.log(EQUIVALENCE))
    means = {a: 100 * sum(acc[a, s][budget] for s in seeds) / len(seeds) for a in CONFIRM_ARMS} if seeds else {}
    return {"budget": budget, "seeds": seeds, "means": means, "contrasts": rows}


def targets(record: dict, dataset: str, seeds=(0, 1)) -> dict:
    """T1-T3 of the module docstring for one setting, from the calibration's validation curves
    (None where a run is missing)."""
    runs = {(r["arm"], r["seed"]): {e["step"]: e["validation_accuracy"] for e in r["eval"]}
            for r in record.get("calibration", []) if r["dataset"] == dataset and r["status"] == "ok"}
    if not all((arm, seed) in runs for arm in ARMS for seed in seeds):
        return {"dataset": dataset, "complete": False}
    gap = {(seed, step): 100 * (runs["oracle", seed][step] - runs["blind", seed][step])
           for seed in seeds for step in (2000, 3000)}
    mean = lambda arm, step: 100 * sum(runs[arm, s][step] for s in seeds) / len(seeds)  # noqa: E731
    best2000 = max(mean(arm, 2000) for arm in ARMS if arm != "dense")
    best3000 = max(mean(arm, 3000) for arm in ARMS)
    return {"dataset": dataset, "complete": True, "oracle_minus_blind": {f"s{k[0]}@{k[1]}": v for k, v in gap.items()},
            "T1": all(v >= 5 for v in gap.values()), "T2": best2000 - mean("dense", 2000) >= 10,
            "T3": best3000 < 95, "mean_gap_2000": sum(gap[s, 2000] for s in seeds) / len(seeds),
            "means": {arm: {step: mean(arm, step) for step in (2000, 3000)} for arm in ARMS}}


def decision(record: dict) -> dict:
    """The calibration's outcome under the module docstring's rule: ``stop`` (T1 failed in every
    chosen setting), or the ``setting`` the study goes on with and the ``limitations`` (targets
    it misses); None for both while a run is missing."""
    found = [targets(record, d) for d in choose(record)["chosen"]]
    if not found or not all(t["complete"] for t in found):
        return {"stop": None, "setting": None, "limitations": None, "targets": found}
    holding = [t for t in found if t["T1"]]
    if not holding:
        return {"stop": True, "setting": None, "limitations": [], "targets": found}
    full = [t for t in holding if t["T2"] and t["T3"]]
    best = max(full or holding, key=lambda t: t["mean_gap_2000"])
    return {"stop": False, "setting": best["dataset"], "limitations": [k for k in ("T2", "T3") if not best[k]],
            "targets": found}


if __name__ == "__main__":
    groups = sys.argv[1:]
    if not groups or any(g not in ("step0", "choose", "calibrate", "targets", "pilot", "rates", "confirm", "analyse")
                         for g in groups):
        sys.exit("usage: pixel_routing.py step0 | choose | calibrate | targets | pilot | rates | confirm | analyse")
    if "step0" in groups:
        step0()
    if "choose" in groups:
        print(json.dumps(choose(load()), indent=1))
    if "calibrate" in groups:
        chosen = choose(load())
        if not chosen["complete"]:
            sys.exit("step 0 is not complete: run `pixel_routing.py step0` first")
        if not chosen["chosen"]:
            sys.exit("step 0: no setting passes; the calibration stops before any ViT (module docstring)")
        only = os.environ.get("SETTINGS_ONLY")  # e.g. "subtask_vote_d8_h16": one setting per core
        calibrate([d for d in chosen["chosen"] if not only or d in only.split(",")])
    if "targets" in groups:
        print(json.dumps(decision(load()), indent=1))
    if "pilot" in groups or "rates" in groups:
        outcome = decision(load())
        if outcome["stop"] is not False:
            sys.exit("the calibration has not chosen a setting to go on with (`pixel_routing.py targets`)")
        if "pilot" in groups:
            pilot(outcome["setting"])
        print(json.dumps(pilot_rates(load(), outcome["setting"]), indent=1))
    if "confirm" in groups:
        confirm(decision(load())["setting"])
    if "analyse" in groups:
        print(json.dumps([analyse(load_confirm(), b) for b in BUDGETS], indent=1))
