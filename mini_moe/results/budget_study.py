"""Issue 51: does learned routing matter on images? Asked at fixed step budgets, away from the
ceiling, on a pixel task whose right routing is known (a calibrated ``subtask_vote``).

Usage, from the repository root after ``make venv`` (every command resumes; one process per core)::

    taskset -c N .venv/bin/python mini_moe/results/budget_study.py pilot ARM [ARM ...]  # the rate grid
    .venv/bin/python mini_moe/results/budget_study.py chosen      # each arm's rate at each budget
    taskset -c N bash mini_moe/results/budget_study.sh SEED [SEED ...]   # the registered cells
    .venv/bin/python mini_moe/results/budget_study.py analyze     # the registered contrasts

One run trains one arm at one learning rate for :data:`TRAINING`'s 3,000 steps with a constant rate
after the warmup, evaluating on 10,000 held-out training images (validation) every 250 steps and
keeping its checkpoints at every multiple of 500 steps. Each budget of :data:`BUDGETS` is then
measured on the run's kept checkpoint at that step: the model after b steps of a run at that rate.
A budget's learning rate is tuned per arm on validation (:func:`chosen_learning_rates`): an arm
whose best rate differs between budgets trains once per rate it needs.

The pilot (exploratory, seed 0) trains every arm at every rate of :data:`LEARNING_RATES`; its
records go to ``budget-pilot-<MACHINE>.json``, committed run by run with ``COMMIT=1``. The
registered cells (``confirm``) refuse to train unless ``mini_moe`` comes from a clean checkout of
the pinned commit (``budget_study.sh`` pins it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

from mini_moe import bench, confirm, data, evaluate, study, train

MACHINE = os.environ.get("MACHINE", "cpu-2core-epyc")
RESULTS = pathlib.Path(os.environ.get("RESULTS_DIR") or pathlib.Path(__file__).resolve().parent)
RUNS = pathlib.Path(os.environ.get("CELL_RUNS", "runs/budget-study"))
PILOT = RESULTS / f"budget-pilot-{MACHINE}.json"
CONFIRMATORY = RESULTS / f"budget-confirmatory-{MACHINE}.json"
PREREGISTRATION = "mini_moe/results/budget-preregistration.md"
VALIDATION = 10_000

#: The task: ``subtask_vote`` with the content dimension, teacher width and signature norm that the
#: calibration (``routing_pilot.py``, groups ``v3_cal_*``) chose.
TASK = "subtask_vote_d8_h16_s2"
#: arm -> (router for :func:`mini_moe.study.cell_config`, its overrides). The dense ViT of equal
#: activated FLOPs has MLPs of 64 units, like one expert; the dense ViT of equal total parameters has
#: MLPs of 288 (0.99 times the MoE model's 223,370 parameters).
ARMS = {"softmax_expert_choice": ("softmax_expert_choice", {}),
        "softmax_token_choice": ("softmax_token_choice", {}),
        "softmax_expert_choice_frozen": ("softmax_expert_choice_frozen", {}),
        "softmax_token_choice_frozen": ("softmax_token_choice_frozen", {}),
        "hash": ("hash", {}),
        "dense": (None, {}),
        "dense_params": (None, {"model_mlp_dim": 288})}
TRAINING = dict(steps=3000, eval_every=250, schedule="constant", keep_every=500)
BUDGETS = (500, 1000, 2000, 3000)
LEARNING_RATES = (1e-3, 2e-3, 4e-3)
PILOT_SEEDS = (0,)


def cell_config(arm: str, seed: int, learning_rate: float):
    router, extra = ARMS[arm]
    return study.cell_config(router, 1.0, seed, dataset=TASK, scale="quick", learning_rate=learning_rate,
                             **TRAINING, **extra)


def run_name(arm: str, seed: int, learning_rate: float) -> str:
    return f"{arm}-lr{learning_rate:g}-s{seed}"


def train_run(arm: str, seed: int, learning_rate: float, runs: pathlib.Path) -> dict:
    """Train (or resume) one run and measure it at every budget: validation accuracy (what the
    rate's choice sees), test accuracy (the outcome) and, for a routed arm, the routing accuracy of
    each MoE layer against the right routing; plus the validation curve and the training cost."""
    cfg = cell_config(arm, seed, learning_rate)
    train_part, validation, test = train.load_data(cfg, validation=VALIDATION)
    out = runs / run_name(arm, seed, learning_rate)
    result = study.run_cell(cfg, out, progress=False, label=arm, capacity=1.0, datasets=(train_part, validation))
    curve = {e["step"]: e["test_accuracy"] for e in result["eval"]}  # train.train's "test" is validation here
    options = data.subtask_vote_options(TASK)
    tasks, _ = data.subtask_vote_tasks("test", **options)
    budgets = {}
    for b in BUDGETS:
        model, _ = train.load_trained(out, step=b)
        entry = {"validation_accuracy": curve[b], "test_accuracy": evaluate.accuracy(model, test)}
        if cfg.model.router is not None:
            entry["routing"] = [{k: v for k, v in layer.items() if k != "counts"}
                                for layer in evaluate.routing_accuracy(model, test.images, tasks)]
        budgets[str(b)] = entry
    return {"arm": arm, "seed": seed, "learning_rate": learning_rate,
            "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=list)),
            "budgets": budgets, "steps": result["steps"], "train_seconds": result["train_seconds"],
            "step_flops": result["step_flops"], "mechanisms": result["mechanisms"],
            "eval": [{"step": s, "validation_accuracy": a} for s, a in sorted(curve.items())]}


def _source_state() -> dict:
    """The commit and cleanliness of the checkout ``mini_moe`` was imported from."""
    state = confirm.source_state()
    return {"source_commit": state["commit"], "source_dirty": state["dirty"]}


def _commit(path: pathlib.Path, message: str) -> None:
    if os.environ.get("COMMIT") == "1":
        subprocess.run(["bash", "-c", f'source mini_moe/results/commit_result.sh && commit_result {path} "{message}"'],
                       check=False)


def pilot(arms) -> None:
    """The exploratory rate grid: every arm of ``arms`` at every rate, seeds :data:`PILOT_SEEDS`."""
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"budget_study: unknown arms {unknown}; expected some of {list(ARMS)}.")
    for seed in PILOT_SEEDS:
        for arm in arms:
            for lr in LEARNING_RATES:
                done = json.loads(PILOT.read_text())["runs"] if PILOT.exists() else []
                if any((r["arm"], r["seed"], r["learning_rate"]) == (arm, seed, lr) for r in done):
                    continue
                tick = time.perf_counter()
                print(f"{arm} lr {lr:g} seed {seed}", file=sys.stderr, flush=True)
                entry = train_run(arm, seed, lr, RUNS / "pilot") | _source_state() | {
                    "machine": bench.machine(), "wall_seconds": round(time.perf_counter() - tick, 1),
                    "command": f"taskset -c N .venv/bin/python mini_moe/results/budget_study.py pilot {arm}"}
                confirm.locked_update(PILOT, lambda rec: rec.update(
                    what="issue 51 pilot (exploratory): the learning-rate grid of every arm on " + TASK,
                    task=TASK, training=TRAINING, budgets=list(BUDGETS),
                    runs=[r for r in rec.get("runs", []) if (r["arm"], r["seed"], r["learning_rate"]) != (arm, seed, lr)]
                    + [entry]))
                print("  " + ", ".join(f"{b}: val {100 * v['validation_accuracy']:.1f} test {100 * v['test_accuracy']:.1f}"
                                       for b, v in entry["budgets"].items()), file=sys.stderr, flush=True)
                _commit(PILOT, f"issue 51 pilot: {run_name(arm, seed, lr)}")


def chosen_learning_rates(runs: list[dict]) -> dict[str, dict[int, float]]:
    """The rule: per arm and budget, the grid rate with the highest mean validation accuracy at
    that budget over the pilot's seeds; a tie goes to the smaller rate. Raises unless every arm has
    every rate for the same seeds."""
    val: dict[tuple[str, float], list[dict]] = {}
    for r in runs:
        val.setdefault((r["arm"], r["learning_rate"]), []).append(r)
    counts = {len(v) for v in val.values()}
    if set(val) != {(a, lr) for a in ARMS for lr in LEARNING_RATES} or len(counts) != 1:
        raise ValueError(f"the pilot is incomplete: {sorted((k, len(v)) for k, v in val.items())}")
    mean = lambda arm, lr, b: float(np.mean([r["budgets"][str(b)]["validation_accuracy"] for r in val[(arm, lr)]]))
    return {arm: {b: max(LEARNING_RATES, key=lambda lr: (mean(arm, lr, b), -lr)) for b in BUDGETS} for arm in ARMS}


# ----------------------------------------------------------------------- the registered study
#: Fixed by the registration (empty until it is committed).
SEEDS: tuple[int, ...] = ()
LEARNING_RATE: dict[str, dict[int, float]] = {}
#: (name, first arm, second arm), at every budget; the difference is first minus second.
CONTRASTS = (
    ("learned_vs_frozen_ec", "softmax_expert_choice", "softmax_expert_choice_frozen"),
    ("learned_vs_frozen_tc", "softmax_token_choice", "softmax_token_choice_frozen"),
    ("learned_tc_vs_hash", "softmax_token_choice", "hash"),
    ("ec_vs_dense", "softmax_expert_choice", "dense"),
    ("ec_vs_dense_params", "softmax_expert_choice", "dense_params"),
)
ALPHA = 0.05
SOURCE = os.environ.get("SOURCE", "")


def logit(p: float, n: int = 10_000) -> float:
    """The log-odds of an accuracy measured on ``n`` images, with half an image added to the
    correct and the wrong side (so 0 % and 100 % stay finite)."""
    correct = p * n
    return math.log((correct + 0.5) / (n - correct + 0.5))


def confirm_cells(seeds) -> None:
    """Train the registered cells of ``seeds``: every arm, at every rate its budgets need."""
    if not SEEDS or set(LEARNING_RATE) != set(ARMS):
        raise SystemExit("budget_study: the registration (SEEDS, LEARNING_RATE) is not filled in.")
    unknown = sorted(set(seeds) - set(SEEDS))
    if unknown:
        raise SystemExit(f"budget_study: seeds {unknown} are not registered ({list(SEEDS)}).")
    for seed in seeds:
        for arm in ARMS:
            for lr in sorted(set(LEARNING_RATE[arm].values())):
                done = json.loads(CONFIRMATORY.read_text())["runs"] if CONFIRMATORY.exists() else []
                if any((r["arm"], r["seed"], r["learning_rate"]) == (arm, seed, lr) for r in done):
                    continue
                state = confirm.require_pinned(SOURCE)
                print(f"{arm} lr {lr:g} seed {seed}", file=sys.stderr, flush=True)
                entry = train_run(arm, seed, lr, RUNS / "confirm") | {
                    "source_commit": state["commit"], "source_dirty": state["dirty"], "machine": bench.machine()}
                confirm.locked_update(CONFIRMATORY, lambda rec: rec.update(
                    preregistration=PREREGISTRATION, task=TASK,
                    runs=[r for r in rec.get("runs", []) if (r["arm"], r["seed"], r["learning_rate"]) != (arm, seed, lr)]
                    + [entry]))
                _commit(CONFIRMATORY, f"issue 51 confirmatory: {run_name(arm, seed, lr)}")


def cell_values(runs: list[dict]) -> dict[tuple[str, int, int], dict]:
    """(arm, seed, budget) -> that budget's measures, from the run at the budget's registered rate."""
    out = {}
    for r in runs:
        for b in BUDGETS:
            if LEARNING_RATE and LEARNING_RATE[r["arm"]][b] == r["learning_rate"]:
                out[(r["arm"], r["seed"], b)] = r["budgets"][str(b)]
    return out


def comparisons(runs: list[dict]) -> tuple[list[int], list[dict]]:
    """Every contrast at every budget on the complete seeds: the paired t-test of the per-seed
    differences of test log-odds (:func:`logit`), Holm over the whole family of
    ``len(CONTRASTS) * len(BUDGETS)``; beside it the difference in points and the exact sign test."""
    from scipy import stats

    values = cell_values(runs)
    seeds = [s for s in SEEDS if all((a, s, b) in values for a in ARMS for b in BUDGETS)]
    if len(seeds) < 2:
        return seeds, []
    rows = []
    for b in BUDGETS:
        for name, first, second in CONTRASTS:
            acc = lambda arm, s: values[(arm, s, b)]["test_accuracy"]
            diffs = [logit(acc(first, s)) - logit(acc(second, s)) for s in seeds]
            points = [100 * (acc(first, s) - acc(second, s)) for s in seeds]
            t = study.paired_t(diffs)
            positive = sum(d > 0 for d in diffs)
            rows.append({"name": name, "budget": b, "arms": [first, second], "log_odds_differences": diffs,
                         "points_differences": points, "points_difference": float(np.mean(points)),
                         **{k: v for k, v in t.items() if k != "p_value"}, "p": t["p_value"],
                         "sign_test_p": stats.binomtest(positive, len(diffs)).pvalue if diffs else float("nan"),
                         "seeds_favouring_first": positive})
    for row, p_holm in zip(rows, study.holm([row["p"] for row in rows])):
        row["p_holm"] = p_holm
        better = row["arms"][0] if row["difference"] > 0 else row["arms"][1]
        row["verdict"] = f"{better} higher test accuracy" if p_holm < ALPHA else "no detectable difference"
    return seeds, rows


def analyze() -> dict:
    commit = subprocess.run(["git", "log", "-1", "--format=%H", "--", PREREGISTRATION], capture_output=True,
                            text=True).stdout.strip()

    def update(record):
        seeds, rows = comparisons(record["runs"])
        record.update(preregistration=PREREGISTRATION, preregistration_commit=commit, task=TASK, arms=list(ARMS),
                      seeds=list(SEEDS), budgets=list(BUDGETS), learning_rates={a: {str(b): v for b, v in m.items()}
                                                                              for a, m in LEARNING_RATE.items()},
                      training=TRAINING, contrasts=[list(c) for c in CONTRASTS], complete_seeds=seeds,
                      comparisons=rows, family=len(rows), alpha=ALPHA,
                      command="taskset -c N bash mini_moe/results/budget_study.sh SEED ...; "
                              ".venv/bin/python mini_moe/results/budget_study.py analyze")
    return confirm.locked_update(CONFIRMATORY, update)


if __name__ == "__main__":
    commands = {"pilot": lambda args: pilot(args or list(ARMS)),
                "chosen": lambda args: print(json.dumps(chosen_learning_rates(json.loads(PILOT.read_text())["runs"]),
                                                        indent=1)),
                "confirm": lambda args: confirm_cells([int(s) for s in args]),
                "analyze": lambda args: print(json.dumps(analyze()["comparisons"], indent=1))}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    commands[sys.argv[1]](sys.argv[2:])
