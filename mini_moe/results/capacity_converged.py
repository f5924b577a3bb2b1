"""Issue 34's amendment: chapter 8's capacity task (``patch_vote``) at convergence, each arm at its
own learning rate, with the routing control (Expert Choice with its router frozen at initialisation)
and the dense ViT of (about) equal total parameters. The design is
``mini_moe/results/patch_vote-converged-preregistration.md``; its three contrasts fill the slots
that the token-level registration (``subtasks-controls-preregistration.md``) reserved, so Holm's
correction runs over all eight.

Usage, from the repository root after ``make venv`` (each command resumes; one process per core)::

    taskset -c 0 bash mini_moe/results/capacity_converged.sh SEED [SEED ...]   # the registered cells
    .venv/bin/python mini_moe/results/capacity_converged.py analyze             # the contrasts
    .venv/bin/python mini_moe/results/capacity_converged.py plan                # the pilot's numbers

Every cell trains like the pilot's runs (``routing_pilot.py``, groups ``capacity_s0`` and
``capacity_s1``): :func:`mini_moe.study.run_cell` of :func:`mini_moe.study.cell_config` on the
training split less 10,000 validation images (:func:`mini_moe.train.load_data`), evaluated on the
validation images every 500 steps, stopped by :data:`TRAINING`'s rule; then its test accuracy is
measured once, on the 10,000 test images. ``confirm`` refuses a cell unless ``mini_moe`` comes from
a clean checkout of the pinned commit, and commits the results file after every cell.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import numpy as np

from mini_moe import bench, confirm, evaluate, study, train

MACHINE = os.environ.get("MACHINE", "cpu-2core-epyc")
RESULTS = pathlib.Path(os.environ.get("RESULTS_DIR") or pathlib.Path(__file__).resolve().parent)
RUNS = pathlib.Path(os.environ.get("CELL_RUNS", "runs/capacity-converged"))
PILOT = RESULTS / "patch_vote-convergence-pilot-cpu-2core-epyc.json"
CONFIRMATORY = RESULTS / f"patch_vote-converged-confirmatory-{MACHINE}.json"
TOKEN_LEVEL = RESULTS / "subtasks-controls-confirmatory-cpu-2core-epyc.json"
VALIDATION = 10_000

#: arm -> (router for :func:`mini_moe.study.cell_config`, its overrides): the dense ViT of equal
#: activated FLOPs, Expert Choice at c = 1, the dense ViT with MLPs of 256 units (0.92 times the MoE
#: model's parameters) and Expert Choice with its router frozen at initialisation.
ARMS = {"dense": (None, {}),
        "softmax_expert_choice": ("softmax_expert_choice", {}),
        "dense_mlp256": (None, {"model_mlp_dim": 256}),
        "softmax_expert_choice_frozen": ("softmax_expert_choice_frozen", {})}
#: How every cell trains (the pilot's schedule): cosine decay over at most 5,000 steps, validation
#: accuracy every 500 steps, stopped when it has not risen by 0.2 points within 1,500 steps.
TRAINING = dict(steps=5000, eval_every=500, patience=1500, min_delta=0.002)
LEARNING_RATES = (2e-3, 4e-3, 8e-3)


def pilot_arm(run: dict) -> str | None:
    """The arm of a run of the pilot's groups ``capacity_s0`` / ``capacity_s1`` (standardised inputs)."""
    if run.get("group") not in ("capacity_s0", "capacity_s1") or run.get("inputs") != "standardised":
        return None
    mlp = run["overrides"].get("model_mlp_dim")
    return {("dense", None): "dense", ("dense", 256): "dense_mlp256"}.get((run["router"], mlp), run["router"])


def chosen_learning_rates(runs: list[dict]) -> dict[str, float]:
    """The registered rule: per arm, the grid value with the highest mean validation accuracy (at the
    run's stopping step) over the pilot's seeds; a tie goes to the smaller rate. Only finished runs
    count; an arm that lacks a rate in some seed raises."""
    val: dict[tuple[str, float], list[float]] = {}
    for r in runs:
        arm = pilot_arm(r)
        if arm is not None and r["status"] == "ok":
            val.setdefault((arm, r["overrides"]["learning_rate"]), []).append(r["validation_accuracy"])
    seeds = {len(v) for v in val.values()}
    if len(val) != len(ARMS) * len(LEARNING_RATES) or len(seeds) != 1:
        raise ValueError(f"the pilot is incomplete: {sorted((k, len(v)) for k, v in val.items())}")
    return {arm: max(LEARNING_RATES, key=lambda lr: (np.mean(val[(arm, lr)]), -lr)) for arm in ARMS}


def pilot_summary(runs: list[dict]) -> list[dict]:
    """Per arm and learning rate: the pilot's seeds, validation and test accuracies, steps."""
    rows: dict[tuple[str, float], list[dict]] = {}
    for r in runs:
        arm = pilot_arm(r)
        if arm is not None:
            rows.setdefault((arm, r["overrides"]["learning_rate"]), []).append(r)
    return [{"arm": arm, "learning_rate": lr, "seeds": [r["seed"] for r in v],
             "validation_accuracy": [r.get("validation_accuracy") for r in v],
             "test_accuracy": [r.get("test_accuracy") for r in v], "steps": [r.get("steps") for r in v],
             "mean_validation_accuracy": float(np.mean([r["validation_accuracy"] for r in v]))}
            for (arm, lr), v in sorted(rows.items())]


def pilot_differences(runs: list[dict], rates: dict[str, float]) -> dict[str, list[float]]:
    """Per registered contrast, the pilot's paired differences of validation accuracy (first arm
    minus second) at the chosen rates, one per pilot seed."""
    acc = {(pilot_arm(r), r["overrides"]["learning_rate"], r["seed"]): r["validation_accuracy"]
           for r in runs if pilot_arm(r) is not None and r["status"] == "ok"}
    seeds = sorted({s for (_, _, s) in acc})
    return {name: [acc[(a, rates[a], s)] - acc[(b, rates[b], s)] for s in seeds] for name, a, b in CONTRASTS}


#: The seed rule's inputs: the smallest difference of interest, 1.5 accuracy points (chapter 8's);
#: power 0.8; at least 6 seeds; the level of Holm's step at which the first of these contrasts is
#: tested (see :func:`plan`). TOST's bound is chapter 8's, +-0.5 points; it is registered for a
#: contrast only where its power is at least 0.5 (issue 34) with the 80 % upper confidence limit of
#: that contrast's pilot SD (two pilot seeds estimate an SD poorly, so not the estimate itself).
DIFFERENCE, POWER, MIN_SEEDS, BOUND, TOST_MIN_POWER = 0.015, 0.8, 6, 0.005, 0.5


def sd_upper(sd: float, df: int, level: float = 0.8) -> float:
    """The one-sided ``level`` upper confidence limit of a normal SD estimated as ``sd`` with ``df``
    degrees of freedom: sd * sqrt(df / chi^2_{1-level, df})."""
    from scipy import stats

    return float(sd * np.sqrt(df / stats.chi2.ppf(1 - level, df)))


def plan(runs: list[dict]) -> dict:
    """The registration's numbers from the pilot: chosen rates, each contrast's pilot differences
    and their SD, the seeds by the rule (the largest SD, :data:`DIFFERENCE` at power :data:`POWER`,
    at alpha 0.05 / 4: the token-level study's four rejections are known, so Holm's step-down tests
    the first of the remaining four hypotheses at 0.05 / 4), the power of each contrast at its own
    pilot difference and at :data:`DIFFERENCE`, and TOST's power at +-:data:`BOUND` for a true
    difference of zero with :func:`sd_upper` of each contrast's pilot SD (TOST is registered where
    that power is at least :data:`TOST_MIN_POWER`)."""
    rates = chosen_learning_rates(runs)
    diffs = pilot_differences(runs, rates)
    sds = {name: float(np.std(d, ddof=1)) for name, d in diffs.items()}
    upper = {name: sd_upper(v, len(diffs[name]) - 1) for name, v in sds.items()}
    sd = max(sds.values())
    alpha = ALPHA / 4
    seeds = max(MIN_SEEDS, study.seeds_for_power(sd, DIFFERENCE, alpha=alpha, power=POWER))
    tost_power = {n: study.tost_power(seeds, upper[n], BOUND) for n in diffs}
    return {"learning_rates": rates, "differences": diffs, "mean_difference": {n: float(np.mean(d)) for n, d in diffs.items()},
            "sd": sds, "sd_upper80": upper, "largest_sd": sd, "alpha": alpha, "seeds": seeds,
            "seeds_by_rule": study.seeds_for_power(sd, DIFFERENCE, alpha=alpha, power=POWER),
            "power_at_difference": study.paired_power(seeds, sd, DIFFERENCE, alpha=alpha),
            "power_at_pilot_difference": {n: study.paired_power(seeds, sd, abs(float(np.mean(d))) or 1e-12, alpha=alpha)
                                          for n, d in diffs.items()},
            "tost_power_at_sd_upper80": tost_power,
            "tost_registered": [n for n, v in tost_power.items() if v >= TOST_MIN_POWER]}


# ----------------------------------------------------------------------- the registered study
#: Fixed by the registration: the seeds, every arm's learning rate (the pilot's rule), the contrasts.
SEEDS: tuple[int, ...] = tuple(range(110, 117))
LEARNING_RATE: dict[str, float] = {"dense": 4e-3, "softmax_expert_choice": 4e-3, "dense_mlp256": 2e-3,
                                   "softmax_expert_choice_frozen": 4e-3}
#: (name, first arm, second arm): the difference is first minus second test accuracy (positive
#: favours the first).
CONTRASTS = (
    ("capacity_ec_vs_dense", "softmax_expert_choice", "dense"),
    ("capacity_ec_vs_dense_equal_params", "softmax_expert_choice", "dense_mlp256"),
    ("capacity_learned_vs_frozen_ec", "softmax_expert_choice", "softmax_expert_choice_frozen"),
)
#: The contrasts with a TOST equivalence test at +-:data:`BOUND` (Holm over these TOST p-values).
TOST_CONTRASTS: tuple[str, ...] = ("capacity_ec_vs_dense_equal_params", "capacity_learned_vs_frozen_ec")
METRIC = "test_accuracy"
FAMILY = 8  # with the token-level study's five contrasts
ALPHA = 0.05
SOURCE = os.environ.get("SOURCE", "")


def cell_config(arm: str, seed: int):
    router, extra = ARMS[arm]
    return study.cell_config(router, 1.0, seed, dataset="patch_vote", scale="quick",
                             learning_rate=LEARNING_RATE[arm], **TRAINING, **extra)


def cell_name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def train_cell(arm: str, seed: int) -> dict:
    """Train (or resume) one cell under ``RUNS`` and measure it: validation accuracy at the stopping
    step (what training saw), test accuracy (the outcome), steps, seconds, FLOPs, mechanisms."""
    cfg = cell_config(arm, seed)
    train_part, validation, test = train.load_data(cfg, validation=VALIDATION)
    result = study.run_cell(cfg, RUNS / cell_name(arm, seed), progress=False, label=arm, capacity=1.0,
                            datasets=(train_part, validation))
    model, _ = train.load_trained(RUNS / cell_name(arm, seed))
    return {"arm": arm, "seed": seed, "learning_rate": cfg.learning_rate,
            "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=list)),
            "validation_accuracy": result["test_accuracy"], "test_accuracy": evaluate.accuracy(model, test),
            "steps": result["steps"], "train_seconds": result["train_seconds"],
            "step_flops": result["step_flops"], "mechanisms": result["mechanisms"],
            # train.train calls its evaluation split "test"; here it is the validation images
            "eval": [{"step": e["step"], "seconds": e["seconds"], "validation_accuracy": e["test_accuracy"]}
                     for e in result["eval"]]}


def confirm_cells(seeds) -> None:
    """Train the registered cells of ``seeds`` (every arm, seed by seed), skipping recorded ones."""
    if not SEEDS or set(LEARNING_RATE) != set(ARMS):
        raise SystemExit("capacity_converged: the registration (SEEDS, LEARNING_RATE) is not filled in.")
    unknown = sorted(set(seeds) - set(SEEDS))
    if unknown:
        raise SystemExit(f"capacity_converged: seeds {unknown} are not registered ({list(SEEDS)}).")
    for seed in seeds:
        for arm in ARMS:
            done = json.loads(CONFIRMATORY.read_text())["runs"] if CONFIRMATORY.exists() else []
            if any(r["arm"] == arm and r["seed"] == seed for r in done):
                continue
            state = confirm.require_pinned(SOURCE)  # refuses other code, or a dirty checkout
            print(f"{arm} seed {seed} (learning rate {LEARNING_RATE[arm]:g})", file=sys.stderr, flush=True)
            result = train_cell(arm, seed) | {"source_commit": state["commit"], "source_dirty": state["dirty"],
                                              "machine": bench.machine()}
            confirm.locked_update(CONFIRMATORY, lambda rec: rec.update(
                runs=[r for r in rec["runs"] if (r["arm"], r["seed"]) != (arm, seed)] + [result],
                machine=bench.machine(), preregistration="mini_moe/results/patch_vote-converged-preregistration.md"))
            print(f"  test accuracy {100 * result['test_accuracy']:.2f} % after {result['steps']} steps "
                  f"({result['train_seconds']:.0f} s)", file=sys.stderr, flush=True)
            if os.environ.get("COMMIT") == "1":
                subprocess.run(["bash", "-c", f'source mini_moe/results/commit_result.sh && commit_result '
                                f'{CONFIRMATORY} "issue 34 capacity-task confirmatory: {arm} seed {seed}"'],
                               check=False)


def token_level_p_values() -> list[float]:
    """The token-level study's five unadjusted p-values (its results file), in its order."""
    return [row["p"] for row in json.loads(TOKEN_LEVEL.read_text())["comparisons"]]


def comparisons(runs: list[dict], token_p: list[float]) -> tuple[list[int], list[dict]]:
    """The registered contrasts on the complete seeds: ``(seeds, rows)``, each row with the paired
    t-test of the per-seed differences (first arm's test accuracy minus the second's), ``p`` and
    ``p_holm``: Holm over the whole family, the token-level study's five p-values (``token_p``)
    and these three (a contrast not yet run counts as p = 1); for :data:`TOST_CONTRASTS`, ``tost_p``
    (:func:`mini_moe.confirm.tost` at +-:data:`BOUND`) and ``tost_p_holm`` (Holm over those); and the
    ``verdict``: a difference where p_Holm < alpha, else equivalence where tost_p_holm < alpha, else
    "no detectable difference"."""
    acc = {(r["arm"], r["seed"]): r[METRIC] for r in runs}
    seeds = [s for s in SEEDS if all((arm, s) in acc for arm in ARMS)]
    if len(seeds) < 2:
        return seeds, []
    rows = []
    for name, first, second in CONTRASTS:
        diffs = [acc[(first, s)] - acc[(second, s)] for s in seeds]
        t = study.paired_t(diffs)
        rows.append({"name": name, "arms": [first, second], "differences": diffs,
                     **{k: v for k, v in t.items() if k != "p_value"}, "p": t["p_value"]})
    family = list(token_p) + [row["p"] for row in rows]
    adjusted = study.holm(family + [1.0] * (FAMILY - len(family)))
    tested = [row for row in rows if row["name"] in TOST_CONTRASTS]
    for row in tested:
        row["tost_p"] = confirm.tost(row["differences"], BOUND)
    for row, p_holm in zip(tested, study.holm([row["tost_p"] for row in tested]) if tested else []):
        row["tost_p_holm"] = p_holm
    for row, p_holm in zip(rows, adjusted[len(token_p):]):
        row["p_holm"] = p_holm
        better = row["arms"][0] if row["difference"] > 0 else row["arms"][1]
        if p_holm < ALPHA:
            row["verdict"] = f"{better} higher test accuracy"
        elif row.get("tost_p_holm", 1.0) < ALPHA:
            row["verdict"] = f"equivalent within +-{100 * BOUND:g} points"
        else:
            row["verdict"] = "no detectable difference" + ("" if "tost_p" in row else " (no equivalence test made)")
    return seeds, rows


def analyze() -> dict:
    """Write the registered design, the pilot's summary and the contrasts into the results file."""
    prereg = "mini_moe/results/patch_vote-converged-preregistration.md"
    commit = subprocess.run(["git", "log", "-1", "--format=%H", "--", prereg], capture_output=True,
                            text=True).stdout.strip()
    pilot = json.loads(PILOT.read_text())["runs"]
    token_p = token_level_p_values()

    def update(record):
        seeds, rows = comparisons(record["runs"], token_p)
        record.update(preregistration=prereg, preregistration_commit=commit, arms=list(ARMS), seeds=list(SEEDS),
                      learning_rates=LEARNING_RATE, learning_rate_grid=list(LEARNING_RATES), training=TRAINING,
                      pilot=pilot_summary(pilot), contrasts=[list(c) for c in CONTRASTS], metric=METRIC,
                      complete_seeds=seeds, comparisons=rows, family=FAMILY, alpha=ALPHA,
                      token_level_p=token_p,
                      command="taskset -c N bash mini_moe/results/capacity_converged.sh SEED ...; "
                              ".venv/bin/python mini_moe/results/capacity_converged.py analyze")
    return confirm.locked_update(CONFIRMATORY, update)


if __name__ == "__main__":
    commands = {"confirm": lambda args: confirm_cells([int(s) for s in args]),
                "analyze": lambda args: print(json.dumps(analyze()["comparisons"], indent=1)),
                "chosen": lambda args: print(chosen_learning_rates(json.loads(PILOT.read_text())["runs"])),
                "plan": lambda args: print(json.dumps(plan(json.loads(PILOT.read_text())["runs"]), indent=1))}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    commands[sys.argv[1]](sys.argv[2:])
