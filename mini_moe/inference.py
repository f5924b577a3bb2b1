"""Routing at inference (issue 53): what one image's prediction owes to the other images of its
batch, how an attacker uses that, and how to route so that it owes them nothing.

A router whose allocation looks at a whole routing group (Token Choice with a capacity, Expert
Choice, Batch Prioritized Routing, and any affinity computed over the group: Sinkhorn plans, the
hash control's centring) makes image i's output a function of the group, ``y_i = f(x_i, x_group)``.
A router that sees one image at a time (Soft MoE's per-image slots, any router in groups of one
image) or one token at a time with nothing to run out of (dropless Token Choice over a per-token
affinity) makes it ``f(x_i)``: batch-invariant.

What this module measures, on a trained :class:`~mini_moe.model.VisionMoE`:

* :func:`batch_dependence`: the share of predictions that change when the images are regrouped
  at random, and when they are permuted within their groups, with a 95 % interval over the
  regroupings;
* :func:`capacity_sweep`: accuracy, dropped share and batch dependence against the capacity
  factor used at test time (V-MoE, arXiv 2106.05974, trades accuracy for compute this way);
* :func:`batch_invariant` / :func:`invariance`: the batch-invariant modes and the rule that says
  whether a configuration is one;
* :func:`filler_attack`: Hayes, Shumailov and Yona's buffer overflow (arXiv 2402.05526): filler
  images that crowd a victim's experts, the victim's flip rate, and the paper's mitigations;
* :func:`twin_fates`: two identical images in one group, whose patches meet different fates
  because of where they sit (the ties of ``jax.lax.top_k`` and of token order);
* :func:`precision_mismatch`: the share of tokens whose top-k set changes when the router
  computes in bfloat16 (Rollout Routing Replay, arXiv 2510.11370, reports ~10 % between engines);
  :func:`record_routing` and :func:`replay_routing` record one forward pass's routing and replay it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mini_moe import evaluate, explorer, routing, study
from mini_moe import routers as routers_lib
from mini_moe.validate import InputError, check_int

#: The affinities that score each token on its own (so a dropless layer over them is batch-invariant).
PER_TOKEN_AFFINITIES = ("Softmax", "NoisySoftmax", "SigmoidGates", "ReluGates", "FrozenWeight", "NullGates")

#: :func:`batch_invariant`'s modes.
INVARIANT_MODES = ("per_image", "dropless")

#: :func:`filler_attack`'s mitigations (Hayes et al. 2024, Sec. 6, and per-image groups).
MITIGATIONS = (None, "random_order", "slack", "bpr", "per_image")


#: The model's MoE blocks (an InputError for a dense model): the explorer's helper.
_moe_blocks = explorer._moe_layers


def group_size(model) -> int:
    """Images per routing group as the model routes now: 1 for Soft MoE or in groups of one image."""
    mlp = _moe_blocks(model)[0].mlp
    return 1 if mlp.router.per_image else int(mlp.group_images)


def _interval(shares) -> dict:
    """Mean of ``shares`` (one per regrouping) with its two-sided 95 % t interval
    (:func:`mini_moe.study.paired_t`), clipped to [0, 1]."""
    shares = [float(x) for x in shares]
    t = study.paired_t(shares)
    return {"mean": t["difference"], "low": max(0.0, t["ci_low"]), "high": min(1.0, t["ci_high"]), "shares": shares}


def predictions(model, images: np.ndarray, order=None, *, batch_size: int = 400) -> np.ndarray:
    """Predicted classes ``[N]`` of ``images [N, H, W, C]`` routed in the order ``order`` (a
    permutation of ``range(N)``; None: as given): consecutive images share routing groups. The
    result is indexed like ``images``, whatever the order."""
    order = np.arange(len(images)) if order is None else np.asarray(order)
    logits = evaluate._collect(model, np.asarray(images)[order], "logits", batch_size)
    out = np.empty(len(images), dtype=np.int64)
    out[order] = logits.argmax(-1)
    return out


def within_group_permutation(n: int, group: int, rng: np.random.Generator) -> np.ndarray:
    """An order of ``range(n)`` that keeps every block of ``group`` consecutive images together
    (the same routing groups) and shuffles the images' positions inside each block."""
    order = np.arange(n)
    for start in range(0, n, group):
        order[start:start + group] = rng.permutation(order[start:start + group])
    return order


def batch_dependence(model, images: np.ndarray, *, regroupings: int = 8, seed: int = 0,
                     batch_size: int = 400) -> dict:
    """How much a prediction depends on the other images of its routing group.

    The images are routed in their order (the reference), then ``regroupings`` times in a random
    order (new groups: ``"regroup"``) and ``regroupings`` times permuted within their groups (the
    same groups, new positions: ``"permute"``). For each, the share of images whose predicted
    class differs from the reference; returned as ``{"mean", "low", "high", "shares"}``, the low
    and high ends a 95 % t interval over the regroupings. A batch-invariant model gives 0 in
    every one (:func:`invariance`).
    """
    check_int("regroupings", regroupings, 2)
    images = np.asarray(images)
    rng = np.random.default_rng(seed)
    reference = predictions(model, images, batch_size=batch_size)
    group = group_size(model)
    regroup = [np.mean(predictions(model, images, rng.permutation(len(images)), batch_size=batch_size) != reference)
               for _ in range(regroupings)]
    permute = [np.mean(predictions(model, images, within_group_permutation(len(images), group, rng),
                                   batch_size=batch_size) != reference) for _ in range(regroupings)]
    return {"regroup": _interval(regroup), "permute": _interval(permute), "images": len(images),
            "group_images": group, "regroupings": regroupings}


def invariance(model) -> tuple[bool, str]:
    """Whether the model's predictions depend on nothing but the image, as it routes now, and why.

    Batch-invariant: every MoE layer routes each image alone (Soft MoE; groups of one image), or
    is Token Choice over an affinity that scores each token alone with nothing to refuse: on the
    dropless path without ReMoE's pick bound (whose overflow is decided over the whole call), or
    with buffers of C >= T slots (a token's k picks go to k different experts, so no expert is
    asked for more than T). Anything with a smaller capacity (Token Choice, Expert Choice, with or
    without Batch Prioritized Routing) or a group-level affinity (Sinkhorn and the other transport
    plans, the hash control) is not.
    """
    reasons = []
    for i, block in enumerate(_moe_blocks(model)):
        mlp = block.mlp
        router = mlp.router
        affinity = type(router.affinity).__name__
        if router.per_image:
            continue
        if mlp.group_images == 1:
            continue
        if mlp.path == "dropless":
            if affinity not in PER_TOKEN_AFFINITIES:
                reasons.append(f"MoE layer {i}: {affinity} scores a token against its whole group")
            elif router.allocation.pick_bound is not None:
                reasons.append(f"MoE layer {i}: the dropless path's pick bound (ReMoE's active_bound) drops the "
                               "smallest gates of the whole call when it overflows")
            continue
        tokens = mlp.group_images * model.cfg.num_patches
        if (isinstance(router.allocation, routers_lib.TokenChoice) and affinity in PER_TOKEN_AFFINITIES
                and routing.capacity(tokens, router.num_experts - router.allocation.null_experts,
                                     router.capacity_factor) >= tokens):
            continue  # every expert has a slot for every token of the group: no pick is refused
        kind = type(router.allocation).__name__
        reasons.append(f"MoE layer {i}: {kind} with capacity factor {router.capacity_factor:g} over groups of "
                       f"{mlp.group_images} images")
    if reasons:
        return False, "; ".join(reasons)
    return True, "every MoE layer routes each image (or each token) on its own"


@contextlib.contextmanager
def batch_invariant(model, mode: str = "per_image"):
    """Evaluate ``model`` in a batch-invariant mode for the block (then restore it):

    * ``"per_image"``: every routing group is one image (any router; the capacity is then
      counted over one image's patches: C = round(c P / E));
    * ``"dropless"``: every Token Choice layer on the dropless path (:func:`mini_moe.evaluate.dropless_mode`);
      refused where that would still depend on the batch (see :func:`invariance`).
    """
    if mode not in INVARIANT_MODES:
        raise InputError(f"mode must be one of {INVARIANT_MODES}, got {mode!r}.")
    blocks = _moe_blocks(model)
    if mode == "per_image":
        saved = [(b.mlp, b.mlp.group_images) for b in blocks]
        for b in blocks:
            b.mlp.group_images = 1
        try:
            yield model
        finally:
            for mlp, value in saved:
                mlp.group_images = value
        return
    with evaluate.dropless_mode(model):
        ok, why = invariance(model)
        if not ok:
            raise InputError(f"mode='dropless' leaves this model batch-dependent ({why}); use mode='per_image'.")
        yield model


def _router_probs(model, images: np.ndarray, batch_size: int = 400) -> list[np.ndarray]:
    """Per MoE layer, ``[N, P, E]``: each patch's distribution over the experts, the images routed
    in their order."""
    parts = []
    with evaluate.eval_mode(model):
        for batch, n in evaluate._padded_batches(model, np.asarray(images), batch_size):
            parts.append([np.asarray(p[:n], np.float32) for p in evaluate._forward(model, batch).probs])
    return [np.concatenate(layer) for layer in zip(*parts)]


def _grouped_predictions(model, groups: np.ndarray) -> np.ndarray:
    """``groups [V, g, H, W, C]`` routed one group each -> predicted classes ``[V, g]``."""
    v, g = groups.shape[:2]
    flat = groups.reshape((v * g,) + groups.shape[2:])
    logits = evaluate._collect(model, flat, "logits", max(g, 256 - 256 % g))
    return logits.argmax(-1).reshape(v, g)


def choose_fillers(victim_probs: np.ndarray, pool_probs: np.ndarray, count: int) -> np.ndarray:
    """The attack's choice (Hayes et al. 2024, Sec. 4, with candidates from a pool instead of
    optimised queries): the ``count`` pool images whose patches want the victim's experts most.
    ``victim_probs [P, E]``, ``pool_probs [N, P, E]`` (router distributions in one MoE layer).
    Each expert is weighted by the share of the victim's patches whose top-1 it is; a pool image
    scores the sum over its patches of its probability mass on the experts, so weighted. A high
    score fills the victim's experts first under Token Choice (its patches come first in the
    group), takes their slots under Expert Choice (its scores are higher) and under Batch
    Prioritized Routing (its top gates are larger). Returns indices into the pool, best first."""
    experts = victim_probs.shape[-1]
    share = np.bincount(victim_probs.argmax(-1), minlength=experts) / victim_probs.shape[0]
    scores = np.einsum("npe,e->n", pool_probs, share)
    return np.argsort(-scores, kind="stable")[:count]


def attack_group(model, victim: np.ndarray, pool: np.ndarray, *, layer: int = 0, position: int | None = None,
                 pool_probs: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """The attacker's routing group for ``victim [H, W, C]``: the ``g - 1`` images of ``pool``
    that :func:`choose_fillers` picks in MoE layer ``layer``, with the victim at ``position``
    (default last, where Token Choice serves it after every filler). Returns ``(group [g, H, W, C],
    position)``; :func:`mini_moe.explorer.routing_view` of it (``image=position``) shows the
    victim's patches under attack. ``pool_probs``: the pool's router distributions in that layer,
    if already computed."""
    g = group_size(model)
    position = g - 1 if position is None else position
    if pool_probs is None:
        pool_probs = _router_probs(model, pool)[layer]
    victim_probs = _router_probs(model, np.asarray(victim)[None])[layer][0]
    group = list(np.asarray(pool)[choose_fillers(victim_probs, pool_probs, g - 1)])
    group.insert(position, np.asarray(victim))
    return np.stack(group), position


@contextlib.contextmanager
def _mitigated(model, mitigation, slack):
    if mitigation == "slack":
        factor = explorer.trained_capacity(model)
        if factor is None:
            raise InputError("mitigation='slack' needs a router with a capacity factor (not Soft MoE or dropless).")
        with explorer.capacity(model, factor * slack):
            yield
    elif mitigation == "bpr":
        routers = [b.mlp.router for b in _moe_blocks(model)]
        if not all(isinstance(r.allocation, routers_lib.TokenChoice) for r in routers):
            raise InputError("mitigation='bpr' (Batch Prioritized Routing) applies to Token Choice routers only.")
        saved = [(r, r.allocation) for r in routers]
        for r in routers:
            r.allocation = dataclasses.replace(r.allocation, batch_priority=True)
        try:
            yield
        finally:
            for r, allocation in saved:
                r.allocation = allocation
    elif mitigation == "per_image":
        with batch_invariant(model, "per_image"):
            yield
    else:
        yield


def filler_attack(model, victims: np.ndarray, pool: np.ndarray, *, layer: int = 0, mitigation: str | None = None,
                  slack: float = 2.0, seed: int = 0) -> dict:
    """The buffer-overflow attack of Hayes, Shumailov and Yona (arXiv 2402.05526) on each victim.

    For victim v, the attacker fills the rest of v's routing group with the ``g - 1`` images of
    ``pool`` that most want v's experts in MoE layer ``layer`` (:func:`choose_fillers`) and puts v
    last (Token Choice serves a group's tokens in order). The benign reference routes v with
    ``g - 1`` random pool images at a random position; a second benign group measures how much v's
    prediction changes without an attacker (the model's own batch dependence).

    ``mitigation``: None; ``"random_order"`` (the server shuffles each batch, so v sits at a random
    position among the fillers); ``"slack"`` (``slack`` times the trained capacity factor);
    ``"bpr"`` (Batch Prioritized Routing, Token Choice); ``"per_image"`` (groups of one image).

    Returns ``{"flip_rate", "benign_change", "victims", "flip_interval", "benign_interval", ...}``:
    the shares of victims whose predicted class under attack differs from the benign reference,
    and whose second benign prediction does, each with a 95 % Wilson interval.
    """
    if mitigation not in MITIGATIONS:
        raise InputError(f"mitigation must be one of {MITIGATIONS}, got {mitigation!r}.")
    victims, pool = np.asarray(victims), np.asarray(pool)
    if victims.ndim != 4 or pool.ndim != 4:
        raise InputError(f"victims and pool must be images [N, H, W, C], got {victims.shape} and {pool.shape}.")
    rng = np.random.default_rng(seed)
    with _mitigated(model, mitigation, slack):
        g = group_size(model)
        if len(pool) < 2 * g:
            raise InputError(f"pool must hold at least 2 x group_images = {2 * g} images, got {len(pool)}.")
        rows = []
        if g > 1:
            victim_probs = _router_probs(model, victims)[layer]
            pool_probs = _router_probs(model, pool)[layer]
        for v in range(len(victims)):
            if g == 1:
                rows.append(([], 0, [], 0, [], 0))  # alone in every group: nothing to fill
                continue
            fillers = choose_fillers(victim_probs[v], pool_probs, g - 1)
            place = int(rng.integers(g)) if mitigation == "random_order" else g - 1
            benign = [rng.choice(len(pool), g - 1, replace=False) for _ in range(2)]
            rows.append((fillers, place, benign[0], int(rng.integers(g)), benign[1], int(rng.integers(g))))
        groups, where = [], []
        for v, (fillers, place, b0, p0, b1, p1) in enumerate(rows):
            for members, position in ((fillers, place), (b0, p0), (b1, p1)):
                group = list(pool[np.asarray(members, int)])
                group.insert(position, victims[v])
                groups.append(np.stack(group))
                where.append(position)
        preds = _grouped_predictions(model, np.stack(groups))
    victim_preds = preds[np.arange(len(groups)), where].reshape(len(victims), 3)
    attacked, benign, benign2 = victim_preds.T
    flips, changes = int(np.sum(attacked != benign)), int(np.sum(benign2 != benign))
    return {"mitigation": mitigation, "victims": len(victims), "group_images": g, "layer": layer,
            "flip_rate": flips / len(victims), "flip_interval": _wilson(flips, len(victims)),
            "benign_change": changes / len(victims), "benign_interval": _wilson(changes, len(victims)),
            "predictions": {"attacked": attacked.tolist(), "benign": benign.tolist(), "benign_again": benign2.tolist()}}


def _wilson(successes: int, n: int) -> tuple[float, float]:
    """Wilson's 95 % interval for a binomial share."""
    z, p = 1.959963984540054, successes / n
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def capacity_sweep(model, dataset, factors, *, regroupings: int = 4, seed: int = 0, batch_size: int = 400) -> list[dict]:
    """The test-time capacity trade-off (V-MoE, arXiv 2106.05974, Sec. 4): for each capacity
    factor of ``factors`` (what the model's configuration means by one), the test accuracy on
    ``dataset`` (``.images``, ``.labels``), per MoE layer the share of tokens no expert processes
    and the share of the router's picks dropped (:func:`mini_moe.evaluate.routing_summary`), and
    :func:`batch_dependence` under random regrouping. A model without a capacity (Soft MoE, the
    dropless path) gives one row, ``capacity_factor`` None."""
    if not explorer.has_capacity(model):
        factors = [None]
    rows = []
    for factor in factors:
        with explorer.capacity(model, factor):
            preds, layers = evaluate.routing_record(model, dataset.images, batch_size=batch_size)
            summaries = [evaluate.routing_summary(layer) for layer in layers]
            dependence = batch_dependence(model, dataset.images, regroupings=regroupings, seed=seed,
                                          batch_size=batch_size)
        rows.append({"capacity_factor": factor, "accuracy": float(np.mean(preds == dataset.labels)),
                     "unprocessed": [s["unprocessed"] for s in summaries],
                     "dropped_routes": [s["dropped_routes"] for s in summaries],
                     "batch_dependence": dependence["regroup"]})
    return rows


def twin_fates(model, image: np.ndarray, companions: np.ndarray, *, first: int = 0, second: int | None = None) -> list[dict]:
    """Two copies of ``image`` in one routing group, at positions ``first`` and ``second`` (default
    last), the other places filled with ``companions``: per MoE layer, which of the copies' patches
    some expert processes (``first [P]``, ``second [P]``, bool) and the share of patches whose
    fate differs. Identical patches have identical scores, so whatever separates them is their
    position: Token Choice serves earlier tokens first, and ``jax.lax.top_k`` (Expert Choice,
    Batch Prioritized Routing's sort) puts the lower index first among equal values."""
    g = group_size(model)
    if g < 2:
        raise InputError("twin_fates needs routing groups of at least 2 images (not Soft MoE or per-image groups).")
    second = g - 1 if second is None else second
    if not (0 <= first < g and 0 <= second < g and first != second):
        raise InputError(f"first and second must be two different positions in 0..{g - 1}, got {first}, {second}.")
    companions = np.asarray(companions)[: g - 2]
    if len(companions) < g - 2:
        raise InputError(f"companions must hold at least group_images - 2 = {g - 2} images, got {len(companions)}.")
    group = list(companions)
    for position in sorted((first, second)):
        group.insert(position, np.asarray(image))
    _, layers = evaluate.routing_record(model, np.stack(group), batch_size=g)
    out = []
    for layer in layers:
        processed = layer["hits"].any(-1)  # [g, P]
        out.append({"first": processed[first], "second": processed[second],
                    "differ": float(np.mean(processed[first] != processed[second]))})
    return out


class _RoundedLinear(nnx.Module):
    """A router's linear map computed in ``dtype`` (inputs and kernel rounded to it, the product
    accumulated in it), its logits handed on in float32 as the rest of the router expects."""

    def __init__(self, inner: nnx.Linear, dtype):
        self.inner, self.dtype = inner, jnp.dtype(dtype)

    def __call__(self, x):
        saved, self.inner.dtype = self.inner.dtype, self.dtype
        try:
            return self.inner(x).astype(x.dtype)
        finally:
            self.inner.dtype = saved


@contextlib.contextmanager
def router_dtype(model, dtype, layers=None):
    """Compute the routers' logits of MoE layers ``layers`` (None: all) in ``dtype`` for the block:
    every linear map of their affinities rounds its input and kernel to ``dtype`` and multiplies
    in it, as an inference engine with a bfloat16 router does; softmax, top-k and the rest stay
    in float32, so what changes is the logits' rounding."""
    blocks = _moe_blocks(model)
    chosen = range(len(blocks)) if layers is None else layers
    swapped = []
    for i in chosen:
        affinity = blocks[i].mlp.router.affinity
        for path, module in list(nnx.iter_graph(affinity)):
            if isinstance(module, nnx.Linear) and path:
                parent = affinity
                for name in path[:-1]:
                    parent = getattr(parent, name)
                swapped.append((parent, path[-1], module))
    for parent, name, module in swapped:
        setattr(parent, name, _RoundedLinear(module, dtype))
    try:
        yield model
    finally:
        for parent, name, module in swapped:
            setattr(parent, name, module)


def _chosen_sets(model, images, batch_size) -> list[np.ndarray | None]:
    """Per MoE layer, ``bool [N, P, E]``: the experts each patch's router prefers, before any
    capacity (Token Choice: its top k; ReLU routing: its positive gates; Expert Choice: its top
    1), or None for Soft MoE (no choice of experts to compare)."""
    out = []
    probs = _router_probs(model, images, batch_size)
    for block, p in zip(_moe_blocks(model), probs):
        allocation = block.mlp.router.allocation
        if block.mlp.router.per_image:
            out.append(None)
        elif getattr(allocation, "min_score", None) is not None:
            out.append(p > 0)
        else:
            k = min(getattr(allocation, "k", 1), p.shape[-1])
            top = np.argsort(-p, axis=-1, kind="stable")[..., :k]
            chosen = np.zeros(p.shape, bool)
            np.put_along_axis(chosen, top, True, axis=-1)
            out.append(chosen)
    return out


def precision_mismatch(model, images: np.ndarray, *, dtype="bfloat16", batch_size: int = 400) -> list[dict]:
    """Per MoE layer, the share of patches whose set of preferred experts changes when routers
    compute in ``dtype`` instead of float32 (the set: Token Choice's top k of the router's
    distribution, ReLU routing's positive gates, Expert Choice's top 1):

    * ``"isolated"``: only this layer's router in ``dtype`` (the layers below are unchanged, so
      the difference is this router's own rounding);
    * ``"cascade"``: every router in ``dtype`` (what an engine with low-precision routers does:
      an earlier layer's changed routing changes this layer's input too).

    None for a Soft MoE layer."""
    images = np.asarray(images)
    reference = _chosen_sets(model, images, batch_size)
    with router_dtype(model, dtype):
        cascade = _chosen_sets(model, images, batch_size)
    out = []
    for i, ref in enumerate(reference):
        if ref is None:
            out.append(None)
            continue
        with router_dtype(model, dtype, layers=[i]):
            isolated = _chosen_sets(model, images, batch_size)[i]
        out.append({"isolated": float(np.mean(np.any(isolated != ref, -1))),
                    "cascade": float(np.mean(np.any(cascade[i] != ref, -1)))})
    return out


class _Replayed:
    """Stands in for a router: calls it (its metrics and probabilities stay live) and hands the
    layer the recorded routing instead of the one it computed."""

    def __init__(self, router, routing):
        self.router, self.routing = router, routing

    def __getattr__(self, name):  # per_image, affinity, allocation, ...: the router's
        return getattr(self.router, name)

    def __call__(self, x, **kwargs):
        return self.router(x, **kwargs).replace(routing=self.routing)


def _check_replayable(model):
    dropless = [i for i, b in enumerate(_moe_blocks(model)) if b.mlp.path == "dropless"]
    if dropless:
        raise InputError(f"routing replay needs dispatch and combine tensors; MoE layers {dropless} run on the "
                         "dropless path, which sorts picks instead. Evaluate them on another path (moe_path='einsum').")


def record_routing(model, images: np.ndarray) -> tuple:
    """One eval-mode forward pass of ``images`` (whole routing groups), run op by op: per MoE layer
    the :class:`~mini_moe.routing.Routing` (dispatch and combine ``[G, T, E, C]``) it used."""
    _check_replayable(model)
    with evaluate.eval_mode(model):
        return tuple(model(jnp.asarray(images), return_routing=True).routings)


def replay_routing(model, images: np.ndarray, routings) -> np.ndarray:
    """The logits ``[N, classes]`` of ``images`` with every MoE layer computing eq. (2) from the
    recorded ``routings`` (:func:`record_routing`) instead of its router's (the router still runs;
    its routing is discarded), op by op as :func:`record_routing` runs, so that replaying a pass's
    own routing gives it back bit for bit. ``routings=None`` runs the model's own routing the same
    way (the reference to compare a replay with)."""
    _check_replayable(model)
    blocks = _moe_blocks(model)
    if routings is not None and len(routings) != len(blocks):
        raise InputError(f"routings must hold one routing per MoE layer ({len(blocks)}), got {len(routings)}.")
    saved = [b.mlp.router for b in blocks]
    try:
        if routings is not None:
            for b, routing in zip(blocks, routings):
                object.__setattr__(b.mlp, "router", _Replayed(b.mlp.router, routing))
        with evaluate.eval_mode(model):
            return np.asarray(model(jnp.asarray(images)).logits)
    finally:
        for b, router in zip(blocks, saved):
            object.__setattr__(b.mlp, "router", router)
