"""The training runs behind chapters 12 and 13 (issue 26): routing since 2024 on ``patch_vote``.

Usage (from the repository root, one training at a time, pinned to one core)::

    taskset -c 1 .venv/bin/python mini_moe/results/routing_2024.py [ARM ...]

Every arm (:data:`ARMS`) trains the ``patch_vote`` ViT of chapter 8 (:mod:`mini_moe.confirm`'s
task, model and schedule: 2,000 steps, E = 8 experts in every second block) with one router or
layer variant, on :data:`SEEDS`. The seeds run one after the other, every arm of a seed before
the next seed, so a stopped run holds complete paired seeds. Each run trains under
``runs/routing_2024/`` (git-ignored) and, when it finishes, its record is written to
``mini_moe/results/routing_2024-<MACHINE>.json``: the config, test accuracy, the mechanism metrics
of :func:`mini_moe.evaluate.mechanisms`, the training log every 100 steps (loss, accuracy and the
router's metrics: dropped tokens, the load's max violation, the bias spread, ...), and per MoE
layer the tokens each expert processed and the histogram of experts per token on the test set,
and the CPU it trained on (``cpu``: times compare only between runs on the same machine). Runs
already recorded are skipped, so the script resumes.

All arms activate the same FLOPs per token except ``tc_c2`` and the dropless ones, whose cost
depends on the routing (that is what chapter 13 measures).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time

import numpy as np

from mini_moe import bench, confirm, evaluate, study, train
from mini_moe import config as config_lib

MACHINE = os.environ.get("MACHINE", "cpu-2core-xeon")
OUT = pathlib.Path(f"mini_moe/results/routing_2024-{MACHINE}.json")
RUNS = pathlib.Path("runs/routing_2024")
SEEDS = (0, 1, 2)
COMMAND = "taskset -c 1 .venv/bin/python mini_moe/results/routing_2024.py"

TC = "softmax_token_choice"
SWITCH = {"k": 1, "capacity_factor": 1.0, "balance_loss": "switch"}
#: The arms as name -> (router, model overrides, router options).
ARMS = {
    # chapter 12: balancing with a loss (per routing group or per batch) or with a bias
    "tc_switch": (TC, {}, SWITCH),
    "tc_switch_batch": (TC, {}, SWITCH | {"balance_scope": "batch"}),
    "loss_free": ("sigmoid_loss_free", {}, {"k": 1, "capacity_factor": 1.0, "bias_rate": 1e-3}),
    "sigmoid_no_bias": ("sigmoid_loss_free", {}, {"k": 1, "capacity_factor": 1.0, "bias_rate": 0.0}),
    # at k = 1 the sigmoid router's gate, normalised over the one chosen expert, is exactly 1, so
    # the task loss sends its weights no gradient; at k = 2 (c = 2) it does: both routers again
    "tc_switch_k2": (TC, {}, SWITCH | {"k": 2, "capacity_factor": 2.0}),
    "loss_free_k2": ("sigmoid_loss_free", {}, {"k": 2, "capacity_factor": 2.0, "bias_rate": 1e-3}),
    # chapter 13: equal activated FLOPs with finer experts (m = 4: 32 experts of 16 hidden units,
    # k = 4) and with one of them shared (k = 3 routed); capacity and dropless
    "fine": (TC, {"model_fine_grained": 4}, SWITCH),
    "fine_shared": (TC, {"model_fine_grained": 4, "model_shared_experts": 1}, SWITCH),
    "tc_c2": (TC, {}, SWITCH | {"capacity_factor": 2.0}),
    "dropless": (TC, {"model_moe_path": "dropless"}, SWITCH),
    # ReMoE aims at k = 1 expert per token on average; a buffer of C = T slots per expert
    # (capacity factor E) drops nothing, like the dropless path, and is 3x faster on CPU
    "remoe": ("remoe", {}, {"k": 1, "capacity_factor": 8.0}),
}
KEEP_EVERY = 100  # steps between the kept rows of the training log


def config(arm: str, seed: int) -> config_lib.TrainConfig:
    """The :class:`~mini_moe.config.TrainConfig` of one run."""
    router, model, options = ARMS[arm]
    return config_lib.get_config(confirm.SCALE, dataset=confirm.DATASET, router=router, seed=seed,
                                 model_placement="every2", model_router_kwargs=options, **model,
                                 **confirm.OVERRIDES)


def routed_counts(model, images: np.ndarray) -> list[dict]:
    """Per MoE layer, on ``images``: the tokens each expert processed and the histogram of the
    number of experts that processed each token (index n: tokens processed by n experts)."""
    _, layers = evaluate.predictions_and_routing(model, images)
    out = []
    for hits, _ in layers:
        per_token = hits.sum(-1).ravel().astype(int)
        out.append({"processed": hits.sum((0, 1)).astype(int).tolist(),
                    "experts_per_token_histogram": np.bincount(per_token, minlength=hits.shape[-1] + 1).tolist()})
    return out


def run(arm: str, seed: int) -> dict:
    """Train (or resume) one run and return its record."""
    cfg = config(arm, seed)
    folder = RUNS / f"{arm}-s{seed}"
    result = study.run_cell(cfg, folder, progress=False, label=arm)
    model, _ = train.load_trained(folder)
    test = train.load_data(cfg)[1]
    history = json.loads((folder / "history.json").read_text())
    log = [row for row in history["train"] if row["step"] % KEEP_EVERY == 0]
    return {"arm": arm, "router": ARMS[arm][0], "seed": seed,
            "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=list)),
            **{k: result[k] for k in ("test_accuracy", "ten_shot_accuracy", "steps", "train_seconds", "step_flops",
                                      "mechanisms", "eval")},
            "train_log": log, "layers": routed_counts(model, test.images)}


def main(arms) -> None:
    record = json.loads(OUT.read_text()) if OUT.exists() else {
        "what": "issue 26: chapters 12 and 13's runs on patch_vote", "command": COMMAND,
        "machine": bench.machine(), "seeds": list(SEEDS), "arms": {a: list(ARMS[a]) for a in ARMS}, "runs": []}
    done = {(r["arm"], r["seed"]) for r in record["runs"]}
    for seed in SEEDS:
        for arm in arms:
            if (arm, seed) in done:
                continue
            tick = time.perf_counter()
            entry = {**run(arm, seed), "cpu": bench.machine()["cpu"]}
            record["runs"].append(entry)
            record["machine"]["date_last"] = bench.machine()["date"]
            OUT.write_text(json.dumps(record, indent=1) + "\n")
            print(f"{arm}-s{seed}: acc={100 * entry['test_accuracy']:.2f} train_s={entry['train_seconds']} "
                  f"wall_s={time.perf_counter() - tick:.0f}", flush=True)


if __name__ == "__main__":
    unknown = [a for a in sys.argv[1:] if a not in ARMS]
    if unknown:
        sys.exit(f"unknown arms {unknown}; arms: {', '.join(ARMS)}")
    main(sys.argv[1:] or list(ARMS))
