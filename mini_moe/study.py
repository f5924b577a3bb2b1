"""The router study (paper 000, Section 3) at a scale you can rerun: ``python -m mini_moe study``.

Every router sits in one architecture (V-MoE's Every-2 placement, paper 000 Sec. 3.1, Soft
MoE included) and is trained at the capacity factors ``c`` of a sweep (default 0.5, 1, 2),
next to the dense ViT of equal activated FLOPs. ``c`` sets each expert's buffer
``C = round(c T / E)`` for every router (:func:`capacity_options`): Token Choice routes
``k = 1`` expert per token for ``c <= 1`` and ``k = c`` above, Expert Choice takes ``C``
tokens per expert, Soft MoE has ``C`` slots per expert (T: the tokens one router call sees).

For every cell the study records test accuracy, 10-shot accuracy, training cost (seconds and
XLA's FLOP count of one step) and the mechanisms of :func:`mini_moe.evaluate.mechanisms`
(dropped and unprocessed tokens, experts per token, load balance, batch dependence, routing
stability). Each cell trains into its own folder under ``out_dir`` and leaves a
``result.json``; a study that is cut short and started again skips finished cells and
resumes an interrupted one from its checkpoint. ``results.json`` (all cells plus mean and
standard deviation per router and capacity) is rewritten after every cell.

The statistics are paired over seeds (:func:`~mini_moe.stats.paired_t`, :func:`compare`), corrected for the
number of comparisons (:func:`~mini_moe.stats.holm`), planned with :func:`seeds_for_power`, and paper 000's
"allocation matters more than affinity" is tested by :func:`allocation_vs_affinity`.

Why one module of some 600 lines: the study's cells, their configuration and the paired
analysis of their results share the cell's key; the analysis reads exactly what the runner wrote.
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
from mini_moe.stats import holm, paired_t  # noqa: F401  (the study's statistics; their home is stats)
from mini_moe import routers as routers_lib
from mini_moe.routers import ROUTERS, general_routers
from mini_moe.validate import InputError

# The routers of the papers, whose claims :func:`claims` tests, and how the capacity factor c
# reaches each (declared with its registration: "token", "expert" or "soft"). A study can also
# train routers registered elsewhere; the claims stay about these.
PAPER_ROUTERS = ("softmax_token_choice", "sinkhorn_token_choice", "svmoe", "softmax_expert_choice",
                 "sinkhorn_expert_choice", "sparsity_constrained_expert_choice", "soft_moe")
ALLOCATION = {name: ROUTERS[name].allocation for name in PAPER_ROUTERS}

# Paper 000's routers as affinity x allocation: pairs that differ only in the affinity, and
# pairs that differ only in the allocation (the test of :func:`allocation_vs_affinity`).
#: Pairs of paper routers that differ only in the affinity.
AFFINITY_PAIRS = (
    ("softmax_token_choice", "sinkhorn_token_choice"), ("softmax_token_choice", "svmoe"),
    ("sinkhorn_token_choice", "svmoe"),
    ("softmax_expert_choice", "sinkhorn_expert_choice"),
    ("softmax_expert_choice", "sparsity_constrained_expert_choice"),
    ("sinkhorn_expert_choice", "sparsity_constrained_expert_choice"),
)
#: Pairs of paper routers that differ only in the allocation.
ALLOCATION_PAIRS = (
    ("softmax_token_choice", "softmax_expert_choice"), ("sinkhorn_token_choice", "sinkhorn_expert_choice"),
)

# Paper 000, Figure 3: Sinkhorn Token Choice whose combine weights come from the transport
# plan instead of the softmax. A study trains it next to the routers: variant -> (router, options).
# Issue 34's routing controls and confound splits: the same router with its weights frozen at
# initialisation (no learned routing), Token Choice without noise or auxiliary loss, or with the
# Switch loss, and Expert Choice with Token Choice's logit noise.
#: The router variants a study can train, by name, as ``{variant: (registered router, options)}``.
VARIANTS = {
    "sinkhorn_token_choice_plan_combine": ("sinkhorn_token_choice", {"softmax_combine": False}),
    "softmax_token_choice_frozen": ("softmax_token_choice", {"frozen": True}),
    "softmax_expert_choice_frozen": ("softmax_expert_choice", {"frozen": True}),
    "softmax_token_choice_plain": ("softmax_token_choice", {"noise_std": 0.0, "balance_loss": "none"}),
    "softmax_token_choice_switch": ("softmax_token_choice", {"balance_loss": "switch"}),
    "softmax_expert_choice_noisy": ("softmax_expert_choice", {"noise_std": 1.0}),
}
STUDY_ROUTERS = sorted(PAPER_ROUTERS) + sorted(VARIANTS)
CAPACITIES = (0.5, 1.0, 2.0)  # paper 002's sweep; paper 000 uses c = 1, 2


def cell_name(router: str | None, capacity: float, seed: int) -> str:
    """``"dense-s3"``, ``"softmax_token_choice-c0.5-s3"``, ``"soft_moe-c2-s3"``."""
    return f"dense-s{seed}" if router is None else f"{router}-c{capacity:g}-s{seed}"


def check_capacity(capacity) -> float:
    """The capacity factor as a float; a clear error unless it is 0.5, 1, or a larger integer
    (Token Choice needs ``k = c`` experts per token above 1)."""
    if isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or not capacity > 0:
        raise InputError(f"capacity must be a number > 0, got {capacity!r}.")
    if capacity > 1 and capacity != int(capacity):
        raise InputError(f"capacity above 1 must be an integer (Token Choice uses k = c), got {capacity!r}.")
    return float(capacity)


def capacity_options(router: str, capacity: float, *, tokens: int, num_experts: int) -> dict:
    """The router options that give every expert ``C = round(c T / E)`` slots.

    Token Choice (Algorithm 1): ``k = 1`` for ``c <= 1`` (paper 003 compares Expert Choice at
    ``c = 0.5`` with top-1 Token Choice), ``k = c`` above, and capacity factor ``c``. Expert
    Choice (Algorithm 2): capacity factor ``c``. Soft MoE: ``round(c T / E)`` slots per expert
    (at least 1), ``T`` being the tokens of one image.
    """
    return routers_lib.spec(router).capacity_options(check_capacity(capacity), tokens=tokens, num_experts=num_experts)


def cell_config(router: str | None, capacity: float, seed: int, *, dataset: str, scale: str | None = None,
                **overrides) -> config_lib.TrainConfig:
    """The :class:`~mini_moe.config.TrainConfig` of one study cell: ``router`` (or one of :data:`VARIANTS`;
    ``None`` for the dense ViT) at capacity factor ``capacity``, in the Every-2 placement."""
    if router is not None and router not in ROUTERS and router not in VARIANTS:
        raise InputError(f"Unknown router {router!r}; expected one of: {', '.join(sorted(ROUTERS) + sorted(VARIANTS))}.")
    capacity = check_capacity(capacity)
    router, options = VARIANTS.get(router, (router, {}))
    overrides = {"model_placement": "every2", **overrides}
    cfg = config_lib.get_config(scale, dataset=dataset, router=router, seed=seed, **overrides)
    if router is None:
        return cfg
    m = cfg.model
    kwargs = dict(m.router_kwargs) | options
    kwargs |= capacity_options(router, capacity, tokens=m.num_patches, num_experts=m.num_experts)
    model = dataclasses.replace(m, router_kwargs=tuple(sorted(kwargs.items())))
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
             progress: bool = True, label: str | None = None, capacity: float = 1.0) -> dict:
    """Train (or resume) one cell, evaluate it and write ``result.json``; returns the result.

    ``label`` names the router in the result (default: ``cfg.model.router`` or ``"dense"``),
    ``capacity`` is the capacity factor the cell was built with (:func:`cell_config`).

    With ``minutes``, the schedule is sized to that much training on this machine (measured
    once; a resumed cell keeps the steps it started with) and training stops when it is spent.
    """
    out_dir = pathlib.Path(out_dir)
    result_path = out_dir / "result.json"
    tick = time.perf_counter()
    if minutes is not None and (out_dir / "config.json").exists():  # the steps it started with
        cfg = train.budget_config(cfg, 60.0 * minutes, out_dir=out_dir)
    train.check_saved_config(out_dir, cfg)  # a result (or a started run) of another configuration is refused
    if result_path.exists():
        return json.loads(result_path.read_text())
    datasets = datasets if datasets is not None else train.load_data(cfg)
    if minutes is not None:
        cfg = train.budget_config(cfg, 60.0 * minutes, out_dir=out_dir, datasets=datasets)
    history = train.train(cfg, out_dir, resume=True, progress=progress, datasets=datasets)
    model, _ = train.load_trained(out_dir)
    flops = step_flops(dataclasses.replace(cfg, seed=0))  # the same program for every seed
    final = history["eval"][-1]
    result = {
        "router": label or cfg.model.router or "dense",
        "capacity": check_capacity(capacity),
        "seed": cfg.seed,
        "steps": final["step"],
        "test_accuracy": final["test_accuracy"],
        "ten_shot_accuracy": evaluate.few_shot_accuracy(model, *datasets, shots=10),
        "train_seconds": round(history["seconds"], 2),
        "step_flops": flops,
        "train_flops": flops * final["step"],
        # wall-clock time of this call: training, evaluation, 10-shot probe, FLOP count
        # (of the last session only, for a cell that was resumed)
        "mechanisms": evaluate.mechanisms(model, datasets[1].images, seed=cfg.seed),
        "wall_seconds": round(time.perf_counter() - tick, 1),
        "eval": history["eval"],  # test accuracy during training: [{"step", "seconds", "test_accuracy"}]
    }
    result_path.write_text(json.dumps(result, indent=1))
    return result


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


def compare(cells: list[dict], better, worse, *, metric: str = "test_accuracy", capacities=None,
            level: float = 0.95) -> dict:
    """Is router group ``better`` ahead of group ``worse``? A paired t-test over seeds.

    For every (seed, capacity) in which both groups have cells, takes the difference of the
    groups' mean ``metric``. Pairing by seed removes what the cells of one seed share (the data
    order, and the initial weights of models of the same shape). For the same reason the
    differences at several capacities of one seed are not independent: they are averaged into
    one difference per seed, and the seeds are the pairs of the test. Returns
    :func:`~mini_moe.stats.paired_t` of those per-seed differences: ``difference`` (mean), ``stderr``,
    ``pairs`` (seeds), ``t``, ``df``, ``p_value`` (two-sided) and the ``level`` confidence
    interval ``ci_low``, ``ci_high``. A study that reports several comparisons should adjust
    their p-values together (:func:`~mini_moe.stats.holm`).

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
        raise InputError(f"No (seed, capacity) has cells of both {groups[0]} and {groups[1]}.")
    return paired_t([statistics.fmean(d) for d in by_seed.values()], level=level)


def verdict(row: dict, *, what: str = "", unit: str = "", scale: float = 1.0, digits: int = 2,
            higher: str = "higher", lower: str = "lower", alpha: float = 0.05) -> str:
    """A comparison's result in words, from a :func:`compare` / :func:`~mini_moe.stats.paired_t` row with ``p_holm``.

    ``"no detectable difference (+0.12 points, p_Holm = 0.3)"`` when the Holm-adjusted p-value is
    at least ``alpha``, else ``"higher by 0.52 points (95 % CI [+0.21, +0.83], p_Holm = 0.004)"``
    (``lower`` for a negative difference). ``scale`` multiplies the difference and the interval
    (100 for accuracies in points), ``what`` is put in front (``"FVU "``).
    """
    if "p_holm" not in row:
        raise InputError("row has no 'p_holm': adjust the family's p-values with holm() first.")
    diff, p = scale * row["difference"], row["p_holm"]
    if not p < alpha:
        return f"no detectable difference ({what}{diff:+.{digits}f}{unit}, p_Holm = {p:.2g})"
    word = higher if diff > 0 else lower
    return (f"{what}{word} by {abs(diff):.{digits}f}{unit} (95 % CI [{scale * row['ci_low']:+.{digits}f}, "
            f"{scale * row['ci_high']:+.{digits}f}], p_Holm = {p:.2g})")


def paired_power(pairs: int, sd: float, difference: float, *, alpha: float = 0.05) -> float:
    """Power of the two-sided paired t-test: the probability that ``pairs`` paired seeds whose
    differences have standard deviation ``sd`` and mean ``difference`` give p < ``alpha``.
    Under that alternative t follows a noncentral t distribution with ``pairs - 1`` degrees of
    freedom and noncentrality ``difference * sqrt(pairs) / sd``. Finite everywhere, in [0, 1]
    (a tail scipy cannot evaluate falls back to a normal approximation, see ``_nct_cdf``)."""
    from scipy import stats

    if isinstance(pairs, bool) or not isinstance(pairs, int) or pairs < 2:
        raise InputError(f"pairs must be an integer >= 2, got {pairs!r}.")
    if not sd > 0:
        raise InputError(f"sd must be > 0, got {sd!r}.")
    if not 0 < alpha < 1:
        raise InputError(f"alpha must be in (0, 1), got {alpha!r}.")
    df, shift = pairs - 1, abs(difference) * math.sqrt(pairs) / sd
    critical = float(stats.t.ppf(1 - alpha / 2, df))
    upper = 1.0 - _nct_cdf(critical, df, shift)  # P(t > critical)
    lower = _nct_cdf(-critical, df, shift)  # P(t < -critical)
    return min(1.0, max(0.0, upper + lower))


def _nct_cdf(x: float, df: int, shift: float) -> float:
    """P(T <= x) for T noncentral t (``df``, ``shift``): scipy's ``nct.cdf``, or, where it
    returns NaN (its series underflows far in a tail: scipy 1.17 at x = -4.5, df = 3, shift = 7),
    the normal approximation of Abramowitz & Stegun 26.7.10,
    Phi((x (1 - 1/(4 df)) - shift) / sqrt(1 + x^2 / (2 df)))."""
    from scipy import stats

    value = float(stats.nct.cdf(x, df, shift))
    if not math.isfinite(value):
        value = float(stats.norm.cdf((x * (1 - 1 / (4 * df)) - shift) / math.sqrt(1 + x * x / (2 * df))))
    return min(1.0, max(0.0, value))


def tost_power(pairs: int, sd: float, bound: float, *, difference: float = 0.0, alpha: float = 0.05) -> float:
    """Power of the paired TOST equivalence test (:func:`mini_moe.confirm.tost`, each one-sided test
    at ``alpha``): the probability that ``pairs`` paired seeds whose differences are normal with
    mean ``difference`` and standard deviation ``sd`` show equivalence within +-``bound``. TOST
    rejects when abs(mean) < bound - t_{1-alpha, n-1} s / sqrt(n); the mean and the sample SD s are
    independent, so the power is the integral over s ~ sd sqrt(chi^2_{n-1} / (n - 1)) of the normal
    probability of that interval (exact up to the quadrature's error, about 1e-8)."""
    from scipy import integrate, stats

    if isinstance(pairs, bool) or not isinstance(pairs, int) or pairs < 2:
        raise InputError(f"pairs must be an integer >= 2, got {pairs!r}.")
    if not sd > 0 or not bound > 0:
        raise InputError(f"sd and bound must be > 0, got sd={sd!r}, bound={bound!r}.")
    if not 0 < alpha < 0.5:
        raise InputError(f"alpha must be in (0, 0.5), got {alpha!r}.")
    df, scale = pairs - 1, sd / math.sqrt(pairs)
    critical = float(stats.t.ppf(1 - alpha, df))
    top = bound / (critical * scale)  # s / sd above this: the interval is empty
    top_q = top * top * df  # the same as a value of chi^2_{df}

    def given(q):  # q = (n - 1) s^2 / sd^2 ~ chi^2_{df}
        half = bound - critical * scale * math.sqrt(q / df)
        inside = stats.norm.cdf((half - difference) / scale) - stats.norm.cdf((-half - difference) / scale)
        return inside * stats.chi2.pdf(q, df)

    end = min(top_q, float(stats.chi2.isf(1e-15, df)))  # beyond it the chi^2 density is negligible
    value, _ = integrate.quad(given, 0.0, end, points=[min(df, end / 2)], limit=200)
    return min(1.0, max(0.0, float(value)))


def seeds_for_power(sd: float, difference: float, *, alpha: float = 0.05, power: float = 0.8,
                    comparisons: int = 1, max_pairs: int = 1000) -> int:
    """The fewest paired seeds that detect ``difference`` with probability ``power`` when the
    paired differences have standard deviation ``sd``, at family-wise level ``alpha`` over
    ``comparisons`` tests (Bonferroni's ``alpha / comparisons``: what Holm's step-down test
    needs for its smallest p-value, so a conservative plan for the others)."""
    if not 0 < power < 1:
        raise InputError(f"power must be in (0, 1), got {power!r}.")
    if isinstance(comparisons, bool) or not isinstance(comparisons, int) or comparisons < 1:
        raise InputError(f"comparisons must be an integer >= 1, got {comparisons!r}.")
    for pairs in range(2, max_pairs + 1):
        if paired_power(pairs, sd, difference, alpha=alpha / comparisons) >= power:
            return pairs
    raise InputError(f"more than max_pairs={max_pairs} seeds needed (sd={sd}, difference={difference}).")


def allocation_vs_affinity(cells: list[dict], *, metric: str = "test_accuracy", capacities=None,
                           level: float = 0.95) -> dict:
    """Paper 000's lesson, "the allocation matters more than the affinity", as a paired test.

    In every (seed, capacity), takes the mean absolute ``metric`` difference over the router
    pairs that differ only in the allocation (:data:`ALLOCATION_PAIRS`: the same affinity with
    Token Choice or Expert Choice) minus the same over the pairs that differ only in the
    affinity (:data:`AFFINITY_PAIRS`: the same allocation, another affinity); averages the
    capacities of each seed and returns :func:`~mini_moe.stats.paired_t` over seeds. Noise inflates both means
    alike, so a positive mean says changing the allocation moves accuracy more.
    """
    table: dict[tuple, dict[str, float]] = {}
    for cell in cells:
        if capacities is None or cell["capacity"] in capacities:
            table.setdefault((cell["seed"], cell["capacity"]), {})[cell["router"]] = cell[metric]
    by_seed: dict[int, list[float]] = {}
    for (seed, _), acc in sorted(table.items()):
        gaps = [[abs(acc[a] - acc[b]) for a, b in pairs if a in acc and b in acc]
                for pairs in (ALLOCATION_PAIRS, AFFINITY_PAIRS)]
        if all(gaps):
            by_seed.setdefault(seed, []).append(statistics.fmean(gaps[0]) - statistics.fmean(gaps[1]))
    if not by_seed:
        raise InputError("No (seed, capacity) has cells of both an allocation pair and an affinity pair.")
    return paired_t([statistics.fmean(d) for d in by_seed.values()], level=level)


TOKEN_CHOICE = tuple(r for r in sorted(ALLOCATION) if ALLOCATION[r] == "token")
EXPERT_CHOICE = tuple(r for r in sorted(ALLOCATION) if ALLOCATION[r] == "expert")


def claims(cells: list[dict], *, metric: str = "test_accuracy", level: float = 0.95) -> list[dict]:
    """Paper 000's conclusions (and paper 003's and V-MoE's) as one family of paired tests.

    Each row: ``claim``, ``source``, the :func:`compare` (or :func:`allocation_vs_affinity`)
    statistics (``difference`` = better minus worse, ``ci_low``, ``ci_high``, ``t``, ``df``,
    ``pairs``, ``p_value``) and ``p_holm``, the p-value adjusted by :func:`~mini_moe.stats.holm` over every row
    (the family). A claim holds at level 0.05 when ``difference > 0`` and ``p_holm < 0.05``.
    Rows whose routers have no cells yet (a study still running) are left out.
    """
    sparse = TOKEN_CHOICE + EXPERT_CHOICE
    tests = [
        ("Expert Choice beats Token Choice", "paper 000, Figures 1-2",
         lambda: compare(cells, list(EXPERT_CHOICE), list(TOKEN_CHOICE), metric=metric, level=level)),
        ("Sinkhorn Token Choice beats Softmax Token Choice", "paper 000, Figure 1",
         lambda: compare(cells, "sinkhorn_token_choice", "softmax_token_choice", metric=metric, level=level)),
        *[(f"Soft MoE beats {r}", "paper 000, Section 5",
           lambda r=r: compare(cells, "soft_moe", r, metric=metric, level=level)) for r in sparse],
        ("the allocation matters more than the affinity", "paper 000, Section 3.3",
         lambda: allocation_vs_affinity(cells, metric=metric, level=level)),
        ("Softmax Expert Choice at c = 0.5 beats top-1 Softmax Token Choice at c = 1", "paper 003",
         lambda: compare([c | {"capacity": 0.0} for c in cells
                          if (c["router"], c["capacity"]) in {("softmax_expert_choice", 0.5), ("softmax_token_choice", 1.0)}],
                         "softmax_expert_choice", "softmax_token_choice", metric=metric, level=level)),
        *[(f"{r} at c = 1 beats the dense ViT", "V-MoE (Riquelme et al. 2021)",
           lambda r=r: compare(cells, r, "dense", metric=metric, capacities=[1.0], level=level))
          for r in sorted(ALLOCATION)],
    ]
    rows = []
    for claim, source, test in tests:
        try:
            rows.append({"claim": claim, "source": source, **test()})
        except ValueError:  # no cells of these routers yet
            continue
    usable = [row for row in rows if not math.isnan(row["p_value"])]
    for row, adjusted in zip(usable, holm([row["p_value"] for row in usable])):
        row["p_holm"] = adjusted
    return rows


def run_study(out_dir, *, dataset: str, routers=None, capacities=CAPACITIES, seeds=(0, 1, 2), dense: bool = True,
              scale: str | None = None, minutes: float | None = None, command: str | None = None,
              progress: bool = True, done=None, **overrides) -> dict:
    """Run (or continue) a study; returns and writes ``out_dir/results.json``.

    The cells run seed by seed (the dense ViT, then every router at every capacity), so a study
    stopped early holds complete paired seeds.

    Args:
      out_dir: folder of the study; one sub-folder per cell.
      dataset: a dataset name (``mini_moe.data.DATASETS``).
      routers: router names or :data:`VARIANTS` (default: every router of :data:`~mini_moe.routers.ROUTERS`
        that builds for any dataset, :func:`~mini_moe.routers.general_routers`).
      capacities: the capacity factors c to try (:func:`capacity_options`).
      seeds: seeds per cell.
      dense: also train the dense ViT (once per seed).
      scale: ``"quick"``/``"full"`` or None (the default for this machine).
      minutes: per-cell training-time budget (else the config's ``steps``).
      command: the command line, recorded in the results.
      done: a ``results.json`` of an earlier run of the same study (a path or the loaded
        dict): its cells count as finished, so a fresh clone continues from committed results.
        A path that does not exist yet counts as no cells (the first run of a study).
      **overrides: config overrides for every cell (``steps=...``, ``model_dim=...``).
    """
    from mini_moe import bench

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    routers = general_routers() if routers is None else list(routers)
    capacities = [check_capacity(c) for c in capacities]
    plan = [(r, c, s) for s in seeds for r, cs in ([(None, [1.0])] if dense else []) + [(r, capacities) for r in routers]
            for c in cs]
    if isinstance(done, (str, pathlib.Path)):
        done = json.loads(pathlib.Path(done).read_text()) if pathlib.Path(done).exists() else None
    if done:  # its cells are reused only if they were made with the same settings
        settings = {"dataset": dataset, "scale": scale or config_lib.default_scale(), "minutes_per_cell": minutes,
                    "overrides": {k: repr(v) for k, v in overrides.items()}}
        differ = {k: (done.get(k), v) for k, v in settings.items() if done.get(k) != v}
        if differ:
            raise InputError("done= holds cells of a study made with other settings: "
                             + "; ".join(f"{k} was {old!r}, here {new!r}" for k, (old, new) in differ.items())
                             + ". Run with the same settings, or without done= to start a new study.")
    finished = {(c["router"], c["capacity"], c["seed"]): c for c in (done or {}).get("cells", [])}
    if not plan:
        raise InputError("Nothing to run: pass at least one router (routers=...) or dense=True, and seeds.")
    first_router, first_capacity, _ = plan[0]  # (a valid config: prc=True has no dense cell)
    datasets = train.load_data(cell_config(first_router, first_capacity, 0, dataset=dataset, scale=scale, **overrides))
    cells, started = [], time.strftime("%Y-%m-%dT%H:%M:%S%z")
    for i, (router, capacity, seed) in enumerate(plan):
        name = cell_name(router, capacity, seed)
        cfg = cell_config(router, capacity, seed, dataset=dataset, scale=scale, **overrides)
        if progress:
            print(f"[{i + 1}/{len(plan)}] {name}", file=sys.stderr, flush=True)
        key = (router or "dense", capacity, seed)
        if key in finished and not (out_dir / name / "result.json").exists():
            cells.append(finished[key])
        else:
            cells.append(run_cell(cfg, out_dir / name, minutes=minutes, datasets=datasets, progress=progress,
                                  label=router, capacity=capacity))
        results = {"command": command, "machine": bench.machine(), "started": started, "dataset": dataset,
                   "scale": scale or config_lib.default_scale(), "minutes_per_cell": minutes,
                   "overrides": {k: repr(v) for k, v in overrides.items()},
                   "routers": routers, "capacities": capacities, "seeds": list(seeds), "planned_cells": len(plan),
                   "wall_seconds": round(sum(c.get("wall_seconds", 0.0) for c in cells), 1),
                   "cells": cells, "summary": summarize(cells), "comparisons": claims(cells)}
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    return results


MARKERS = {"softmax_token_choice": "X", "sinkhorn_token_choice": "P", "svmoe": "p",
           "softmax_expert_choice": "s", "sinkhorn_expert_choice": "o",
           "sparsity_constrained_expert_choice": "^", "soft_moe": "*", "dense": "D",
           "sinkhorn_token_choice_plan_combine": "h"}
MECHANISMS = ("unprocessed", "dropped_routes", "experts_per_token", "load_cv", "processed_cv",
              "stability_top1", "stability_top2")


def _style(router):
    import matplotlib.pyplot as plt

    names = sorted(MARKERS)
    return dict(marker=MARKERS.get(router, "o"), color=plt.cm.tab10(names.index(router) % 10 if router in names else 0))


def mechanism_summary(cells: list[dict]) -> list[dict]:
    """Per (router, capacity): the mean over seeds (and MoE layers) of every mechanism of
    :func:`mini_moe.evaluate.mechanisms`, test accuracy, and ``batch_dependence``; ``None``
    where a mechanism does not apply (``dropped_routes`` outside Token Choice)."""
    groups: dict[tuple, list[dict]] = {}
    for cell in cells:
        if "mechanisms" in cell:
            groups.setdefault((cell["router"], cell["capacity"]), []).append(cell)
    rows = []
    for (router, capacity), members in sorted(groups.items(), key=lambda kv: (kv[0][0] != "dense", kv[0])):
        row = {"router": router, "capacity": capacity, "seeds": len(members),
               "test_accuracy": statistics.fmean(m["test_accuracy"] for m in members),
               "batch_dependence": statistics.fmean(m["mechanisms"]["batch_dependence"] for m in members)}
        for key in MECHANISMS:
            values = [layer[key] for m in members for layer in m["mechanisms"]["layers"] if layer[key] is not None]
            row[key] = statistics.fmean(values) if values else None
        rows.append(row)
    return rows


def ranking_agreement(cells: list[dict]) -> list[dict]:
    """How settled the ranking of the (router, capacity) cells is during training: for every
    evaluation step, Kendall's tau between the cells' test accuracies at that step and at the
    end of training, per seed, then the mean over seeds. Returns ``[{"step", "tau", "seeds"}]``."""
    from scipy import stats

    by_seed: dict[int, list[dict]] = {}
    for cell in cells:
        by_seed.setdefault(cell["seed"], []).append(cell)
    taus: dict[int, list[float]] = {}
    for members in by_seed.values():
        if len(members) < 3:
            continue
        final = [m["test_accuracy"] for m in members]
        for i, entry in enumerate(members[0]["eval"]):
            step_acc = [m["eval"][i]["test_accuracy"] for m in members if len(m["eval"]) > i]
            if len(step_acc) == len(final):
                taus.setdefault(entry["step"], []).append(float(stats.kendalltau(step_acc, final).statistic))
    return [{"step": step, "tau": statistics.fmean(v), "seeds": len(v)} for step, v in sorted(taus.items())]


def plot_study(results: dict, *, cost: str = "train_seconds"):
    """Accuracy against training cost (paper 000, Figures 1-2): one marker per router and
    capacity, larger markers for larger capacity factors, error bars: standard error over seeds."""
    import matplotlib.pyplot as plt

    sizes = {0.5: 6, 1.0: 9, 2.0: 13}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, title in ((axes[0], "test_accuracy", "test accuracy (%)"),
                              (axes[1], "ten_shot_accuracy", "10-shot accuracy (%)")):
        for row in results["summary"]:
            n = max(row["seeds"], 1)
            ax.errorbar(row[cost], 100 * row[metric], yerr=100 * row[metric + "_std"] / math.sqrt(n),
                        markersize=sizes.get(row["capacity"], 9), linestyle="none", **_style(row["router"]),
                        label=row["router"] if row["capacity"] == 1.0 else None)
        ax.set_xlabel({"train_seconds": "training time (s)", "train_flops": "training FLOPs (XLA count)"}[cost])
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5), title="marker size: c")
    fig.tight_layout()
    return fig


def plot_capacity_sweep(results: dict, *, metrics=("test_accuracy", "unprocessed", "batch_dependence")):
    """One panel per metric against the capacity factor c (log scale), one line per router
    (mean over seeds); the dense ViT as a horizontal line where it applies."""
    import matplotlib.pyplot as plt

    rows = mechanism_summary(results["cells"])
    labels = {"test_accuracy": "test accuracy (%)", "unprocessed": "tokens no expert processes",
              "dropped_routes": "requested routes dropped", "experts_per_token": "experts per token",
              "load_cv": "load CV (top-1 choices)", "processed_cv": "load CV (processed)",
              "batch_dependence": "predictions that change with the group",
              "stability_top1": "top-1 match under augmentation"}
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        scale = 100 if metric == "test_accuracy" else 1
        for router in sorted({r["router"] for r in rows} - {"dense"}):
            pts = sorted((r["capacity"], r[metric]) for r in rows if r["router"] == router and r[metric] is not None)
            if pts:
                ax.plot([c for c, _ in pts], [scale * v for _, v in pts], label=router, **_style(router))
        dense = [r for r in rows if r["router"] == "dense"]
        if dense and metric in ("test_accuracy", "batch_dependence"):
            ax.axhline(scale * dense[0][metric], color="k", linestyle="--", linewidth=1, label="dense ViT")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["capacity"] for r in rows if r["router"] != "dense"}))
        ax.set_xticklabels([f"{c:g}" for c in ax.get_xticks()])
        ax.set_xlabel("capacity factor c")
        ax.set_title(labels.get(metric, metric), fontsize=10)
        ax.grid(alpha=0.3)
    axes[0, -1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    return fig


def plot_curves(results: dict, *, capacity: float = 1.0):
    """Test accuracy during training (each cell's ``eval`` history), mean over seeds, for every
    router at one capacity factor and the dense ViT."""
    import matplotlib.pyplot as plt

    curves: dict[str, dict[int, list[float]]] = {}
    for cell in results["cells"]:
        if cell["router"] == "dense" or cell["capacity"] == capacity:
            for entry in cell["eval"]:
                curves.setdefault(cell["router"], {}).setdefault(entry["step"], []).append(entry["test_accuracy"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for router, by_step in sorted(curves.items()):
        steps = sorted(by_step)
        ax.plot(steps, [100 * statistics.fmean(by_step[s]) for s in steps], label=router,
                linestyle="--" if router == "dense" else "-", **_style(router))
    ax.set_xlabel("training step")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"capacity factor c = {capacity:g}; mean over seeds", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig
