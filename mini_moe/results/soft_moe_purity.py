"""Chapter 9's Soft MoE slot purity at convergence, for every seed (study audit 2026-11-25,
finding 22): the chapter measured it on one live run at step 800. ``subtasks.run`` keeps no
checkpoints, so this script trains each uniform-frequency Soft MoE run of chapter 9's experiment
again by the same stopping rule, then measures :func:`mini_moe.subtasks.slot_purity` on the test
groups, for the trained layer and for the same layer at initialisation (the control).

    taskset -c 1 bash mini_moe/results/soft_moe_purity.sh [SEED ...]   # resumable, commits per seed

Each record also carries the committed run's stopping step and test FVU
(``subtasks-converged-*.json``) beside the retrained one's: the code and the machine differ from
the committed runs', so the two may differ a little; the purity is measured on the retrained layer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys


from mini_moe import bench, subtasks, train

RESULTS = pathlib.Path(__file__).resolve().parent
OUT = RESULTS / f"subtasks-soft_moe-purity-{os.environ.get('MACHINE', 'cpu-2core-epyc')}.json"
CONVERGED = sorted(RESULTS.glob("subtasks-converged-*.json"))


def committed(seed: int) -> dict:
    """Chapter 9's committed uniform Soft MoE run of ``seed``."""
    runs = [r for f in CONVERGED for r in json.loads(f.read_text())["runs"]]
    return next(r for r in runs if (r["config"]["router"], r["config"]["frequencies"], r["config"]["seed"])
                == ("soft_moe", "uniform", seed))


def measure(seed: int) -> dict:
    twin = committed(seed)
    cfg = subtasks.SubtaskConfig(**twin["config"])
    result, layer, (x, _, task) = subtasks.run(cfg, return_layer=True)
    untrained = subtasks.SubtaskLayer(cfg, rngs=train.model_rngs(cfg.seed))
    return {"seed": seed, "config": dataclasses.asdict(cfg), "steps": result["steps"], "stopped": result["stopped"],
            "fvu": result["final"]["fvu"], "seconds": result["seconds"],
            "purity": subtasks.slot_purity(layer, x, task, cfg.tasks),
            "purity_untrained": subtasks.slot_purity(untrained, x, task, cfg.tasks),
            "committed_steps": twin["steps"], "committed_fvu": twin["final"]["fvu"],
            "machine": bench.machine(), "source_commit": os.environ.get("SOURCE", "")}


if __name__ == "__main__":
    for seed in [int(s) for s in sys.argv[1:]] or range(8):
        record = json.loads(OUT.read_text()) if OUT.exists() else {"runs": []}
        if any(r["seed"] == seed for r in record["runs"]):
            continue
        print(f"soft_moe uniform seed {seed}", file=sys.stderr, flush=True)
        record["runs"] = sorted(record["runs"] + [measure(seed)], key=lambda r: r["seed"])
        record["command"] = "taskset -c 1 bash mini_moe/results/soft_moe_purity.sh"
        OUT.write_text(json.dumps(record, indent=1) + "\n")
