"""A controlled experiment where the right routing is known: tokens drawn from K sub-tasks.

Every token belongs to one of ``K`` sub-tasks. Its sub-task sets where it lies (a cluster
around a centre ``mu_k``, so a linear router can tell the sub-tasks apart) and which function
maps it to its target: ``y = f_k(x)``, where ``f_k`` is a random two-layer GELU MLP of the same
shape as one expert (``D -> H -> D``). So ``K`` experts can fit the data exactly, one per
sub-task, while one MLP of the same width ``H`` (the dense layer of equal activated compute)
cannot fit ``K`` unrelated functions. The right routing is known: all tokens of a sub-task
to one expert, a different expert per sub-task. :func:`run` trains one MoE layer (any router
of :data:`mini_moe.routers.ROUTERS`) on this data and measures how close the router gets to it.

Metrics (:func:`evaluate_layer`, on fresh test groups):

* ``fvu``: fraction of variance unexplained, ``mean |y - y_hat|^2 / mean |y - mean y|^2``
  (0 is a perfect fit, 1 is predicting the mean);
* ``routing_accuracy``: the fraction of tokens whose main expert (largest combine weight; none
  if unprocessed) is the expert matched to their sub-task, under the best one-to-one matching
  of sub-tasks to experts (Hungarian algorithm on the sub-task x expert counts);
* ``unprocessed``, ``experts_per_token``, ``processed_cv``: as in
  :func:`mini_moe.evaluate.mechanisms`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mini_moe import routers as routers_lib
from mini_moe import study, train
from mini_moe.evaluate import assignment_counts
from mini_moe.layer import MlpExperts
from mini_moe.modes import eval_mode
from mini_moe.model import MoeLayer
from mini_moe.validate import InputError, check_int

Array = Any

FREQUENCIES = ("uniform", "skewed")


@dataclasses.dataclass(frozen=True)
class SubtaskConfig:
    """One run of the controlled experiment.

    Attributes:
      router: a router name (``mini_moe.ROUTERS``), a study variant (:data:`mini_moe.study.VARIANTS`,
        e.g. ``"softmax_token_choice_frozen"``: the router with its weights frozen), or ``"dense"`` (one MLP of width
        ``hidden``: equal activated compute) or ``"dense_wide"`` (width ``tasks * hidden``:
        equal parameters, a reference that needs ``tasks`` times the compute).
      capacity: capacity factor c (:func:`mini_moe.study.capacity_options`).
      tasks: number of sub-tasks K (and of experts).
      frequencies: ``"uniform"`` (each sub-task 1/K of the tokens) or ``"skewed"`` (Zipf:
        sub-task k has probability proportional to 1/(k+1)).
      dim, hidden: token width D and the width H of every teacher and every expert.
      separation: distance of each sub-task's centre from the origin, in units of the
        within-cluster standard deviation (1).
      group_tokens: tokens per routing group T; ``groups``: groups per training batch.
      steps: training steps, the most :func:`run` takes when ``patience`` is set.
      patience: 0 (train all ``steps``) or the stopping rule's window: stop at the first
        evaluation where the validation FVU has not fallen below ``(1 - tolerance)`` times its
        best value of ``patience`` steps earlier or before (a relative improvement of
        ``tolerance`` within the window). Validation groups are drawn apart from the test groups.
      tolerance: the relative improvement the stopping rule asks for (0.01: 1 %).
    """

    router: str = "softmax_token_choice"
    capacity: float = 1.0
    tasks: int = 8
    frequencies: str = "uniform"
    dim: int = 32
    hidden: int = 32
    separation: float = 4.0
    group_tokens: int = 256
    groups: int = 8
    steps: int = 1500
    learning_rate: float = 3e-3
    aux_loss_weight: float = 0.01
    eval_every: int = 100
    seed: int = 0
    patience: int = 0
    tolerance: float = 0.01

    def __post_init__(self):
        if self.router not in ROUTER_CHOICES + VARIANT_CHOICES:
            raise InputError(f"Unknown router {self.router!r}; expected 'dense', 'dense_wide' or one of: "
                             f"{', '.join(ROUTER_CHOICES[2:] + VARIANT_CHOICES)}.")
        if self.frequencies not in FREQUENCIES:
            raise InputError(f"frequencies must be one of {FREQUENCIES}, got {self.frequencies!r}.")
        for name in ("tasks", "dim", "hidden", "group_tokens", "groups", "steps", "eval_every"):
            check_int(name, getattr(self, name))
        check_int("patience", self.patience, 0)
        if self.patience and self.patience % self.eval_every:
            raise InputError(f"patience must be a multiple of eval_every={self.eval_every}, got {self.patience}.")
        if not 0 <= self.tolerance < 1:
            raise InputError(f"tolerance must be in [0, 1), got {self.tolerance!r}.")
        study.check_capacity(self.capacity)

    def probabilities(self) -> np.ndarray:
        """``[K]`` the share of tokens of each sub-task."""
        weights = np.ones(self.tasks) if self.frequencies == "uniform" else 1.0 / np.arange(1, self.tasks + 1)
        return weights / weights.sum()


class Teacher:
    """The K sub-tasks: centres ``[K, D]`` and teacher MLPs, fixed by ``data_seed``."""

    def __init__(self, cfg: SubtaskConfig, data_seed: int = 0):
        rng = np.random.default_rng(data_seed)
        directions = np.linalg.qr(rng.normal(size=(cfg.dim, cfg.dim)))[0][: cfg.tasks]  # orthonormal rows
        self.centres = cfg.separation * directions if cfg.tasks <= cfg.dim else cfg.separation * rng.normal(
            size=(cfg.tasks, cfg.dim)) / math.sqrt(cfg.dim)
        scale = 1.0 / math.sqrt(cfg.dim + cfg.separation**2)  # inputs have squared norm ~ D + separation^2
        self.w1 = 2.0 * scale * rng.normal(size=(cfg.tasks, cfg.dim, cfg.hidden))
        self.b1 = rng.normal(size=(cfg.tasks, 1, cfg.hidden)) * 0.5
        self.w2 = rng.normal(size=(cfg.tasks, cfg.hidden, cfg.dim)) / math.sqrt(cfg.hidden)
        self.p = cfg.probabilities()
        self.cfg = cfg

    def sample(self, rng: np.random.Generator, groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``groups`` routing groups: tokens ``x [G, T, D]``, targets ``y [G, T, D]`` and the
        sub-task of every token ``[G, T]``."""
        cfg = self.cfg
        task = rng.choice(cfg.tasks, size=(groups, cfg.group_tokens), p=self.p)
        x = self.centres[task] + rng.normal(size=(groups, cfg.group_tokens, cfg.dim))
        y = np.empty_like(x)
        for k in range(cfg.tasks):  # each sub-task's tokens through its teacher
            mine = task == k
            y[mine] = _gelu(x[mine] @ self.w1[k] + self.b1[k]) @ self.w2[k]
        return x.astype(np.float32), y.astype(np.float32), task


def _gelu(x: np.ndarray) -> np.ndarray:
    """GELU, tanh form: what ``jax.nn.gelu`` (the experts' activation) computes by default."""
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


class SubtaskLayer(MoeLayer):
    """One MoE layer (``router`` + ``tasks`` experts of width ``hidden``; the package's
    :class:`~mini_moe.model.MoeLayer`) or a dense MLP (``router`` is None).

    ``layer(x [G, T, D]) -> (y [G, T, D], RouterOutput or None)``.
    """

    def __init__(self, cfg: SubtaskConfig, *, rngs: nnx.Rngs):
        if cfg.router in ("dense", "dense_wide"):
            width = cfg.hidden * (cfg.tasks if cfg.router == "dense_wide" else 1)
            super().__init__(None, MlpExperts(1, cfg.dim, width, rngs=rngs))
        else:
            name, options = study.VARIANTS.get(cfg.router, (cfg.router, {}))
            kwargs = study.capacity_options(name, cfg.capacity, tokens=cfg.group_tokens, num_experts=cfg.tasks)
            router = routers_lib.make_router(name, cfg.dim, cfg.tasks, rngs=rngs, **kwargs, **options)
            super().__init__(router, MlpExperts(cfg.tasks, cfg.dim, cfg.hidden, rngs=rngs))

    def __call__(self, x: Array):
        if self.router is None:
            g, t, d = x.shape
            return self.experts(x.reshape(1, g * t, d)).reshape(g, t, -1), None
        y, out = super().__call__(x)
        routers_lib.after_forward([(self.router.affinity, out.metrics)])  # the model's step: ReMoE's lambda
        return y, out


def _loss(layer, x, y, aux_weight):
    pred, out = layer(x)
    mse = jnp.mean(jnp.sum((pred - y) ** 2, -1))
    aux = 0.0 if out is None else out.aux_loss
    return mse + aux_weight * aux, mse


@nnx.jit(static_argnames=("aux_weight",))
def _train_step(layer, optimizer, x, y, aux_weight):
    (_, mse), grads = nnx.value_and_grad(_loss, has_aux=True)(layer, x, y, aux_weight)
    optimizer.update(layer, grads)
    return mse


@nnx.jit
def _predict(layer, x):
    pred, out = layer(x)
    if out is None:
        return pred, None, None
    weight = out.routing.combine.sum(-1)  # [G, T, E]: each expert's combine weight for the token
    hits = (out.routing.dispatch > 0).any(-1)  # [G, T, E]
    return pred, weight, hits


def routing(layer: SubtaskLayer, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(weight, hits)``, both ``[G, T, E]``: each expert's combine weight for every token and
    whether it processes the token (eval mode)."""
    with eval_mode(layer):
        _, weight, hits = _predict(layer, jnp.asarray(x))
    return np.asarray(weight), np.asarray(hits)


def balance_bound(cfg: SubtaskConfig, *, groups: int = 20_000, seed: int = 0) -> float:
    """The best routing accuracy any allocation with ``C = round(c T / E)`` slots per expert can
    reach, ``1 - E[sum_k max(n_k - C, 0)] / T``: a sub-task with ``n_k`` tokens in a group keeps at
    most ``C`` of them at its own expert. ``n ~ Multinomial(T, p)``, estimated from ``groups``
    sampled groups."""
    from mini_moe.routing import capacity as capacity_of

    slots = capacity_of(cfg.group_tokens, cfg.tasks, cfg.capacity)
    counts = np.random.default_rng(seed).multinomial(cfg.group_tokens, cfg.probabilities(), size=groups)
    return float(1 - np.maximum(counts - slots, 0).sum(-1).mean() / cfg.group_tokens)


def evaluate_layer(layer: SubtaskLayer, x: np.ndarray, y: np.ndarray, task: np.ndarray, num_tasks: int) -> dict:
    """The metrics of the module docstring on test groups ``x, y [G, T, D]``, ``task [G, T]``."""
    from scipy.optimize import linear_sum_assignment

    with eval_mode(layer):
        pred, weight, hits = _predict(layer, jnp.asarray(x))
    pred = np.asarray(pred)
    fvu = float(np.mean(np.sum((pred - y) ** 2, -1)) / np.mean(np.sum((y - y.mean((0, 1))) ** 2, -1)))
    if weight is None:
        return {"fvu": fvu}
    weight, hits = np.asarray(weight), np.asarray(hits)
    processed = hits.any(-1)
    counts = assignment_counts(weight, hits, task, num_tasks)
    rows, cols = linear_sum_assignment(-counts)
    per_token = hits.sum(-1)
    load = hits.sum((0, 1)).astype(float)
    return {"fvu": fvu, "routing_accuracy": float(counts[rows, cols].sum() / task.size),
            "unprocessed": float(np.mean(~processed)), "experts_per_token": float(per_token.mean()),
            "processed_cv": float(load.std() / load.mean()) if load.mean() > 0 else 0.0}


def run(cfg: SubtaskConfig, *, test_groups: int = 32, data_seed: int = 0, return_layer: bool = False):
    """Train one layer on the sub-task data and return its learning curve and final metrics.

    The sub-tasks (centres and teachers) are fixed by ``data_seed`` and shared by every run;
    ``cfg.seed`` sets the layer's initialisation and the order of training tokens, so runs with
    the same seed are paired. With ``cfg.patience`` the run stops by the rule of
    :class:`SubtaskConfig` on validation groups (each curve entry then has ``val_fvu``), and
    ``stopped`` says whether the rule stopped it before ``cfg.steps``. Returns ``{"config",
    "curve": [{"step", **metrics}], "final", "steps", "stopped", "seconds"}``; with
    ``return_layer``, ``(that dict, the trained layer, the test groups (x, y, task))``.
    """
    teacher = Teacher(cfg, data_seed)
    test = teacher.sample(np.random.default_rng(10_000 + data_seed), test_groups)
    valid = teacher.sample(np.random.default_rng(20_000 + data_seed), test_groups) if cfg.patience else None
    best = []  # (step, best validation FVU so far)
    rng = np.random.default_rng(cfg.seed)
    layer = SubtaskLayer(cfg, rngs=train.model_rngs(cfg.seed))
    optimizer = nnx.Optimizer(layer, _adam(cfg.learning_rate), wrt=nnx.Param)
    curve, tick = [], time.perf_counter()
    for step in range(1, cfg.steps + 1):
        x, y, _ = teacher.sample(rng, cfg.groups)
        _train_step(layer, optimizer, jnp.asarray(x), jnp.asarray(y), cfg.aux_loss_weight)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            curve.append({"step": step, **evaluate_layer(layer, *test, cfg.tasks)})
            if valid is not None:
                curve[-1]["val_fvu"] = evaluate_layer(layer, *valid, cfg.tasks)["fvu"]
                best.append((step, min(curve[-1]["val_fvu"], best[-1][1] if best else math.inf)))
                if _converged(best, cfg.patience, cfg.tolerance):
                    break
    out = {"config": dataclasses.asdict(cfg), "curve": curve, "final": curve[-1], "steps": curve[-1]["step"],
           "stopped": curve[-1]["step"] < cfg.steps, "seconds": round(time.perf_counter() - tick, 2)}
    return (out, layer, test) if return_layer else out


@functools.lru_cache(maxsize=16)
def _adam(learning_rate: float) -> optax.GradientTransformation:
    """One (stateless) Adam transformation per learning rate, shared by the runs: the jitted
    training step is cached by the optimizer's structure, which holds it, so runs that share it
    compile the step once (as :func:`mini_moe.train.make_optimizer` does)."""
    return optax.adam(learning_rate)


def _converged(best: list[tuple[int, float]], patience: int, tolerance: float) -> bool:
    """The stopping rule on ``best`` ([(step, best validation FVU up to that step)]): the best
    value now is not below ``(1 - tolerance)`` times the best value ``patience`` steps ago."""
    step, now = best[-1]
    before = [value for s, value in best if s <= step - patience]
    return bool(before) and not now < (1 - tolerance) * before[-1]


#: The models :func:`run_experiment` trains by default: the dense layers and every registered router
#: that routes by the tokens it is given (the raw-key routers read image patches, which this
#: token-level experiment has none of).
ROUTER_CHOICES = ("dense", "dense_wide") + tuple(r for r in routers_lib.general_routers()
                                                 if routers_lib.spec(r).reads == "representation")
#: The study's variants (``mini_moe.study.VARIANTS``), which it can train besides, among them
#: the routing controls (a router with its weights frozen at initialisation).
VARIANT_CHOICES = tuple(sorted(study.VARIANTS))
_ORDER = ROUTER_CHOICES + VARIANT_CHOICES


def run_experiment(out_path, *, routers=ROUTER_CHOICES, frequencies=FREQUENCIES, capacities=(1.0,), seeds=range(8),
                   command: str | None = None, progress: bool = True, **overrides) -> dict:
    """Every router (and both dense references) on every frequency setting, capacity and seed.

    Resumable: ``out_path`` (JSON) is rewritten after every run, and runs already in it are not
    repeated. Returns ``{"command", "machine", "runs": [run(...) results]}`` (each run with the
    ``machine`` it trained on; the file's own ``machine`` is its last writer's); ``overrides`` go to
    every :class:`SubtaskConfig` (``steps=...``, ``tasks=...``).
    """
    import json
    import pathlib
    import sys

    from mini_moe import bench

    out_path = pathlib.Path(out_path)
    results = json.loads(out_path.read_text()) if out_path.exists() else {"runs": []}
    done = {json.dumps(r["config"], sort_keys=True) for r in results["runs"]}
    plan = [SubtaskConfig(router=r, capacity=1.0 if r.startswith("dense") else float(c), frequencies=f, seed=s,
                          **overrides)
            for s in seeds for f in frequencies for r in routers for c in (capacities[:1] if r.startswith("dense")
                                                                           else capacities)]
    for i, cfg in enumerate(plan):
        if json.dumps(dataclasses.asdict(cfg), sort_keys=True) in done:
            continue
        if progress:
            print(f"[{i + 1}/{len(plan)}] {cfg.router} c={cfg.capacity:g} {cfg.frequencies} seed {cfg.seed}",
                  file=sys.stderr, flush=True)
        results["runs"].append(run(cfg) | {"machine": bench.machine()})  # each run's own machine
        results.update(command=command, machine=bench.machine(), planned_runs=len(plan))
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=1))
    return results


def paired(results: dict, better: str, worse: str, *, frequencies: str, capacity: float = 1.0,
           metric: str = "fvu", lower_is_better: bool = True) -> dict:
    """:func:`mini_moe.stats.paired_t` of ``better`` against ``worse`` over the seeds both ran
    (same data, same training tokens): the difference is oriented so that a positive mean says
    ``better`` is better (for FVU: ``worse``'s minus ``better``'s)."""
    final = {}
    for r in results["runs"]:
        c = r["config"]
        if c["frequencies"] == frequencies and (c["capacity"] == capacity or c["router"].startswith("dense")):
            final[(c["router"], c["seed"])] = r["final"][metric]
    seeds = sorted({s for (name, s) in final if name == better} & {s for (name, s) in final if name == worse})
    if not seeds:
        raise InputError(f"No seed has runs of both {better!r} and {worse!r} ({frequencies}, c = {capacity:g}).")
    sign = -1.0 if lower_is_better else 1.0
    return study.paired_t([sign * (final[(better, s)] - final[(worse, s)]) for s in seeds])


def summary(results: dict, *, capacity: float = 1.0) -> list[dict]:
    """Per (frequencies, router): mean and standard deviation over seeds of every final metric,
    and the number of seeds. Routers in :data:`ROUTER_CHOICES` order, then the variants."""
    groups: dict[tuple, list[dict]] = {}
    for r in results["runs"]:
        c = r["config"]
        if c["capacity"] == capacity or c["router"].startswith("dense"):
            groups.setdefault((c["frequencies"], c["router"]), []).append(r["final"])
    rows = []
    for (freq, router), finals in sorted(groups.items(), key=lambda kv: (FREQUENCIES.index(kv[0][0]),
                                                                         _ORDER.index(kv[0][1]))):
        row = {"frequencies": freq, "router": router, "seeds": len(finals)}
        for key in finals[0]:
            if key != "step":
                values = [f[key] for f in finals]
                row[key] = float(np.mean(values))
                row[key + "_std"] = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
        rows.append(row)
    return rows


def pairwise(results: dict, *, capacity: float = 1.0, metric: str = "fvu") -> list[dict]:
    """Every pair of routers in every frequency setting, as one family of paired t-tests over
    seeds with Holm's correction: rows ``{"frequencies", "better", "worse", **paired_t,
    "p_holm"}``, oriented so that ``better`` has the lower mean ``metric`` (FVU)."""
    rows = []
    for freq in FREQUENCIES:
        means = {r["router"]: r[metric] for r in summary(results, capacity=capacity) if r["frequencies"] == freq}
        names = sorted(means, key=means.get)
        for i, better in enumerate(names):
            for worse in names[i + 1:]:
                rows.append({"frequencies": freq, "better": better, "worse": worse,
                             **paired(results, better, worse, frequencies=freq, capacity=capacity, metric=metric)})
    usable = [row for row in rows if not math.isnan(row["p_value"])]
    for row, adjusted in zip(usable, study.holm([row["p_value"] for row in usable])):
        row["p_holm"] = adjusted
    return rows


def plot_curves(results: dict, *, frequencies: str, capacity: float = 1.0,
                metrics=("fvu", "routing_accuracy", "unprocessed")):
    """Learning curves, mean over seeds: one panel per metric, one line per router. A run that
    stopped early (the stopping rule of :class:`SubtaskConfig`) keeps its last values up to the
    longest run of the plot, so that every mean is over all seeds."""
    import matplotlib.pyplot as plt

    chosen = [r for r in results["runs"] if r["config"]["frequencies"] == frequencies
              and (r["config"]["capacity"] == capacity or r["config"]["router"].startswith("dense"))]
    steps = sorted({point["step"] for r in chosen for point in r["curve"]})
    curves: dict[str, dict[str, dict[int, list[float]]]] = {}
    for r in chosen:
        points = {point["step"]: point for point in r["curve"]}
        last = None
        for step in steps:
            last = points.get(step, last)
            for m in metrics:
                if last is not None and m in last:
                    curves.setdefault(m, {}).setdefault(r["config"]["router"], {}).setdefault(step, []).append(last[m])
    titles = {"fvu": "fraction of variance unexplained", "routing_accuracy": "tokens at their sub-task's expert",
              "unprocessed": "tokens no expert processes", "processed_cv": "load CV (processed)"}
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.3 * len(metrics), 3.6), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        for router, by_step in sorted(curves.get(m, {}).items(), key=lambda kv: ROUTER_CHOICES.index(kv[0])):
            steps = sorted(by_step)
            style = study._style(router if router in study.MARKERS else "dense")
            if router == "dense_wide":
                style = dict(style, color="0.5")
            ax.plot(steps, [np.mean(by_step[s]) for s in steps], label=router, markersize=4,
                    linestyle="--" if router.startswith("dense") else "-", **style)
        ax.set_xlabel("training step")
        ax.set_title(titles.get(m, m), fontsize=10)
        ax.grid(alpha=0.3)
    if "fvu" in metrics:
        axes[0, list(metrics).index("fvu")].set_yscale("log")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    axes[0, -1].legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(f"{frequencies} sub-task frequencies, c = {capacity:g}; mean over seeds", fontsize=10)
    fig.tight_layout()
    return fig


def slot_purity(layer: SubtaskLayer, x: np.ndarray, task: np.ndarray, num_tasks: int) -> float:
    """For any routing (meant for Soft MoE): the mean over slots of the largest share of the
    slot's dispatch weight that comes from one sub-task. 1 when every slot draws from a single
    sub-task (always true for a sparse routing: one token per slot); ``1 / K`` when slots mix
    all sub-tasks evenly. Empty slots are left out."""
    with eval_mode(layer):
        dispatch = np.asarray(layer.router(jnp.asarray(x)).routing.dispatch)  # [G, T, E, S]
    onehot = np.eye(num_tasks)[task]  # [G, T, K]
    mass = np.einsum("gtk,gtes->gkes", onehot, dispatch)  # each slot's weight per sub-task
    total = mass.sum(1)
    used = total > 0
    return float((mass.max(1)[used] / total[used]).mean())
