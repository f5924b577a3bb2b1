"""Issue 34's routing task at the token level: chapter 9's controlled experiment
(:mod:`mini_moe.subtasks`, eight sub-tasks whose right routing is known) with the routing controls
(a router with its weights frozen at initialisation, the hash router) and the confound split
(Token Choice without noise or auxiliary loss, against Expert Choice, which has neither).

Usage, from the repository root after ``make venv`` (each command resumes; one process per core):

    taskset -c 0 .venv/bin/python mini_moe/results/subtasks_controls.py lr_pilot SEED [SEED ...]
    taskset -c 0 bash mini_moe/results/subtasks_controls.sh SEED [SEED ...]    # the registered runs
    .venv/bin/python mini_moe/results/subtasks_controls.py analyze

``lr_pilot`` (exploratory, seeds 0 and 1, never reused): every arm at the learning rates of
:data:`LEARNING_RATES`, trained to the stopping rule of :data:`TRAINING` (validation FVU), into
``subtasks-controls-lr-pilot-seedsS-MACHINE.json`` (one file per process). ``confirm`` (through ``subtasks_controls.sh``, which
pins the code): the registered cells (``subtasks-controls-preregistration.md``), each committed as
it finishes into ``subtasks-controls-confirmatory-MACHINE.json``; it refuses to train unless
``mini_moe`` is imported from a clean checkout of the pinned commit. ``analyze``: the registered
contrasts on the complete seeds, written into the same file.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np

from mini_moe import bench, confirm, study, subtasks

MACHINE = os.environ.get("MACHINE", "cpu-2core-epyc")
RESULTS = pathlib.Path(os.environ.get("RESULTS_DIR") or pathlib.Path(__file__).resolve().parent)

#: The arms: the learned routers, their frozen twins, the hash router, Token Choice with neither
#: noise nor auxiliary loss (Expert Choice has neither), and the dense layer of equal parameters.
ARMS = ("softmax_token_choice", "softmax_token_choice_frozen", "softmax_expert_choice",
        "softmax_expert_choice_frozen", "hash", "softmax_token_choice_plain", "dense_wide")
#: The learning-rate grid, and how every run trains: to the stopping rule on validation FVU
#: (1 % within 1,000 steps), at most 20,000 steps, uniform sub-task frequencies, c = 1.
LEARNING_RATES = (1e-3, 3e-3, 1e-2)
TRAINING = dict(steps=20000, patience=1000)
#: The pilot's records: one file per process (``-seeds0``, ``-seeds1``, ...), so that two cores
#: never write the same file.
PILOT_GLOB = "subtasks-controls-lr-pilot-seeds*-*.json"
CONFIRMATORY = RESULTS / f"subtasks-controls-confirmatory-{MACHINE}.json"


def lr_pilot(seeds) -> None:
    out = RESULTS / f"subtasks-controls-lr-pilot-seeds{'-'.join(map(str, seeds))}-{MACHINE}.json"
    command = f"taskset -c N .venv/bin/python mini_moe/results/subtasks_controls.py lr_pilot {' '.join(map(str, seeds))}"
    for lr in LEARNING_RATES:
        subtasks.run_experiment(out, routers=ARMS, frequencies=("uniform",), seeds=seeds, command=command,
                                learning_rate=lr, **TRAINING)


def pilot_runs() -> list[dict]:
    """Every run of the learning-rate pilot (all its files)."""
    return [r for f in sorted(RESULTS.glob(PILOT_GLOB)) for r in json.loads(f.read_text())["runs"]]


def chosen_learning_rates(runs: list[dict]) -> dict[str, float]:
    """The registered rule: per arm, the grid value with the lowest mean validation FVU (at the
    run's stopping point) over the pilot's seeds; a tie goes to the smaller rate."""
    val: dict[tuple[str, float], list[float]] = {}
    for r in runs:
        c = r["config"]
        val.setdefault((c["router"], c["learning_rate"]), []).append(r["final"]["val_fvu"])
    return {arm: min(LEARNING_RATES, key=lambda lr: (np.mean(val[(arm, lr)]), lr)) for arm in ARMS}


# ----------------------------------------------------------------------- the registered study
#: Fixed by the registration (subtasks-controls-preregistration.md): the seeds, the learning rate
#: of every arm (from :func:`chosen_learning_rates` on the pilot), the contrasts and the metric.
SEEDS: tuple[int, ...] = tuple(range(100, 109))
LEARNING_RATE: dict[str, float] = {'softmax_token_choice': 0.003, 'softmax_token_choice_frozen': 0.01, 'softmax_expert_choice': 0.003, 'softmax_expert_choice_frozen': 0.01, 'hash': 0.01, 'softmax_token_choice_plain': 0.01, 'dense_wide': 0.01}
#: (name, first arm, second arm): a positive difference favours the first (lower test FVU).
CONTRASTS = (
    ("learned_vs_frozen_tc", "softmax_token_choice", "softmax_token_choice_frozen"),
    ("learned_vs_frozen_ec", "softmax_expert_choice", "softmax_expert_choice_frozen"),
    ("learned_tc_vs_hash", "softmax_token_choice", "hash"),
    ("ec_vs_tc_matched", "softmax_expert_choice", "softmax_token_choice_plain"),
    ("moe_vs_dense_equal_params", "softmax_token_choice", "dense_wide"),
)
METRIC = "fvu"
#: The family: these five contrasts and up to three of the capacity task, added by an amendment
#: before its first cell; until then the missing p-values count as 1 (Holm is monotone, so the
#: adjusted p-values can only fall when they arrive).
FAMILY = 8
ALPHA = 0.05
SOURCE = os.environ.get("SOURCE", "")


def _config(arm: str, seed: int) -> subtasks.SubtaskConfig:
    return subtasks.SubtaskConfig(router=arm, seed=seed, learning_rate=LEARNING_RATE[arm], **TRAINING)


def confirm_cells(seeds) -> None:
    """Train the registered cells of ``seeds`` (every arm), skipping those already recorded."""
    if not SEEDS or set(LEARNING_RATE) != set(ARMS):
        raise SystemExit("subtasks_controls: the registration (SEEDS, LEARNING_RATE) is not filled in.")
    unknown = sorted(set(seeds) - set(SEEDS))
    if unknown:
        raise SystemExit(f"subtasks_controls: seeds {unknown} are not registered ({list(SEEDS)}).")
    for seed in seeds:
        for arm in ARMS:
            cfg = _config(arm, seed)
            done = json.loads(CONFIRMATORY.read_text())["runs"] if CONFIRMATORY.exists() else []
            if any(r["config"] == json.loads(json.dumps(vars(cfg))) for r in done):
                continue
            state = confirm.require_pinned(SOURCE)  # refuses other code, or a dirty checkout
            print(f"{arm} seed {seed} (learning rate {cfg.learning_rate:g})", file=sys.stderr, flush=True)
            result = subtasks.run(cfg) | {"source_commit": state["commit"], "source_dirty": state["dirty"],
                                          "machine": bench.machine()}
            confirm.locked_update(CONFIRMATORY, lambda rec: rec.update(
                runs=[r for r in rec["runs"] if r["config"] != result["config"]] + [result],
                machine=bench.machine(), preregistration="mini_moe/results/subtasks-controls-preregistration.md"))
            if os.environ.get("COMMIT") == "1":
                subprocess.run(["bash", "-c", f'source mini_moe/results/commit_result.sh && commit_result '
                                f'{CONFIRMATORY} "issue 34 token-level confirmatory: '
                                f'{arm} seed {seed}"'], check=False)


def comparisons(runs: list[dict]) -> tuple[list[int], list[dict]]:
    """The registered contrasts on the complete seeds: ``(seeds, rows)``. Each row: the contrast's
    ``name`` and ``arms``, :func:`mini_moe.study.paired_t` of the per-seed differences (second
    arm's test FVU minus the first's: positive favours the first), ``p``, ``p_holm`` (Holm over
    :data:`FAMILY`, the unrun contrasts at p = 1) and the ``verdict``."""
    fvu = {(r["config"]["router"], r["config"]["seed"]): r["final"][METRIC] for r in runs}
    seeds = [s for s in SEEDS if all((arm, s) in fvu for arm in ARMS)]
    if len(seeds) < 2:
        return seeds, []
    rows = []
    for name, first, second in CONTRASTS:
        diffs = [fvu[(second, s)] - fvu[(first, s)] for s in seeds]
        t = study.paired_t(diffs)
        rows.append({"name": name, "arms": [first, second], "differences": diffs,
                     **{k: v for k, v in t.items() if k != "p_value"}, "p": t["p_value"]})
    adjusted = study.holm([row["p"] for row in rows] + [1.0] * (FAMILY - len(rows)))
    for row, p_holm in zip(rows, adjusted):
        row["p_holm"] = p_holm
        better = row["arms"][0] if row["difference"] > 0 else row["arms"][1]
        row["verdict"] = (f"{better} lower test FVU" if p_holm < ALPHA else "no detectable difference")
    return seeds, rows


def pilot_summary(runs: list[dict]) -> list[dict]:
    """Per arm and learning rate: the pilot's seeds and mean validation FVU (what the rule read)."""
    rows: dict[tuple[str, float], list[float]] = {}
    for r in runs:
        rows.setdefault((r["config"]["router"], r["config"]["learning_rate"]), []).append(
            (r["config"]["seed"], r["final"]["val_fvu"]))
    return [{"arm": arm, "learning_rate": lr, "seeds": [s for s, _ in v],
             "mean_validation_fvu": float(np.mean([f for _, f in v]))} for (arm, lr), v in sorted(rows.items())]


def analyze() -> dict:
    """Write the registered design, the pilot's summary and the contrasts into the results file."""
    prereg = "mini_moe/results/subtasks-controls-preregistration.md"
    commit = subprocess.run(["git", "log", "-1", "--format=%H", "--", prereg], capture_output=True,
                            text=True).stdout.strip()

    def update(record):
        seeds, rows = comparisons(record["runs"])
        record.update(preregistration=prereg, preregistration_commit=commit, arms=list(ARMS), seeds=list(SEEDS),
                      learning_rates=LEARNING_RATE, learning_rate_grid=list(LEARNING_RATES),
                      pilot=pilot_summary(pilot_runs()), contrasts=[list(c) for c in CONTRASTS],
                      metric=METRIC, complete_seeds=seeds, comparisons=rows, family=FAMILY, alpha=ALPHA,
                      command="taskset -c N bash mini_moe/results/subtasks_controls.sh SEED ...; "
                              ".venv/bin/python mini_moe/results/subtasks_controls.py analyze")
    return confirm.locked_update(CONFIRMATORY, update)


if __name__ == "__main__":
    commands = {"lr_pilot": lambda args: lr_pilot([int(s) for s in args]),
                "confirm": lambda args: confirm_cells([int(s) for s in args]),
                "analyze": lambda args: print(json.dumps(analyze()["comparisons"], indent=1)),
                "chosen": lambda args: print(chosen_learning_rates(pilot_runs()))}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    commands[sys.argv[1]](sys.argv[2:])
