"""A health report for a trained MoE: is the routing balanced, are tokens dropped, is it stable?

``diagnose(model, images)`` measures, per MoE layer, what the questions practitioners ask about
their MoE runs come down to (load balance, drops, how many experts a token reaches, how sure the
router is, how large its logits are, whether it still changes, whether a prediction depends on
the other images of its routing group), gives every measurement a verdict against a stated
threshold (:data:`THRESHOLDS`), and a one-line hint for each warning. ``python -m mini_moe
diagnose RUN`` runs it on a folder written by ``train``, with the run's previous checkpoint for
the stability and the run's training configuration for the grouping.

The thresholds are rules of thumb for the book's scale (8 to 16 experts, capacity factor 1 to 2);
chapter 8's and 13's runs give reference values. A warning is a reason to look, not a proof of a
bug. Root causes come first: a layer whose load is collapsing also drops tokens, and only the
load warning is given (its hint names the drops).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from mini_moe import evaluate, routers
from mini_moe.validate import InputError

#: The health thresholds, ``{metric: (direction, threshold)}``. A "max" metric warns above its
#: threshold, a "min" one below.
THRESHOLDS = {
    "load_max_over_mean": ("max", 2.0),
    "dropped_tokens": ("max", 0.15),
    "router_entropy": ("max", 0.95),
    "router_logit_lse_sq": ("max", 100.0),
    "stability": ("min", 0.7),
    "batch_dependence": ("max", 0.02),
    "slot_sharpness": ("max", 0.9),
}

HINTS = {
    "load_max_over_mean": "one expert takes {value:.1f}x the mean share of first choices (and {dropped:.0%} of "
                          "tokens reach no expert): the router is collapsing; add or raise a balance loss "
                          "(aux_loss_weight), or use an allocation that balances (Expert Choice, Sinkhorn)",
    "dropped_tokens": "{value:.0%} of tokens reach no expert: raise the capacity factor, add a balance loss, "
                      "or use the dropless path (moe_path='dropless')",
    "router_entropy": "the router's distributions are nearly uniform ({value:.2f} of the maximum entropy): it "
                      "has not learned to route yet (too few steps, a frozen router, or a learning rate too low)",
    "router_logit_lse_sq": "router logits are large (mean logsumexp^2 = {value:.0f}): add the z-loss "
                           "(router option z_loss=1e-3) before they overflow in bfloat16",
    "stability": "only {value:.0%} of tokens keep their top-1 expert between the last two checkpoints: the "
                 "routing has not settled; train longer or lower the learning rate",
    "batch_dependence": "{value:.1%} of test predictions change when the test images are regrouped: a "
                        "capacity-limited router makes a prediction depend on its group; evaluate in the "
                        "training grouping, raise the capacity, or report the grouping with the accuracy",
    "slot_sharpness": "Soft MoE's slots each take almost one token ({value:.2f} of a slot's weight on its top "
                      "token): the learned scale is huge and Soft MoE has become a hard router",
    "bias_frozen": "the loss-free bias never moved although bias_rate = {value:g}: nothing updates it "
                   "(check that training runs the router in training mode)",
    "grouping": "evaluated in routing groups of {value} images, trained in groups of {trained}: Expert Choice "
                "and capacity-limited decisions depend on the group; evaluate with the training grouping",
}


@dataclasses.dataclass(frozen=True)
class Finding:
    """One warning: the layer (None for the model), the metric, its value and the hint."""

    layer: int | None
    metric: str
    value: float
    hint: str


def _probs_and_metrics(model, images, batch_size):
    """Per MoE layer: router distributions ``[N, P, E]``, Soft MoE slot sharpness, and the mean of
    the router's scalar metrics."""
    probs, sharp, metrics, batches = None, None, None, 0
    with evaluate.eval_mode(model):
        for batch, n in evaluate._padded_batches(model, images, batch_size):
            out = evaluate._forward(model, batch, return_routing=True)
            layer_probs = [np.asarray(p[:n]) for p in out.probs]
            layer_sharp = []
            for rt in out.routings:
                if rt.sparse:
                    layer_sharp.append(None)
                else:  # Soft MoE: the dispatch weights of a slot sum to 1 over the tokens of its image
                    d = np.asarray(rt.dispatch, np.float64)[: max(1, n)]  # [images, T, E, S]
                    layer_sharp.append(float(d.max(axis=1).mean()))
            scalars = [{k: float(v) for k, v in m.items() if np.ndim(v) == 0} for m in out.metrics]
            probs = layer_probs if probs is None else [np.concatenate([a, b]) for a, b in zip(probs, layer_probs)]
            sharp = [[s] for s in layer_sharp] if sharp is None else [a + [s] for a, s in zip(sharp, layer_sharp)]
            metrics = scalars if metrics is None else [{k: a[k] + m[k] for k in a} for a, m in zip(metrics, scalars)]
            batches += 1
    sharp = [None if s[0] is None else float(np.mean(s)) for s in sharp]
    metrics = [{k: v / batches for k, v in m.items()} for m in metrics]
    return probs, sharp, metrics


def diagnose(model, images: np.ndarray, *, previous=None, trained_group_images: int | None = None, seed: int = 0,
             batch_size: int = 400) -> dict:
    """The health report of ``model`` on ``images`` ``[N, H, W, C]``.

    Args:
      model: a :class:`~mini_moe.model.VisionMoE` with at least one MoE layer.
      images: test images (a few thousand are plenty).
      previous: the same model at an earlier checkpoint, for ``stability`` (else it is None).
      trained_group_images: the routing group size the model was trained with, to warn when it
        is evaluated in other groups.
      seed: the order of the regrouped test set for ``batch_dependence``.

    Returns ``{"layers": [per MoE layer: metrics], "batch_dependence": float, "findings":
    [Finding, ...]}``. Per layer: ``load_cv`` and ``load_max_over_mean`` (top-1 choices per
    expert, before capacity), ``dropped_picks`` (Token Choice: picks that found no room) and
    ``dropped_tokens`` (tokens no expert processes), ``experts_per_token``, ``router_entropy``
    (mean entropy of the router's distribution over ``log E``), ``router_logit_lse_sq`` (the mean
    squared logsumexp of the logits, what the z-loss penalises; softmax routers only),
    ``stability`` (share of tokens whose top-1 expert is the same under ``previous``),
    ``bias_spread`` (loss-free routers) and ``slot_sharpness`` (Soft MoE: the mean over slots of
    the largest dispatch weight, 1 when each slot takes a single token).
    """
    cfg = model.cfg
    layers_cfg = [block.mlp.router for block in model.blocks if block.use_moe]
    if not layers_cfg:
        raise InputError("diagnose needs a model with MoE layers; this one is dense (router=None).")
    images = np.asarray(images)
    preds, routing = evaluate.predictions_and_routing(model, images, batch_size=batch_size)
    order = np.random.default_rng(seed).permutation(len(images))
    regrouped = np.empty_like(preds)
    regrouped[order] = evaluate.predictions_and_routing(model, images[order], batch_size=batch_size)[0]
    probs, sharpness, metrics = _probs_and_metrics(model, images, batch_size)
    before = None if previous is None else evaluate.predictions_and_routing(previous, images, batch_size=batch_size)[1]
    layers, findings = [], []
    experts = cfg.routed_experts
    for i, ((hits, top1), router, p, sharp, m) in enumerate(zip(routing, layers_cfg, probs, sharpness, metrics)):
        per_token = hits.sum(-1)
        k = getattr(router.allocation, "k", None)
        soft = sharp is not None  # Soft MoE: every expert processes every image's slots, no top-1 load
        load = np.bincount(top1.ravel(), minlength=experts).astype(float)
        entropy = -np.sum(p * np.log(np.clip(p, 1e-12, None)), -1).mean() / math.log(experts)
        row = {
            "load_cv": None if soft else float(load.std() / load.mean()),
            "load_max_over_mean": None if soft else float(load.max() / load.mean()),
            "dropped_picks": None if k is None or sharp is not None else float(1 - per_token.mean() / k),
            "dropped_tokens": 0.0 if sharp is not None else float(np.mean(per_token == 0)),
            "experts_per_token": float(experts if sharp is not None else per_token.mean()),
            "router_entropy": float(entropy),
            "router_logit_lse_sq": m.get("z_loss"),
            "stability": None if before is None else float(np.mean(before[i][1] == top1)),
            "bias_spread": m.get("bias_spread"),
            "slot_sharpness": sharp,
        }
        layers.append(row)
        warned = set()
        # the entropy verdict is for softmax distributions (a sigmoid router's normalised scores, a
        # hash router's or Soft MoE's summed combine weights are not one)
        softmax = isinstance(router.affinity, (routers.Softmax, routers.NoisySoftmax))
        for metric, (direction, threshold) in THRESHOLDS.items():
            value = row.get(metric)
            if value is None or (metric == "dropped_tokens" and "load_max_over_mean" in warned) \
                    or (metric == "router_entropy" and not softmax):
                continue
            if (value > threshold) if direction == "max" else (value < threshold):
                warned.add(metric)
                findings.append(Finding(i, metric, value, HINTS[metric].format(value=value,
                                                                                dropped=row["dropped_tokens"])))
        affinity = router.affinity
        if isinstance(affinity, routers.SigmoidGates) and affinity.bias_rate > 0 and row["bias_spread"] == 0:
            findings.append(Finding(i, "bias_frozen", affinity.bias_rate, HINTS["bias_frozen"].format(
                value=affinity.bias_rate)))
    batch_dependence = float(np.mean(preds != regrouped))
    drops_explained = any(f.metric in ("load_max_over_mean", "dropped_tokens") for f in findings)
    if batch_dependence > THRESHOLDS["batch_dependence"][1] and not drops_explained:  # else a consequence
        findings.append(Finding(None, "batch_dependence", batch_dependence,
                                HINTS["batch_dependence"].format(value=batch_dependence)))
    if (trained_group_images is not None and not routers.per_image(cfg.router)
            and cfg.group_images != trained_group_images):
        findings.append(Finding(None, "grouping", cfg.group_images, HINTS["grouping"].format(
            value=cfg.group_images, trained=trained_group_images)))
    return {"layers": layers, "batch_dependence": batch_dependence, "findings": findings}


def diagnose_run(run_dir, *, images: int = 2000) -> dict:
    """:func:`diagnose` on a folder written by ``train``: its last checkpoint on the first
    ``images`` test images, the checkpoint before it for ``stability``, and its training
    grouping. Adds ``"run"``, ``"step"`` and ``"previous_step"``."""
    import pathlib

    from mini_moe import train

    run_dir = pathlib.Path(run_dir)
    if not (run_dir / "config.json").exists() or not (run_dir / "checkpoints").is_dir():
        raise InputError(f"{run_dir} is not a training run: it needs config.json and checkpoints/ "
                         "(a folder written by 'python -m mini_moe train').")
    model, cfg = train.load_trained(run_dir)
    if cfg.model.router is None:
        raise InputError(f"{run_dir} holds a dense model (router=None): there is no routing to diagnose.")
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    previous = None
    if len(steps) > 1:
        previous = train.make_model(cfg)
        manager = train._manager(run_dir)
        train.restore_checkpoint(manager, previous, train.make_optimizer(previous, cfg), steps[-2])
    _, test = train.load_data(cfg)
    report = diagnose(model, test.images[:images], previous=previous, trained_group_images=cfg.model.group_images)
    return {"run": str(run_dir), "step": steps[-1] if steps else None,
            "previous_step": steps[-2] if len(steps) > 1 else None, **report}


def format_report(report: dict) -> str:
    """The report as a table: one row per metric, one column per MoE layer, then the warnings."""
    layers = report["layers"]
    names = [k for k in layers[0]]
    lines = [f"{'metric':22s}" + "".join(f"{'layer ' + str(i):>12s}" for i in range(len(layers)))]
    for name in names:
        cells = ["-" if layer[name] is None else f"{layer[name]:.3f}" for layer in layers]
        lines.append(f"{name:22s}" + "".join(f"{c:>12s}" for c in cells))
    lines.append(f"{'batch_dependence':22s}{report['batch_dependence']:>12.3f}")
    findings = report["findings"]
    lines.append("")
    lines.append("no warnings" if not findings else f"{len(findings)} warning(s):")
    for f in findings:
        where = "model" if f.layer is None else f"layer {f.layer}"
        lines.append(f"  warn  {where}: {f.metric}: {f.hint}")
    return "\n".join(lines)


def plot_report(report: dict):
    """A one-page dashboard of the report: one panel per thresholded metric, a bar per MoE layer,
    the threshold as a dashed line, warnings in orange. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    names = [m for m in THRESHOLDS if m != "batch_dependence"]
    fig, axes = plt.subplots(2, 4, figsize=(13, 5.5))
    layers = report["layers"]
    for ax, name in zip(axes.flat, names + ["batch_dependence"]):
        values = [report["batch_dependence"]] if name == "batch_dependence" else [l[name] for l in layers]
        labels = ["model"] if name == "batch_dependence" else [f"layer {i}" for i in range(len(layers))]
        direction, threshold = THRESHOLDS[name]
        shown = [np.nan if v is None else v for v in values]
        bad = [v is not None and ((v > threshold) if direction == "max" else (v < threshold)) for v in values]
        ax.bar(labels, shown, color=["#e69f00" if b else "#0072b2" for b in bad])  # colour-blind-safe pair
        ax.axhline(threshold, color="black", linestyle="--", linewidth=1)
        ax.set_title(name, fontsize=10)
    axes.flat[-1].axis("off")
    count = len(report["findings"])
    fig.suptitle(f"{report.get('run', 'MoE')}: {'no warnings' if not count else f'{count} warning(s)'}", fontsize=11)
    fig.tight_layout()
    return fig
