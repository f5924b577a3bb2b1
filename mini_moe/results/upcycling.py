"""Issue 54's registered upcycling comparison on Fashion-MNIST (``upcycling-preregistration.md``).

Usage, from the repository root after ``make venv`` (each command resumes; one process per core)::

    taskset -c 0 bash mini_moe/results/upcycling.sh 300 302 304 306 308     # the registered cells
    taskset -c 1 bash mini_moe/results/upcycling.sh 301 303 305 307
    .venv/bin/python mini_moe/results/upcycling.py analyze [--stopped]      # the ten contrasts
    .venv/bin/python mini_moe/results/upcycling.py smoke --runs DIR         # every arm, tiny, digits

A cell is one (arm, seed) of :data:`ARMS` x the plan's seeds, run seed by seed in :data:`ARMS`'
order (``dense`` first: the upcycled arms start from its step-N checkpoint). Each cell trains in its
own folder under ``--runs`` (resumable from its checkpoints: :func:`mini_moe.train.train`'s
``init_from`` / ``start_step`` for the upcycled arms) and, when it finishes, one record goes into
the results file (``upcycling-confirmatory-<MACHINE>.json``; with ``COMMIT=1`` committed alone
after every cell). Cells already recorded are skipped. A cell whose loss becomes non-finite is
recorded as failed and never rerun (stop rule 1).

What a record holds: the test accuracy at every evaluation (every 500 steps; the registered
budgets are steps N + 500 and N + 2,000), the training log, seconds, and the registered secondary
outcomes on the probe set (the first 2,048 training images in file order, eval mode) at the logged
steps after the cell's start (:data:`REGISTERED` ``probe_after``): cross-entropy and accuracy; per
MoE layer the mean ``KL(p_t || uniform) = log E - H(p_t)``, the top-1 agreement with the last
logged step, the mean pairwise cosine similarity of the experts' flattened ``(w1, b1, w2, b2)`` and
of their updates since the start, tokens no expert processes and dropped picks. The upcycled arms'
records add the loss jump (probe cross-entropy at the start minus the dense model's at N).

``smoke`` runs the same code on :data:`SMOKE` (digits, tiny model, 40 steps) into a results file
under ``--runs``, with no pinning: a check of the pipeline, never a result.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import optax

from mini_moe import bench, confirm, evaluate, study, train
from mini_moe import runs as run_folder
from mini_moe.upcycle import upcycle
from mini_moe.validate import InputError

MACHINE = os.environ.get("MACHINE", "cpu-2core-epyc")
RESULTS = pathlib.Path(os.environ.get("RESULTS_DIR") or pathlib.Path(__file__).resolve().parent)
PREREGISTRATION = "mini_moe/results/upcycling-preregistration.md"
TC, EC = "softmax_token_choice", "softmax_expert_choice"

#: The arms as name -> (kind, router, drop ratio r, frozen router), in the order each seed runs them.
ARMS = {
    "dense": ("dense", None, 0.0, False),
    "up_tc": ("upcycled", TC, 0.0, False),
    "up_ec": ("upcycled", EC, 0.0, False),
    "up_tc_frozen": ("upcycled", TC, 0.0, True),
    "up_tc_r25": ("upcycled", TC, 0.25, False),
    "up_tc_r50": ("upcycled", TC, 0.5, False),
    "scratch_tc": ("scratch", TC, 0.0, False),
    "scratch_ec": ("scratch", EC, 0.0, False),
}
#: KL from uniform (nats) above which the router has "left uniform routing" (registered threshold).
KL_THRESHOLD = 0.1
ALPHA = 0.05


@dataclasses.dataclass(frozen=True)
class Plan:
    """The study's sizes: dataset and model (``study.cell_config`` overrides), N dense steps, the
    budgets M, the kept-checkpoint period, the logged steps after a cell's start, the probe set."""

    name: str
    dataset: str
    overrides: dict
    n: int
    budgets: tuple
    keep_every: int
    probe_after: tuple
    probe_images: int
    probe_batch: int
    seeds: tuple

    @property
    def steps(self) -> int:  # every run ends at N + the largest budget (the upcycled ones start at N)
        return self.n + max(self.budgets)


#: The registration: chapter 16's Fashion-MNIST models (width 64, MLPs and experts of 64, E = 8,
#: Every-2, groups of 8 images, c = 1), chapter 8's optimiser with a constant rate, N = 2,000,
#: M in {500, 2,000}, seeds 300-308.
REGISTERED = Plan(name="confirmatory", dataset="fashion_mnist",
                  overrides=dict(model_dim=64, model_mlp_dim=64, **confirm.OVERRIDES),
                  n=2000, budgets=(500, 2000), keep_every=500,
                  probe_after=(0, 10, 25, 50, 100, 250, 500, 1000, 2000), probe_images=2048, probe_batch=512,
                  seeds=tuple(range(300, 309)))
#: The pipeline check: digits, a tiny model, N = 20 and M in {10, 20}, one seed.
SMOKE = Plan(name="smoke", dataset="digits",
             overrides=dict(model_dim=16, model_mlp_dim=16, model_heads=2, model_depth=2, batch_size=32, learning_rate=2e-3,
                            warmup_steps=2, eval_every=10, eval_batch_size=128),
             n=20, budgets=(10, 20), keep_every=10, probe_after=(0, 1, 2, 5, 10, 20), probe_images=256,
             probe_batch=128, seeds=(0,))


def contrasts(plan: Plan) -> list[tuple]:
    """The ten registered contrasts: (number, first arm, its step, second arm, its step, question)."""
    n, (m1, m2) = plan.n, plan.budgets
    return [
        (1, "up_tc", n + m1, "dense", n + m1, "upcycled Token Choice vs dense continuation"),
        (2, "up_tc", n + m2, "dense", n + m2, "upcycled Token Choice vs dense continuation"),
        (3, "up_ec", n + m1, "dense", n + m1, "upcycled Expert Choice vs dense continuation"),
        (4, "up_ec", n + m2, "dense", n + m2, "upcycled Expert Choice vs dense continuation"),
        (5, "up_tc", n + m1, "scratch_tc", n + m1, "upcycled vs from scratch, same total steps"),
        (6, "up_tc", n + m2, "scratch_tc", n + m2, "upcycled vs from scratch, same total steps"),
        (7, "up_ec", n + m1, "scratch_ec", n + m1, "Expert Choice, upcycled vs from scratch"),
        (8, "up_ec", n + m2, "scratch_ec", n + m2, "Expert Choice, upcycled vs from scratch"),
        (9, "up_tc", n + m1, "scratch_tc", m1, "positive control: the dense pretraining carries over"),
        (10, "up_tc", n + m2, "up_tc_frozen", n + m2, "routing control: does the router's learning matter?"),
    ]


# --------------------------------------------------------------------------------- configurations


def config(arm: str, seed: int, plan: Plan):
    """The :class:`~mini_moe.config.TrainConfig` of one cell: ``study.cell_config`` of the arm's
    router at c = 1 (the dense ViT for ``dense``), the constant schedule, ``plan.steps`` steps,
    checkpoints kept every ``keep_every``; the frozen arm adds ``frozen=True`` to its router."""
    kind, router, _, frozen = ARMS[arm]
    cfg = study.cell_config(router, 1.0, seed, dataset=plan.dataset, scale="quick",
                            **{**plan.overrides, "steps": plan.steps, "schedule": "constant",
                               "keep_every": plan.keep_every})
    if frozen:
        kwargs = tuple(sorted({**dict(cfg.model.router_kwargs), "frozen": True}.items()))
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, router_kwargs=kwargs))
    return cfg


def upcycled_start(arm: str, seed: int, plan: Plan, runs: pathlib.Path):
    """The model an upcycled cell starts from: ``upcycle`` of the dense cell's checkpoint at N
    (router fresh from the seed, Drop-Upcycling's r), checked to have the cell's configuration."""
    _, router, ratio, _ = ARMS[arm]
    cfg = config(arm, seed, plan)
    dense, _ = train.load_trained(runs / f"dense-s{seed}", step=plan.n)
    model = upcycle(dense, router=router, num_experts=cfg.model.num_experts, drop_ratio=ratio, seed=seed,
                    router_kwargs=dict(cfg.model.router_kwargs))
    if model.cfg != cfg.model:
        raise RuntimeError(f"{arm}: the upcycled model's config {model.cfg} is not the cell's {cfg.model}")
    return model


# ---------------------------------------------------------------------------------- measurements

def probe_set(train_ds, plan: Plan):
    """The first ``probe_images`` training images in file order (standardised) and their labels."""
    return train_ds.images[: plan.probe_images], train_ds.labels[: plan.probe_images]


def experts_of(model) -> list[np.ndarray]:
    """Per MoE layer, the experts' parameters flattened: ``[E, P]`` (``w1, b1, w2, b2``)."""
    out = []
    for block in model.blocks:
        if block.use_moe:
            ex = block.mlp.experts
            e = ex.w1.shape[0]
            out.append(np.concatenate([np.asarray(getattr(ex, k)[...]).reshape(e, -1) for k in ("w1", "b1", "w2", "b2")],
                                      axis=1).astype(np.float64))
    return out


def mean_pairwise_cosine(x: np.ndarray) -> float | None:
    """The mean over the E(E-1)/2 pairs of rows of ``x [E, P]`` of their cosine similarity; None
    when a row is zero (the updates at the start)."""
    norms = np.linalg.norm(x, axis=1)
    if not np.all(norms > 0):
        return None
    unit = x / norms[:, None]
    cos = unit @ unit.T
    return float(np.mean(cos[np.triu_indices(len(x), 1)]))


def measure(model, images, labels, *, batch: int, start_experts=None) -> tuple[dict, dict]:
    """The probe-set measurements of ``model`` (eval mode; the model is left as it was):
    ``(row, arrays)``, ``arrays`` the per-layer top-1 experts (for the agreement with the last step)
    and the experts' parameters."""
    # the evaluation pass routing_record runs too (one compilation per model)
    logits = np.concatenate([np.asarray(out.logits[:n], np.float64)
                             for out, n in evaluate.forward_batches(model, images, batch_size=batch, routing=True)])
    ce = float(np.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels)))
    row = {"loss": ce, "accuracy": float(np.mean(logits.argmax(-1) == labels)), "layers": []}
    arrays = {}
    if model.cfg.router is None:
        return row, arrays
    _, layers = evaluate.routing_record(model, images, batch_size=batch)
    experts = experts_of(model)
    for i, (layer, ex) in enumerate(zip(layers, experts)):
        summary = evaluate.routing_summary(layer)
        e = ex.shape[0]
        row["layers"].append({
            "kl_uniform": float(np.mean(math.log(e) - layer["entropy"])),
            "expert_cosine": mean_pairwise_cosine(ex),
            "update_cosine": None if start_experts is None else mean_pairwise_cosine(ex - start_experts[i]),
            "unprocessed": summary["unprocessed"], "dropped_routes": summary["dropped_routes"],
            "experts_per_token": summary["experts_per_token"]})
        arrays[f"top1_{i}"] = layer["top1"].astype(np.int16)
        arrays[f"experts_{i}"] = ex.astype(np.float32)
    return row, arrays


# ----------------------------------------------------------------------------------------- a cell


def _measure_steps(arm: str, plan: Plan) -> list[int]:
    kind = ARMS[arm][0]
    after = list(plan.probe_after)
    if kind == "upcycled":
        return [plan.n + p for p in after]
    if kind == "dense":  # its own start, and N + p: the dense continuation beside the upcycled arms
        return sorted(set(after) | {plan.n} | {plan.n + p for p in after})
    return after


def run_cell(arm: str, seed: int, plan: Plan, runs: pathlib.Path, datasets, *, dense_failed: bool = False) -> dict:
    """Train (or resume) one cell and return its record (``failed`` set when its loss became
    non-finite)."""
    tick = time.perf_counter()
    kind, router, ratio, frozen = ARMS[arm]
    cfg = config(arm, seed, plan)
    folder = runs / f"{arm}-s{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    images, labels = probe_set(datasets[0], plan)
    start = plan.n if kind == "upcycled" else 0
    init = None
    if kind == "upcycled":
        dense_dir = runs / f"dense-s{seed}"
        if plan.n not in run_folder.kept_steps(dense_dir):
            if dense_failed:  # stop rule 1: the dense cell failed before N, so this arm cannot start
                return {"failed": f"the dense cell of seed {seed} failed with no checkpoint at step {plan.n}"}
            raise SystemExit(f"upcycling: {arm} seed {seed} starts from {dense_dir}'s checkpoint at step {plan.n}, "
                             "which is not here: run on the machine that trained the dense cell (or copy its folder).")
        init = upcycled_start(arm, seed, plan, runs)
    probes_path = folder / "probes.json"
    probes = {int(k): v for k, v in json.loads(probes_path.read_text()).items()} if probes_path.exists() else {}

    def on_step(step, model):
        start_file = folder / f"probe-{start}.npz"
        start_experts = None
        if step != start and start_file.exists():
            with np.load(start_file) as f:
                start_experts = [f[k] for k in sorted(f.files) if k.startswith("experts_")]
        row, arrays = measure(model, images, labels, batch=plan.probe_batch, start_experts=start_experts)
        np.savez(folder / f"probe-{step}.npz", **arrays)
        probes[step] = {"step": step, "after": step - start, **row}
        probes_path.write_text(json.dumps({str(k): v for k, v in sorted(probes.items())}, indent=1))

    try:
        history = train.train(cfg, folder, progress=False, datasets=datasets, init_from=init, start_step=start,
                              measure=on_step, measure_at=set(_measure_steps(arm, plan)))
    except InputError as error:
        if "not finite" not in str(error):
            raise
        return {"failed": str(error)}
    rows = [probes[s] for s in sorted(probes) if s in set(_measure_steps(arm, plan))]
    last = start + max(plan.probe_after)
    if cfg.model.router is not None:  # top-1 agreement with the last logged step
        with np.load(folder / f"probe-{last}.npz") as f:
            final = {k: f[k] for k in f.files if k.startswith("top1_")}
        for row in rows:
            with np.load(folder / f"probe-{row['step']}.npz") as f:
                for i, layer in enumerate(row["layers"]):
                    layer["top1_agreement_with_last"] = float(np.mean(f[f"top1_{i}"] == final[f"top1_{i}"]))
    record = {
        "arm": arm, "seed": seed, "kind": kind, "router": router, "drop_ratio": ratio, "frozen_router": frozen,
        "start_step": start, "start": history.get("start"),
        "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=list)),
        "test_accuracy": {str(r["step"]): r["test_accuracy"] for r in history["eval"]},
        "probe": rows,
        "train_seconds": round(history["seconds"], 2),
        "seconds_per_step": round(history["seconds"] / (cfg.steps - start), 5),
        "train_log": history["train"],
    }
    if kind == "upcycled":
        record["upcycled_from"] = {"run": f"dense-s{seed}", "step": plan.n}
    if cfg.model.router is not None:
        record["kl_first_above_threshold"] = [
            next((r["after"] for r in rows if r["layers"][i]["kl_uniform"] > KL_THRESHOLD), None)
            for i in range(len(rows[0]["layers"]))]
    record["wall_seconds"] = round(time.perf_counter() - tick, 1)  # of this session only, if resumed
    return record


def loss_jump(record: dict, dense: dict | None, plan: Plan) -> dict | None:
    """An upcycled cell's loss jump: its probe cross-entropy after 0, 10 and 100 steps minus the
    dense cell's at N, and the first logged step at which it is back below that (None: not within
    the last logged step)."""
    if record.get("kind") != "upcycled" or not dense or "probe" not in dense:
        return None
    base = next(r["loss"] for r in dense["probe"] if r["step"] == plan.n)
    by_after = {r["after"]: r["loss"] - base for r in record["probe"]}
    return {"dense_loss_at_n": base, **{f"after_{a}": by_after.get(a) for a in plan.probe_after[:1] + (10, 100)},
            "back_below_dense_after": next((a for a in sorted(by_after) if by_after[a] < 0), None)}


# ----------------------------------------------------------------------------------------- driver


def results_path(plan: Plan, runs: pathlib.Path) -> pathlib.Path:
    if plan is SMOKE:
        return runs / f"upcycling-smoke-{MACHINE}.json"
    return RESULTS / f"upcycling-confirmatory-{MACHINE}.json"


def run_study(plan: Plan, seeds, runs: pathlib.Path, *, source: str | None = None, commit: bool = False) -> dict:
    """Every arm of each seed in turn; a cell already in the results file is skipped. With
    ``source``, refuses to train unless ``mini_moe`` comes from a clean checkout of that commit."""
    unknown = sorted(set(seeds) - set(plan.seeds))
    if unknown:
        raise SystemExit(f"upcycling: seeds {unknown} are not in the plan ({list(plan.seeds)}).")
    out = results_path(plan, runs)
    datasets = None
    for seed, arm in itertools.product(seeds, ARMS):
        done = json.loads(out.read_text())["runs"] if out.exists() else []
        if any((r["arm"], r["seed"]) == (arm, seed) for r in done):
            continue
        state = confirm.require_pinned(source) if source else confirm.source_state()
        if datasets is None:
            datasets = train.load_data(config("dense", seed, plan))
        print(f"upcycling {plan.name}: {arm} seed {seed}", file=sys.stderr, flush=True)
        dense_failed = any((r["arm"], r["seed"]) == ("dense", seed) and "failed" in r for r in done)
        record = {"arm": arm, "seed": seed, **run_cell(arm, seed, plan, runs, datasets, dense_failed=dense_failed),
                  "source_commit": state["commit"], "source_dirty": state["dirty"], "cpu": bench.machine()["cpu"]}

        def update(rec, record=record):
            dense = next((r for r in rec["runs"] if (r["arm"], r["seed"]) == ("dense", seed)), None)
            jump = loss_jump(record, dense, plan)
            if jump is not None:
                record["loss_jump"] = jump
            rec["runs"] = [r for r in rec["runs"] if (r["arm"], r["seed"]) != (arm, seed)] + [record]
            rec.update(what="issue 54: sparse upcycling on Fashion-MNIST, the registered comparison"
                       if plan is REGISTERED else "issue 54: the upcycling runner's smoke run (not a result)",
                       plan=plan.name, preregistration=PREREGISTRATION, machine=bench.machine(),
                       arms={a: list(v) for a, v in ARMS.items()}, seeds=list(plan.seeds), n=plan.n,
                       budgets=list(plan.budgets), probe_after=list(plan.probe_after),
                       contrasts=[list(c) for c in contrasts(plan)],
                       command="taskset -c N bash mini_moe/results/upcycling.sh SEED ...")
        confirm.locked_update(out, update)
        print(f"  {arm} seed {seed}: {'FAILED ' + record['failed'] if 'failed' in record else record['test_accuracy']}",
              file=sys.stderr, flush=True)
        if commit:
            subprocess.run(["bash", "-c", f'source mini_moe/results/commit_result.sh && commit_result {out} '
                            f'"issue 54 upcycling confirmatory: {arm} seed {seed}"'], check=False)
    return json.loads(out.read_text()) if out.exists() else {"runs": []}


def analysis(record: dict, plan: Plan, *, stopped: bool = False) -> dict:
    """The registered contrasts of a results ``record``, on the seeds whose cells of both arms
    finished: mean paired difference in points, two-sided paired t (df = n - 1), 95 % CI, Holm over
    all ten. Refuses while a planned seed is incomplete, unless ``stopped`` (the study ended under
    stop rule 2). A pure function of the record: the chapter re-computes the committed analysis."""
    acc = {(r["arm"], r["seed"]): r["test_accuracy"] for r in record["runs"] if "failed" not in r}
    complete = [s for s in plan.seeds if all(any((a, s) == (r["arm"], r["seed"]) for r in record["runs"]) for a in ARMS)]
    if len(complete) < len(plan.seeds) and not stopped:
        raise SystemExit(f"upcycling analyze: {len(complete)}/{len(plan.seeds)} seeds complete; the contrasts "
                         "are computed once every planned seed has finished (or with --stopped, stop rule 2).")
    rows = []
    for number, a, sa, b, sb, question in contrasts(plan):
        seeds = [s for s in complete if (a, s) in acc and (b, s) in acc]
        diffs = [acc[a, s][str(sa)] - acc[b, s][str(sb)] for s in seeds]
        rows.append({"number": number, "first": [a, sa], "second": [b, sb], "question": question, "seeds": seeds,
                     "differences": diffs, **study.paired_t(diffs)})
    for row, p in zip(rows, study.holm([1.0 if math.isnan(r["p_value"]) else r["p_value"] for r in rows])):
        row["p_holm"] = p
        row["verdict"] = study.verdict(row, unit=" points", scale=100, alpha=ALPHA)
    control = rows[8]
    return {"complete_seeds": complete, "stopped": stopped, "rows": rows,
            "positive_control_holds": bool(control["p_holm"] < ALPHA and control["difference"] > 0),
            "exploratory": len(complete) < 6}


#: How each arm is drawn in :func:`plot`: (colour, line style).
STYLE = {"dense": ("k", "-"), "up_tc": ("C0", "-"), "up_ec": ("C1", "-"), "up_tc_frozen": ("C0", ":"),
         "up_tc_r25": ("C2", "-"), "up_tc_r50": ("C3", "-"), "scratch_tc": ("C0", "--"), "scratch_ec": ("C1", "--")}


def probe_curve(runs: list[dict], arm: str, field: str, seeds) -> tuple[np.ndarray, np.ndarray]:
    """``(steps after the start [P], values [seeds, P])`` of probe metric ``field`` of ``arm``'s runs
    on ``seeds`` (failed runs left out), the mean over the MoE layers (NaN where the metric is None,
    e.g. the update cosine at a scratch arm's start)."""
    cells = [r for r in runs if r["arm"] == arm and r["seed"] in seeds and "failed" not in r]
    after = np.array([p["after"] for p in cells[0]["probe"]])
    values = np.array([[np.mean([layer[field] for layer in p["layers"]]) if p["layers"][0][field] is not None
                        else np.nan for p in r["probe"]] for r in cells], float)
    return after, values


def plot(record: dict, plan: Plan, seeds):
    """Chapter 18's four panels from a study record: test accuracy against the step per arm (mean over
    ``seeds``, band min-max; a grey line at the upcycling step N), the router's KL from uniform on the
    probe set, and the mean cosine between experts and between their updates, against the steps after
    the start (log scale, 0 drawn at 1). Returns the figure."""
    import warnings

    import matplotlib.pyplot as plt

    cells = {arm: [r for r in record["runs"] if r["arm"] == arm and r["seed"] in seeds and "failed" not in r]
             for arm in ARMS}
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    for arm in ARMS:
        steps = sorted({int(s) for r in cells[arm] for s in r["test_accuracy"]})
        accuracy = np.array([[r["test_accuracy"][str(s)] for s in steps] for r in cells[arm]]) * 100
        colour, line = STYLE[arm]
        axes[0].plot(steps, accuracy.mean(0), color=colour, ls=line, marker=".", label=arm)
        axes[0].fill_between(steps, accuracy.min(0), accuracy.max(0), color=colour, alpha=0.08)
    axes[0].axvline(plan.n, color="grey", lw=0.8)
    axes[0].set(xlabel="training step", ylabel="test accuracy (%)", title="mean over seeds (band: min-max)")
    axes[0].legend(fontsize=7, ncol=2)
    for arm in ("up_tc", "up_ec", "up_tc_frozen", "scratch_tc", "scratch_ec"):
        after, kl = probe_curve(record["runs"], arm, "kl_uniform", seeds)
        colour, line = STYLE[arm]
        axes[1].plot(np.maximum(after, 1), kl.mean(0), color=colour, ls=line, marker=".", label=arm)
    axes[1].axhline(KL_THRESHOLD, color="grey", lw=0.8, ls=":")
    axes[1].set(xscale="log", xlabel="steps after the start (0 plotted at 1)", ylabel="nats",
                title="KL(router || uniform), probe set")
    axes[1].legend(fontsize=7)
    for ax, field, title in ((axes[2], "expert_cosine", "mean cosine between experts"),
                             (axes[3], "update_cosine", "mean cosine between the experts' updates")):
        for arm in ("up_tc", "up_tc_r25", "up_tc_r50", "scratch_tc"):
            after, cos = probe_curve(record["runs"], arm, field, seeds)
            colour, line = STYLE[arm]
            with warnings.catch_warnings():  # the scratch arm has no update at its start: an empty mean there
                warnings.simplefilter("ignore", RuntimeWarning)
                mean_cos = np.nanmean(cos, 0)
            ax.plot(np.maximum(after, 1), mean_cos, color=colour, ls=line, marker=".", label=arm)
        ax.set(xscale="log", xlabel="steps after the start (0 plotted at 1)", title=title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def analyze(plan: Plan, out: pathlib.Path, *, stopped: bool = False) -> dict:
    """:func:`analysis` of the results file ``out``, written into it (``"analysis"``)."""
    def update(rec):
        rec["analysis"] = analysis(rec, plan, stopped=stopped)
    return confirm.locked_update(out, update)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="mini_moe/results/upcycling.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    confirm_cmd = sub.add_parser("confirm", help="the registered cells of SEEDS (through upcycling.sh: pinned code)")
    confirm_cmd.add_argument("seeds", type=int, nargs="*")
    confirm_cmd.add_argument("--runs", default="runs/upcycling")
    smoke = sub.add_parser("smoke", help="every arm on digits in about a minute (a pipeline check)")
    smoke.add_argument("--runs", default="runs/upcycling-smoke")
    analysis = sub.add_parser("analyze", help="the ten registered contrasts")
    analysis.add_argument("--stopped", action="store_true", help="the study stopped under stop rule 2")
    args = parser.parse_args(argv)
    if args.what == "smoke":
        record = run_study(SMOKE, SMOKE.seeds, pathlib.Path(args.runs))
        print(f"smoke: {len(record['runs'])} cells in {results_path(SMOKE, pathlib.Path(args.runs))}")
    elif args.what == "confirm":
        source = os.environ.get("SOURCE", "")
        if not source:
            sys.exit("upcycling confirm needs SOURCE=<pinned commit>: run it through mini_moe/results/upcycling.sh")
        run_study(REGISTERED, args.seeds or REGISTERED.seeds, pathlib.Path(args.runs), source=source,
                  commit=os.environ.get("COMMIT") == "1")
    else:
        record = analyze(REGISTERED, results_path(REGISTERED, pathlib.Path(".")), stopped=args.stopped)
        for row in record["analysis"]["rows"]:
            print(f"{row['number']:2d} {row['first']} - {row['second']}: {row['verdict']}")


if __name__ == "__main__":
    main()
