"""Issue 65: does learned routing matter on pixels? The calibration, step 0 (per token, no ViT).

Usage (from the repository root, pinned to one core)::

    COMMIT=1 taskset -c 1 .venv/bin/python mini_moe/results/pixel_routing.py step0
    .venv/bin/python mini_moe/results/pixel_routing.py choose     # the decision, from the record

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
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from mini_moe import bench
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


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def _dirty() -> bool:
    return bool(subprocess.run(["git", "status", "--porcelain", "--", "mini_moe"], capture_output=True,
                               text=True).stdout.strip())


def load() -> dict:
    if OUT.exists():
        return json.loads(OUT.read_text())
    return {"what": "issue 65 calibration (exploratory): step 0, per-token probes of subtask_vote; then the "
                    "ViT calibration runs", "machine": bench.machine(), "targets": TARGETS, "probes": []}


def step0() -> None:
    """Run the 18 probes not yet recorded, recording each as it finishes."""
    record = load()
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
            if os.environ.get("COMMIT") == "1":
                subprocess.run(["bash", "-c", "source mini_moe/results/commit_result.sh && "
                                f'commit_result {OUT} "issue 65 step 0: {name}"'], check=False)


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


if __name__ == "__main__":
    groups = sys.argv[1:]
    if not groups or any(g not in ("step0", "choose") for g in groups):
        sys.exit("usage: pixel_routing.py step0 | choose")
    if "step0" in groups:
        step0()
    if "choose" in groups:
        print(json.dumps(choose(load()), indent=1))
