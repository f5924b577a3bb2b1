"""Issue 54 §2's registered comparison of compute per patch on Fashion-MNIST
(``compute-per-patch-preregistration.md``): seven routers at a matched average of 2 real experts
per patch.

Usage, from the repository root after ``make venv`` (each command resumes; one process per core)::

    taskset -c 0 bash mini_moe/results/compute_per_patch.sh 310 312 314 316    # the registered cells
    taskset -c 1 bash mini_moe/results/compute_per_patch.sh 311 313 315 317
    .venv/bin/python mini_moe/results/compute_per_patch.py analyze [--stopped]  # the seven contrasts
    .venv/bin/python mini_moe/results/compute_per_patch.py smoke --runs DIR     # every arm, tiny, digits

A cell is one (arm, seed) of :data:`ARMS` x the plan's seeds, run seed by seed in :data:`ARMS`'
order. Each cell trains in its own folder under ``--runs`` (resumable from its checkpoints,
:func:`mini_moe.train.train`) and, when it finishes, one record goes into the results file
(``compute-per-patch-confirmatory-<MACHINE>.json``; with ``COMMIT=1`` committed alone after every
cell). Cells already recorded are skipped. A cell whose loss becomes non-finite is recorded as
failed and never rerun (stop rule 1).

What a record holds: the test accuracy at every evaluation (every 500 steps; the positive control
compares ``tc_k2`` at step 2,000 with its own evaluation at step 500), the training log and
seconds, and the registered secondary outcomes of the step-2,000 model on the 10,000 test images
(eval mode, batches of 512 routed in the model's groups; :func:`measure`): per MoE layer the real
experts per patch (mean by position, distribution 0..E, share with none, Spearman's rho against
the patch's pixel variance and against its distance from the image centre, the reached mean and
whether it is within 0.25 of 2), the activated expert FLOPs per image, and the batch dependence
(:func:`mini_moe.evaluate.batch_dependence`, 4 random regroupings). The per-patch counts
themselves are saved beside the cell's checkpoints (``real_experts.npz``).

``smoke`` runs the same code on :data:`SMOKE` (digits, tiny model, 20 steps) into a results file
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
import warnings

import numpy as np

from mini_moe import bench, confirm, evaluate, study, train
from mini_moe import runs as run_folder
from mini_moe.model import patchify
from mini_moe.validate import InputError

MACHINE = os.environ.get("MACHINE", "cpu-2core-epyc")
RESULTS = pathlib.Path(os.environ.get("RESULTS_DIR") or pathlib.Path(__file__).resolve().parent)
PREREGISTRATION = "mini_moe/results/compute-per-patch-preregistration.md"
TC, EC = "softmax_token_choice", "softmax_expert_choice"
ZERO8 = ("zero",) * 8  # eight zero experts beside the E = 8 real ones


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm: the registered ``router``; ``capacity``, the capacity factor c that
    :func:`mini_moe.study.cell_config` turns into the router's ``k`` and ``capacity_factor``
    (Token Choice: ``k = c``; Expert Choice: ``capacity_factor = c``); the router ``options``
    beyond those (``frozen``: :func:`mini_moe.routers.make_router`'s routing control); the
    layer's ``path`` (``"dropless"`` for every Token Choice arm) and the ``null_experts``' kinds."""

    router: str
    capacity: float
    options: tuple = ()
    path: str = "auto"
    null_experts: tuple = ()


#: The arms, in the order each seed runs them (the registration's table). Every Token Choice arm
#: is dropless; Expert Choice has no dropless form (the default path, gather).
ARMS = {
    "tc_k2": Arm(TC, 2.0, path="dropless"),
    "ec_c2": Arm(EC, 2.0),
    "adamoe": Arm("adamoe", 4.0, path="dropless", null_experts=ZERO8),
    "longcat": Arm("longcat", 4.0, (("bias_rate", 0.1), ("target_real", 2.0)), "dropless", ZERO8),
    "longcat_frozen": Arm("longcat", 4.0, (("bias_rate", 0.1), ("frozen", True), ("target_real", 2.0)), "dropless",
                          ZERO8),
    "top_p": Arm("top_p", 2.0, (("pick_bound", 4.0), ("target_k", 2.0)), "dropless"),
    "remoe": Arm("remoe", 2.0, (("active_bound", 2.0),), "dropless"),
}
ALPHA = 0.05
#: The matched average of real experts per patch, and how far a reached mean may be from it.
TARGET, TOLERANCE = 2.0, 0.25
#: The largest paired SD of the earlier Fashion-MNIST study (points) and the difference the seeds
#: were planned for (points): the power stated beside the contrasts.
PLANNING_SD, PLANNING_DIFFERENCE = 0.58, 1.0


@dataclasses.dataclass(frozen=True)
class Plan:
    """The study's sizes: dataset and model (``study.cell_config`` overrides, steps and evaluation
    period included), the positive control's two steps (early, late), the seeds, the measurement
    batch and the batch dependence's regroupings."""

    name: str
    dataset: str
    overrides: dict
    control: tuple
    seeds: tuple
    measure_batch: int
    regroupings: int

    @property
    def steps(self) -> int:
        return self.overrides["steps"]


#: The registration: chapter 16's Fashion-MNIST models (width 64, MLPs and experts of 64, E = 8,
#: Every-2, groups of 8 images), chapter 8's optimiser and cosine schedule (``confirm.OVERRIDES``:
#: 2,000 steps, peak 2e-3, 100 warm-up steps, evaluation every 500), seeds 310-317.
REGISTERED = Plan(name="confirmatory", dataset="fashion_mnist",
                  overrides=dict(model_dim=64, model_mlp_dim=64, **confirm.OVERRIDES),
                  control=(500, 2000), seeds=tuple(range(310, 318)), measure_batch=512, regroupings=4)
#: The pipeline check: digits (8x8 images in 2x2 patches: the same 4x4 grid), a tiny model, 20 steps.
SMOKE = Plan(name="smoke", dataset="digits",
             overrides=dict(model_dim=16, model_mlp_dim=16, model_heads=2, model_depth=2, batch_size=32,
                            learning_rate=2e-3, warmup_steps=2, steps=20, eval_every=10, eval_batch_size=128),
             control=(10, 20), seeds=(0,), measure_batch=128, regroupings=2)


def contrasts(plan: Plan) -> list[tuple]:
    """The seven registered contrasts: (number, first arm, its step, second arm, its step, question)."""
    early, late = plan.control
    return [
        (1, "adamoe", late, "tc_k2", late, "null experts with AdaMoE's loss vs a fixed k"),
        (2, "longcat", late, "tc_k2", late, "null experts with LongCat's controller vs a fixed k"),
        (3, "top_p", late, "tc_k2", late, "top-p vs a fixed k"),
        (4, "remoe", late, "tc_k2", late, "ReLU routing vs a fixed k"),
        (5, "ec_c2", late, "tc_k2", late, "Expert Choice vs a fixed k"),
        (6, "longcat", late, "longcat_frozen", late, "routing control: does the learned router matter?"),
        (7, "tc_k2", late, "tc_k2", early, "positive control: can this testbed see a difference?"),
    ]


# --------------------------------------------------------------------------------- configurations


def config(arm: str, seed: int, plan: Plan):
    """The :class:`~mini_moe.config.TrainConfig` of one cell: ``study.cell_config`` of the arm's
    router at its capacity factor (``scale="quick"``, the plan's overrides), with the arm's path,
    null experts (``model_null_experts``) and router options (``model_router_kwargs``; the
    capacity factor sets ``k`` and ``capacity_factor`` after them)."""
    spec = ARMS[arm]
    overrides = {**plan.overrides, "model_moe_path": spec.path}
    if spec.null_experts:
        overrides["model_null_experts"] = spec.null_experts
    if spec.options:
        overrides["model_router_kwargs"] = dict(spec.options)
    return study.cell_config(spec.router, spec.capacity, seed, dataset=plan.dataset, scale="quick", **overrides)


# ---------------------------------------------------------------------------------- measurements


def _bounded(hits: np.ndarray, gates: np.ndarray, max_picks: int | None) -> np.ndarray:
    """The picks :func:`mini_moe.layer.moe_sorted` computes under its bound: of the picks made
    in one call (``hits`` bool ``[..., T, E]``, every group of the call), the ``max_picks`` of
    largest gate (``gates``, the same shape) when more were made, else all of them."""
    if max_picks is None or hits.sum() <= max_picks:
        return hits
    flat, values = hits.reshape(-1), np.where(hits, gates, -np.inf).reshape(-1)
    keep = np.zeros(flat.shape, bool)
    keep[np.argsort(-values, kind="stable")[:max_picks]] = True
    return (flat & keep).reshape(hits.shape)


def real_experts(model, images: np.ndarray, *, batch_size: int = 512) -> tuple[list[np.ndarray], list[dict]]:
    """How many real experts process each patch, per MoE layer: ``int [N, P]`` arrays, and per
    layer the router's scalar metrics averaged over the images (eval mode, the model left as it was).

    ``images [N, H, W, C]`` go through the model in batches of ``batch_size`` (a multiple of its
    routing group; the last padded with copies, left out), routed in its groups as at evaluation
    (:func:`mini_moe.evaluate.accuracy`). A patch's real experts are the experts whose slots hold
    it: ``(dispatch > 0).any(-1).sum(-1)`` of the layer's routing ``[groups, T, E, C]``, which
    covers the real experts only (a null pick takes no slot). On the dropless path the routing
    is built with C = T, so it holds every pick made; where the layer's pick bound (ReMoE's
    ``active_bound``, top-p's ``pick_bound``) drops picks in a call, the picks kept are those of
    largest gate over the call (:func:`_bounded`, the rule of :func:`mini_moe.layer.moe_sorted`;
    ties between equal gates aside), and the layer's ``overflow`` metric says how many went.
    """
    cfg = model.cfg
    mlps = [block.mlp for block in model.blocks if block.use_moe]
    if not mlps:
        raise InputError("real_experts needs a model with MoE layers (cfg.router is None).")
    counts, scalars, total = [[] for _ in mlps], [{} for _ in mlps], 0
    for out, n in evaluate.forward_batches(model, images, batch_size=batch_size, routing=True):
        for i, (mlp, rt, metrics) in enumerate(zip(mlps, out.routings, out.metrics)):
            dispatch = np.asarray(rt.dispatch)  # [groups, T, E, C]
            hits = (dispatch > 0).any(-1)  # [groups, T, E]
            if mlp.path == "dropless":
                gates = np.asarray(rt.combine).sum(-1)  # one slot per pick: the pick's gate
                hits = _bounded(hits, gates, mlp.router.allocation.max_picks(hits.shape[0] * hits.shape[1]))
            counts[i].append(hits.sum(-1).reshape(-1, cfg.num_patches)[:n].astype(np.int16))
            for key, value in metrics.items():
                if np.ndim(value) == 0:
                    scalars[i][key] = scalars[i].get(key, 0.0) + n * float(value)
        total += n
    return [np.concatenate(c) for c in counts], [{k: v / total for k, v in s.items()} for s in scalars]


def patch_variance(images: np.ndarray, patch_size: int) -> np.ndarray:
    """The variance of each patch's pixels (all channels), ``[N, P]`` in float64 (a constant,
    e.g. blank, patch has exactly 0). Standardised images give the same ranks as raw ones
    (the standardisation is one affine map per channel)."""
    return np.var(np.asarray(patchify(np.asarray(images, np.float32), patch_size), np.float64), axis=-1)


def centre_distance(image_size: int, patch_size: int) -> np.ndarray:
    """Each patch's distance from the image centre, in pixels (patch centre to image centre),
    ``[P]`` in the row-major order of :func:`mini_moe.model.patchify`."""
    grid = image_size // patch_size
    centres = (np.arange(grid) + 0.5) * patch_size - image_size / 2
    return np.hypot(centres[:, None], centres[None, :]).reshape(-1)


def spearman(x: np.ndarray, y: np.ndarray) -> float | None:
    """Spearman's rank correlation of ``x`` and ``y`` (flattened; ties get mean ranks); None when
    either is constant (Token Choice's every patch 2: no correlation to speak of)."""
    from scipy import stats

    x, y = np.ravel(x), np.ravel(np.broadcast_to(y, np.shape(x)))
    if np.all(x == x[0]) or np.all(y == y[0]):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rho = float(stats.spearmanr(x, y).statistic)
    return None if math.isnan(rho) else rho


def expert_flops(counts: list[np.ndarray], dim: int, hidden: int) -> np.ndarray:
    """Activated expert FLOPs per image ``[N]``: its real picks (summed over the MoE layers and
    patches) x ``2 x 2 x D x H`` (an expert's two matmuls, 2 FLOPs per multiply-add). The router,
    attention and the rest are the same in every arm and left out."""
    picks = sum(np.asarray(c, np.int64).sum(-1) for c in counts)
    return picks * (2 * 2 * dim * hidden)


def layer_profile(counts: np.ndarray, variance: np.ndarray, distance: np.ndarray, *, num_experts: int,
                  target: float = TARGET, tolerance: float = TOLERANCE) -> dict:
    """One MoE layer's real experts per patch ``counts [N, P]``, described: the mean, whether it
    is within ``tolerance`` of ``target`` (``matched``), the mean by position (a square map), the
    distribution (shares of 0, 1, ..., E), the share with none, and Spearman's rho against the
    patches' pixel ``variance [N, P]`` and against their ``distance [P]`` from the image centre."""
    counts = np.asarray(counts)
    grid = math.isqrt(counts.shape[1])
    mean = float(counts.mean())
    return {
        "mean": mean, "matched": bool(abs(mean - target) <= tolerance),
        "by_position": counts.mean(0).reshape(grid, grid).tolist(),
        "distribution": (np.bincount(counts.reshape(-1), minlength=num_experts + 1) / counts.size).tolist(),
        "none": float(np.mean(counts == 0)),
        "spearman_variance": spearman(counts, variance),
        "spearman_centre_distance": spearman(counts, distance[None, :]),
    }


def measure(model, images: np.ndarray, *, batch_size: int, regroupings: int, seed: int,
            target: float = TARGET, tolerance: float = TOLERANCE) -> tuple[dict, list[np.ndarray]]:
    """The registered secondary outcomes of ``model`` on ``images`` (standardised, as the model
    sees them): ``(row, counts)``, ``counts`` the per-layer ``[N, P]`` real experts per patch.

    ``row``: ``layers`` (per MoE layer, :func:`layer_profile` with the block's index and the
    router's scalar metrics), ``reached_mean`` (over the layers) and ``matched`` (every layer's
    mean within ``tolerance`` of ``target``), ``expert_flops_per_image`` (mean, SD, min, max of
    :func:`expert_flops`) and ``batch_dependence`` (:func:`mini_moe.evaluate.batch_dependence`:
    ``regroupings`` random regroupings and as many permutations within groups, in batches of
    ``batch_size``)."""
    cfg = model.cfg
    counts, scalars = real_experts(model, images, batch_size=batch_size)
    variance = patch_variance(images, cfg.patch_size)
    distance = centre_distance(cfg.image_size, cfg.patch_size)
    blocks = cfg.moe_blocks()
    layers = [{"block": int(b), **layer_profile(c, variance, distance, num_experts=cfg.num_experts, target=target,
                                                tolerance=tolerance), "router_metrics": s}
              for b, c, s in zip(blocks, counts, scalars)]
    flops = expert_flops(counts, cfg.dim, cfg.mlp_dim // cfg.fine_grained)
    row = {
        "images": int(len(images)), "layers": layers,
        "reached_mean": float(np.mean([layer["mean"] for layer in layers])),
        "matched": all(layer["matched"] for layer in layers),
        "expert_flops_per_image": {"mean": float(flops.mean()), "sd": float(flops.std()), "min": int(flops.min()),
                                   "max": int(flops.max())},
        "batch_dependence": evaluate.batch_dependence(model, images, regroupings=regroupings, seed=seed,
                                                       batch_size=batch_size),
    }
    return row, counts


# ----------------------------------------------------------------------------------------- a cell


def _finite(obj):
    """``obj`` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def run_cell(arm: str, seed: int, plan: Plan, runs: pathlib.Path, datasets) -> dict:
    """Train (or resume) one cell, measure its model at the last step (:func:`measure`: the live
    model, or its last checkpoint when the run was resumed past it) and return its record
    (``failed`` set when its loss became non-finite). The measurement is kept in the cell's folder
    (``secondary.json``, ``real_experts.npz``)."""
    tick = time.perf_counter()
    spec = ARMS[arm]
    cfg = config(arm, seed, plan)
    folder = runs / f"{arm}-s{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    measured = folder / "secondary.json"

    def on_step(step, model):  # the live model at the last step (its evaluation's compilation is reused)
        row, counts = measure(model, datasets[1].images, batch_size=plan.measure_batch,
                              regroupings=plan.regroupings, seed=seed)
        np.savez_compressed(folder / "real_experts.npz", **{f"layer_{i}": c for i, c in enumerate(counts)})
        measured.write_text(json.dumps({"step": step, **row}))

    try:
        history = train.train(cfg, folder, progress=False, datasets=datasets, measure=on_step,
                              measure_at={cfg.steps})
    except InputError as error:
        if "not finite" not in str(error):
            raise
        return {"failed": str(error)}
    if not measured.exists():  # resumed after the last checkpoint, before its measurement
        model, saved = train.load_trained(folder, step=cfg.steps)
        if run_folder.as_saved(saved) != run_folder.as_saved(cfg):
            raise RuntimeError(f"{arm} seed {seed}: the run in {folder} has config {saved}, not the cell's {cfg}")
        on_step(cfg.steps, model)
    row = json.loads(measured.read_text())
    if row.pop("step") != cfg.steps or history["eval"][-1]["step"] != cfg.steps:
        raise RuntimeError(f"{arm} seed {seed}: the run in {folder} did not reach step {cfg.steps}")
    record = {
        "arm": arm, "seed": seed, "router": spec.router, "capacity": spec.capacity, "options": dict(spec.options),
        "moe_path": spec.path, "null_experts": list(spec.null_experts),
        "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=list)),
        "test_accuracy": {str(r["step"]): r["test_accuracy"] for r in history["eval"]},
        "measured_at": cfg.steps, "secondary": row,
        "train_seconds": round(history["seconds"], 2),
        "seconds_per_step": round(history["seconds"] / cfg.steps, 5),
        "train_log": history["train"],
    }
    record["wall_seconds"] = round(time.perf_counter() - tick, 1)  # of this session only, if resumed
    return _finite(record)


# ----------------------------------------------------------------------------------------- driver


def results_path(plan: Plan, runs: pathlib.Path) -> pathlib.Path:
    if plan is SMOKE:
        return runs / f"compute-per-patch-smoke-{MACHINE}.json"
    return RESULTS / f"compute-per-patch-confirmatory-{MACHINE}.json"


def run_study(plan: Plan, seeds, runs: pathlib.Path, *, source: str | None = None, commit: bool = False) -> dict:
    """Every arm of each seed in turn; a cell already in the results file is skipped. With
    ``source``, refuses to train unless ``mini_moe`` comes from a clean checkout of that commit."""
    unknown = sorted(set(seeds) - set(plan.seeds))
    if unknown:
        raise SystemExit(f"compute_per_patch: seeds {unknown} are not in the plan ({list(plan.seeds)}).")
    out = results_path(plan, runs)
    datasets = None
    for seed, arm in itertools.product(seeds, ARMS):
        done = json.loads(out.read_text())["runs"] if out.exists() else []
        if any((r["arm"], r["seed"]) == (arm, seed) for r in done):
            continue
        state = confirm.require_pinned(source) if source else confirm.source_state()
        if datasets is None:
            datasets = train.load_data(config("tc_k2", seed, plan))
        print(f"compute_per_patch {plan.name}: {arm} seed {seed}", file=sys.stderr, flush=True)
        record = {"arm": arm, "seed": seed, **run_cell(arm, seed, plan, runs, datasets),
                  "source_commit": state["commit"], "source_dirty": state["dirty"], "cpu": bench.machine()["cpu"]}

        def update(rec, record=record):
            rec["runs"] = [r for r in rec["runs"] if (r["arm"], r["seed"]) != (arm, seed)] + [record]
            rec.update(what="issue 54 §2: compute per patch on Fashion-MNIST, the registered comparison"
                       if plan is REGISTERED else "issue 54 §2: the compute-per-patch runner's smoke (not a result)",
                       plan=plan.name, preregistration=PREREGISTRATION, machine=bench.machine(),
                       arms={a: dataclasses.asdict(v) for a, v in ARMS.items()}, seeds=list(plan.seeds),
                       steps=plan.steps, target=TARGET, tolerance=TOLERANCE,
                       contrasts=[list(c) for c in contrasts(plan)],
                       command="taskset -c N bash mini_moe/results/compute_per_patch.sh SEED ...")
        confirm.locked_update(out, update)
        print(f"  {arm} seed {seed}: {'FAILED ' + record['failed'] if 'failed' in record else record['test_accuracy']}",
              file=sys.stderr, flush=True)
        if commit:
            subprocess.run(["bash", "-c", f'source mini_moe/results/commit_result.sh && commit_result {out} '
                            f'"issue 54 compute-per-patch confirmatory: {arm} seed {seed}"'], check=False)
    return json.loads(out.read_text()) if out.exists() else {"runs": []}


def arm_summary(runs: list[dict], plan: Plan) -> dict:
    """Per arm, over its finished cells: seeds, mean test accuracy at the last step, per layer the
    mean reached real experts per patch and share with none, the arm's ``matched`` flag (every
    layer's mean over seeds within the tolerance of the target), expert FLOPs per image and batch
    dependence (regroup), each a mean over seeds."""
    out = {}
    for arm in ARMS:
        cells = [r for r in runs if r["arm"] == arm and "failed" not in r]
        if not cells:
            out[arm] = {"seeds": []}
            continue
        layers = [[c["secondary"]["layers"][i] for c in cells] for i in range(len(cells[0]["secondary"]["layers"]))]
        reached = [float(np.mean([layer["mean"] for layer in per])) for per in layers]
        out[arm] = {
            "seeds": [c["seed"] for c in cells],
            "test_accuracy": float(np.mean([c["test_accuracy"][str(plan.steps)] for c in cells])),
            "reached_mean_per_layer": reached,
            "none_per_layer": [float(np.mean([layer["none"] for layer in per])) for per in layers],
            "matched": all(abs(m - TARGET) <= TOLERANCE for m in reached),
            "expert_flops_per_image": float(np.mean([c["secondary"]["expert_flops_per_image"]["mean"] for c in cells])),
            "batch_dependence": float(np.mean([c["secondary"]["batch_dependence"]["regroup"]["mean"] for c in cells])),
        }
    return out


def analysis(record: dict, plan: Plan, *, stopped: bool = False) -> dict:
    """The registered contrasts of a results ``record``, on the seeds whose cells of both arms
    finished: mean paired difference in points, two-sided paired t (df = n - 1), 95 % CI, Holm over
    all seven. Refuses while a planned seed is incomplete, unless ``stopped`` (the study ended under
    stop rule 2). Every row says whether an arm in it missed the matched average (``not_matched``)
    and whether the positive control held (else the contrasts are uninformative); with fewer than 5
    complete seeds everything is exploratory. A pure function of the record: the chapter
    re-computes the committed analysis with it."""
    acc = {(r["arm"], r["seed"]): r["test_accuracy"] for r in record["runs"] if "failed" not in r}
    recorded = {(r["arm"], r["seed"]) for r in record["runs"]}
    complete = [s for s in plan.seeds if all((a, s) in recorded for a in ARMS)]
    if len(complete) < len(plan.seeds) and not stopped:
        raise SystemExit(f"compute_per_patch analyze: {len(complete)}/{len(plan.seeds)} seeds complete; the "
                         "contrasts are computed once every planned seed has finished (or with --stopped, stop "
                         "rule 2).")
    summary = arm_summary([r for r in record["runs"] if r["seed"] in complete], plan)
    rows = []
    for number, a, sa, b, sb, question in contrasts(plan):
        seeds = [s for s in complete if (a, s) in acc and (b, s) in acc]
        if not seeds:
            raise SystemExit(f"compute_per_patch analyze: contrast {number} has no seed with both arms finished.")
        diffs = [acc[a, s][str(sa)] - acc[b, s][str(sb)] for s in seeds]
        rows.append({"number": number, "first": [a, sa], "second": [b, sb], "question": question, "seeds": seeds,
                     "differences": diffs, **study.paired_t(diffs),
                     "not_matched": sorted({x for x in (a, b) if not summary[x].get("matched", False)})})
    for row, p in zip(rows, study.holm([1.0 if math.isnan(r["p_value"]) else r["p_value"] for r in rows])):
        row["p_holm"] = p
        row["verdict"] = study.verdict(row, unit=" points", scale=100, alpha=ALPHA)
    control = rows[6]
    holds = bool(control["p_holm"] < ALPHA and control["difference"] > 0)
    n = len(complete)
    return _finite({
        "complete_seeds": complete, "stopped": stopped, "rows": rows, "arms": summary,
        "positive_control_holds": holds, "uninformative": not holds, "exploratory": n < 5,
        "power": (study.paired_power(n, PLANNING_SD, PLANNING_DIFFERENCE, alpha=ALPHA / len(rows))
                  if n >= 2 else None)})


def analyze(plan: Plan, out: pathlib.Path, *, stopped: bool = False) -> dict:
    """:func:`analysis` of the results file ``out``, written into it (``"analysis"``)."""
    def update(rec):
        rec["analysis"] = analysis(rec, plan, stopped=stopped)
    return confirm.locked_update(out, update)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="mini_moe/results/compute_per_patch.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    confirm_cmd = sub.add_parser("confirm",
                                 help="the registered cells of SEEDS (through compute_per_patch.sh: pinned code)")
    confirm_cmd.add_argument("seeds", type=int, nargs="*")
    confirm_cmd.add_argument("--runs", default="runs/compute-per-patch")
    smoke = sub.add_parser("smoke", help="every arm on digits in about a minute (a pipeline check)")
    smoke.add_argument("--runs", default="runs/compute-per-patch-smoke")
    analysis = sub.add_parser("analyze", help="the seven registered contrasts")
    analysis.add_argument("--stopped", action="store_true", help="the study stopped under stop rule 2")
    args = parser.parse_args(argv)
    if args.what == "smoke":
        record = run_study(SMOKE, SMOKE.seeds, pathlib.Path(args.runs))
        print(f"smoke: {len(record['runs'])} cells in {results_path(SMOKE, pathlib.Path(args.runs))}")
    elif args.what == "confirm":
        source = os.environ.get("SOURCE", "")
        if not source:
            sys.exit("compute_per_patch confirm needs SOURCE=<pinned commit>: run it through "
                     "mini_moe/results/compute_per_patch.sh")
        run_study(REGISTERED, args.seeds or REGISTERED.seeds, pathlib.Path(args.runs), source=source,
                  commit=os.environ.get("COMMIT") == "1")
    else:
        record = analyze(REGISTERED, results_path(REGISTERED, pathlib.Path(".")), stopped=args.stopped)
        analysis = record["analysis"]
        if analysis["exploratory"]:
            print(f"exploratory: {len(analysis['complete_seeds'])} complete seeds (< 5)")
        if analysis["uninformative"]:
            print("the positive control did not hold: every contrast is uninformative")
        for row in analysis["rows"]:
            flag = f"  [not matched: {', '.join(row['not_matched'])}]" if row["not_matched"] else ""
            print(f"{row['number']} {row['first']} - {row['second']}: {row['verdict']}{flag}")


if __name__ == "__main__":
    main()
