"""The router study (paper 000, Section 3) at a scale you can rerun: ``python -m mini_moe study``.

Trains every router at capacity 1 and 2 (``k`` for Token Choice, the capacity factor ``c``
for Expert Choice, ``c * round(T/E)`` slots per expert for Soft MoE) and the dense ViT,
for several seeds, then evaluates test accuracy, 10-shot accuracy and training cost (seconds
of training and XLA's FLOP count of one step). Each cell trains into its own folder under
``out_dir`` and leaves a ``result.json``; a study that is cut short and started again skips
finished cells and resumes an interrupted one from its checkpoint. ``results.json`` (all
cells plus mean and standard deviation per router and capacity) is rewritten after every
cell.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mini_moe import config as config_lib
from mini_moe import evaluate, train
from mini_moe.routers import ROUTERS

# Which router option the capacity sets (paper 000: k = 1, 2 and c = 1, 2).
CAPACITY_OPTION = {
    "softmax_token_choice": "k",
    "sinkhorn_token_choice": "k",
    "svmoe": "k",
    "softmax_expert_choice": "capacity_factor",
    "sinkhorn_expert_choice": "capacity_factor",
    "sparsity_constrained_expert_choice": "capacity_factor",
    "soft_moe": "slots_per_expert",
}
assert set(CAPACITY_OPTION) == set(ROUTERS), "every router needs a capacity option"

# Paper 000, Figure 3: Sinkhorn Token Choice whose combine weights come from the transport
# plan instead of the softmax. A study trains it next to the routers: variant -> (router, options).
VARIANTS = {"sinkhorn_token_choice_plan_combine": ("sinkhorn_token_choice", {"softmax_combine": False})}
STUDY_ROUTERS = sorted(ROUTERS) + sorted(VARIANTS)


def cell_name(router: str | None, capacity: int, seed: int) -> str:
    return f"dense-s{seed}" if router is None else f"{router}-c{capacity}-s{seed}"


def cell_config(router: str | None, capacity: int, seed: int, *, dataset: str, scale: str | None = None,
                **overrides) -> config_lib.TrainConfig:
    """The :class:`TrainConfig` of one study cell (``router=None``: the dense ViT; ``router``
    may also name one of :data:`VARIANTS`)."""
    if router is not None and router not in STUDY_ROUTERS:
        raise ValueError(f"Unknown router {router!r}; expected one of: {', '.join(STUDY_ROUTERS)}.")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}.")
    router, options = VARIANTS.get(router, (router, {}))
    cfg = config_lib.get_config(scale, dataset=dataset, router=router, seed=seed, **overrides)
    if router is None:
        return cfg
    kwargs = dict(cfg.model.router_kwargs) | options
    option = CAPACITY_OPTION[router]
    kwargs[option] = capacity * kwargs["slots_per_expert"] if option == "slots_per_expert" else capacity
    model = dataclasses.replace(cfg.model, router_kwargs=tuple(sorted(kwargs.items())))
    return dataclasses.replace(cfg, model=model)


@functools.lru_cache(maxsize=None)
def step_flops(cfg: config_lib.TrainConfig) -> float:
    """FLOPs of one training step's forward + backward pass, as counted by XLA on the
    compiled program (optimizer excluded). Loops are counted once, so iterative solvers
    (Sinkhorn, the sparsity-constrained plan) are undercounted: time is the honest cost."""
    model = train.make_model(cfg)
    graphdef, state = nnx.split(model)
    m = cfg.model
    images = jnp.zeros((cfg.batch_size, m.image_size, m.image_size, m.channels), jnp.float32)
    labels = jnp.zeros((cfg.batch_size,), jnp.int32)

    def loss(model):
        out = model(images)
        return optax.softmax_cross_entropy_with_integer_labels(out.logits, labels).mean() + out.aux_loss

    def gradients(state):  # nnx.grad: gradients of the parameters only (not of RNG keys)
        return nnx.grad(loss)(nnx.merge(graphdef, state))

    analysis = jax.jit(gradients).lower(state).compile().cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0]
    return float(analysis.get("flops", float("nan")))


def run_cell(cfg: config_lib.TrainConfig, out_dir, *, minutes: float | None = None, datasets=None,
             progress: bool = True, label: str | None = None) -> dict:
    """Train (or resume) one cell, evaluate it and write ``result.json``; returns the result.

    ``label`` names the router in the result (default: ``cfg.model.router`` or ``"dense"``).

    With ``minutes``, the schedule is sized to that much training on this machine (measured
    once; a resumed cell keeps the steps it started with) and training stops when it is spent.
    """
    out_dir = pathlib.Path(out_dir)
    result_path = out_dir / "result.json"
    if result_path.exists():
        return json.loads(result_path.read_text())
    tick = time.perf_counter()
    datasets = datasets if datasets is not None else train.load_data(cfg)
    if minutes is not None:
        cfg = train.budget_config(cfg, 60.0 * minutes, out_dir=out_dir, datasets=datasets)
    history = train.train(cfg, out_dir, resume=True, progress=progress, datasets=datasets)
    model, _ = train.load_trained(out_dir)
    flops = step_flops(dataclasses.replace(cfg, seed=0))  # the same program for every seed
    final = history["eval"][-1]
    result = {
        "router": label or cfg.model.router or "dense",
        "capacity": _capacity_of(cfg),
        "seed": cfg.seed,
        "steps": final["step"],
        "test_accuracy": final["test_accuracy"],
        "ten_shot_accuracy": evaluate.few_shot_accuracy(model, *datasets, shots=10),
        "train_seconds": round(history["seconds"], 2),
        "step_flops": flops,
        "train_flops": flops * final["step"],
        # wall-clock time of this call: training, evaluation, 10-shot probe, FLOP count
        # (of the last session only, for a cell that was resumed)
        "wall_seconds": round(time.perf_counter() - tick, 1),
        "eval": history["eval"],  # test accuracy during training: [{"step", "seconds", "test_accuracy"}]
    }
    result_path.write_text(json.dumps(result, indent=1))
    return result


def _capacity_of(cfg) -> int:
    if cfg.model.router is None:
        return 1
    value = dict(cfg.model.router_kwargs)[CAPACITY_OPTION[cfg.model.router]]
    if CAPACITY_OPTION[cfg.model.router] == "slots_per_expert":
        base = max(1, round(cfg.model.num_patches / cfg.model.num_experts))
        return max(1, round(value / base))
    return int(value)


def summarize(cells: list[dict]) -> list[dict]:
    """Mean and standard deviation over seeds of every (router, capacity)."""
    groups: dict[tuple, list[dict]] = {}
    for cell in cells:
        groups.setdefault((cell["router"], cell["capacity"]), []).append(cell)
    rows = []
    for (router, capacity), members in groups.items():
        row = {"router": router, "capacity": capacity, "seeds": len(members)}
        for key in ("test_accuracy", "ten_shot_accuracy", "train_seconds", "train_flops"):
            values = [m[key] for m in members]
            row[key] = statistics.fmean(values)
            row[key + "_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        rows.append(row)
    return rows


def paired_t(differences, *, level: float = 0.95) -> dict:
    """Paired t-test of ``differences`` (one per independent pair) against zero.

    Returns ``{"difference": mean, "stderr": standard error of the mean, "pairs": n,
    "t": mean / stderr, "df": n - 1, "p_value": two-sided p-value of Student's t with n - 1
    degrees of freedom, "ci_low", "ci_high": the ``level`` confidence interval of the mean
    difference, mean -+ t_{(1 + level)/2, n-1} * stderr}``. With one pair every statistic but
    the mean is NaN; with a zero spread the t statistic is infinite (p = 0) unless the mean is
    zero too (t = 0, p = 1).
    """
    from scipy import stats  # a dependency of scikit-learn

    diffs = [float(d) for d in differences]
    if not diffs:
        raise ValueError("paired_t needs at least one difference.")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}.")
    n, mean = len(diffs), statistics.fmean(diffs)
    out = {"difference": mean, "pairs": n, "df": n - 1}
    if n < 2:
        return out | {"stderr": math.nan, "t": math.nan, "p_value": math.nan, "ci_low": math.nan, "ci_high": math.nan}
    stderr = statistics.stdev(diffs) / math.sqrt(n)
    if stderr > 0:
        t = mean / stderr
        p_value = float(2 * stats.t.sf(abs(t), n - 1))
    else:
        t, p_value = (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
    half = float(stats.t.ppf((1 + level) / 2, n - 1)) * stderr
    return out | {"stderr": stderr, "t": t, "p_value": p_value, "ci_low": mean - half, "ci_high": mean + half}


def holm(p_values) -> list[float]:
    """Holm's step-down adjustment of a family of p-values (controls the family-wise error rate).

    The i-th smallest of m p-values is multiplied by m - i + 1 (i = 1, ..., m), the products are
    made non-decreasing in that order and capped at 1; returned in the order given. A comparison
    is significant at level alpha for the whole family when its adjusted p-value is below alpha.
    """
    p = [float(v) for v in p_values]
    if any(not 0 <= v <= 1 for v in p):
        raise ValueError(f"p-values must lie in [0, 1], got {p}.")
    m = len(p)
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(sorted(range(m), key=lambda i: p[i])):
        running = max(running, min(1.0, (m - rank) * p[index]))
        adjusted[index] = running
    return adjusted


def compare(cells: list[dict], better, worse, *, metric: str = "test_accuracy", capacities=None,
            level: float = 0.95) -> dict:
    """Is router group ``better`` ahead of group ``worse``? A paired t-test over seeds.

    For every (seed, capacity) in which both groups have cells, takes the difference of the
    groups' mean ``metric``. Pairing by seed removes what the cells of one seed share (the data
    order, and the initial weights of models of the same shape). For the same reason the
    differences at several capacities of one seed are not independent: they are averaged into
    one difference per seed, and the seeds are the pairs of the test. Returns
    :func:`paired_t` of those per-seed differences: ``difference`` (mean), ``stderr``,
    ``pairs`` (seeds), ``t``, ``df``, ``p_value`` (two-sided) and the ``level`` confidence
    interval ``ci_low``, ``ci_high``. A study that reports several comparisons should adjust
    their p-values together (:func:`holm`).

    Args:
      cells: the ``cells`` of a study's results.
      better, worse: a router name or a list of names (e.g. both Expert Choice routers).
      metric: ``"test_accuracy"``, ``"ten_shot_accuracy"``, ``"train_seconds"``, ...
      capacities: restrict to these capacities (default: all).
      level: the confidence level of the interval.
    """
    groups = [[better] if isinstance(better, str) else list(better), [worse] if isinstance(worse, str) else list(worse)]
    by_key: dict[tuple, list[list[float]]] = {}
    for cell in cells:
        if capacities is not None and cell["capacity"] not in capacities:
            continue
        for side, names in enumerate(groups):
            if cell["router"] in names:
                by_key.setdefault((cell["seed"], cell["capacity"]), [[], []])[side].append(cell[metric])
    by_seed: dict[int, list[float]] = {}
    for (seed, _), (a, b) in sorted(by_key.items()):
        if a and b:
            by_seed.setdefault(seed, []).append(statistics.fmean(a) - statistics.fmean(b))
    if not by_seed:
        raise ValueError(f"No (seed, capacity) has cells of both {groups[0]} and {groups[1]}.")
    return paired_t([statistics.fmean(d) for d in by_seed.values()], level=level)


def run_study(out_dir, *, dataset: str, routers=None, capacities=(1, 2), seeds=(0, 1, 2), dense: bool = True,
              scale: str | None = None, minutes: float | None = None, command: str | None = None,
              progress: bool = True, **overrides) -> dict:
    """Run (or continue) a study; returns and writes ``out_dir/results.json``.

    Args:
      out_dir: folder of the study; one sub-folder per cell.
      dataset: a dataset name (``mini_moe.data.DATASETS``).
      routers: router names or :data:`VARIANTS` (default: all of :data:`STUDY_ROUTERS`).
      capacities: the capacities to try (paper 000: 1 and 2).
      seeds: seeds per cell.
      dense: also train the dense ViT (once per seed).
      scale: ``"quick"``/``"full"`` or None (the default for this machine).
      minutes: per-cell training-time budget (else the config's ``steps``).
      command: the command line, recorded in the results.
      **overrides: config overrides for every cell (``steps=...``, ``model_dim=...``).
    """
    from mini_moe import bench

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    routers = list(STUDY_ROUTERS) if routers is None else list(routers)
    plan = [(None, 1, s) for s in seeds] if dense else []
    plan += [(r, c, s) for s in seeds for r in routers for c in capacities]
    datasets = train.load_data(cell_config(None, 1, 0, dataset=dataset, scale=scale, **overrides))
    cells = []
    for i, (router, capacity, seed) in enumerate(plan):
        name = cell_name(router, capacity, seed)
        cfg = cell_config(router, capacity, seed, dataset=dataset, scale=scale, **overrides)
        if progress:
            print(f"[{i + 1}/{len(plan)}] {name}", file=sys.stderr, flush=True)
        cells.append(run_cell(cfg, out_dir / name, minutes=minutes, datasets=datasets, progress=progress,
                              label=router))
        results = {"command": command, "machine": bench.machine(), "dataset": dataset, "scale": scale or config_lib.default_scale(),
                   "minutes_per_cell": minutes, "overrides": {k: repr(v) for k, v in overrides.items()},
                   "wall_seconds": round(sum(c.get("wall_seconds", 0.0) for c in cells), 1),
                   "cells": cells, "summary": summarize(cells)}
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    return results


def plot_study(results: dict, *, cost: str = "train_seconds"):
    """Accuracy against training cost (paper 000, Figures 1-2): one marker per router and
    capacity (filled: capacity 1, open: capacity 2), error bars over seeds."""
    import matplotlib.pyplot as plt

    markers = {"softmax_token_choice": "o", "sinkhorn_token_choice": "s", "svmoe": "P",
               "softmax_expert_choice": "v", "sinkhorn_expert_choice": "D",
               "sparsity_constrained_expert_choice": "^", "soft_moe": "*", "dense": "x",
               "sinkhorn_token_choice_plan_combine": "X"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, title in ((axes[0], "test_accuracy", "test accuracy"),
                              (axes[1], "ten_shot_accuracy", "10-shot accuracy")):
        for i, row in enumerate(results["summary"]):
            color = plt.cm.tab10(sorted(markers).index(row["router"]) % 10)
            ax.errorbar(row[cost], row[metric], xerr=row[cost + "_std"], yerr=row[metric + "_std"],
                        marker=markers.get(row["router"], "o"), markersize=9, linestyle="none", color=color,
                        markerfacecolor=color if row["capacity"] == 1 else "white",
                        label=f"{row['router']} ({row['capacity']})")
        ax.set_xlabel({"train_seconds": "training time (s)", "train_flops": "training FLOPs (XLA count)"}[cost])
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    return fig


def plot_curves(out_dir, results: dict):
    """Test accuracy against training time of every cell (from each cell's history.json)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for cell in results["cells"]:
        name = cell_name(None if cell["router"] == "dense" else cell["router"], cell["capacity"], cell["seed"])
        history = json.loads((pathlib.Path(out_dir) / name / "history.json").read_text())
        ax.plot([e["seconds"] for e in history["eval"]], [100 * e["test_accuracy"] for e in history["eval"]],
                marker="o", markersize=3, label=name, linestyle="--" if cell["router"] == "dense" else "-")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig
