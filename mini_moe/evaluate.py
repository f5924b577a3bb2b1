"""Evaluation: accuracy, the 10-shot linear probe, and what the routers learned.

* :func:`few_shot_accuracy` — paper 000 Sec. 3.3: frozen features, closed-form ridge
  regression onto one-hot labels from ``shots`` training images per class.
* :func:`router_report` — per MoE layer over a dataset: tokens per expert, dropped
  tokens, experts per token, buffer fill, and router confidence (mean top-1, top-2 and
  the rest of each patch's expert distribution; paper 004 Table 5).
* :func:`correspondence_matrices` — paper 004's matrix S of eq. (3), per MoE layer.
* :func:`routing_stability` — paper 004 Table 4: two augmented views of each image,
  corresponding patches, and how often their top-1 / top-2 / unordered top-2 experts match.
* :func:`mechanisms` — what decides accuracy between routers: dropped and unprocessed tokens,
  experts per token, load balance, batch dependence and routing stability, per MoE layer.
* :func:`routing_record` and :func:`routing_summary` — one pass's per-image routing record and
  what it says per MoE layer: the one home of the metrics :func:`mechanisms` and
  :mod:`mini_moe.diagnose` report.
* :func:`perturbation_path` — paper 004 Figure 1: an image moved along a path of growing noise,
  its class probabilities and the steps where its routing changes.
* :func:`group_routing` — the routing tensors ``[T, E, C]`` of one routing group of a trained model.
* :func:`dispatch_mass` — how much of each patch reaches the experts (Soft MoE's "soft dropping").
* :func:`group_dependence` — one router and MoE layer: how often an image's tokens get a
  different layer output when the other images of its routing group change.
* :func:`expert_maps` and :func:`plot_expert_maps` — which expert each patch went to.
* :func:`forward_batches` — the one evaluation loop every function here runs (batches of whole
  routing groups, the last padded, eval mode); :func:`predictions` and :func:`batch_dependence`
  — predicted classes in a given order, and how many change when the images are regrouped.

All functions run the model in eval mode (no router noise) and leave every module in the
mode they found it in (train, eval, or a mix). The modes that run a model differently (dropless,
another capacity, per-image groups, ...) are in :mod:`mini_moe.modes`; ``accuracy(...,
dropless=True)`` evaluates with no pick dropped.

Why one module of some 800 lines: every measurement of a trained model goes through one
evaluation loop (:func:`forward_batches`) and one definition of a patch's main expert; a second
module would need a second copy of either.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mini_moe import augment
from mini_moe import layer, modes, parallel, stats
from mini_moe import losses as losses_lib
from mini_moe import routing as routing_lib
from mini_moe.validate import InputError, check_int, moved_names

Array = Any


@nnx.jit(static_argnames=("return_routing", "mesh"))
def _forward(model, images, return_routing=False, mesh=None):
    return model(images, return_routing=return_routing, mesh=mesh)


def forward_batches(model, images: np.ndarray, *, batch_size: int = 400, routing: bool = False):
    """The one evaluation loop: ``images [N, H, W, C]`` in their order, in batches of
    ``batch_size`` images (rounded down to whole routing groups, times the number of devices for
    a sharded model), the last padded with copies of its own images, each run in eval mode.

    Yields ``(output, n)``: the model's :class:`~mini_moe.model.ModelOutput` for the batch (with
    every MoE layer's routing tensors and picks when ``routing=True``) and how many of its images
    are real, its first ``n``: slice per-image fields with ``[:n]``, and weigh a batch's metrics
    (means over the whole batch, copies included) by ``n``.
    """
    mesh = parallel.model_mesh(model)
    with modes.eval_mode(model):
        for chunk, n in _padded_chunks(model, images, batch_size):
            batch = jnp.asarray(chunk) if mesh is None else jax.device_put(chunk, parallel.batch_sharding(mesh))
            yield _forward(model, batch, return_routing=routing, mesh=mesh), n


def _padded_chunks(model, images: np.ndarray, batch_size: int):
    """:func:`forward_batches`' batches as NumPy arrays ``(chunk, n)``: ``batch_size`` rounded
    down to whole routing groups as the model routes now (:func:`mini_moe.modes.group_images`: any
    size in a per-image mode), times the devices of a sharded model; the last padded with copies
    of its own images."""
    images = np.asarray(images)
    mesh = parallel.model_mesh(model)
    group = modes.group_images(model) * (1 if mesh is None else mesh.size)
    size = max(group, batch_size - batch_size % group)
    for start in range(0, len(images), size):
        chunk = images[start:start + size]
        n = len(chunk)
        if n < size:
            chunk = np.concatenate([chunk, np.resize(chunk, (size - n,) + chunk.shape[1:])])
        yield chunk, n


def _collect(model, images, field, batch_size):
    """One field of every real image's output (``logits``, ``features``), concatenated."""
    return np.concatenate([np.asarray(getattr(out, field)[:n])
                           for out, n in forward_batches(model, images, batch_size=batch_size)])


def predictions(model, images: np.ndarray, order=None, *, batch_size: int = 400) -> np.ndarray:
    """Predicted classes ``[N]`` of ``images [N, H, W, C]`` routed in the order ``order`` (a
    permutation of ``range(N)``; None: as given): consecutive images share routing groups. The
    result is indexed like ``images``, whatever the order."""
    images = np.asarray(images)
    order = np.arange(len(images)) if order is None else np.asarray(order)
    out = np.empty(len(images), dtype=np.int64)
    out[order] = _collect(model, images[order], "logits", batch_size).argmax(-1)
    return out


def features(model, images: np.ndarray, *, batch_size: int = 256) -> np.ndarray:
    """Pooled pre-head features ``[N, D]``."""
    return _collect(model, images, "features", batch_size)


def accuracy(model, dataset, *, batch_size: int = 512, dropless: bool = False) -> float:
    """Top-1 accuracy over a dataset (images already normalised like the training data), the
    images in their order, in batches of ``batch_size`` routed in the model's groups. With
    ``dropless=True`` every MoE layer runs on the dropless path (:func:`~mini_moe.modes.dropless_mode`): no pick
    is dropped, so the result no longer depends on how the images are grouped."""
    with modes.dropless_mode(model) if dropless else contextlib.nullcontext():
        logits = _collect(model, dataset.images, "logits", batch_size)
    return float(np.mean(np.argmax(logits, -1) == dataset.labels))


def ridge_probe(train_x, train_y, test_x, test_y, *, num_classes: int, l2: float = 1.0) -> float:
    """Closed-form ridge regression from features onto one-hot labels (with a bias);
    returns test accuracy. Features are centred and scaled by the training statistics."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    a = np.concatenate([(train_x - mean) / std, np.ones((len(train_x), 1))], axis=1).astype(np.float64)
    b = np.concatenate([(test_x - mean) / std, np.ones((len(test_x), 1))], axis=1).astype(np.float64)
    targets = np.eye(num_classes)[train_y]
    reg = l2 * np.eye(a.shape[1])
    reg[-1, -1] = 0.0  # do not shrink the bias
    weights = np.linalg.solve(a.T @ a + reg, a.T @ targets)
    return float(np.mean(np.argmax(b @ weights, axis=1) == test_y))


def few_shot_accuracy(model, train, test, *, shots: int = 10, l2: float = 1.0, seed: int = 0,
                      max_test: int | None = None) -> float:
    """``shots``-shot linear probe accuracy (paper 000 Sec. 3.3; Dosovitskiy et al. 2021).

    Picks ``shots`` training images per class (seeded), extracts frozen features, fits
    ridge regression onto one-hot labels in closed form and scores the test set.
    """
    if shots < 1:
        raise InputError(f"shots must be >= 1, got {shots}.")
    rng = np.random.default_rng(seed)
    picks = []
    for c in range(train.num_classes):
        idx = np.flatnonzero(train.labels == c)
        if len(idx) < shots:
            raise InputError(f"class {c} has {len(idx)} training images, fewer than shots={shots}.")
        picks.append(rng.choice(idx, shots, replace=False))
    picks = np.concatenate(picks)
    test_images, test_labels = test.images, test.labels
    if max_test is not None:
        test_images, test_labels = test_images[:max_test], test_labels[:max_test]
    return ridge_probe(features(model, train.images[picks]), train.labels[picks],
                       features(model, test_images), test_labels, num_classes=train.num_classes, l2=l2)


# --------------------------------------------------------------------- routers


def _confidence(probs: np.ndarray) -> dict:
    top = -np.sort(-probs, axis=-1)
    return {"top1": float(top[..., 0].mean()),
            "top2": float(top[..., 1].mean()) if top.shape[-1] > 1 else 0.0,
            "rest": float(top[..., 2:].sum(-1).mean()) if top.shape[-1] > 2 else 0.0}


def router_report(model, images: np.ndarray, *, batch_size: int = 256) -> list[dict]:
    """Per MoE layer: routing metrics averaged over ``images`` and router confidence.

    Returns a list (one dict per MoE layer) with ``tokens_per_expert [E]`` (per group),
    ``dropped``, ``experts_per_token``, ``buffer_fill`` and ``confidence`` (mean top-1,
    top-2 and the rest of each patch's expert distribution). Each batch's metrics count with
    the number of real images in it, so the last batch's padding copies do not tip the mean.
    """
    sums, probs, total = None, None, 0
    for out, n in forward_batches(model, images, batch_size=batch_size):
        metrics = [{k: n * np.asarray(v, np.float64) for k, v in m.items()} for m in out.metrics]
        sums = metrics if sums is None else [{k: s[k] + m[k] for k in s} for s, m in zip(sums, metrics)]
        layer_probs = [np.asarray(p[:n]) for p in out.probs]
        probs = layer_probs if probs is None else [np.concatenate([a, b]) for a, b in zip(probs, layer_probs)]
        total += n
    if sums is None:
        return []
    report = []
    for layer_sums, layer_probs in zip(sums, probs):
        entry = {k: (v / total).tolist() if np.ndim(v) else float(v / total) for k, v in layer_sums.items()}
        entry["confidence"] = _confidence(layer_probs)
        report.append(entry)
    return report


def _cv(counts: np.ndarray) -> float:
    """Coefficient of variation (population std / mean) of per-expert counts; 0 if all zero."""
    mean = counts.mean()
    return float(counts.std() / mean) if mean > 0 else 0.0


def routing_record(model, images: np.ndarray, *, batch_size: int = 400):
    """One pass of ``model`` (eval mode, in its routing groups) over ``images [N, H, W, C]``: the
    per-image record that :func:`mechanisms` and :mod:`mini_moe.diagnose` measure. The last
    batch is padded with copies of its images (:func:`forward_batches`); the copies are routed
    with the others but left out of the record.

    Returns ``(preds [N], layers)``, one dict per MoE layer:

    * ``hits`` ``bool [N, P, E]``: whether expert e processes patch p of image n (any slot,
      any weight > 0);
    * ``top1`` ``int [N, P]``: the expert with the largest router probability (the router's own
      choice, before any capacity);
    * ``picks`` ``int [N, P]`` or None: how many real experts each patch picked before any
      capacity cut, as the router reports it (:attr:`~mini_moe.routers.RouterOutput.picks`);
      None for an allocation that makes no per-token picks (Expert Choice, Soft MoE);
    * ``entropy`` ``[N, P]``: the entropy of each patch's distribution over the experts, in nats;
    * ``slot_sharpness`` ``[N]`` or None: Soft MoE only, per image the mean over its slots of
      the largest dispatch weight (1 when each slot takes a single token);
    * ``scalars``: the router's scalar metrics (e.g. ``z_loss``, ``bias_spread``), each batch's
      mean counted with the number of real images in it.
    """
    cfg = model.cfg
    preds, parts, total = [], [], 0
    for out, n in forward_batches(model, images, batch_size=batch_size, routing=True):
        preds.append(np.asarray(out.logits[:n]).argmax(-1))
        per_layer = []
        for rt, probs, picks, metrics in zip(out.routings, out.probs, out.picks, out.metrics):
            probs = np.asarray(probs[:n])  # [n, P, E]
            dispatch = np.asarray(rt.dispatch)  # [groups, T, E, C]
            hits = (dispatch > 0).any(-1).reshape(-1, cfg.num_patches, cfg.routed_experts)[:n]
            # Soft MoE: a group is an image, each slot's weights sum to 1 over its tokens
            sharp = None if rt.sparse else dispatch[:n].max(axis=1).mean(axis=(1, 2))
            per_layer.append({
                # top-1 among the real experts (null columns, when there are any, come last)
                "hits": hits, "top1": probs[..., :cfg.routed_experts].argmax(-1), "picks": None if picks is None else np.asarray(picks[:n, :, :cfg.routed_experts]).sum(-1),
                "entropy": -np.sum(probs * np.log(np.clip(probs, 1e-12, None)), -1), "slot_sharpness": sharp,
                "scalars": {k: n * float(v) for k, v in metrics.items() if np.ndim(v) == 0}})
        parts.append(per_layer)
        total += n
    layers = []
    for acc in zip(*parts):
        layer = {key: None if acc[0][key] is None else np.concatenate([part[key] for part in acc])
                 for key in ("hits", "top1", "picks", "entropy", "slot_sharpness")}
        layer["scalars"] = {k: sum(part["scalars"][k] for part in acc) / total for k in acc[0]["scalars"]}
        layers.append(layer)
    return np.concatenate(preds), layers


def predictions_and_routing(model, images: np.ndarray, *, batch_size: int = 400):
    """Predicted classes ``[N]`` and, per MoE layer, ``(hits [N, P, E], top1 [N, P])``: whether
    expert e processes patch p of image n (any slot, any weight > 0), and the expert with the
    largest router probability (the router's own choice, before any capacity). See
    :func:`routing_record` for the rest of what one pass records."""
    preds, layers = routing_record(model, images, batch_size=batch_size)
    return preds, [(layer["hits"], layer["top1"]) for layer in layers]


def routing_summary(layer: dict) -> dict:
    """What one MoE layer's :func:`routing_record` entry says about its routing, over all
    patches of all images:

    * ``unprocessed``: the fraction of tokens that no expert processes (their MoE output is 0);
    * ``dropped_routes``: Token Choice only (else None): the fraction of the picks the router
      made that found no room, ``1 - sum(experts per token) / sum(picks made)`` (0 when no pick
      was made). A ReLU router (ReMoE) makes a pick per positive gate, not ``k = E``;
    * ``experts_per_token``: the mean number of experts that process a token;
    * ``load_cv``, ``load_max_over_mean``: how many tokens pick each expert as their top-1 (the
      router's own balance, before capacity), as the coefficient of variation over experts and
      as the largest expert's count over the mean;
    * ``processed_cv``: the coefficient of variation of the tokens each expert processes.
    """
    hits, picks = layer["hits"], layer["picks"]
    per_token = hits.sum(-1)
    load = np.bincount(layer["top1"].ravel(), minlength=hits.shape[-1]).astype(float)
    made = None if picks is None else int(picks.sum())
    return {
        "unprocessed": float(np.mean(per_token == 0)),
        "dropped_routes": None if made is None else (float(1 - per_token.sum() / made) if made else 0.0),
        "experts_per_token": float(per_token.mean()),
        "load_cv": _cv(load),
        "load_max_over_mean": float(load.max() / load.mean()) if load.sum() else 0.0,
        "processed_cv": _cv(hits.sum((0, 1)).astype(float)),
    }


def perturbation_path(model, image: np.ndarray, companions: np.ndarray, direction: np.ndarray,
                      alphas, *, batch_size: int = 512) -> dict:
    """Paper 004, Figure 1: follow ``image + alpha * direction`` for each ``alpha`` in ``alphas``.

    At every point the perturbed image is routed in a group with the same ``companions`` (the
    other ``group_images - 1`` images of its routing group never change, so only the image
    itself moves). Returns ``{"probs": [A, classes]`` softmax outputs for the image,
    ``"changes": [A - 1]`` whether the set of (MoE layer, patch, expert) triples that process
    the image differs between consecutive points, ``"alphas": [A]}``. Between two changes the
    model is a smooth function of alpha; at a change its output can jump.
    """
    cfg = model.cfg
    group = modes.group_images(model)
    companions = np.asarray(companions)[: group - 1]
    if len(companions) != group - 1:
        raise InputError(f"companions must hold group_images - 1 = {group - 1} images, got {len(companions)}.")
    alphas = np.asarray(alphas, np.float32)
    points = np.asarray(image)[None] + alphas[:, None, None, None] * np.asarray(direction)[None]
    groups = np.concatenate([points[:, None], np.broadcast_to(companions, (len(alphas),) + companions.shape)], 1)
    flat = groups.reshape((-1,) + points.shape[1:]).astype(np.float32)
    per_batch = max(group, batch_size - batch_size % group)
    probs, hits = [], []
    with modes.eval_mode(model):
        for start in range(0, len(flat), per_batch):
            out = _forward(model, jnp.asarray(flat[start:start + per_batch]), return_routing=True)
            probs.append(np.asarray(jax.nn.softmax(out.logits[::group], axis=-1)))
            layers = [(np.asarray(rt.dispatch) > 0).any(-1).reshape(-1, cfg.num_patches, cfg.routed_experts)[::group]
                      for rt in out.routings]
            hits.append(np.stack(layers, 1))  # [points, layers, P, E]
    probs, hits = np.concatenate(probs), np.concatenate(hits)
    changes = np.any(hits[1:] != hits[:-1], axis=(1, 2, 3))
    return {"probs": probs, "changes": changes, "alphas": alphas}


def assignment_counts(weight: np.ndarray, hits: np.ndarray, task: np.ndarray, num_tasks: int) -> np.ndarray:
    """``[K, E]``: how many tokens of each sub-task have each expert as their *main expert*, the
    processing expert with the largest combine weight. ``weight, hits [..., E]`` (combine weight
    summed over slots; whether the expert processes the token), ``task [...]``; unprocessed
    tokens count nowhere."""
    processed = hits.any(-1)
    main = np.where(hits, weight, -np.inf).argmax(-1)
    counts = np.zeros((num_tasks, weight.shape[-1]), np.int64)
    np.add.at(counts, (task[processed], main[processed]), 1)
    return counts


def routing_accuracy(model, images: np.ndarray, tasks: np.ndarray, *, batch_size: int = 400) -> list[dict]:
    """How close each MoE layer's routing is to a known right routing, one sub-task per expert.

    ``tasks`` ``int [N, P]`` is the sub-task of every patch (e.g.
    :func:`mini_moe.data.subtask_vote_tasks`). A patch's main expert is the processing expert
    with the largest combine weight (:func:`assignment_counts`; none if no expert processes it),
    for every allocation: Token Choice's top-1 when it was kept, the expert that gives it the
    most weight under Expert Choice. Sub-tasks are matched one-to-one to experts by the
    Hungarian algorithm on the ``[K, E]`` counts, the matching that agrees with the most
    patches, as chapter 9 does (:func:`mini_moe.subtasks.evaluate_layer`). Per MoE layer:

    * ``routing_accuracy``: the fraction of all patches whose main expert is their sub-task's
      matched expert (an unprocessed patch counts as wrong);
    * ``purity``: the fraction of processed patches whose main expert is the most common main
      expert of their sub-task (1 when each sub-task goes to one expert, even if several share one);
    * ``unprocessed``: the fraction of patches no expert processes;
    * ``counts``: the ``[K, E]`` matrix, as nested lists.

    Soft MoE mixes every token into every slot, so it has no main expert; use
    :func:`dispatch_mass` for it.
    """
    from scipy.optimize import linear_sum_assignment

    cfg = model.cfg
    tasks = np.asarray(tasks)
    if tasks.shape != (len(images), cfg.num_patches):
        raise InputError(f"tasks must be [N, P] = [{len(images)}, {cfg.num_patches}], got {tasks.shape}.")
    num_tasks = int(tasks.max()) + 1
    layers = None
    for out, n in forward_batches(model, images, batch_size=batch_size, routing=True):
        per_layer = []
        for rt in out.routings:
            weight = np.asarray(rt.combine, np.float32).sum(-1).reshape(-1, cfg.num_patches, cfg.routed_experts)
            hits = (np.asarray(rt.dispatch) > 0).any(-1).reshape(weight.shape)
            per_layer.append((weight[:n], hits[:n]))
        layers = [[x] for x in per_layer] if layers is None else [a + [x] for a, x in zip(layers, per_layer)]
    result = []
    for acc in layers or []:
        weight, hits = np.concatenate([w for w, _ in acc]), np.concatenate([h for _, h in acc])
        counts = assignment_counts(weight, hits, tasks, num_tasks)
        rows, cols = linear_sum_assignment(-counts)
        processed = max(int(counts.sum()), 1)
        result.append({"routing_accuracy": float(counts[rows, cols].sum() / tasks.size),
                       "purity": float(counts.max(1).sum() / processed),
                       "unprocessed": float(1 - counts.sum() / tasks.size), "counts": counts.tolist()})
    return result


def router_inputs(model, images: np.ndarray, *, batch_size: int = 400) -> list[np.ndarray]:
    """What each MoE layer's router reads from the representation: per MoE layer, ``float32
    [N, P, D]``, the layer-normed residual stream that enters the layer, for every image. The
    model's own modules in the order its forward calls them (patch embedding, position, each
    block's attention, then the MoE layer's norm); ``tests/test_raw_key.py`` checks that routing
    these inputs gives the model's own picks."""
    from mini_moe.model import patchify

    cfg = model.cfg
    dtype = jnp.dtype(cfg.dtype)
    layers = None
    with modes.eval_mode(model):
        for chunk, n in _padded_chunks(model, images, batch_size):
            patches = patchify(jnp.asarray(chunk), cfg.patch_size)
            x = model.embed(patches.astype(dtype)) + model.pos[...].astype(dtype)
            found = []
            for block in model.blocks:
                if block.use_moe:
                    found.append(np.asarray(block.norm2(x + block.attn(block.norm1(x))), np.float32)[:n])
                x, _ = block(x, None, patches)
            layers = [[f] for f in found] if layers is None else [a + [f] for a, f in zip(layers, found)]
    return [np.concatenate(parts) for parts in layers or []]


def _picked_expert(router, inputs: np.ndarray, group_images: int) -> np.ndarray:
    """``int [N, P]``: each patch's first picked expert under ``router`` (its picks before any
    capacity cut), the inputs routed in groups of ``group_images`` images."""
    n, p, d = inputs.shape
    grouped = jnp.asarray(inputs.reshape(n // group_images, group_images * p, d))
    with modes.eval_mode(router):
        picks = np.asarray(router(grouped).picks)
    return picks.reshape(n, p, -1).argmax(-1)


def fresh_router_accuracy(model, images: np.ndarray, tasks: np.ndarray, *, draws: int = 5, seed: int = 0,
                          layer: int = 0) -> dict:
    """The steering test of issue 65: on the inputs MoE layer ``layer`` receives from the trained
    trunk (:func:`router_inputs`), the routing accuracy of the layer's own router and of
    ``draws`` fresh routers of its kind and options (new initialisations, seeds ``seed`` ...).

    Each patch goes to the expert its router picks (before any capacity cut); sub-tasks are
    matched one-to-one to experts by the Hungarian algorithm (:func:`routing_accuracy`'s
    matching). A trunk that *steers* its inputs toward a fixed router's projection makes that
    router route better than fresh ones; a trunk that merely *clusters* the patches by sub-task
    lets any projection route about as well. Returns ``{"own": accuracy, "fresh": [accuracies]}``.
    """
    from scipy.optimize import linear_sum_assignment

    from mini_moe import routers as routers_lib

    cfg = model.cfg
    if not 0 <= layer < len(cfg.moe_blocks()):
        raise InputError(f"layer must be in [0, {len(cfg.moe_blocks())}) (the model's MoE layers), got {layer}.")
    if routers_lib.spec(cfg.router).reads == "pixels":
        raise InputError(f"{cfg.router} reads the raw patches, not the representation: there is nothing to steer.")
    tasks = np.asarray(tasks)
    inputs = router_inputs(model, images)[layer]
    group = modes.group_images(model)

    def accuracy(expert):
        counts = assignment_counts(np.eye(cfg.routed_experts, dtype=np.float32)[expert],
                                   np.ones(expert.shape + (cfg.routed_experts,), bool), tasks, int(tasks.max()) + 1)
        rows, cols = linear_sum_assignment(-counts)
        return float(counts[rows, cols].sum() / tasks.size)

    own = [b for b in model.blocks if b.use_moe][layer].mlp.router
    fresh = [routers_lib.make_router(cfg.router, cfg.dim, cfg.routed_experts, rngs=nnx.Rngs(seed + i),
                                     **cfg.routed_options()) for i in range(draws)]
    return {"own": accuracy(_picked_expert(own, inputs, group)),
            "fresh": [accuracy(_picked_expert(r, inputs, group)) for r in fresh]}


def group_routing(model, images: np.ndarray, *, layer: int = -1):
    """The :class:`~mini_moe.routing.Routing` of the first routing group of ``images`` in MoE
    layer ``layer`` (eval mode), with tensors ``[T, E, C]``: the first ``group_images`` images
    for a sparse router, the first image for Soft MoE. Draw it with
    :func:`mini_moe.figures.routing_heatmaps`."""
    group = modes.group_images(model)
    if len(images) < group:
        raise InputError(f"images must hold at least one routing group ({group} images), got {len(images)}.")
    with modes.eval_mode(model):
        rt = _forward(model, jnp.asarray(images[:group]), return_routing=True).routings[layer]
    return routing_lib.Routing(np.asarray(rt.dispatch[0]), np.asarray(rt.combine[0]), sparse=rt.sparse)


def dispatch_mass(model, images: np.ndarray, *, batch_size: int = 256) -> list[np.ndarray]:
    """Per MoE layer, ``[N, P]``: how much of each patch the experts receive.

    The sum of the patch's dispatch weights over every slot of every expert, divided by the
    share it would get if every slot took every token of its group equally (slots / tokens per
    group). 1 is an average patch. For a sparse router the sum counts the slots that hold the
    patch (0: dropped); for Soft MoE, whose slots are weighted averages of all of an image's
    tokens, a value near 0 means the patch reaches no slot with a noticeable weight: it is
    "softly dropped" (it still receives the combined output through eq. (2)).
    """
    cfg = model.cfg
    batches = []  # per batch, per MoE layer: [n, P]
    for out, n in forward_batches(model, images, batch_size=batch_size, routing=True):
        per_layer = []
        for rt in out.routings:
            dispatch = np.asarray(rt.dispatch, np.float64)  # [groups, T, E, C]
            uniform = dispatch.shape[-1] * dispatch.shape[-2] / dispatch.shape[-3]
            per_layer.append((dispatch.sum((-1, -2)) / uniform).reshape(-1, cfg.num_patches)[:n])
        batches.append(per_layer)
    return [np.concatenate(layer) for layer in zip(*batches)]


def slot_mixing(model, images: np.ndarray, *, batch_size: int = 256) -> list[dict]:
    """How many tokens a Soft MoE slot mixes, per MoE layer (Soft MoE only).

    A slot's input is a weighted average of its image's T tokens, with dispatch weights ``w``
    summing to 1. Per layer: ``tokens_per_slot``, the mean over slots and images of the effective
    number of tokens ``1 / sum_t w_t**2`` (T when the slot averages every token equally, 1 when it
    takes one token); ``max_weight``, the mean of a slot's largest weight (1/T to 1); ``tokens``
    (T), ``slots`` (E x S) and ``scale``, the learned scale of the normalised logits
    (:class:`~mini_moe.routers.SlotLogits`, initialised at 1: larger values sharpen the weights).
    """
    layers = [block.mlp for block in model.blocks if block.use_moe]
    if not layers or not all(m.router.per_image for m in layers):
        raise InputError("slot_mixing needs a Soft MoE model (router='soft_moe'): only its slots mix tokens.")
    sums = None  # per layer: [sum of effective tokens, sum of max weights, slot count]
    for out, n in forward_batches(model, images, batch_size=batch_size, routing=True):
        per_layer = []
        for rt in out.routings:
            w = np.asarray(rt.dispatch, np.float64)[:n]  # [images, T, E, S]: one image per group
            per_layer.append(np.array([np.sum(1 / np.sum(w**2, axis=1)), np.sum(w.max(axis=1)),
                                       w.shape[0] * w.shape[2] * w.shape[3]]))
        sums = per_layer if sums is None else [a + b for a, b in zip(sums, per_layer)]
    return [{"tokens_per_slot": float(total[0] / total[2]), "max_weight": float(total[1] / total[2]),
             "tokens": model.cfg.num_patches, "scale": float(m.router.affinity.scale[...]),
             "slots": m.router.affinity.num_experts * m.router.affinity.slots_per_expert}
            for total, m in zip(sums, layers)]


def within_group_permutation(n: int, group: int, rng: np.random.Generator) -> np.ndarray:
    """An order of ``range(n)`` that keeps every block of ``group`` consecutive images together
    (the same routing groups) and shuffles the images' positions inside each block."""
    order = np.arange(n)
    for start in range(0, n, group):
        order[start:start + group] = rng.permutation(order[start:start + group])
    return order


def batch_dependence(model, images: np.ndarray, *, regroupings: int = 8, permutations: int | None = None,
                     seed: int = 0, batch_size: int = 400, reference: np.ndarray | None = None) -> dict:
    """How much a prediction depends on the other images of its routing group: the one measure
    of batch dependence (:func:`mechanisms`, :mod:`mini_moe.diagnose` and chapter 17 read it).

    The images are routed in their order (the reference; pass its predictions as ``reference`` if
    you have them), then ``regroupings`` times in a random order (new groups: ``"regroup"``), and
    ``permutations`` (default ``regroupings``) times permuted within blocks of the model's
    configured ``group_images`` (the same groups as trained, new positions: ``"permute"``; a
    per-image mode then shows 0 as a measurement, not by construction). For each, per draw the
    share of images whose predicted class differs from the reference, and:

    * ``mean``, and ``low``, ``high``: a 95 % t interval over the draws (None with one draw). It
      covers the draws' noise for these images only;
    * ``image_low``, ``image_high``: a 95 % percentile bootstrap over the images (each image's
      share of draws in which it changed), the interval a new sample of images would need;
    * ``changed``: how many images changed in at least one draw.

    A batch-invariant model (:func:`mini_moe.modes.invariance`) gives 0 in every draw, in exact
    arithmetic. The first regrouping is the order ``np.random.default_rng(seed).permutation(N)``.
    """
    check_int("regroupings", regroupings, 1)
    permutations = regroupings if permutations is None else permutations
    check_int("permutations", permutations, 0)
    images = np.asarray(images)
    rng = np.random.default_rng(seed)
    reference = predictions(model, images, batch_size=batch_size) if reference is None else np.asarray(reference)
    regroup = [predictions(model, images, rng.permutation(len(images)), batch_size=batch_size) != reference
               for _ in range(regroupings)]
    group = modes.group_images(model)
    block = model.cfg.group_images if group == 1 else group
    permute = [predictions(model, images, within_group_permutation(len(images), block, rng),
                           batch_size=batch_size) != reference for _ in range(permutations)]
    return {"regroup": _dependence(regroup, seed), "permute": _dependence(permute, seed) if permute else None,
            "images": len(images), "group_images": group, "permute_block": block,
            "regroupings": regroupings, "permutations": permutations}


def _dependence(changed: list, seed: int) -> dict:
    """The shares of changed predictions of each draw (``changed``: one ``bool [N]`` per draw),
    with a t interval over the draws and a bootstrap interval over the images."""
    changed = np.asarray(changed)  # [draws, N]
    shares = [float(x) for x in changed.mean(1)]
    mean = float(np.mean(shares))
    low = high = None
    if len(shares) > 1:
        t = stats.paired_t(shares)
        low, high = max(0.0, t["ci_low"]), min(1.0, t["ci_high"])
    image_low, image_high = (0.0, 0.0) if not changed.any() else stats.bootstrap_mean(changed.mean(0), seed=seed)
    return {"mean": mean, "low": low, "high": high, "shares": shares, "image_low": image_low,
            "image_high": image_high, "changed": int(changed.any(0).sum())}


def mechanisms(model, images: np.ndarray, *, seed: int = 0, batch_size: int = 400,
               stability_images: int = 2000) -> dict:
    """The mechanisms behind accuracy differences between routers, measured on ``images``.

    Returns ``{"batch_dependence": float, "layers": [one dict per MoE layer]}``:

    * ``batch_dependence``: the fraction of predictions that change when each image's routing
      group is refilled with other images (:func:`batch_dependence`, one seeded regrouping).
      0 for Soft MoE and the dense ViT, which see one image at a time.
    * per layer, over all patches of all images:

      - ``unprocessed``: fraction of tokens that no expert processes (their MoE output is 0);
      - ``dropped_routes``: Token Choice only (else None): fraction of the picks the router made
        that found no room, ``1 - experts_per_token / k`` at a fixed k (ReMoE: per positive gate);
      - ``experts_per_token``: mean number of experts that process a token (Soft MoE: every
        expert sees every token with some weight, so E);
      - ``load_cv``: coefficient of variation over experts of how many tokens pick each expert
        as their top-1 (the router's own balance, before capacity; what auxiliary losses target);
      - ``processed_cv``: the same for the tokens each expert processes (0 for Expert Choice:
        every expert fills its C slots);
      - ``stability_top1``, ``stability_top2``: paper 004 Table 4's match ratios of the top-1 and
        ordered top-2 experts of corresponding patches in two augmented views
        (:func:`routing_stability`, on the first ``stability_images`` images).
    """
    preds, layers = routing_record(model, images, batch_size=batch_size)
    dependence = batch_dependence(model, images, regroupings=1, permutations=0, seed=seed, batch_size=batch_size,
                                  reference=preds)
    stability = routing_stability(model, images[:stability_images], seed=seed) if layers else []
    keys = ("unprocessed", "dropped_routes", "experts_per_token", "load_cv", "processed_cv")
    out = []
    for layer, stable in zip(layers, stability):
        summary = routing_summary(layer)
        out.append({**{k: summary[k] for k in keys}, "stability_top1": float(stable["top1"]),
                    "stability_top2": None if stable["top2"] is None else float(stable["top2"])})
    return {"batch_dependence": dependence["regroup"]["mean"], "layers": out}


def group_dependence(router, experts, images: Array, *, group_images: int, trials: int = 8, seed: int = 0,
                     rtol: float = 1e-4) -> float:
    """How much one image's MoE-layer output depends on the other images of its routing group.

    Image 0 of ``images`` is routed in ``trials`` groups of ``group_images`` images, the other
    members drawn at random from ``images[1:]`` each time (without replacement within a group)
    and image 0 placed at a random position in the group (Token Choice without Batch Priority
    Routing serves earlier tokens first, so the position is part of the group).
    A token of image 0 counts as changed in a trial when its output of eq. (2) differs from its
    output in the first group by more than ``rtol`` times that output's norm (a token dropped in
    both groups has output 0 in both and is unchanged). ``group_images=1`` routes image 0 alone,
    the grouping paper 002 defines for Soft MoE: then nothing can change.

    Args:
      router: a router (called in eval mode, restored afterwards) mapping ``[T, D]`` tokens to a
        :class:`~mini_moe.routers.RouterOutput`.
      experts: the experts, ``[E, N, D] -> [E, N, D_out]`` (see :func:`mini_moe.layer.moe`).
      images: ``[N, P, D]`` tokens of N images (N >= group_images).
      group_images: images per routing group (>= 1).
      trials: groups to route image 0 in (>= 2).

    Returns:
      The fraction of (trial, token) pairs of image 0, over trials 2..``trials``, whose output changed.
    """
    images = jnp.asarray(images)
    if images.ndim != 3:
        raise InputError(f"images must be token arrays [N, P, D], got shape {images.shape}.")
    if not (isinstance(group_images, int) and 1 <= group_images <= images.shape[0]):
        raise InputError(f"group_images must be an int in [1, N={images.shape[0]}], got {group_images!r}.")
    if not (isinstance(trials, int) and trials >= 2):
        raise InputError(f"trials must be an int >= 2, got {trials!r}.")
    rng = np.random.default_rng(seed)
    num_patches = images.shape[1]
    outputs = []
    with modes.eval_mode(router):
        for _ in range(trials):
            members = rng.choice(np.arange(1, images.shape[0]), group_images - 1, replace=False)
            position = int(rng.integers(group_images))  # where image 0 sits in the group
            members = np.insert(members, position, 0)
            group = images[members].reshape(group_images * num_patches, -1)
            y = layer.moe(group, router(group).routing, experts)
            outputs.append(np.asarray(y[position * num_patches:(position + 1) * num_patches], np.float64))
    reference = outputs[0]
    scale = np.linalg.norm(reference, axis=-1)
    changed = [np.linalg.norm(y - reference, axis=-1) > rtol * np.maximum(scale, 1e-12) for y in outputs[1:]]
    return float(np.mean(changed))


def expert_maps(model, images: np.ndarray) -> np.ndarray:
    """``int [L, B, h, w]``: per MoE layer and patch, the expert with the largest combine
    weight, or -1 where the patch reached no expert (dropped)."""
    cfg = model.cfg
    with modes.eval_mode(model):
        out = _forward(model, jnp.asarray(images), return_routing=True)
    b, side = len(images), cfg.image_size // cfg.patch_size
    maps = []
    for rt in out.routings:
        combine = np.asarray(rt.combine).reshape(b, side * side, cfg.routed_experts, -1).sum(-1)
        reached = (np.asarray(rt.dispatch).reshape(b, side * side, cfg.routed_experts, -1) > 0).any(axis=(-1, -2))
        maps.append(np.where(reached, combine.argmax(-1), -1).reshape(b, side, side))
    return np.stack(maps) if maps else np.zeros((0, b, side, side), int)


def plot_expert_maps(images: np.ndarray, maps: np.ndarray, *, num_experts: int, layer: int = -1,
                     labels=None, max_images: int = 8):
    """Draw images with their patches coloured by expert (dropped patches hatched black).

    Args:
      images: ``[B, H, W, C]`` (any scale; shown min-max normalised).
      maps: output of :func:`expert_maps`.
      layer: which MoE layer to show.
    Returns:
      The matplotlib figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    n = min(max_images, len(images))
    fig, axes = plt.subplots(2, n, figsize=(1.6 * n, 3.4), squeeze=False)
    colors = plt.get_cmap("tab20")(np.arange(num_experts) % 20)
    cmap = ListedColormap(np.vstack([[0, 0, 0, 1], colors]))
    for i in range(n):
        img = images[i]
        img = (img - img.min()) / (img.max() - img.min() + 1e-9)
        axes[0, i].imshow(img.squeeze(-1) if img.shape[-1] == 1 else img, cmap="gray")
        axes[1, i].imshow(maps[layer, i] + 1, cmap=cmap, vmin=0, vmax=num_experts)
        if labels is not None:
            axes[0, i].set_title(str(labels[i]), fontsize=8)
        for ax in axes[:, i]:
            ax.set_xticks([]), ax.set_yticks([])
    axes[1, 0].set_ylabel("expert", fontsize=8)
    fig.tight_layout()
    return fig


VIEW_CROP = dict(scale=(0.35, 1.0), ratio=(3 / 4, 4 / 3), flip=True)  # paper 004's two random views


def _view_pairs(model, images: np.ndarray, *, seed: int, batch_size: int, crop: dict):
    """Per batch: two random views of each image (the higher-resolution one first), each view's
    router distributions per MoE layer ``[n, P, E]``, and the patch correspondences
    ``index, valid [n, P]`` (see :func:`mini_moe.augment.patch_correspondence`)."""
    cfg = model.cfg
    rng = np.random.default_rng(seed)
    with modes.eval_mode(model):
        for batch, n in _padded_chunks(model, images, batch_size):
            v1, t1 = augment.random_resized_crop(rng, batch, out_size=cfg.image_size, **crop)
            v2, t2 = augment.random_resized_crop(rng, batch, out_size=cfg.image_size, **crop)
            v1, t1, v2, t2 = order_views(v1, t1, v2, t2, out_size=cfg.image_size)
            index, valid = augment.patch_correspondence(
                t1, t2, out_size1=cfg.image_size, out_size2=cfg.image_size, patch_size=cfg.patch_size)
            p1 = [np.asarray(p)[:n] for p in _forward(model, jnp.asarray(v1)).probs]
            p2 = [np.asarray(p)[:n] for p in _forward(model, jnp.asarray(v2)).probs]
            yield p1, p2, index[:n], valid[:n]


def correspondence_matrices(model, images: np.ndarray, *, seed: int = 0, batch_size: int = 128) -> list[np.ndarray]:
    """Paper 004's ``S`` (eq. 3, :func:`mini_moe.losses.correspondence_matrix`) per MoE layer,
    ``[E, E]``, over two random views of each of ``images`` (the views of :func:`routing_stability`)."""
    sums, pairs = None, 0
    for p1, p2, index, valid in _view_pairs(model, images, seed=seed, batch_size=batch_size, crop=VIEW_CROP):
        count = int(valid.sum())
        layer = [np.asarray(losses_lib.correspondence_matrix(a, b, index, valid), np.float64) * count for a, b in zip(p1, p2)]
        sums = layer if sums is None else [x + y for x, y in zip(sums, layer)]
        pairs += count
    return [s / max(pairs, 1) for s in (sums or [])]


def routing_stability(model, images: np.ndarray, *, seed: int = 0, batch_size: int = 128,
                      scale=VIEW_CROP["scale"], ratio=VIEW_CROP["ratio"], flip: bool = VIEW_CROP["flip"]) -> list[dict]:
    """Paper 004 Table 4: expert-selection match ratios of corresponding patches.

    For each image, two random resized crops (+ flips) are drawn; the higher-resolution
    view is view 1. For every view-1 patch whose centre lands inside view 2, the top-1
    (and top-2) experts of its distribution are compared with those of the nearest
    view-2 patch. ``scale``, ``ratio`` and ``flip`` go to
    :func:`mini_moe.augment.random_resized_crop`. Returns one dict per MoE layer: ``top1``, ``top2`` (both in order),
    ``top2_unordered`` (None for a model with one expert) and ``pairs`` (number of patch pairs compared).
    """
    cfg = model.cfg
    counts = None
    for p1, p2, index, valid in _view_pairs(model, images, seed=seed, batch_size=batch_size,
                                            crop=dict(scale=scale, ratio=ratio, flip=flip)):
        layer_counts = []
        for a, b in zip(p1, p2):
            b = np.take_along_axis(b, index[:, :, None], axis=1)
            if a.shape[-1] < 2:  # one expert: the top-1 always matches, there is no top-2
                a, b = np.concatenate([a, 0 * a], -1), np.concatenate([b, 0 * b], -1)
            ta, tb = np.argsort(-a, -1)[..., :2], np.argsort(-b, -1)[..., :2]
            top1 = ta[..., 0] == tb[..., 0]
            top2 = top1 & (ta[..., 1] == tb[..., 1])
            unordered = top2 | ((ta[..., 0] == tb[..., 1]) & (ta[..., 1] == tb[..., 0]))
            layer_counts.append(np.array([top1[valid].sum(), top2[valid].sum(), unordered[valid].sum(), valid.sum()]))
        counts = layer_counts if counts is None else [c + d for c, d in zip(counts, layer_counts)]
    two = cfg.routed_experts >= 2  # with one expert the top-2 ratios are undefined (None)
    return [{"top1": c[0] / max(c[3], 1), "top2": c[1] / max(c[3], 1) if two else None,
             "top2_unordered": c[2] / max(c[3], 1) if two else None, "pairs": int(c[3])} for c in (counts or [])]


def order_views(v1, t1, v2, t2, *, out_size):
    """Swap the two views per image so that view 1 has the higher resolution (paper 004)."""
    swap = augment.view_resolution(t2, out_size=out_size) > augment.view_resolution(t1, out_size=out_size)
    s = swap[:, None, None, None]
    first = np.where(s, v2, v1), augment.CropTransform(*[np.where(swap, b, a) for a, b in zip(t1, t2)])
    second = np.where(s, v1, v2), augment.CropTransform(*[np.where(swap, a, b) for a, b in zip(t1, t2)])
    return first[0], first[1], second[0], second[1]


# Moved after 0.4.0 (issue 64); the old names warn for one release.
__getattr__ = moved_names(__name__, {"eval_mode": "mini_moe.modes:eval_mode",
                                     "dropless_mode": "mini_moe.modes:dropless_mode"})
