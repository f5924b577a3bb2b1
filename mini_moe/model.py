"""A small Vision Transformer whose MLPs can be MoE layers with any router (V-MoE).

Architecture (Dosovitskiy et al. 2021; Riquelme et al. 2021): non-overlapping patches ->
linear embedding + learned position embeddings -> pre-norm blocks (attention, then an
MLP or MoE) -> layer norm -> global average pooling -> linear head.

MoE placement: ``"every2"`` replaces the MLP of every other block (V-MoE "Every-2": blocks
1, 3, ...), ``"lastN"`` (e.g. ``"last2"``) the last N blocks (Soft MoE's placement),
``"none"`` gives the dense ViT. Sparse routers route per group of ``group_images`` images'
tokens; Soft MoE per image. A router registered with ``reads="pixels"`` (the raw-key controls)
routes each token by its raw patch, the patchified pixels the embedding receives, which the
model hands to every MoE layer alongside the representation.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# A list of sub-modules: nnx.List on flax >= 0.12; flax 0.11 (Colab's runtime) takes a plain list.
_ModuleList = getattr(nnx, "List", list)

from mini_moe import parallel
from mini_moe import routers as routers_lib
from mini_moe.layer import NULL_KINDS, PATHS, MlpExperts, NullExperts, moe, moe_sorted, overflow
from mini_moe.validate import InputError, check_int

Array = Any
DTYPES = ("float32", "bfloat16")  # compute dtypes of ModelConfig.dtype
#: Every path of the MoE layer, eq. (2) as einsum or gather (:func:`mini_moe.layer.moe`) and
#: dropless Token Choice by sorting and grouped matmuls (:func:`mini_moe.layer.moe_sorted`).
MOE_PATHS = PATHS + ("dropless",)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of :class:`VisionMoE` (see ``mini_moe.config`` for named presets)."""

    image_size: int = 28
    channels: int = 1
    patch_size: int = 4
    num_classes: int = 10
    dim: int = 64
    depth: int = 4
    heads: int = 4
    mlp_dim: int = 128  # hidden size of the dense MLPs and of every expert
    router: str | None = "soft_moe"  # None: the dense ViT
    num_experts: int = 8
    placement: str = "every2"  # "every2", "lastN" or "none"
    group_images: int = 8  # images per routing group (sparse routers)
    router_kwargs: tuple = ()  # (("k", 2), ...): hashable, so configs can key caches
    moe_path: str = "auto"  # layer path: "auto", "einsum", "gather" or "dropless" (MOE_PATHS)
    dtype: str = "float32"  # compute dtype, "float32" or "bfloat16" (parameters stay float32; see VisionMoE)
    fine_grained: int = 1  # m: every expert split into m of mlp_dim / m hidden units (DeepSeekMoE)
    shared_experts: int = 0  # K_s fine-grained experts that every token passes through (DeepSeekMoE)
    # kinds of the null experts in the router's choice set ("zero", "identity", "constant"); a router
    # with null experts (adamoe, longcat) given none gets its default count of zero experts
    null_experts: tuple = ()

    def __post_init__(self):
        for name in ("image_size", "channels", "patch_size", "num_classes", "dim", "depth", "heads",
                     "mlp_dim", "num_experts", "group_images"):
            check_int(name, getattr(self, name))
        if self.image_size % self.patch_size:
            raise InputError(
                f"image_size={self.image_size} must be divisible by patch_size={self.patch_size}."
            )
        if self.dim % self.heads:
            raise InputError(f"dim={self.dim} must be divisible by heads={self.heads}.")
        if self.router is not None and self.router not in routers_lib.ROUTERS:
            raise InputError(
                f"Unknown router {self.router!r}; expected None (dense) or one of: "
                f"{', '.join(sorted(routers_lib.ROUTERS))}."
            )
        self.moe_blocks()  # validates placement
        if self.dtype not in DTYPES:
            raise InputError(f"dtype must be one of {DTYPES} (the compute dtype), got {self.dtype!r}.")
        if self.moe_path not in MOE_PATHS:
            raise InputError(f"moe_path must be one of {MOE_PATHS}, got {self.moe_path!r}.")
        if self.moe_path == "dropless" and self.router is not None and routers_lib.spec(self.router).allocation != "token":
            raise InputError(f"moe_path='dropless' needs a Token Choice router, not {self.router!r} "
                             f"(allocation {routers_lib.spec(self.router).allocation!r}).")
        check_int("fine_grained", self.fine_grained)
        check_int("shared_experts", self.shared_experts, 0)
        if self.mlp_dim % self.fine_grained:
            raise InputError(f"fine_grained={self.fine_grained} must divide mlp_dim={self.mlp_dim} "
                             "(each expert is split into fine_grained experts of mlp_dim / fine_grained units).")
        self.routed_options()  # validates the fine-grained budget
        options = routers_lib.spec(self.router).options if self.router is not None else {}
        if "null_experts" in options and not self.null_experts:  # the router's default count, zero experts
            count = dict(self.router_kwargs).get("null_experts", options["null_experts"])
            object.__setattr__(self, "null_experts", ("zero",) * count)
        if self.null_experts:
            if not isinstance(self.null_experts, tuple) or any(k not in NULL_KINDS for k in self.null_experts):
                raise InputError(f"null_experts must be a tuple of kinds from {NULL_KINDS}, got {self.null_experts!r}.")
            if "null_experts" not in options:
                raise InputError(f"null_experts needs a router with null experts in its choice set ('adamoe' or "
                                 f"'longcat'), not {self.router!r}.")

    @property
    def routed_experts(self) -> int:
        """``num_experts * fine_grained``, the number of routed experts."""
        return self.num_experts * self.fine_grained

    def routed_options(self) -> dict:
        """The router's options for the routed experts (DeepSeekMoE, arXiv 2401.06066, Sec. 3).

        With ``fine_grained = m`` and ``shared_experts = K_s``, each of the E experts becomes m
        experts of ``mlp_dim / m`` hidden units, and K_s such experts process every token. The
        activated FLOPs stay those of the coarse layer: a token's routed slots shrink from s to
        ``m s - K_s`` fine experts (m s fine slots cost what s coarse ones did, and the shared
        experts take K_s of them). So Token Choice's ``k`` and ``capacity_factor`` and Expert
        Choice's ``capacity_factor`` become ``m x - K_s``. Soft MoE (slots, not experts per
        token) is not split."""
        kwargs = dict(self.router_kwargs)
        if self.null_experts:
            kwargs["null_experts"] = len(self.null_experts)
        m, shared = self.fine_grained, self.shared_experts
        if self.router is None or (m == 1 and shared == 0):
            return kwargs
        spec = routers_lib.spec(self.router)
        if spec.allocation == "soft":
            raise InputError(f"fine_grained and shared_experts apply to Token and Expert Choice routers, not to "
                             f"{self.router!r} (a soft allocation); leave them at 1 and 0.")
        defaults = spec.options
        if spec.allocation == "token":
            k = kwargs.get("k", defaults.get("k", 1))
            factor = kwargs.get("capacity_factor", defaults.get("capacity_factor"))
            kwargs |= {"k": m * k - shared, "capacity_factor": m * (k if factor is None else factor) - shared}
            if kwargs["k"] < 1:
                raise InputError(f"shared_experts={shared} leaves no routed expert: fine_grained * k = {m * k} "
                                 "must exceed it.")
        else:
            kwargs["capacity_factor"] = m * kwargs.get("capacity_factor", defaults.get("capacity_factor", 1.0)) - shared
            if not kwargs["capacity_factor"] > 0:
                raise InputError(f"shared_experts={shared} leaves no routed slots: fine_grained * capacity_factor "
                                 f"= {kwargs['capacity_factor'] + shared:g} must exceed it.")
        return kwargs

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def moe_blocks(self) -> tuple[int, ...]:
        """Indices of the blocks whose MLP is an MoE layer."""
        if self.router is None or self.placement == "none":
            return ()
        if self.placement == "every2":
            return tuple(range(1, self.depth, 2))
        match = re.fullmatch(r"last(\d+)", self.placement)
        if not match or not 1 <= int(match.group(1)) <= self.depth:
            raise InputError(
                f"placement must be 'every2', 'none' or 'lastN' with 1 <= N <= depth={self.depth}, "
                f"got {self.placement!r}."
            )
        return tuple(range(self.depth - int(match.group(1)), self.depth))


@flax.struct.dataclass
class ModelOutput:
    """What :class:`VisionMoE` returns.

    Attributes:
      logits: ``[B, classes]``.
      aux_loss: sum of the MoE layers' auxiliary losses.
      metrics: per MoE layer, the router's metrics dict.
      features: pooled features ``[B, D]`` (for linear probes).
      probs: per MoE layer, ``[B, N, E]`` each patch's distribution over experts.
      routings: per MoE layer, the :class:`~mini_moe.routing.Routing` (grouped as the
        router saw it), only with ``return_routing=True``.
      picks: per MoE layer, ``bool [B, N, E (+ Z)]`` the experts each patch picked before any
        capacity cut, or None where the router makes no per-token picks (Expert Choice, Soft MoE);
        only with ``return_routing=True`` (:attr:`~mini_moe.routers.RouterOutput.picks`).
    """

    logits: Array
    aux_loss: Array
    metrics: tuple
    features: Array
    probs: tuple
    routings: tuple = ()
    picks: tuple = ()


def patchify(images: Array, patch_size: int) -> Array:
    """``[B, H, W, C]`` -> ``[B, (H/p)*(W/p), p*p*C]``, patches in row-major order."""
    b, h, w, c = images.shape
    if h % patch_size or w % patch_size:
        raise InputError(f"image size {h}x{w} must be divisible by patch_size={patch_size}.")
    x = images.reshape(b, h // patch_size, patch_size, w // patch_size, patch_size, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, (h // patch_size) * (w // patch_size), -1)


class MoeLayer(nnx.Module):
    """The MoE layer of eq. (2), the one the whole package uses (the model, the benchmarks and
    the controlled experiment of :mod:`mini_moe.subtasks`): a router, experts and the layer.

    ``layer(x [G, T, D], mesh=None, router_input=None) -> (y [G, T, D], RouterOutput)``: every
    group of T tokens is routed on its own, by ``x`` itself or, where given, by ``router_input
    [G, T, D_r]`` (one row per token of ``x``: the raw patches a router with ``reads="pixels"``
    reads). The router runs in float32 whatever the compute dtype (logits,
    softmax, transport plans and auxiliary losses); its dispatch and combine tensors are cast
    to the tokens' dtype where eq. (2) uses them, and the experts compute in that dtype.

    Args:
      router: a :class:`~mini_moe.routers.Router`.
      experts: expert inputs ``[E, N, D]`` -> outputs (:class:`~mini_moe.layer.MlpExperts`).
      path: how the layer is computed on one device: ``"auto"``, ``"einsum"`` or ``"gather"``
        (eq. 2, :func:`~mini_moe.layer.moe`), or ``"dropless"`` (Token Choice routers only):
        every token reaches its k experts whatever the load (the router's buffers are T deep),
        computed by sorting the picks by expert and two grouped matmuls
        (:func:`~mini_moe.layer.moe_sorted`), with no ``[T, E, C]`` tensor.
      shared: None, or a module ``[..., D] -> [..., D]`` that every token passes through, added
        to the routed output (DeepSeekMoE's shared experts).
      null: None, or the :class:`~mini_moe.layer.NullExperts` of a router with null experts
        (``TokenChoice.null_experts``): the real experts take the routing tensors, the null ones
        the router's ``null_gates``.

    With a ``mesh`` (:func:`mini_moe.parallel.make_mesh`) the experts run split over its
    ``"expert"`` axis and tokens travel by ``all_to_all``
    (:func:`mini_moe.parallel.expert_parallel_moe`, which picks its own path: gather for sparse
    routings, einsum for soft ones), so a ``path`` other than ``"auto"`` is refused there.
    """

    def __init__(self, router: routers_lib.Router, experts, *, path: str = "auto", shared=None, null=None):
        if path not in MOE_PATHS:
            raise InputError(f"path must be one of {MOE_PATHS}, got {path!r}.")
        if path == "dropless" and not router.allocation.supports_dropless:
            raise InputError(f"path='dropless' needs a Token Choice router, not {type(router.allocation).__name__}.")
        routed_null = getattr(getattr(router, "allocation", None), "null_experts", 0)  # router None: set later
        if routed_null != (0 if null is None else len(null.kinds)):
            raise InputError(f"the router routes to {routed_null} null experts but the layer has "
                             f"{0 if null is None else len(null.kinds)} (null: a NullExperts with one kind per "
                             "null column of the router).")
        self.router, self.experts, self.path, self.shared, self.null = router, experts, path, shared, null

    def __call__(self, x: Array, mesh: parallel.Mesh | None = None,
                 router_input: Array | None = None) -> tuple[Array, routers_lib.RouterOutput]:
        dropless = self.path == "dropless" and mesh is None
        keys = x if router_input is None else router_input  # what the router routes by
        out = self.router(keys.astype(jnp.float32), dropless=dropless)
        if dropless:
            picks = self.router.allocation.real_picks(out.affinities)
            bound = self.router.allocation.max_picks(math.prod(x.shape[:-1]))
            y = moe_sorted(x, picks["scores"], self.experts, k=picks["k"], combine_scores=picks["combine_scores"],
                           min_score=picks["min_score"], max_picks=bound)
            if bound is not None:  # the picks the bound dropped (ReMoE's first, nearly dense steps)
                out.metrics["overflow"] = overflow(picks["scores"], k=picks["k"], min_score=picks["min_score"],
                                                   max_picks=bound)
        elif mesh is None:
            y = moe(x, out.routing, self.experts, path=self.path)
        elif self.path != "auto":
            raise InputError(f"moe_path={self.path!r} applies on one device; with a mesh the expert-parallel "
                             "layer picks its own path. Use moe_path='auto' with a mesh.")
        else:
            y = parallel.expert_parallel_moe(x, out.routing, self.experts, mesh)
        if out.null_gates is not None:  # zero experts add nothing and are never computed
            extra = self.null(x, out.null_gates)
            y = y if extra is None else y + extra
        return (y if self.shared is None else y + self.shared(x)), out


class MoeMlp(MoeLayer):
    """An MoE layer in place of a Transformer MLP: :class:`MoeLayer` on routing groups.

    Regroups the ``[B, N, D]`` tokens of a batch into routing groups first: one image
    per group for Soft MoE, ``group_images`` images per group for sparse routers. A router
    registered with ``reads="pixels"`` is built for the raw patches (``p*p*C`` values per token)
    and routes by them, regrouped as the tokens are.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        hidden = cfg.mlp_dim // cfg.fine_grained
        self.reads = routers_lib.spec(cfg.router).reads  # "representation" or "pixels"
        router_dim = cfg.patch_size**2 * cfg.channels if self.reads == "pixels" else cfg.dim
        router = routers_lib.make_router(cfg.router, router_dim, cfg.routed_experts, rngs=rngs, **cfg.routed_options())
        experts = MlpExperts(cfg.routed_experts, cfg.dim, hidden, rngs=rngs)
        # K_s shared experts of `hidden` units summed are one MLP of K_s * hidden units.
        shared = DenseMlp(cfg.dim, cfg.shared_experts * hidden, dtype=jnp.dtype(cfg.dtype), rngs=rngs) \
            if cfg.shared_experts else None
        null = NullExperts(cfg.null_experts, cfg.dim, rngs=rngs) if cfg.null_experts else None
        super().__init__(router, experts, path=cfg.moe_path, shared=shared, null=null)
        self.group_images = cfg.group_images
        self.record = False  # :func:`mini_moe.modes.recording`: keep this layer's input tokens

    def __call__(self, x: Array, mesh: parallel.Mesh | None = None,
                 patches: Array | None = None) -> tuple[Array, routers_lib.RouterOutput]:
        """``x [B, N, D]`` (and the raw ``patches [B, N, p*p*C]``, which a router that reads
        pixels needs) -> (``[B, N, D]``, the router's output with ``probs [B, N, E]``)."""
        b, n, d = x.shape
        if self.record:  # one call's input [B, N, D], read and cleared by mini_moe.modes.recording's caller
            self.recorded = nnx.Intermediate(x)
        per_group = 1 if self.router.per_image else min(self.group_images, b)
        if b % per_group:
            raise InputError(
                f"batch size {b} must be a multiple of group_images={per_group} for sparse routers "
                "(pad the batch, or change group_images)."
            )
        keys = None
        if self.reads == "pixels":
            if patches is None:
                raise InputError("this MoE layer's router reads the raw patches (reads='pixels'); pass patches "
                                 "[B, N, p*p*C] (VisionMoE does).")
            keys = patches.reshape(b // per_group, per_group * n, -1)
        y, out = super().__call__(x.reshape(b // per_group, per_group * n, d), mesh, keys)
        picks = None if out.picks is None else out.picks.reshape(b, n, -1)
        return y.reshape(b, n, d), out.replace(probs=out.probs.reshape(b, n, -1), picks=picks)


class DenseMlp(nnx.Module):
    """Two-layer GELU MLP ``[..., D] -> [..., D]`` computing in ``dtype`` (parameters float32)."""

    def __init__(self, dim: int, hidden: int, *, dtype=None, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(dim, hidden, dtype=dtype, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, dim, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


class Block(nnx.Module):
    """Pre-norm Transformer block; the MLP is dense or an :class:`MoeMlp`."""

    def __init__(self, cfg: ModelConfig, use_moe: bool, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.norm1 = nnx.LayerNorm(cfg.dim, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(cfg.heads, cfg.dim, decode=False, deterministic=True, dtype=dtype,
                                           rngs=rngs)
        self.norm2 = nnx.LayerNorm(cfg.dim, dtype=dtype, rngs=rngs)
        self.mlp = MoeMlp(cfg, rngs=rngs) if use_moe else DenseMlp(cfg.dim, cfg.mlp_dim, dtype=dtype, rngs=rngs)
        self.use_moe = use_moe

    def __call__(self, x, mesh=None, patches=None):
        x = x + self.attn(self.norm1(x))
        if self.use_moe:
            y, out = self.mlp(self.norm2(x), mesh, patches)
            return x + y, out
        return x + self.mlp(self.norm2(x)), None


class VisionMoE(nnx.Module):
    """ViT / V-MoE classifier. ``model(images [B, H, W, C]) -> ModelOutput``.

    Mixed precision (``cfg.dtype = "bfloat16"``): parameters are float32; the patch embedding,
    attention, layer norms, dense MLPs, experts and the residual stream compute in bfloat16
    (dispatch and combine are cast to it in eq. 2); the routers (logits, softmax, transport
    plans, auxiliary losses), the final layer norm, the pooled features and the classifier head
    compute in float32, so logits and losses are float32.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        patch_dim = cfg.patch_size**2 * cfg.channels
        self.embed = nnx.Linear(patch_dim, cfg.dim, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (1, cfg.num_patches, cfg.dim)))
        moe_blocks = cfg.moe_blocks()
        self.blocks = _ModuleList([Block(cfg, i in moe_blocks, rngs=rngs) for i in range(cfg.depth)])
        self.norm = nnx.LayerNorm(cfg.dim, rngs=rngs)
        self.head = nnx.Linear(cfg.dim, cfg.num_classes, kernel_init=nnx.initializers.zeros, rngs=rngs)

    def __call__(self, images: Array, *, return_routing: bool = False,
                 mesh: parallel.Mesh | None = None) -> ModelOutput:
        """Classify ``images [B, H, W, C]``. ``return_routing`` also returns every MoE layer's
        routing tensors; ``mesh`` runs the experts split over its ``"expert"`` axis (expert
        parallelism: place the parameters with :func:`mini_moe.parallel.shard_model` and the
        batch with :func:`mini_moe.parallel.batch_sharding` first)."""
        cfg = self.cfg
        shape = np.shape(images)
        if len(shape) != 4 or shape[1:] != (cfg.image_size, cfg.image_size, cfg.channels):
            raise InputError(
                f"images must have shape [B, {cfg.image_size}, {cfg.image_size}, {cfg.channels}], got {shape}."
            )
        dtype = jnp.dtype(cfg.dtype)
        patches = patchify(images, cfg.patch_size)  # the raw patches: the embedding's input and a raw key's
        x = self.embed(patches.astype(dtype)) + self.pos[...].astype(dtype)
        aux, metrics, probs, routings, picks, layers = jnp.zeros(()), [], [], [], [], []
        for block in self.blocks:
            x, out = block(x, mesh, patches)
            if out is not None:
                aux = aux + out.aux_loss
                metrics.append(out.metrics)
                probs.append(out.probs)
                if return_routing:
                    routings.append(out.routing)
                    picks.append(out.picks)
                layers.append((block.mlp.router.affinity, out.metrics))
        routers_lib.after_forward(layers)  # e.g. ReMoE: one lambda for the model, moved by all its layers
        features = jnp.mean(self.norm(x.astype(jnp.float32)), axis=1)
        return ModelOutput(self.head(features), aux, tuple(metrics), features, tuple(probs), tuple(routings),
                           tuple(picks))

    def apply_deferred_updates(self, metrics: list) -> None:
        """After the micro-batches of one accumulated step (routers in
        :func:`~mini_moe.routers.defer_updates` mode): one update of every router's own state from
        the whole batch. ``metrics``: each micro-batch's ``ModelOutput.metrics`` (one dict per MoE
        layer). Each router's affinity gets its layer's metrics of every micro-batch through
        :func:`~mini_moe.routers.after_step` (the protocol of
        :class:`~mini_moe.routers.StatefulAffinity`): DeepSeek-V3's bias moves by the picks summed
        over the micro-batches; ReMoE's lambda by the sparsity averaged over them (equal-sized
        micro-batches), per layer or over the model as its ``l1_scope`` says."""
        affinities = [block.mlp.router.affinity for block in self.blocks if block.use_moe]
        routers_lib.after_step([(affinity, [m[i] for m in metrics]) for i, affinity in enumerate(affinities)])
