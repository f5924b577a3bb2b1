"""Run a trained model differently for a block, then restore it: one idiom, one home.

Every function here that changes how a model routes is a context manager that puts back what it
changed, whatever happens inside the block::

    with modes.eval_mode(model), modes.capacity(model, 2.0):
        accuracy = evaluate.accuracy(model, test)

* :func:`eval_mode`: eval mode (no router noise, running statistics), each module's own mode back
  afterwards;
* :func:`capacity`: another capacity factor (V-MoE's test-time trade, arXiv 2106.05974);
* :func:`dropless_mode`: every MoE layer on the dropless path (no pick dropped);
* :func:`per_image_groups`: routing groups of one image;
* :func:`batch_invariant`: :func:`per_image_groups` or :func:`dropless_mode`, refused where the
  result would still depend on the batch (:func:`invariance` says why);
* :func:`batch_priority`: Batch Prioritized Routing in every Token Choice layer (V-MoE Sec. 4.1);
* :func:`router_dtype`: routers computing their logits in another precision (bfloat16);
* :func:`replay`: every MoE layer routing as a recorded pass did (routing replay).
* :func:`recording`: every MoE layer keeps its input tokens, which :func:`recorded` hands over after
  each forward pass (what :mod:`mini_moe.compress` calibrates on).

The facts these modes read about a model come from its layers, never from its configuration
alone, so a mode and what measures under it cannot disagree: :func:`moe_layers` lists the MoE
layers, :func:`group_images` says how many images share a routing group as the model routes
now (the one source of that number).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax.numpy as jnp
from flax import nnx

from mini_moe import routing
from mini_moe.model import MoeLayer, MoeMlp
from mini_moe.validate import InputError

#: :func:`batch_invariant`'s modes.
INVARIANT_MODES = ("per_image", "dropless")

#: :func:`replay`'s variants: ``"selection"`` replays which experts (and slots) each token used and
#: recomputes the gate weights from the live router (Rollout Routing Replay, Megatron-LM); ``"full"``
#: replays dispatch and combine both.
REPLAY_VARIANTS = ("selection", "full")

_MODE_ATTRIBUTES = ("deterministic", "use_running_average")  # what model.train() / eval() set


def moe_layers(model) -> list[MoeMlp]:
    """The model's MoE layers (:class:`~mini_moe.model.MoeMlp`), bottom to top; an ``InputError``
    for a dense model."""
    layers = [block.mlp for block in model.blocks if block.use_moe]
    if not layers:
        raise InputError("this needs a model with MoE layers; this one is dense (router=None).")
    return layers


def group_images(model) -> int:
    """Images per routing group as the model routes now: 1 for a router that routes each image
    alone (Soft MoE), in :func:`per_image_groups`, or for a dense model; else the MoE layers'
    ``group_images``. The one place this number is read (the configuration's ``group_images`` is
    what the model was built with; a mode may change the layers')."""
    sizes = {1 if m.router.per_image else int(m.group_images)
             for m in (block.mlp for block in model.blocks if block.use_moe)}
    if len(sizes) > 1:
        raise InputError(f"the MoE layers route groups of different sizes {sorted(sizes)}; give them one "
                         "group_images.")
    return sizes.pop() if sizes else 1


@contextlib.contextmanager
def eval_mode(model):
    """Put ``model`` in eval mode for the block, then restore each module's own mode (whether
    it was in train or eval mode before): ``with eval_mode(model): ...``."""
    saved = [(module, name, getattr(module, name))
             for _, module in nnx.iter_graph(model) if isinstance(module, nnx.Module)
             for name in _MODE_ATTRIBUTES if hasattr(module, name)]
    model.eval()
    try:
        yield model
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@contextlib.contextmanager
def _swapped(changes, *, raw: bool = False):
    """Set ``(obj, attribute, value)`` for the block, then put every old value back. ``raw``:
    bypass the module's own ``__setattr__`` (a stand-in router that is not an nnx module)."""
    put = object.__setattr__ if raw else setattr
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in changes]
    try:
        for obj, name, value in changes:
            put(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            put(obj, name, value)


@contextlib.contextmanager
def dropless_mode(model):
    """Compute every MoE layer of ``model`` on the dropless path for the block (every pick reaches
    its expert, no capacity), then restore each layer's own path: ``with dropless_mode(model): ...``.

    Evaluating a model trained with capacity this way separates what dropping cost in training from
    what it costs at inference (DeepSeek-V3 drops no token at inference, its Sec. 2.1.2). Only
    allocations with a dropless path (Token Choice) have one; any other MoE layer raises ``InputError``.
    """
    layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, MoeLayer)]
    others = sorted({type(m.router.allocation).__name__ for m in layers if not m.router.allocation.supports_dropless})
    if others:
        raise InputError(f"dropless evaluation needs Token Choice routers in every MoE layer; this model has {others}.")
    with _swapped([(m, "path", "dropless") for m in layers]):
        yield model


def _routed_factor(cfg, factor: float) -> float:
    """The routers' capacity factor for the configuration's factor ``factor``: what
    :meth:`mini_moe.model.ModelConfig.routed_options` makes of it (``m c - K_s`` with fine-grained
    and shared experts; ``c`` itself otherwise)."""
    kwargs = dict(cfg.router_kwargs) | {"capacity_factor": float(factor)}
    return dataclasses.replace(cfg, router_kwargs=tuple(kwargs.items())).routed_options()["capacity_factor"]


def has_capacity(model) -> bool:
    """Whether the model's routers have a capacity factor that can be changed: not Soft MoE (it has
    slots, no capacity) and not the dropless path (nothing is dropped for capacity)."""
    layer = moe_layers(model)[0]
    return (not layer.router.per_image and layer.path != "dropless"
            and hasattr(layer.router.allocation, "capacity_factor"))


def trained_capacity(model) -> float | None:
    """The capacity factor the model routes with, as its configuration states it (the c of
    :func:`capacity`; None without one: Soft MoE, dropless)."""
    if not has_capacity(model):
        return None
    routed = float(moe_layers(model)[0].router.capacity_factor)
    coarse = (routed + model.cfg.shared_experts) / model.cfg.fine_grained  # the inverse of m c - K_s
    return float(f"{coarse:.12g}")  # without the float round-off of m c - K_s (0.7, not 0.6999...98)


@contextlib.contextmanager
def capacity(model, factor: float | None):
    """Route with capacity factor ``factor`` in every MoE layer whose router has one (Token and
    Expert Choice; Soft MoE has none), for the block; the trained factors come back afterwards.
    ``factor`` means what the model's configuration means by it (``router_kwargs``'
    ``capacity_factor``): with fine-grained and shared experts the routers get ``m c - K_s``.
    ``None`` changes nothing."""
    if factor is not None and not factor > 0:
        raise InputError(f"capacity_factor must be > 0, got {factor!r}.")
    routers = [m.router for m in moe_layers(model) if hasattr(m.router.allocation, "capacity_factor")]
    if factor is None or not routers:
        yield model
        return
    routed = _routed_factor(model.cfg, factor)
    with _swapped([(r, "capacity_factor", routed) for r in routers]):
        yield model


@contextlib.contextmanager
def recording(model):
    """Keep every MoE layer's input tokens for the block: after each forward pass (jitted or not)
    :func:`recorded` returns them, one ``[B, N, D]`` array per MoE layer, and forgets them, so the
    next batch's pass is the same program (what :func:`mini_moe.compress.calibrate` reads)."""
    layers = moe_layers(model)
    try:
        with _swapped([(m, "record", True) for m in layers]):
            yield model
    finally:
        for m in layers:  # nothing recorded outlives the block
            if hasattr(m, "recorded"):
                del m.recorded


def recorded(model) -> list:
    """The input tokens ``[B, N, D]`` of each MoE layer in the last forward pass under
    :func:`recording` (bottom to top), removed from the layers; an ``InputError`` when a layer
    holds none."""
    out = []
    for m in moe_layers(model):
        if not hasattr(m, "recorded"):
            raise InputError("no recorded inputs: run a forward pass inside `with modes.recording(model):` first.")
        out.append(m.recorded[...])
        del m.recorded
    return out


@contextlib.contextmanager
def per_image_groups(model):
    """Route every image in a group of its own for the block (any router; the capacity is then
    counted over one image's P patches: C = round(c P / E))."""
    with _swapped([(m, "group_images", 1) for m in moe_layers(model)]):
        yield model


def invariance(model) -> tuple[bool, str]:
    """Whether the model's predictions depend on nothing but the image, as it routes now, and why.

    Batch-invariant (in exact arithmetic): every MoE layer routes each image alone (Soft MoE;
    groups of one image), or scores each token alone (``affinity.per_token``) with nothing to
    refuse: on the dropless path without ReMoE's pick bound (whose overflow is decided over the
    whole call), or with buffers of C >= T slots (Token Choice: a token's picks go to different
    experts, so no expert is asked for more than T; Expert Choice: every expert takes every
    token). In this book's convention C = round(c T / E), so C >= T is c >= E whatever k (c >= E/k
    where C = round(k c T / E), as in V-MoE). Anything with a smaller
    capacity (Token Choice, Expert Choice, with or without Batch Prioritized Routing) or a
    group-level affinity (the transport plans, the hash control's centring) is not.
    """
    reasons = []
    for i, mlp in enumerate(moe_layers(model)):
        router = mlp.router
        if router.per_image or mlp.group_images == 1:
            continue
        name = type(router.affinity).__name__
        if not getattr(router.affinity, "per_token", False):
            reasons.append(f"MoE layer {i}: {name} scores a token against its whole group")
            continue
        if mlp.path == "dropless":
            if getattr(router.allocation, "pick_bound", None) is not None:
                reasons.append(f"MoE layer {i}: the dropless path's pick bound (ReMoE's active_bound) drops the "
                               "smallest gates of the whole call when it overflows")
            continue
        tokens = mlp.group_images * model.cfg.num_patches
        if router.allocation.budget(tokens, router.num_experts).capacity >= tokens:
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

    * ``"per_image"``: every routing group is one image (:func:`per_image_groups`; any router);
    * ``"dropless"``: every Token Choice layer on the dropless path (:func:`dropless_mode`);
      refused where that would still depend on the batch (see :func:`invariance`).

    Invariant in exact arithmetic: the float results can still differ in the last bits between
    serving batch sizes, because XLA's kernels sum in an order that depends on the shapes (see
    :func:`mini_moe.evaluate.predictions`' ``fixed_batch`` for results bit-identical across them).
    """
    if mode not in INVARIANT_MODES:
        raise InputError(f"mode must be one of {INVARIANT_MODES}, got {mode!r}.")
    if mode == "per_image":
        with per_image_groups(model):
            yield model
        return
    with dropless_mode(model):
        ok, why = invariance(model)
        if not ok:
            raise InputError(f"mode='dropless' leaves this model batch-dependent ({why}); use mode='per_image'.")
        yield model


@contextlib.contextmanager
def batch_priority(model):
    """Batch Prioritized Routing (V-MoE, arXiv 2106.05974, Sec. 4.1) in every MoE layer for the
    block: the group's picks are served by decreasing gate instead of in token order. Token
    Choice routers only."""
    routers = [m.router for m in moe_layers(model)]
    if not all(hasattr(r.allocation, "batch_priority") for r in routers):
        raise InputError("Batch Prioritized Routing applies to Token Choice routers only.")
    with _swapped([(r, "allocation", dataclasses.replace(r.allocation, batch_priority=True)) for r in routers]):
        yield model


class _RoundedLinear(nnx.Module):
    """A router's linear map with its input and kernel rounded to ``dtype`` (bfloat16), the
    product computed by XLA's dot for that dtype (on CPU: exact products, summed in float32, the
    sum rounded once to ``dtype``, as engines with bfloat16 inputs and float32 accumulation do),
    handed on in float32 as the rest of the router expects."""

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
    """Compute the routers' logits of MoE layers ``layers`` (indices; None: all) in ``dtype`` for
    the block: every linear map of their affinities rounds its input and kernel to ``dtype``, and
    the logits come out rounded to it, as an inference engine with a bfloat16 router gives them;
    softmax, top-k and the rest stay in float32, so what changes is the logits' rounding."""
    mlps = moe_layers(model)
    chosen = range(len(mlps)) if layers is None else layers
    swaps = []
    for i in chosen:
        affinity = mlps[i].router.affinity
        for path, module in list(nnx.iter_graph(affinity)):
            if isinstance(module, nnx.Linear) and path:
                parent = affinity
                for name in path[:-1]:
                    parent = getattr(parent, name)
                swaps.append((parent, path[-1], _RoundedLinear(module, dtype)))
    with _swapped(swaps):
        yield model


class _Replayed:
    """Stands in for a router: calls it (its metrics, probabilities and gates stay live) and hands
    the layer the recorded routing (``"full"``), or the recorded slots with the live router's gate
    weights (``"selection"``)."""

    def __init__(self, router, recorded: routing.Routing, variant: str):
        self.router, self.recorded, self.variant = router, recorded, variant

    def __getattr__(self, name):  # per_image, affinity, allocation, ...: the router's
        return getattr(self.router, name)

    def __call__(self, x, **kwargs):
        out = self.router(x, **kwargs)
        if self.variant == "full":
            return out.replace(routing=self.recorded)
        return out.replace(routing=replay_selection(self.recorded, out))


def replay_selection(recorded: routing.Routing, live) -> routing.Routing:
    """The routing that uses the slots of ``recorded`` with the gate weights of the live router
    output ``live`` (:class:`~mini_moe.routers.RouterOutput`): dispatch is the recorded one, and
    the combine weight of token t in a slot of expert e is the live affinity's combine source at
    (t, e), the number the allocation reads a pick's gate from (:func:`mini_moe.routing.token_choice`'s
    ``combine_scores``). Gradients reach the router through those weights, as in Rollout Routing
    Replay (arXiv 2510.11370) and Megatron-LM's ``router_replay.py``, which gather the live scores
    at the replayed indices. For softmax routers that is exactly their rule (V-MoE's gates are the
    softmax at the pick, not renormalised). Affinities that mask and renormalise their gates over
    their own top k (sigmoid gates, top-p, null experts) give a replayed pick that the live router
    would not make the weight 0, and do not renormalise the rest."""
    affinities = live.affinities
    if affinities is None or not recorded.sparse:
        raise InputError("selection replay needs a sparse routing (Token or Expert Choice) and its router's "
                         "affinities; replay Soft MoE with variant='full'.")
    gates = affinities.scores if affinities.combine is None else affinities.combine  # [..., T, E (+Z)]
    dispatch = recorded.dispatch
    gates = gates[..., :dispatch.shape[-2]]  # the real experts (null columns, if any, come last)
    return routing.Routing(dispatch, dispatch.astype(gates.dtype) * gates[..., None], sparse=True)


def check_replayable(model) -> None:
    """Refuse a model whose routing cannot be recorded and replayed: an ``InputError`` for a dense
    model or one with MoE layers on the dropless path (it sorts picks, with no routing tensors)."""
    dropless = [i for i, m in enumerate(moe_layers(model)) if m.path == "dropless"]
    if dropless:
        raise InputError(f"routing replay needs dispatch and combine tensors; MoE layers {dropless} run on the "
                         "dropless path, which sorts picks instead. Evaluate them on another path (moe_path='einsum').")


@contextlib.contextmanager
def replay(model, routings, variant: str = "selection"):
    """Route every MoE layer as a recorded pass did, for the block (routing replay).

    ``routings``: one :class:`~mini_moe.routing.Routing` per MoE layer (dispatch and combine
    ``[G, T, E, C]``, e.g. :func:`mini_moe.inference.record_routing`). ``variant``:

    * ``"selection"``: replay which expert and slot each token used, and compute the gate weights
      from the live router, so gradients still reach it (Rollout Routing Replay, arXiv 2510.11370;
      Megatron-LM's ``moe_enable_routing_replay``). A live router that differs from the recorded
      one (another precision) still changes the output through its weights;
    * ``"full"``: replay dispatch and combine both, so the recorded pass comes back bit for bit
      and the router influences nothing (no gradient reaches it).

    The layers run on the einsum or gather path (the dropless path sorts picks instead of using
    routing tensors, so it is refused).
    """
    if variant not in REPLAY_VARIANTS:
        raise InputError(f"variant must be one of {REPLAY_VARIANTS}, got {variant!r}.")
    check_replayable(model)
    mlps = moe_layers(model)
    if len(routings) != len(mlps):
        raise InputError(f"routings must hold one routing per MoE layer ({len(mlps)}), got {len(routings)}.")
    with _swapped([(m, "router", _Replayed(m.router, rt, variant)) for m, rt in zip(mlps, routings)], raw=True):
        yield model
