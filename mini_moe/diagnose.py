"""A health report for a trained MoE: is the routing balanced, are tokens dropped, is it stable?

``diagnose(model, images)`` measures, per MoE layer, what the questions practitioners ask about
their MoE runs come down to (load balance, drops, how many experts a token reaches, how sure the
router is, how large its logits are, whether it still changes, whether a prediction depends on
the other images of its routing group), gives every measurement a verdict against a threshold
and a one-line hint for each warning. ``python -m mini_moe diagnose RUN`` runs it on a folder
written by ``train``, with the run's previous checkpoint for the stability and the run's training
configuration for the grouping; a damaged folder is a one-line :class:`~mini_moe.validate.InputError` naming the file.

The thresholds depend on the router's family (:func:`thresholds`): Expert Choice leaves tokens
unpicked by design, a dropless layer or Soft MoE cannot make a prediction depend on its group, a
ReLU router (ReMoE) sends a token to as many experts as it has positive gates. They are
calibrated on the book's reference runs (:data:`REFERENCES`), none of which warns; the report
prints, beside each threshold, the range those runs measured and their margin to it.

A warning is a reason to look, not a proof of a bug. Root causes come first: weights that are not
finite are the only verdict while they last, and a layer whose load is collapsing also drops
tokens, but only the load warning is given (its hint names the drops). Metrics come from
:func:`mini_moe.evaluate.routing_record` and :func:`mini_moe.evaluate.routing_summary`, the ones
:func:`mini_moe.evaluate.mechanisms` reports.

Why one module of some 700 lines: each check, its threshold, its verdict and its hint are
read side by side, so that a threshold and the sentence that explains it cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np
from flax import nnx

from mini_moe import evaluate, modes, routers
from mini_moe.runs import tree_key
from mini_moe.validate import InputError

#: The default thresholds, ``{metric: (direction, threshold)}``: a "max" metric warns above its
#: threshold, a "min" one below. They are those of capacity-limited Token Choice;
#: :func:`thresholds` adapts them to the model's router family.
THRESHOLDS = {
    "load_max_over_mean": ("max", 2.5),
    "dropped_tokens": ("max", 0.30),
    "router_entropy": ("max", 0.98),
    "router_logit_lse_sq": ("max", 100.0),
    "stability": ("min", 0.7),
    "batch_dependence": ("max", 0.15),
    "slot_sharpness": ("max", 0.9),
}

#: The most batch dependence allowed to a model that drops nothing (Soft MoE, the dropless path), whose own is 0.
NO_DROP_BATCH_DEPENDENCE = 0.005

#: What the book's reference runs measure, per router family (:func:`family`): per metric the
#: ``(low, high)`` range over their MoE layers and runs, and ``"runs"``, which runs they are:
#: chapter 8's confirmatory cells (10 seeds each, 10,000 test images; the metrics its committed
#: ``mechanisms`` hold) and the book's committed explorer models (one seed each, :func:`diagnose`
#: on the first 1,000 test images). ``tests/test_diagnose_reference.py`` recomputes them.
REFERENCES = {
    "token k=1 c=1": {
        "runs": "20 confirmatory cells of chapter 8; explorer: fashion_mnist-token_choice, patch_vote-token_choice",
        "dropped_tokens": (0.042, 0.212), "dropped_picks": (0.042, 0.213), "experts_per_token": (0.787, 0.958),
        "load_cv": (0.035, 0.24), "load_max_over_mean": (1.074, 1.159), "router_entropy": (0.416, 0.949),
        "router_logit_lse_sq": (4.551, 21.24), "batch_dependence": (0.012, 0.088),
    },
    "token k=2 c=2": {
        "runs": "explorer: patch_vote-loss_free_k2, patch_vote-token_choice_k2",
        "dropped_tokens": (0, 0.013), "dropped_picks": (0.061, 0.185), "experts_per_token": (1.629, 1.877),
        "load_cv": (0.074, 0.408), "load_max_over_mean": (1.146, 1.834), "router_entropy": (0.344, 0.924),
        "router_logit_lse_sq": (12.184, 27.535), "bias_spread": (0.024, 0.202), "batch_dependence": (0.016, 0.047),
    },
    "relu dropless": {
        "runs": "explorer: patch_vote-remoe",
        "dropped_tokens": (0.216, 0.505), "dropped_picks": (0, 0), "experts_per_token": (0.568, 1.421),
        "load_cv": (0.638, 1.31), "load_max_over_mean": (2.661, 4.444), "router_entropy": (0.356, 0.521),
        "batch_dependence": (0, 0),
    },
    "null k=4 dropless": {
        "runs": "explorer: fashion_mnist-longcat",
        "dropped_tokens": (0.05, 0.072), "dropped_picks": (0, 0), "experts_per_token": (2.006, 2.023),
        "load_cv": (0.349, 0.517), "load_max_over_mean": (1.526, 1.802), "router_entropy": (0.505, 0.819),
        "bias_spread": (0.056, 0.059), "batch_dependence": (0, 0),
    },
    "expert c=1": {
        "runs": "10 confirmatory cells of chapter 8; explorer: fashion_mnist-expert_choice, patch_vote-expert_choice",
        "dropped_tokens": (0.077, 0.224), "experts_per_token": (1, 1), "load_cv": (0.062, 0.633),
        "load_max_over_mean": (1.454, 2.473), "router_entropy": (0.405, 0.631), "batch_dependence": (0.014, 0.056),
    },
    "expert c=0.5": {
        "runs": "10 confirmatory cells of chapter 8",
        "dropped_tokens": (0.5, 0.512), "experts_per_token": (0.5, 0.5), "load_cv": (0.082, 0.404),
        "batch_dependence": (0.086, 0.098),
    },
    "soft": {
        "runs": "10 confirmatory cells of chapter 8; explorer: fashion_mnist-soft_moe, patch_vote-soft_moe",
        "dropped_tokens": (0, 0), "experts_per_token": (8, 8), "load_cv": (0.132, 0.486),
        "router_entropy": (0.973, 0.989), "slot_sharpness": (0.073, 0.115), "batch_dependence": (0, 0),
    },
}


@dataclasses.dataclass(frozen=True)
class Finding:
    """One warning: the MoE layer (None for the model), the metric, its value and the hint."""

    layer: int | None
    metric: str
    value: float
    hint: str


def _tokens_per_group(model) -> int:
    return model.cfg.num_patches * modes.group_images(model)


def _fact(affinity, name: str, default):
    """What ``affinity`` declares about itself (:class:`~mini_moe.routers.Affinity`'s class
    attributes), or ``default`` for an affinity that does not derive from it."""
    return getattr(affinity, name, default)


def _capacity_limited(model) -> bool:
    """True when a token's routing can depend on the other tokens of its group: a sparse
    allocation whose buffers hold fewer than the group's T tokens, off the dropless path."""
    layer = modes.moe_layers(model)[0]
    allocation, tokens = layer.router.allocation, _tokens_per_group(model)
    if allocation.per_image or layer.path == "dropless":
        return False
    return allocation.budget(tokens, layer.router.num_experts).capacity < tokens  # the router's columns


def family(model) -> str:
    """The router family that decides which thresholds apply and which reference runs compare:
    ``"token k=K c=C"``, ``"token k=K dropless"``, ``"relu c=C"`` / ``"relu dropless"`` (ReMoE),
    ``"top-p c=C"`` / ``"top-p dropless"``, ``"null k=K ..."`` (null experts in the choice set),
    ``"expert c=C"`` or ``"soft"``."""
    layer = modes.moe_layers(model)[0]
    allocation = layer.router.allocation
    if allocation.name == "token":
        name = f"null k={allocation.k}" if allocation.null_experts else f"token k={allocation.k}"
        if allocation.min_score is not None:  # a number of picks that varies from token to token
            name = _fact(layer.router.affinity, "pick_rule", None) or "variable"
        return f"{name} dropless" if layer.path == "dropless" else f"{name} c={allocation.capacity_factor:g}"
    if allocation.name == "expert":
        return f"expert c={allocation.capacity_factor:g}"
    return "soft"


def _forced_unpicked(model) -> float:
    """The share of tokens that no expert can take because E buffers of C slots hold fewer than
    the group's T tokens: ``max(0, 1 - E C / T)``."""
    tokens, experts = _tokens_per_group(model), model.cfg.routed_experts
    router = modes.moe_layers(model)[0].router
    capacity = router.allocation.budget(tokens, router.num_experts).capacity  # per real expert
    return max(0.0, 1 - experts * capacity / tokens)


def thresholds(model) -> dict:
    """``{metric: (direction, threshold)}`` for ``model``'s router family (:func:`family`):

    * ``load_max_over_mean`` (top-1 choices before capacity): Token Choice with a fixed k only;
      Expert Choice and Soft MoE balance by construction, a router whose number of picks varies
      (ReMoE, top-p: ``min_score`` set; "relu" below) has no fixed-k routing to measure it on;
    * ``dropped_tokens``: capacity-limited Token Choice, fixed (a dropped token wanted an
      expert); Expert Choice leaves tokens unpicked by design, so its threshold starts from the
      share its capacity forces (``_forced_unpicked``); none where nothing can drop, nor for
      a ReLU router, whose tokens with no positive gate chose no expert;
    * ``dropped_picks``: a capacity-limited ReLU router instead (the picks its buffers refused);
    * ``batch_dependence``: capacity-limited models; :data:`NO_DROP_BATCH_DEPENDENCE` for a model
      that drops nothing, where it should be 0;
    * ``router_entropy``: softmax affinities only (the other routers' distributions are not one);
    * ``router_logit_lse_sq``: routers with the ``z_loss`` option; ``slot_sharpness``: Soft MoE.
    """
    layer = modes.moe_layers(model)[0]
    allocation, affinity = layer.router.allocation, layer.router.affinity
    out = dict(THRESHOLDS)
    limited = _capacity_limited(model)
    token = allocation.name == "token"
    relu = token and allocation.min_score is not None
    if not token or relu:
        del out["load_max_over_mean"]
    if not limited or relu:
        del out["dropped_tokens"]
    elif allocation.name == "expert":
        out["dropped_tokens"] = ("max", round(_forced_unpicked(model) + THRESHOLDS["dropped_tokens"][1], 3))
    if relu and limited:
        out["dropped_picks"] = ("max", THRESHOLDS["dropped_tokens"][1])
    if not limited:
        out["batch_dependence"] = ("max", NO_DROP_BATCH_DEPENDENCE)
    if not _fact(affinity, "softmax_choice", False):
        del out["router_entropy"]
    if "z_loss" not in _options(model):  # the metric exists where the fix does
        del out["router_logit_lse_sq"]
    if not allocation.per_image:
        del out["slot_sharpness"]
    return out


def _options(model) -> set[str]:
    """The options the model's registered router takes (``z_loss``, ``balance_loss``, ...)."""
    return set(routers.spec(model.cfg.router).options)


def _fixes(model, problem: str) -> str:
    """The fixes that apply to ``model``'s router for ``problem`` (``"balance"`` or ``"drops"``),
    as a hint's ending; never one its router does not have."""
    layer = modes.moe_layers(model)[0]
    allocation, affinity = layer.router.allocation, layer.router.affinity
    token = allocation.name == "token"
    knob = _fact(affinity, "balance_knob", None)
    options, fixes = _options(model), []
    if problem == "drops" and _capacity_limited(model):
        fixes.append("raise the capacity factor (router option capacity_factor)")
    if knob == "balance_loss" and "balance_loss" in options:
        fixes.append("add a balance loss (router option balance_loss='switch')" if affinity.balance_loss == "none"
                     else "raise the balance loss's weight (aux_loss_weight)")
    if knob == "bias_rate" and "bias_rate" in options:
        fixes.append("raise the loss-free bias rate (router option bias_rate)" if affinity.bias_rate > 0
                     else "turn on the loss-free bias (router option bias_rate=1e-3)")
    learned = _fact(affinity, "learned", True) and not _fact(affinity, "balances_group", False)
    if problem == "balance" and token and learned:  # a plan balances already, a hash router learns nothing
        fixes.append("use an allocation that balances by construction (Expert Choice, Sinkhorn)")
    if problem == "drops" and token and layer.path != "dropless":
        fixes.append("use the dropless path (moe_path='dropless')")
    return "; " + ", or ".join(fixes) if fixes else ""


def _hint(model, metric: str, value: float, row: dict) -> str:
    """The one-line hint of a warning about ``metric`` at ``value`` (``row``: its layer's metrics)."""
    if metric == "load_max_over_mean":
        return (f"one expert takes {value:.1f}x the mean share of first choices (and {row['dropped_tokens']:.0%} of "
                f"tokens reach no expert): the router is collapsing" + _fixes(model, "balance"))
    if metric == "dropped_tokens" and modes.moe_layers(model)[0].router.allocation.name == "expert":
        return (f"{value:.0%} of tokens reach no expert, more than the {_forced_unpicked(model):.0%} its capacity "
                "leaves no room for: the experts pick the same tokens; raise the capacity factor (router option "
                "capacity_factor), or give the router more training")
    if metric == "dropped_tokens":
        return f"{value:.0%} of tokens reach no expert" + _fixes(model, "drops")
    if metric == "dropped_picks":
        return (f"{value:.0%} of the picks the ReLU router made find a full buffer; raise the capacity factor "
                "(router option capacity_factor), or use the dropless path (moe_path='dropless') that ReMoE is "
                "meant for")
    if metric == "batch_dependence" and not _capacity_limited(model):
        return (f"{value:.1%} of test predictions change when the test images are regrouped, although this model "
                "drops nothing and should not depend on its group: something mixes the images of a batch")
    return {
        "router_entropy": f"the router's distributions are nearly uniform ({value:.2f} of the maximum entropy): it "
                          "has not learned to route yet (too few steps, a frozen router, or a learning rate too low)",
        "router_logit_lse_sq": f"router logits are large (mean logsumexp^2 = {value:.0f}): add the z-loss (router "
                               "option z_loss=0.1, ST-MoE's 1e-3 beside a 1e-2 balance loss) before they overflow "
                               "in bfloat16",
        "stability": f"only {value:.0%} of tokens keep their top-1 expert between the last two checkpoints: the "
                     "routing has not settled; train longer or lower the learning rate",
        "batch_dependence": f"{value:.1%} of test predictions change when the test images are regrouped: a "
                            "capacity-limited router makes a prediction depend on its group; evaluate in the "
                            "training grouping, raise the capacity, or report the grouping with the accuracy",
        "slot_sharpness": f"Soft MoE's slots each take almost one token ({value:.2f} of a slot's weight on its top "
                          "token): the learned scale is huge and Soft MoE has become a hard router",
    }[metric]


def _non_finite_weights(model) -> list[tuple[str, int, int]]:
    """``(path, non-finite count, size)`` of every floating-point array of ``model`` that holds a
    NaN or an infinity (parameters and state such as the loss-free bias)."""
    import jax

    bad = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Not(nnx.RngState)))[0]:
        value = np.asarray(leaf)
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            name = ".".join(tree_key(k) for k in path).removesuffix(".value")
            bad.append((name, int((~np.isfinite(value)).sum()), int(value.size)))
    return bad


def _non_finite_findings(model, weights) -> list[Finding]:
    """One finding per MoE layer (or the model) whose weights are not all finite."""
    moe_blocks = [i for i, block in enumerate(model.blocks) if block.use_moe]
    grouped = {}
    for name, count, size in weights:
        parts = name.split(".")
        block = int(parts[1]) if parts[0] == "blocks" else None
        layer = moe_blocks.index(block) if block in moe_blocks and parts[2] == "mlp" else None
        grouped.setdefault(layer, []).append(f"{name} ({count} of {size} values)")
    return [Finding(layer, "non_finite", float(len(names)),
                    f"non-finite weights in {'the model' if layer is None else f'MoE layer {layer}'}: "
                    f"{', '.join(names)}; everything computed from them is meaningless: restore an earlier "
                    "checkpoint, and lower the learning rate or clip the gradients harder (grad_clip)")
            for layer, names in grouped.items()]


def _check_images(model, images) -> np.ndarray:
    cfg = model.cfg
    images = np.asarray(images)
    expected = (cfg.image_size, cfg.image_size, cfg.channels)
    if images.ndim != 4 or images.shape[1:] != expected or len(images) < 1:
        raise InputError(f"images must have shape [N >= 1, {', '.join(map(str, expected))}], got {images.shape}.")
    if not np.isfinite(images).all():
        raise InputError(f"images hold {int((~np.isfinite(images)).sum())} non-finite values (NaN or inf); "
                         "diagnose needs finite, normalised test images.")
    return images


def diagnose(model, images: np.ndarray, *, previous=None, trained_group_images: int | None = None, seed: int = 0,
             batch_size: int = 400) -> dict:
    """The health report of ``model`` on ``images`` ``[N, H, W, C]`` (finite; a few thousand are plenty).

    Args:
      model: a :class:`~mini_moe.model.VisionMoE` with at least one MoE layer.
      previous: the same model at an earlier checkpoint, for ``stability`` (else it is None).
      trained_group_images: the routing group size the model was trained with, to warn when it
        is evaluated in other groups.
      seed: the order of the regrouped test set for ``batch_dependence``.

    Returns ``{"family", "layers": [per MoE layer: metrics], "batch_dependence": float,
    "batch_invariant": {"invariant": bool, "why": str}, "thresholds": {metric: {"direction",
    "threshold", "reference", "reference_margin"}}, "reference_runs", "findings": [Finding, ...]}``;
    ``batch_invariant`` says whether the configuration, as it routes, makes a prediction depend on
    nothing but its image (:func:`mini_moe.modes.invariance`). Per layer: ``load_cv`` and
    ``load_max_over_mean`` (top-1 choices per expert, before capacity), ``dropped_picks`` (Token
    Choice: the picks made that found no room) and ``dropped_tokens`` (tokens no expert
    processes), ``experts_per_token``, ``router_entropy`` (mean entropy of the router's
    distribution over ``log E``), ``router_logit_lse_sq`` (the mean squared logsumexp of the
    logits, what the z-loss penalises; softmax Token Choice only), ``stability`` (share of tokens
    whose top-1 expert is the same under ``previous``), ``bias_spread`` (loss-free routers) and
    ``slot_sharpness`` (Soft MoE: the mean over slots of the largest dispatch weight, 1 when each
    slot takes a single token). A metric that does not apply is None; one that is not finite
    stays NaN here (:func:`to_json` writes it as null). ``reference`` is the ``(low, high)`` range
    of the family's reference runs (:data:`REFERENCES`), ``reference_margin`` their distance to
    the threshold (positive: none of them warns).
    """
    cfg = model.cfg
    modes.moe_layers(model)  # refuses a dense model
    images = _check_images(model, images)
    preds, record = evaluate.routing_record(model, images, batch_size=batch_size)
    dependence = evaluate.batch_dependence(model, images, regroupings=1, permutations=0, seed=seed,
                                           batch_size=batch_size, reference=preds)
    before = None if previous is None else evaluate.routing_record(previous, images, batch_size=batch_size)[1]
    layers = []
    for i, layer in enumerate(record):
        summary = evaluate.routing_summary(layer)
        soft = layer["slot_sharpness"] is not None  # every expert processes every image's slots: no top-1 load
        layers.append({
            "load_cv": None if soft else summary["load_cv"],
            "load_max_over_mean": None if soft else summary["load_max_over_mean"],
            "dropped_picks": summary["dropped_routes"],
            "dropped_tokens": summary["unprocessed"],
            "experts_per_token": summary["experts_per_token"],
            "router_entropy": float(layer["entropy"].mean() / math.log(cfg.routed_experts)),
            "router_logit_lse_sq": layer["scalars"].get("z_loss"),
            "stability": None if before is None else float(np.mean(before[i]["top1"] == layer["top1"])),
            "bias_spread": layer["scalars"].get("bias_spread"),
            "slot_sharpness": None if not soft else float(layer["slot_sharpness"].mean()),
        })
    batch_dependence = dependence["regroup"]["mean"]
    rules, name = thresholds(model), family(model)
    invariant, why = modes.invariance(model)
    return {"family": name, "layers": layers, "batch_dependence": batch_dependence,
            "batch_invariant": {"invariant": invariant, "why": why}, **_references(name, rules),
            "findings": _findings(model, layers, batch_dependence, rules, trained_group_images)}


def _references(name: str, rules: dict) -> dict:
    """The thresholds with the reference range of family ``name`` and its margin to each."""
    ref = REFERENCES.get(name, {})
    out = {}
    for metric, (direction, threshold) in rules.items():
        low_high = ref.get(metric)
        margin = None if low_high is None else round(threshold - low_high[1] if direction == "max"
                                                      else low_high[0] - threshold, 4)
        out[metric] = {"direction": direction, "threshold": threshold,
                       "reference": None if low_high is None else list(low_high), "reference_margin": margin}
    return {"thresholds": out, "reference_runs": ref.get("runs")}


def _findings(model, layers, batch_dependence, rules, trained_group_images) -> list[Finding]:
    """The warnings, root causes first: non-finite weights (the only verdict when the routing reads
    them), then per MoE layer non-finite metrics (which end the layers' checks) or the thresholds."""
    cfg = model.cfg
    bad_weights = _non_finite_weights(model)
    findings = _non_finite_findings(model, bad_weights)
    if any(not name.startswith(("head", "norm")) for name, _, _ in bad_weights):
        return findings  # the routing reads them: every routing metric is a consequence
    for i, (row, module) in enumerate(zip(layers, modes.moe_layers(model))):
        broken = sorted(k for k, v in row.items() if v is not None and not np.isfinite(v))
        if broken:
            z_loss = ", or add the z-loss (router option z_loss=0.1)" if "z_loss" in _options(model) else ""
            findings.append(Finding(i, "non_finite", float(len(broken)), f"non-finite metrics in MoE layer {i} "
                                    f"({', '.join(broken)}) although the weights are finite: the router's logits "
                                    f"overflow; lower the learning rate{z_loss}"))
            break  # the later layers read this one
        warned = set()
        for metric, (direction, threshold) in rules.items():
            value = row.get(metric)
            if value is None or (metric == "dropped_tokens" and "load_max_over_mean" in warned):
                continue
            if (value > threshold) if direction == "max" else (value < threshold):
                warned.add(metric)
                findings.append(Finding(i, metric, value, _hint(model, metric, value, row)))
        affinity = module.router.affinity
        if _fact(affinity, "bias_moves", False) and row["bias_spread"] == 0:
            findings.append(Finding(i, "bias_frozen", affinity.bias_rate, f"the loss-free bias never moved although "
                                    f"bias_rate = {affinity.bias_rate:g}: nothing updates it (check that training "
                                    "runs the router in training mode)"))
    explained = any(f.metric in ("load_max_over_mean", "dropped_tokens", "dropped_picks", "non_finite")
                    for f in findings)
    if batch_dependence > rules["batch_dependence"][1] and not explained:  # else a consequence
        findings.append(Finding(None, "batch_dependence", batch_dependence,
                                _hint(model, "batch_dependence", batch_dependence, {})))
    if (trained_group_images is not None and not routers.per_image(cfg.router)
            and cfg.group_images != trained_group_images):
        findings.append(Finding(None, "grouping", cfg.group_images, (
            f"evaluated in routing groups of {cfg.group_images} images, trained in groups of {trained_group_images}: "
            "Expert Choice and capacity-limited decisions depend on the group; evaluate with the training grouping")))
    return findings


# ------------------------------------------------------------------------- a run folder


def diagnose_run(run_dir, *, images: int = 2000) -> dict:
    """:func:`diagnose` on a folder written by ``train``: its last checkpoint on the first
    ``images`` test images, the checkpoint before it for ``stability``, and its training
    grouping. Adds ``"run"``, ``"step"``, ``"previous_step"`` and ``"notes"`` (e.g. a previous
    checkpoint that could not be read). The folder is read by :func:`mini_moe.train.load_trained`:
    a damaged one raises :class:`~mini_moe.validate.InputError` naming the file."""
    from mini_moe import runs, train

    run_dir = pathlib.Path(run_dir)
    if images < 1:
        raise InputError(f"images must be >= 1, got {images}.")
    if not (run_dir / runs.CONFIG).exists() or not (run_dir / runs.CHECKPOINTS).is_dir():
        raise InputError(f"{run_dir} is not a training run: it needs config.json and checkpoints/ "
                         "(a folder written by 'python -m mini_moe train').")
    model, cfg = train.load_trained(run_dir)
    if cfg.model.router is None:
        raise InputError(f"{run_dir} holds a dense model (router=None): there is no routing to diagnose.")
    steps = runs.kept_steps(run_dir)
    previous, notes = None, []
    if len(steps) > 1:
        try:
            previous, _ = train.load_trained(run_dir, steps[-2])
        except InputError as e:
            notes.append(f"no stability: {e}")
    _, test = train.load_data(cfg)
    report = diagnose(model, test.images[:images], previous=previous, trained_group_images=cfg.model.group_images)
    return {"run": str(run_dir), "step": steps[-1], "previous_step": steps[-2] if previous is not None else None,
            "notes": notes, **report}


# ------------------------------------------------------------------------- output


def to_json(report: dict) -> str:
    """The report as one line of standard JSON: findings as objects, and every NaN or infinity
    as null, its place listed under ``"non_finite"`` (e.g. ``"layers[0].router_entropy"``)."""
    non_finite = []

    def clean(value, where):
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        if isinstance(value, dict):
            return {k: clean(v, f"{where}.{k}" if where else k) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, (float, np.floating)) and not np.isfinite(value):
            non_finite.append(where)
            return None
        return value.item() if isinstance(value, np.generic) else value

    cleaned = clean(report, "")
    return json.dumps({**cleaned, "non_finite": non_finite}, allow_nan=False)


def _cell(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_report(report: dict) -> str:
    """The report as a table: one row per metric, one column per MoE layer, then the threshold,
    the range of the family's reference runs and their margin to the threshold, then the warnings."""
    layers, rules = report["layers"], report["thresholds"]
    sign = {"max": "<=", "min": ">="}
    lines = [f"{'metric':22s}" + "".join(f"{'layer ' + str(i):>10s}" for i in range(len(layers)))
             + f"  {'healthy':>10s}  {'reference':>13s}  {'margin':>7s}"]

    def rule_cells(name):
        rule = rules.get(name)
        if rule is None:
            return ""
        ref = "-" if rule["reference"] is None else "{:.3f}-{:.3f}".format(*rule["reference"])
        margin = "-" if rule["reference_margin"] is None else f"{rule['reference_margin']:.3f}"
        return f"  {sign[rule['direction']] + ' ' + format(rule['threshold'], 'g'):>10s}  {ref:>13s}  {margin:>7s}"

    for name in layers[0]:
        cells = "".join(f"{_cell(layer[name]):>10s}" for layer in layers)
        lines.append(f"{name:22s}{cells}" + rule_cells(name))
    lines.append(f"{'batch_dependence':22s}{_cell(report['batch_dependence']):>10s}"
                 + " " * 10 * (len(layers) - 1) + rule_cells("batch_dependence"))
    if "batch_invariant" in report:
        inv = report["batch_invariant"]
        lines.append(f"batch-invariant configuration: {'yes' if inv['invariant'] else 'no'} ({inv['why']})")
    runs = report.get("reference_runs") or "none of this family"
    lines.append(f"router family: {report['family']}; reference runs: {runs}")
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    findings = report["findings"]
    lines.append("")
    lines.append("no warnings" if not findings else f"{len(findings)} warning(s):")
    for f in findings:
        where = "model" if f.layer is None else f"layer {f.layer}"
        lines.append(f"  warn  {where}: {f.metric}: {f.hint}")
    return "\n".join(lines)


def plot_report(report: dict):
    """A one-page dashboard of the report: one panel per thresholded metric, a bar per MoE layer,
    the threshold as a dashed line and the reference range as a grey band, warnings in orange.
    Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    rules = report["thresholds"]
    names = [m for m in rules if m != "batch_dependence"] + ["batch_dependence"]
    fig, axes = plt.subplots(2, 4, figsize=(13, 5.5))
    layers = report["layers"]
    warned = {(f.layer, f.metric) for f in report["findings"]}
    for ax, name in zip(axes.flat, names):
        model_level = name == "batch_dependence"
        values = [report["batch_dependence"]] if model_level else [layer[name] for layer in layers]
        labels = ["model"] if model_level else [f"layer {i}" for i in range(len(layers))]
        shown = [np.nan if v is None else v for v in values]
        bad = [(None if model_level else i, name) in warned for i in range(len(values))]
        ax.bar(labels, shown, color=["#e69f00" if b else "#0072b2" for b in bad])  # colour-blind-safe pair
        ax.axhline(rules[name]["threshold"], color="black", linestyle="--", linewidth=1)
        if rules[name]["reference"] is not None:
            ax.axhspan(*rules[name]["reference"], color="0.85", zorder=0)
        ax.set_title(name, fontsize=10)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    count = len(report["findings"])
    fig.suptitle(f"{report.get('run', 'MoE')} ({report['family']}): "
                 f"{'no warnings' if not count else f'{count} warning(s)'}", fontsize=11)
    fig.tight_layout()
    return fig
