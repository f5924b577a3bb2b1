"""Issue 67 §2: one-shot pruning against merging on this book's vision MoEs, the registered
comparison (``mini_moe/results/compression-preregistration.md``).

Usage, from the repository root (each command resumes; one process per core)::

    COMMIT=1 taskset -c 1 .venv/bin/python mini_moe/results/compress_study.py run --source COMMIT [--seeds 1 2]
    .venv/bin/python mini_moe/results/compress_study.py analyse     # the registered family, from the JSON
    .venv/bin/python mini_moe/results/compress_study.py smoke --runs DIR   # every arm, tiny, on digits

For each dataset and seed, :func:`model_cell` trains the model (Softmax Token Choice, k = 2, c = 2,
E = 8), calibrates it on :data:`CALIBRATION` training images (:func:`mini_moe.compress.calibrate`),
and measures every one-shot arm at every compression (test accuracy, per-layer reconstruction error
and routing agreement, expert parameters stored); :func:`reference_cell` trains the MoE of E = 4
from scratch. ``smoke`` runs the same code on :data:`SMOKE` (digits, a tiny model, 20 steps) into
``--runs``: a check of the pipeline, never a result. (Not ``compression.py``: run as a script,
that name would shadow the ``compression`` module JAX's compilation cache tries to import.)
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import numpy as np

from mini_moe import bench, compress, confirm, evaluate, stats, study, train

MACHINE = os.environ.get("MACHINE", "cpu-2core-epyc")
RESULTS = pathlib.Path(os.environ.get("RESULTS_DIR") or pathlib.Path(__file__).resolve().parent)
PREREGISTRATION = "mini_moe/results/compression-preregistration.md"
ROUTER = "softmax_token_choice"
PRUNE = ("frequency", "gate", "ean", "reap", "random")
MERGE = compress.GROUPINGS
FAMILY = (("P1 reap - random", "reap", "random"), ("P2 reap - frequency", "reap", "frequency"),
          ("P3 reap - mc_smoe", "reap", "mc_smoe"), ("P4 reap - hc_smoe", "reap", "hc_smoe"))
ALPHA = 0.05


@dataclasses.dataclass(frozen=True)
class Plan:
    """The study's sizes: datasets, ``study.cell_config`` overrides (for all, and per dataset), seeds,
    experts removed per layer, calibration images, the primary compression (experts removed) and the
    reference's E."""

    name: str
    datasets: tuple
    overrides: dict
    per_dataset: dict
    seeds: tuple
    removed: tuple
    calibration: int
    primary: int
    reference_experts: int


#: The registration: chapter 8's recipe; on Fashion-MNIST chapter 16's models (width 64, MLPs and
#: experts of 64 units, as ``patch_vote``'s), not the quick configuration's width 128.
REGISTERED = Plan("confirmatory", ("patch_vote", "fashion_mnist"), dict(confirm.OVERRIDES),
                  {"fashion_mnist": dict(model_dim=64, model_mlp_dim=64)}, (1, 2, 3, 4, 5), (2, 4, 6), 1024, 4, 4)
SMOKE = Plan("smoke", ("digits",), dict(model_dim=16, model_mlp_dim=16, model_heads=2, model_depth=2, batch_size=32,
                                        learning_rate=2e-3, warmup_steps=2, steps=20, eval_every=20,
                                        eval_batch_size=128), {}, (0,), (2, 4, 6), 64, 4, 4)


def config(dataset: str, seed: int, plan: Plan, num_experts: int = 8):
    """The :class:`~mini_moe.config.TrainConfig` of one model (module docstring)."""
    return study.cell_config(ROUTER, 2.0, seed, dataset=dataset, scale="quick", model_num_experts=num_experts,
                             model_router_kwargs={"k": 2}, **plan.overrides, **plan.per_dataset.get(dataset, {}))


def calibration_images(train_part, plan: Plan) -> np.ndarray:
    """The first ``plan.calibration`` images of a permutation (seed 0) of the training part."""
    order = np.random.default_rng(0).permutation(len(train_part.images))[:plan.calibration]
    return np.asarray(train_part.images)[np.sort(order)]


def arms(model, records, plan: Plan, seed: int) -> dict:
    """Every one-shot arm at every compression: ``{(arm, removed): compressed model}``."""
    out = {}
    for removed in plan.removed:
        kept = 8 - removed
        for criterion in PRUNE:
            keep = [compress.keep_top(compress.saliency(r, criterion, seed=seed), kept) for r in records]
            out[criterion, removed] = compress.prune(model, keep)
        for method in MERGE:
            out[method, removed] = compress.merge(model, records, kept, method)
    return out


def measure(model, test) -> dict:
    """Test accuracy, which test images were classified right (``correct``: :func:`pack`), and the
    expert parameters stored."""
    correct = evaluate.predictions(model, test.images, batch_size=512) == np.asarray(test.labels)
    return {"test_accuracy": float(correct.mean()), "test_images": len(correct), "correct": pack(correct),
            "expert_parameters": compress.stored_expert_parameters(model)}


def pack(correct: np.ndarray) -> str:
    """Booleans ``[N]`` as base64 text of their bits (10,000 test images: 1,668 characters)."""
    return base64.b64encode(np.packbits(np.asarray(correct, bool)).tobytes()).decode()


def unpack(text: str, n: int) -> np.ndarray:
    """The inverse of :func:`pack` for ``n`` images."""
    return np.unpackbits(np.frombuffer(base64.b64decode(text), np.uint8))[:n].astype(bool)


def model_cell(dataset: str, seed: int, plan: Plan, runs: pathlib.Path) -> dict:
    """Train (or resume) one model, calibrate it, and measure it and every one-shot arm."""
    cfg = config(dataset, seed, plan)
    train_part, validation, test = train.load_data(cfg, validation=10_000 if plan is REGISTERED else 200)
    out_dir = runs / f"{dataset}-s{seed}"
    history = train.train(cfg, out_dir, progress=False, datasets=(train_part, validation))
    model, _ = train.load_trained(out_dir)
    records = compress.calibrate(model, calibration_images(train_part, plan))
    row = {"train_seconds": round(history["seconds"], 1), "none": measure(model, test), "arms": []}
    for (arm, removed), small in arms(model, records, plan, seed).items():
        layers = compress.fidelity(model, small, records)
        row["arms"].append({"arm": arm, "removed": removed, **measure(small, test), "layers": layers})
    return row


def reference_cell(dataset: str, seed: int, plan: Plan, runs: pathlib.Path) -> dict:
    """The MoE of ``plan.reference_experts`` experts trained from scratch with the same recipe."""
    cfg = config(dataset, seed, plan, num_experts=plan.reference_experts)
    train_part, validation, test = train.load_data(cfg, validation=10_000 if plan is REGISTERED else 200)
    out_dir = runs / f"{dataset}-E{plan.reference_experts}-s{seed}"
    history = train.train(cfg, out_dir, progress=False, datasets=(train_part, validation))
    model, _ = train.load_trained(out_dir)
    return {"train_seconds": round(history["seconds"], 1), **measure(model, test)}


def results_path(plan: Plan, runs: pathlib.Path) -> pathlib.Path:
    if plan is SMOKE:
        return runs / f"compression-smoke-{MACHINE}.json"
    return RESULTS / f"compression-confirmatory-{MACHINE}.json"


def run_study(plan: Plan, seeds, runs: pathlib.Path, *, source: str | None = None, commit: bool = False) -> dict:
    """Every cell (model, then reference) of each seed and dataset in turn; a recorded cell is
    skipped, a failed one recorded. With ``source``, refuses to train unless ``mini_moe`` comes from
    a clean checkout of that commit."""
    unknown = sorted(set(seeds) - set(plan.seeds))
    if unknown:
        raise SystemExit(f"compression: seeds {unknown} are not in the plan ({list(plan.seeds)}).")
    out = results_path(plan, runs)
    for seed in seeds:
        for dataset in plan.datasets:
            for kind, fn in (("model", model_cell), ("reference", reference_cell)):
                done = json.loads(out.read_text())["cells"] if out.exists() else []
                if any((c["kind"], c["dataset"], c["seed"]) == (kind, dataset, seed) for c in done):
                    continue
                state = confirm.require_pinned(source) if source else confirm.source_state()
                print(f"compression {plan.name}: {kind} {dataset} seed {seed}", file=sys.stderr, flush=True)
                try:
                    cell = fn(dataset, seed, plan, runs)
                except Exception as e:  # recorded, never dropped; the study goes on
                    cell = {"failed": f"{type(e).__name__}: {e}"}
                record = {"kind": kind, "dataset": dataset, "seed": seed, **cell, "source_commit": state["commit"],
                          "source_dirty": state["dirty"], "cpu": bench.machine()["cpu"]}

                def update(rec, record=record):
                    rec["cells"] = [c for c in rec.get("cells", []) if (c["kind"], c["dataset"], c["seed"]) !=
                                    (record["kind"], record["dataset"], record["seed"])] + [record]
                    rec.update(what="issue 67 §2: one-shot pruning against merging, the registered comparison"
                               if plan is REGISTERED else "issue 67 §2: the compression runner's smoke (not a result)",
                               plan=dataclasses.asdict(plan), preregistration=PREREGISTRATION, machine=bench.machine(),
                               command="COMMIT=1 taskset -c N .venv/bin/python mini_moe/results/compress_study.py run "
                                       "--source COMMIT --seeds ...")

                confirm.locked_update(out, update)
                if commit:
                    subprocess.run(["bash", "-c", f'source mini_moe/results/commit_result.sh && commit_result {out} '
                                    f'"issue 67 compression: {kind} {dataset} seed {seed}"'], check=False)
    return json.loads(out.read_text()) if out.exists() else {"cells": []}


def _measurements(record: dict):
    """``((dataset, arm, removed, seed), measurement)`` of every finished cell; the uncompressed
    model is arm ``"none"`` (removed 0), the reference ``"retrained"`` (removed 8 - its E)."""
    for c in record["cells"]:
        if "failed" in c:
            continue
        if c["kind"] == "reference":
            yield (c["dataset"], "retrained", 8 - record["plan"]["reference_experts"], c["seed"]), c
            continue
        yield (c["dataset"], "none", 0, c["seed"]), c["none"]
        for a in c["arms"]:
            yield (c["dataset"], a["arm"], a["removed"], c["seed"]), a


def accuracy_table(record: dict) -> dict:
    """``{(dataset, arm, removed, seed): test accuracy}`` of every finished cell (arms named as in
    :func:`_measurements`)."""
    return {key: m["test_accuracy"] for key, m in _measurements(record)}


def correct_table(record: dict) -> dict:
    """``{(dataset, arm, removed, seed): correct [test images] (bool)}`` where a cell recorded it."""
    return {key: unpack(m["correct"], m["test_images"]) for key, m in _measurements(record) if "correct" in m}


def interval(record: dict, dataset: str, first: str, removed: int, second: str | None = None,
             seeds=None) -> tuple[float, float] | None:
    """95 % interval over seeds and test images (:func:`mini_moe.stats.crossed_bootstrap`), in
    points, of arm ``first``'s accuracy, or of ``first - second`` paired by seed and image; None
    where a seed lacks the per-image record."""
    bits = correct_table(record)
    seeds = record["plan"]["seeds"] if seeds is None else seeds
    rows = []
    for s in seeds:
        a, b = bits.get((dataset, first, removed, s)), None if second is None else bits.get((dataset, second, removed, s))
        if a is None or (second is not None and b is None):
            return None
        rows.append(a.astype(float) - (0 if b is None else b))
    low, high = stats.crossed_bootstrap(np.stack(rows))
    return 100 * low, 100 * high


def analyse(record: dict) -> dict:
    """The registered family at the primary compression: per dataset, on the seeds where every arm
    of the family finished, each contrast of :data:`FAMILY` as the mean paired difference in points
    with Student's t (df = seeds - 1), its 95 % CI, Holm over all of them; and, descriptively, the
    difference's 95 % interval over seeds and test images (:func:`interval`)."""
    plan = record["plan"]
    table = accuracy_table(record)
    rows = []
    for dataset in plan["datasets"]:
        needed = {a for _, a, b in FAMILY for a in (a, b)}
        seeds = [s for s in plan["seeds"] if all((dataset, a, plan["primary"], s) in table for a in needed)]
        for name, first, second in FAMILY:
            diffs = [100 * (table[dataset, first, plan["primary"], s] - table[dataset, second, plan["primary"], s])
                     for s in seeds]
            rows.append({"dataset": dataset, "name": name, "arms": [first, second], "seeds": seeds,
                         **(stats.paired_t(diffs) if diffs else {"pairs": 0}),
                         "seeds_and_images_ci": interval(record, dataset, first, plan["primary"], second, seeds)
                         if len(seeds) > 1 else None})
    ps = [r.get("p_value", float("nan")) for r in rows]
    if all(np.isfinite(ps)):
        for r, p in zip(rows, stats.holm(ps)):
            r["p_holm"] = p
    return {"removed": plan["primary"], "alpha": ALPHA, "contrasts": rows}


def secondary(record: dict) -> list[dict]:
    """The registration's descriptive contrasts, not adjusted: the family's four at every other
    compression, and at the primary ``retrained - reap``, ``gate - reap`` and ``ean - reap``; each
    the mean paired difference in points over the seeds where both arms finished, with Student's t
    (:func:`mini_moe.stats.paired_t`)."""
    plan = record["plan"]
    table = accuracy_table(record)
    pairs = [(removed, first, second) for removed in plan["removed"] if removed != plan["primary"]
             for _, first, second in FAMILY]
    pairs += [(plan["primary"], first, "reap") for first in ("retrained", "gate", "ean")]
    rows = []
    for dataset in plan["datasets"]:
        for removed, first, second in pairs:
            seeds = [s for s in plan["seeds"] if (dataset, first, removed, s) in table and (dataset, second, removed, s) in table]
            diffs = [100 * (table[dataset, first, removed, s] - table[dataset, second, removed, s]) for s in seeds]
            rows.append({"dataset": dataset, "removed": removed, "arms": [first, second], "seeds": seeds,
                         **(stats.paired_t(diffs) if diffs else {"pairs": 0})})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="the registered cells (resumes)")
    run.add_argument("--seeds", type=int, nargs="*", default=list(REGISTERED.seeds))
    run.add_argument("--source", default=None, help="the pinned commit the cells must run from")
    run.add_argument("--runs", default="runs/compression")
    smoke = sub.add_parser("smoke", help="every arm on digits in a few minutes (a pipeline check)")
    smoke.add_argument("--runs", default="runs/compression-smoke")
    sub.add_parser("analyse", help="the registered family, from the results file")
    args = parser.parse_args(argv)
    if args.what == "analyse":
        print(json.dumps(analyse(json.loads(results_path(REGISTERED, pathlib.Path(".")).read_text())), indent=1))
    elif args.what == "smoke":
        record = run_study(SMOKE, SMOKE.seeds, pathlib.Path(args.runs))
        print(f"smoke: {len(record['cells'])} cells in {results_path(SMOKE, pathlib.Path(args.runs))}")
    else:
        run_study(REGISTERED, args.seeds, pathlib.Path(args.runs), source=args.source,
                  commit=os.environ.get("COMMIT") == "1")


if __name__ == "__main__":
    main()
