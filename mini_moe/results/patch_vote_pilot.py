"""The exploratory pilot of issue 25 on ``patch_vote``: runs cells and records every one.

Usage (from the repository root, one training at a time, pinned to one core)::

    taskset -c 1 .venv/bin/python mini_moe/results/patch_vote_pilot.py GROUP [GROUP ...]

Each GROUP names a list of runs (:data:`GROUPS`). Every run is one
:func:`mini_moe.study.run_cell` of :func:`mini_moe.study.cell_config` (the confirmatory
runner's code path), trained under ``runs/patch_vote-pilot/`` (git-ignored). After each run,
finished or failed, its record is appended to ``mini_moe/results/patch_vote-pilot-<MACHINE>.json``
(``MACHINE``, default ``cpu-2core-epyc``): the command, the full config, the seed, test accuracy,
steps, seconds and the mechanism metrics, or the error. Runs already recorded are skipped, so
the pilot resumes. The pilot is exploratory: its p-values are not a result.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shlex
import sys
import time
import traceback

from mini_moe import bench, study

MACHINE = os.environ.get("MACHINE", "cpu-2core-epyc")
OUT = pathlib.Path(f"mini_moe/results/patch_vote-pilot-{MACHINE}.json")
RUNS = pathlib.Path("runs/patch_vote-pilot")

DENSE, TC, EC = None, "softmax_token_choice", "softmax_expert_choice"
SOFT, SINK = "soft_moe", "sinkhorn_token_choice"


def run(router, seed, dataset="patch_vote", capacity=1.0, **overrides):
    return dict(router=router, seed=seed, dataset=dataset, capacity=capacity, overrides=overrides)


#: The pilot's runs, by group, in the order they were planned.
GROUPS = {
    # the setting (dim 64, mlp 64, 2,000 steps, V = 4096): dense vs Token vs Expert Choice
    "reproduce": [run(r, s) for s in (0, 1, 2) for r in (DENSE, EC, TC)],
    # where MoE starts to pay: the vocabulary size V
    "vocab": [run(r, 0, dataset=d) for d in ("patch_vote_v512", "patch_vote_v16384") for r in (DENSE, EC)],
    # does the dense MLP's width matter? 4x (256) and 8x (512 = E x 64: the experts' parameters)
    "width": [run(DENSE, s, model_mlp_dim=w) for w in (256, 512) for s in (0, 1)],
    # the other arms of the pre-registration, two seeds each
    "arms": [run(r, s, capacity=c) for s in (0, 1) for r, c in ((SINK, 1.0), (SOFT, 1.0), (EC, 0.5))],
    # is dense still catching up? twice the steps
    "long": [run(r, 0, steps=4000) for r in (DENSE, EC)],
    # the contrast: on Fashion-MNIST (its quick model: 7x7 patches, width 128), does the dense
    # MLP's width matter at all?
    "fmnist_width": [run(DENSE, 0, dataset="fashion_mnist", model_mlp_dim=w) for w in (16, 64, 256, 1024)],
    # a better dense model of Fashion-MNIST (4x4 patches: 49 tokens), and Expert Choice on it
    "fmnist_better": [run(r, 0, dataset="fashion_mnist", model_patch_size=4, model_dim=64, model_mlp_dim=128,
                          steps=3000) for r in (DENSE, EC)],
    # why does the quick dense ViT of Fashion-MNIST (7x7 patches, width 128, MLP 256, 1,500 steps,
    # learning rate 2e-3, warm-up 100) stop below scikit-learn's MLP? One lever at a time, seed 0,
    # beside the unchanged configuration on the same machine (dict(): no lever).
    "fmnist_levers": [run(DENSE, 0, dataset="fashion_mnist", **lever) for lever in (
        dict(), dict(learning_rate=1e-3), dict(learning_rate=4e-3), dict(warmup_steps=500), dict(augment=True),
        dict(steps=3000), dict(steps=6000), dict(model_depth=6))],
}


#: Reference models that are not ViTs, recorded like the runs (``router`` names the model).
BASELINES = {
    # scikit-learn's MLP (one hidden layer of 100, 30 epochs of Adam) on standardised pixels: the
    # bar a dense ViT of Fashion-MNIST should clear before it is a testbed (issue 25).
    "fmnist_mlp": "fashion_mnist-sklearn_mlp100-s0",
}


def sklearn_mlp(seed: int = 0) -> dict:
    """scikit-learn's ``MLPClassifier(hidden_layer_sizes=(100,), max_iter=30)`` on Fashion-MNIST's
    standardised pixels: test accuracy and training seconds."""
    import warnings

    import numpy as np
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier
    from sklearn.preprocessing import StandardScaler

    from mini_moe import data

    train, test = data.load("fashion_mnist"), data.load("fashion_mnist", "test")
    scaler = StandardScaler().fit(train.images.reshape(len(train), -1))
    x_train, x_test = (scaler.transform(d.images.reshape(len(d), -1)) for d in (train, test))
    tick = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # 30 epochs, as the reference run
        model = MLPClassifier(hidden_layer_sizes=(100,), max_iter=30, random_state=seed).fit(x_train, train.labels)
    seconds = time.perf_counter() - tick
    return {"test_accuracy": float(np.mean(model.predict(x_test) == test.labels)), "train_seconds": round(seconds, 2)}


def name(spec) -> str:
    extra = "".join(f"-{k.removeprefix('model_')}{v}" for k, v in sorted(spec["overrides"].items()))
    return f"{spec['dataset']}{extra}-{study.cell_name(spec['router'], spec['capacity'], spec['seed'])}"


def main(groups) -> None:
    record = json.loads(OUT.read_text()) if OUT.exists() else {
        "what": "issue 25 pilot on patch_vote (exploratory): every run, finished or failed",
        "machine": bench.machine(), "runs": []}
    done = {r["name"] for r in record["runs"] if r["status"] == "ok"}
    for group in [g for g in groups if g in BASELINES]:
        if BASELINES[group] in done:
            continue
        entry = {"name": BASELINES[group], "group": group, "router": "sklearn_mlp", "capacity": 1.0, "seed": 0,
                 "dataset": "fashion_mnist", "overrides": {}, "status": "ok",
                 "command": f"taskset -c 0 .venv/bin/python mini_moe/results/patch_vote_pilot.py {group}",
                 **sklearn_mlp(0)}
        record["runs"].append(entry)
        OUT.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{entry['name']}: acc={100 * entry['test_accuracy']:.2f} train_s={entry['train_seconds']}", flush=True)
    for group in [g for g in groups if g not in BASELINES]:
        for spec in GROUPS[group]:
            run_name = name(spec)
            if run_name in done:
                continue
            command = (f"taskset -c 1 .venv/bin/python mini_moe/results/patch_vote_pilot.py {group}"
                       f"  # run {run_name}")
            entry = {"name": run_name, "group": group, "command": command, "router": spec["router"] or "dense",
                     "capacity": spec["capacity"], "seed": spec["seed"], "dataset": spec["dataset"],
                     "overrides": spec["overrides"]}
            tick = time.perf_counter()
            try:
                cfg = study.cell_config(spec["router"], spec["capacity"], spec["seed"], dataset=spec["dataset"],
                                        scale="quick", **spec["overrides"])
                entry["config"] = json.loads(json.dumps(dataclasses.asdict(cfg), default=list))
                result = study.run_cell(cfg, RUNS / run_name, progress=False, label=spec["router"],
                                        capacity=spec["capacity"])
                entry |= {"status": "ok", "test_accuracy": result["test_accuracy"],
                          "ten_shot_accuracy": result["ten_shot_accuracy"], "steps": result["steps"],
                          "train_seconds": result["train_seconds"], "wall_seconds": result["wall_seconds"],
                          "step_flops": result["step_flops"], "mechanisms": result["mechanisms"],
                          "eval": result["eval"]}
            except Exception as e:  # recorded, the pilot goes on
                entry |= {"status": "failed", "error": f"{type(e).__name__}: {e}",
                          "traceback": traceback.format_exc()[-2000:],
                          "wall_seconds": round(time.perf_counter() - tick, 1)}
            record["runs"] = [r for r in record["runs"] if r["name"] != run_name] + [entry]
            record["machine"]["date_last"] = bench.machine()["date"]
            OUT.write_text(json.dumps(record, indent=1) + "\n")
            acc = entry.get("test_accuracy")
            print(f"{run_name}: {entry['status']} acc={acc if acc is None else round(100 * acc, 2)} "
                  f"train_s={entry.get('train_seconds')} wall_s={entry['wall_seconds']}", flush=True)


if __name__ == "__main__":
    unknown = [g for g in sys.argv[1:] if g not in GROUPS and g not in BASELINES]
    if unknown or len(sys.argv) < 2:
        sys.exit(f"usage: {shlex.quote(sys.argv[0])} GROUP [GROUP ...]; groups: {', '.join([*GROUPS, *BASELINES])}")
    main(sys.argv[1:])
