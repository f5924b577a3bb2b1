"""Routing at inference on every committed model (issue 53 §1): for each model of
``mini_moe/results/explorer-models`` (Token Choice k = 1 and 2, Expert Choice, Soft MoE, the
loss-free sigmoid router, ReMoE, LongCat's null experts; Fashion-MNIST and ``patch_vote``), on
the first ``--images`` test images:

- the test-time capacity sweep (:func:`mini_moe.inference.capacity_sweep`): accuracy, tokens no
  expert processes, dropped picks and batch dependence under regrouping, at each factor of
  ``FACTORS`` (one row without a capacity: Soft MoE, dropless);
- batch dependence at the trained factor, under regrouping and under permutation within groups,
  with its 95 % interval (:func:`mini_moe.evaluate.batch_dependence`);
- the filler attack (:func:`mini_moe.inference.filler_attack`) at each factor of
  ``ATTACK_FACTORS`` and with every mitigation that applies, on ``--victims`` victims: the flip
  rate, its position control (random fillers, the victim in the attacker's place) and the excess
  over it, the victim's dropped patches, and without a mitigation the run-twice check. Each row
  keeps every victim's predicted class per kind of group as a string of digits
  (``predictions``), so paired tests (McNemar) recompute from the file.

Writes ``inference-<machine>.json`` and ``inference-capacity_sweep.png`` here::

    taskset -c 0 .venv/bin/python mini_moe/results/inference_study.py [--images 2000] [--victims 300]

Everything is evaluation of committed weights: nothing is trained, and a rerun on the same
machine gives the same numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys
import time

import numpy as np

from mini_moe import bench, evaluate, explorer, inference, modes, train
from mini_moe.validate import InputError

HERE = pathlib.Path(__file__).resolve().parent
FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
ATTACK_FACTORS = (0.5, 1.0, 2.0)


def _attack_rows(model, images, victims: int) -> list[dict]:
    pool = images[len(images) // 2:]
    factors = ATTACK_FACTORS if modes.has_capacity(model) else (None,)
    rows = []
    for factor in factors:
        with modes.capacity(model, factor):
            for mitigation in inference.MITIGATIONS:
                try:
                    result = inference.filler_attack(model, images[:victims], pool, mitigation=mitigation, seed=3,
                                                     run_twice=mitigation is None)
                except InputError:  # a mitigation that does not apply (BPR on Expert Choice, ...)
                    continue
                result["predictions"] = {kind: "".join(map(str, p)) for kind, p in result["predictions"].items()}
                rows.append({"capacity_factor": factor, **result})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--victims", type=int, default=300)
    parser.add_argument("--machine", default="cpu-2core-epyc")
    parser.add_argument("names", nargs="*", help="some of the committed models (default: all)")
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    record = {"what": __doc__.split("\n\n")[0], "command": "python mini_moe/results/inference_study.py " +
              " ".join(sys.argv[1:] if argv is None else argv), "machine": bench.machine(), "source_commit": commit,
              "images": args.images, "victims": args.victims, "factors": list(FACTORS), "models": {}}
    files = sorted(explorer.WEIGHTS.glob("*.npz"))
    if args.names:
        files = [f for f in files if f.stem in args.names]
    for file in files:
        tick = time.perf_counter()
        model, cfg, info = explorer.load_weights(file)
        test = train.load_data(cfg)[1]
        images, labels = np.asarray(test.images[:args.images]), np.asarray(test.labels[:args.images])
        subset = dataclasses.replace(test, images=images, labels=labels)
        invariant, why = modes.invariance(model)
        record["models"][file.stem] = {
            "label": info["label"], "dataset": cfg.dataset, "router": cfg.model.router,
            "trained_capacity_factor": modes.trained_capacity(model), "moe_path": cfg.model.moe_path,
            "invariant": invariant, "why": why,
            "batch_dependence": evaluate.batch_dependence(model, images, regroupings=4, seed=0),
            "capacity_sweep": inference.capacity_sweep(model, subset, FACTORS, regroupings=2, seed=2),
            "attack": _attack_rows(model, images, args.victims),
            "seconds": None}
        record["models"][file.stem]["seconds"] = round(time.perf_counter() - tick, 1)
        print(file.stem, record["models"][file.stem]["seconds"], "s", flush=True)
    out = HERE / f"inference-{args.machine}.json"
    out.write_text(json.dumps(record, indent=1, default=float) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    plot(record, HERE / "inference-capacity_sweep.png")
    print("wrote", out)
    return 0


def plot(record: dict, path: pathlib.Path | None = None):
    """Accuracy, dropped tokens and batch dependence against the test-time capacity factor, one
    line per capacity-limited model, one row of panels per data set; saved to ``path``, or
    returned as a figure when ``path`` is None (a notebook shows it)."""
    import matplotlib.pyplot as plt

    datasets = sorted({m["dataset"] for m in record["models"].values()})
    fig, axes = plt.subplots(len(datasets), 3, figsize=(12, 3.2 * len(datasets)), squeeze=False)
    for row, dataset in zip(axes, datasets):
        for name, m in record["models"].items():
            sweep = m["capacity_sweep"]
            if m["dataset"] != dataset or sweep[0]["capacity_factor"] is None:
                continue
            c = [r["capacity_factor"] for r in sweep]
            row[0].plot(c, [r["accuracy"] for r in sweep], "o-", label=m["label"])
            row[1].plot(c, [np.mean(r["unprocessed"]) for r in sweep], "o-")
            row[2].plot(c, [r["batch_dependence"]["mean"] for r in sweep], "o-")
        for ax, title in zip(row, ("test accuracy", "tokens no expert processes", "predictions changed by regrouping")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("capacity factor at test time")
            ax.set_title(f"{dataset}: {title}", fontsize=9)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    if path is None:
        return fig
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
