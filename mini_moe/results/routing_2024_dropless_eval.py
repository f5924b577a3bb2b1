"""Chapters 12 and 13, v2 runs evaluated again without drops (review item 21, after the runs; not
part of the registration).

A capacity-limited router drops picks at inference as well as in training, so its test accuracy
mixes what drops cost the training with what they cost the evaluation, and it depends on how the
test images are grouped (``mechanisms.batch_dependence``). DeepSeek-V3 drops no token at inference
(its Sec. 2.1.2). This script loads every v2 run's final checkpoint (``runs/routing_2024_v2/ARM-sSEED``,
made by ``routing_2024_v2.sh``) and measures its test accuracy twice on the 10,000 test images in
file order: as trained (the recorded number, recomputed as a check) and with every MoE layer on the
dropless path (:func:`mini_moe.modes.dropless_mode`). Results go to
``mini_moe/results/routing_2024_v2-dropless_eval-<MACHINE>.json``, rewritten after every run, so
the script resumes where it stopped::

    MACHINE=cpu-2core-epyc taskset -c 0 .venv/bin/python mini_moe/results/routing_2024_dropless_eval.py
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

os.environ["STUDY"] = "v2"
from mini_moe import bench, evaluate, train  # noqa: E402
from mini_moe.results import routing_2024  # noqa: E402

MACHINE = os.environ.get("MACHINE", "cpu-2core-epyc")
OUT = pathlib.Path(f"mini_moe/results/routing_2024_v2-dropless_eval-{MACHINE}.json")
RUNS = pathlib.Path("runs/routing_2024_v2")
COMMAND = "MACHINE=cpu-2core-epyc taskset -c 0 .venv/bin/python mini_moe/results/routing_2024_dropless_eval.py"


def evaluate_run(arm: str, seed: int) -> dict:
    folder = RUNS / f"{arm}-s{seed}"
    if not folder.exists():
        raise SystemExit(f"{folder} is missing: this script reads the v2 runs' checkpoints "
                         "(bash mini_moe/results/routing_2024_v2.sh trains them)")
    model, cfg = train.load_trained(folder)
    test = train.load_data(cfg)[1]
    return {"arm": arm, "seed": seed, "moe_path": cfg.model.moe_path,
            "test_accuracy": evaluate.accuracy(model, test),
            "test_accuracy_dropless": evaluate.accuracy(model, test, dropless=True)}


def main() -> None:
    record = json.loads(OUT.read_text()) if OUT.exists() else {
        "what": "the v2 runs of routing_2024 (chapters 12-13) evaluated as trained and with no drops "
                "(every MoE layer on the dropless path); review item 21, not registered",
        "command": COMMAND, "machine": bench.machine(), "runs": []}
    recorded = {(r["arm"], r["seed"]): r for r in bench.committed("routing_2024_v2-cpu-2core-epyc.json")["runs"]}
    done = {(r["arm"], r["seed"]) for r in record["runs"]}
    for seed in routing_2024.SEEDS_V2:
        for arm in routing_2024.ARMS_V2:
            if (arm, seed) in done:
                continue
            tick = time.perf_counter()
            entry = evaluate_run(arm, seed)
            entry["recorded_test_accuracy"] = recorded[arm, seed]["test_accuracy"]
            record["runs"].append(entry)
            OUT.write_text(json.dumps(record, indent=1) + "\n")
            print(f"{arm}-s{seed}: {100 * entry['test_accuracy']:.2f} (recorded "
                  f"{100 * entry['recorded_test_accuracy']:.2f}) dropless {100 * entry['test_accuracy_dropless']:.2f} "
                  f"[{time.perf_counter() - tick:.0f} s]", flush=True)


if __name__ == "__main__":
    sys.exit(main())
