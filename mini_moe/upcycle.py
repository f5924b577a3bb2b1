"""Sparse upcycling: an MoE model that starts from a trained dense ViT.

Komatsuzaki et al. (*Sparse Upcycling*, ICLR 2023, arXiv 2212.05055) turn a dense checkpoint
into an MoE model instead of training the MoE from scratch: every parameter outside the MLPs
(patch embedding, position embeddings, attention, layer norms, head) is copied, each MLP that
becomes an MoE layer is copied into all E experts, and only the router starts from random
weights. V-MoE's code does the copy with ``ExpandTileRule`` (``vmoe/initialization/rules.py``):
``jnp.tile(jnp.expand_dims(x, axis), reps)``, a new leading expert axis, E copies along it.

Drop-Upcycling (Nakamura et al., ICLR 2025, arXiv 2502.19261) breaks the experts' symmetry: in
every expert, independently, a random share r of the MLP's hidden units is re-initialised (the
columns of ``w1`` and the entries of ``b1`` feeding those units, the rows of ``w2`` leaving
them), drawn from a normal with the mean and standard deviation of the dense matrix it replaces.
r = 0 is plain copying; r = 1 keeps no hidden unit of the dense MLP.

What copying gives at initialisation follows from eq. (2). With E identical experts,
``MLP_e = MLP``, and a sparse dispatch (each token in at most one slot of an expert),

    MoE(X)[t] = (sum_{e, c} C[t, e, c]) * MLP(x_t),

so the upcycled layer equals the dense MLP exactly where every token's combine weights sum to
1: normalised top-k gates (``sigmoid_loss_free``, ``group_limited`` at k >= 2), the hash router
(weights 1/k), Token Choice with k = E, Expert Choice with C = T; in each case only if nothing
is dropped. Softmax Token Choice at k < E scales each token by its gates' sum (< 1), Expert
Choice at C < T drops some tokens and gives others several experts, and Soft MoE's slots mix
tokens before the (non-linear) experts: there the upcycled model starts away from the dense one.

Komatsuzaki et al.'s vision recipe (Sec. 2.2, "normalize weights after routing", vision only)
divides every token's combine weights by their sum, so that s_t = 1 for each token that reached
an expert and only tokens that reached none keep s_t = 0. ``upcycle(..., renormalize=True)`` does
that (:func:`renormalize_combine`, :class:`RenormalisedTokenChoice`,
:class:`RenormalisedExpertChoice`): with it Softmax Token Choice with nothing dropped computes the
dense model's function exactly, and Expert Choice computes it for every token some expert took.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mini_moe import routers as routers_lib
from mini_moe import routing as routing_lib
from mini_moe.model import ModelConfig, VisionMoE
from mini_moe.train import model_rngs
from mini_moe.validate import InputError, check_int

#: ModelConfig fields that ``upcycle(**overrides)`` may change: none of them changes the shape of
#: a copied parameter. (The architecture's sizes come from the dense model.)
OVERRIDABLE = ("group_images", "moe_path", "dtype")
#: Folded into the seed's key for Drop-Upcycling's draws, apart from the router's initialisation.
DROP_STREAM = 0x64726F70


def expand_tile(x, num_experts: int):
    """V-MoE's ``ExpandTileRule`` on a new leading axis: ``x [...]`` -> ``[E, ...]``, E copies."""
    x = jnp.expand_dims(x, 0)
    return jnp.tile(x, (num_experts,) + (1,) * (x.ndim - 1))


def reinit_units(experts: dict, dense: dict, chosen, noise: dict) -> dict:
    """Drop-Upcycling's re-initialisation, given its choice of units and its draws.

    Args:
      experts: ``w1 [E, D, H]``, ``b1 [E, 1, H]``, ``w2 [E, H, D]`` (and ``b2``, left as it is),
        E copies of the dense MLP.
      dense: the dense MLP's ``w1 [D, H]``, ``b1 [H]``, ``w2 [H, D]``: each one's mean and
        (population) standard deviation are the statistics of its re-drawn entries.
      chosen: bool ``[E, H]``, True where expert e re-initialises its hidden unit j.
      noise: standard normal draws ``w1 [E, D, H]``, ``b1 [E, 1, H]``, ``w2 [E, H, D]``.

    Returns:
      ``experts`` with ``w1[e, :, j]``, ``b1[e, 0, j]`` and ``w2[e, j, :]`` replaced by
      ``mean + std * noise`` of the dense ``w1``, ``b1`` and ``w2`` wherever ``chosen[e, j]``:
      the unit's input column, its bias and its output row.
    """
    chosen = jnp.asarray(chosen, bool)
    masks = {"w1": chosen[:, None, :], "b1": chosen[:, None, :], "w2": chosen[:, :, None]}
    return experts | {name: jnp.where(mask, jnp.mean(dense[name]) + jnp.std(dense[name]) * noise[name], experts[name])
                      for name, mask in masks.items()}


def drop_reinit(experts: dict, dense: dict, ratio: float, key) -> dict:
    """Drop-Upcycling's re-initialisation of tiled experts (:func:`reinit_units` with random draws).

    Args:
      experts: ``w1 [E, D, H]``, ``b1 [E, 1, H]``, ``w2 [E, H, D]`` (and ``b2``, left as it is),
        E copies of the dense MLP.
      dense: the dense MLP's ``w1 [D, H]``, ``b1 [H]``, ``w2 [H, D]``: their means and standard
        deviations are the re-initialisation's statistics.
      ratio: r; every expert re-initialises ``round(r H)`` of its H hidden units, a subset drawn
        independently per expert.
      key: a JAX random key.

    Returns:
      ``experts`` with, for each expert e and each of its chosen units j, ``w1[e, :, j]``,
      ``b1[e, 0, j]`` and ``w2[e, j, :]`` redrawn from ``N(mean, std^2)`` of the dense ``w1``,
      ``b1`` and ``w2`` respectively.
    """
    num_experts, hidden = experts["w1"].shape[0], experts["w1"].shape[-1]
    dropped = math.floor(ratio * hidden + 0.5)
    keys = jax.random.split(key, 4)
    order = jax.vmap(lambda k: jax.random.permutation(k, hidden))(jax.random.split(keys[0], num_experts))
    chosen = jnp.zeros((num_experts, hidden), bool).at[jnp.arange(num_experts)[:, None], order[:, :dropped]].set(True)
    noise = {name: jax.random.normal(k, experts[name].shape, experts[name].dtype)
             for name, k in zip(("w1", "b1", "w2"), keys[1:])}
    return reinit_units(experts, dense, chosen, noise)


def renormalize_combine(rt: routing_lib.Routing) -> routing_lib.Routing:
    """Every token's combine weights divided by their sum ``s_t = sum_{e, c} C[t, e, c]``, so that
    they sum to 1 wherever ``s_t > 0``; a token no slot holds keeps weights 0 (Komatsuzaki et al.
    2023, Sec. 2.2, vision only). The dispatch is unchanged; the compact form of a sparse routing
    (``slot_weight``) is rescaled the same way."""
    total = rt.combine.sum((-2, -1))  # [..., T]
    inverse = jnp.where(total > 0, 1 / jnp.where(total > 0, total, 1), 0)
    combine = rt.combine * inverse[..., None, None].astype(rt.combine.dtype)
    if rt.slot_token is None:
        return routing_lib.Routing(rt.dispatch, combine, sparse=rt.sparse)
    padded = jnp.concatenate([inverse, jnp.zeros(inverse.shape[:-1] + (1,), inverse.dtype)], -1)  # token T: empty
    lead = rt.slot_token.shape[:-2]
    scale = jnp.take_along_axis(padded, rt.slot_token.reshape(lead + (-1,)), -1).reshape(rt.slot_token.shape)
    return routing_lib.Routing(rt.dispatch, combine, sparse=rt.sparse, slot_token=rt.slot_token,
                               slot_weight=rt.slot_weight * scale.astype(rt.slot_weight.dtype))


@dataclasses.dataclass(frozen=True)
class RenormalisedTokenChoice(routers_lib.TokenChoice):
    """:class:`~mini_moe.routers.TokenChoice` whose routing goes through :func:`renormalize_combine`.
    At k = 1 every kept token's weight is then 1, so the task sends the router no gradient (only
    the auxiliary losses train it)."""

    def __call__(self, affinities, budget):
        return renormalize_combine(super().__call__(affinities, budget))


@dataclasses.dataclass(frozen=True)
class RenormalisedExpertChoice(routers_lib.ExpertChoice):
    """:class:`~mini_moe.routers.ExpertChoice` whose routing goes through :func:`renormalize_combine`:
    s_t = 1 for a token one or more experts took, 0 for a token none took. A token that only one
    expert took gets weight 1 and sends the router no gradient from the task."""

    def __call__(self, affinities, budget):
        return renormalize_combine(super().__call__(affinities, budget))


def _renormalised(allocation):
    """The renormalised allocation with ``allocation``'s fields, or an InputError."""
    kinds = {routers_lib.TokenChoice: RenormalisedTokenChoice, routers_lib.ExpertChoice: RenormalisedExpertChoice}
    kind = kinds.get(type(allocation))
    if kind is None or getattr(allocation, "null_experts", 0) or getattr(allocation, "min_score", None) is not None:
        raise InputError(f"renormalize=True needs a Token Choice (no null experts, no min_score) or Expert Choice "
                         f"router, not {allocation!r}: Soft MoE's combine weights already sum to 1.")
    return kind(**{f.name: getattr(allocation, f.name) for f in dataclasses.fields(allocation)})


def upcycled_config(dense_cfg: ModelConfig, *, router: str, num_experts: int, router_kwargs: dict | None = None,
                    placement: str | None = None, **overrides) -> ModelConfig:
    """The :class:`~mini_moe.model.ModelConfig` of the MoE model upcycled from a dense ViT of
    ``dense_cfg``: its sizes, with the router, experts and placement given (placement None: the
    router's registered one, as :func:`mini_moe.config.get_config` gives it: ``"every2"`` for the
    sparse routers, ``"last2"`` for Soft MoE)."""
    if not isinstance(router, str) or router not in routers_lib.ROUTERS:
        raise InputError(f"Unknown router {router!r}; upcycle needs one of: {', '.join(sorted(routers_lib.ROUTERS))}.")
    check_int("num_experts", num_experts)
    if router_kwargs is not None and not isinstance(router_kwargs, dict):
        raise InputError(f"router_kwargs must be a dict of the router's options or None, got {router_kwargs!r}.")
    if overrides.pop("fine_grained", 1) != 1 or overrides.pop("shared_experts", 0) != 0:
        raise InputError("upcycling into fine-grained or shared experts (splitting the dense MLP's hidden units "
                         "between experts) is not implemented; leave fine_grained=1 and shared_experts=0.")
    unknown = sorted(set(overrides) - set(OVERRIDABLE))
    if unknown:
        raise InputError(f"upcycle cannot change {unknown}: the MoE model keeps the dense model's sizes, so that its "
                         f"parameters can be copied. Options it takes: {', '.join(OVERRIDABLE)}.")
    placement = routers_lib.spec(router).placement if placement is None else placement
    if placement == "none":
        raise InputError("placement='none' leaves no MoE layer to upcycle; use 'every2' or 'lastN'.")
    return dataclasses.replace(dense_cfg, router=router, num_experts=num_experts, placement=placement,
                               router_kwargs=tuple(sorted((router_kwargs or {}).items())),
                               fine_grained=1, shared_experts=0, **overrides)


def upcycle(dense_model: VisionMoE, *, router: str = "softmax_token_choice", num_experts: int | None = None,
            drop_ratio: float = 0.0, seed: int = 0, router_kwargs: dict | None = None, placement: str | None = None,
            renormalize: bool = False, **overrides) -> VisionMoE:
    """A :class:`~mini_moe.model.VisionMoE` upcycled from the dense ViT ``dense_model``.

    Args:
      dense_model: a ``VisionMoE`` whose ``cfg.router`` is None (a dense ViT, e.g. from
        :func:`mini_moe.train.load_trained`). It is not modified.
      router: a registered router name (``mini_moe.ROUTERS``).
      num_experts: E (None: ``dense_model.cfg.num_experts``).
      drop_ratio: Drop-Upcycling's r in [0, 1]: the share of each expert's hidden units
        re-initialised (:func:`drop_reinit`); 0 copies the MLP exactly.
      seed: the router's initialisation, which is random (Komatsuzaki et al. 2023: the router is
        the one new module): the router of ``VisionMoE(cfg, rngs=train.model_rngs(seed))``, the
        same as a model trained from scratch with this seed would start with. The draws of
        Drop-Upcycling come from ``seed`` too, on a stream of their own.
      router_kwargs: the router's options (``{"k": 2, "capacity_factor": 2.0}``, ...).
      placement: which blocks' MLPs become MoE layers (``"every2"``, ``"lastN"``); None: the
        router's registered placement (``"every2"``; Soft MoE ``"last2"``).
      renormalize: Komatsuzaki et al.'s "normalize weights after routing" (Sec. 2.2, their vision
        recipe): every MoE layer's router divides each token's combine weights by their sum
        (:func:`renormalize_combine`), so s_t = 1 for every token that reaches an expert. Token
        Choice or Expert Choice routers only, on the ``"einsum"`` or ``"gather"`` path (``moe_path``
        ``"auto"`` included; not ``"dropless"``, which combines from the router's scores). It
        changes the returned model's routers only: it is not part of ``cfg``, so a model rebuilt
        from its config (``train.load_trained``, ``train.train(init_from=...)``) routes without it.
      **overrides: ``group_images``, ``moe_path`` or ``dtype`` of the MoE model's config.

    Returns:
      The MoE model, in training mode (as a new model is). Its ``cfg`` is
      :func:`upcycled_config`'s. Every parameter and variable the dense model has at the same
      place is copied; each MoE block's experts are E copies of that block's dense MLP:
      ``w1 [E, D, H]`` = tiled ``fc1.kernel [D, H]``, ``b1 [E, 1, H]`` = tiled ``fc1.bias [H]``,
      ``w2 [E, H, D]`` = tiled ``fc2.kernel``, ``b2 [E, 1, D]`` = tiled ``fc2.bias``.
    """
    if not isinstance(dense_model, VisionMoE) or dense_model.cfg.router is not None:
        got = f"router={dense_model.cfg.router!r}" if isinstance(dense_model, VisionMoE) else type(dense_model).__name__
        raise InputError(f"dense_model must be a dense ViT (a VisionMoE with ModelConfig.router=None), got {got}.")
    if isinstance(drop_ratio, bool) or not isinstance(drop_ratio, (int, float)) or not 0 <= drop_ratio <= 1:
        raise InputError(f"drop_ratio must be a number in [0, 1] (the share of hidden units re-initialised), "
                         f"got {drop_ratio!r}.")
    check_int("seed", seed, 0)
    if not isinstance(renormalize, bool):
        raise InputError(f"renormalize must be True or False, got {renormalize!r}.")
    num_experts = dense_model.cfg.num_experts if num_experts is None else num_experts
    cfg = upcycled_config(dense_model.cfg, router=router, num_experts=num_experts, router_kwargs=router_kwargs,
                          placement=placement, **overrides)
    if renormalize and cfg.moe_path == "dropless":
        raise InputError("renormalize=True acts on the routing tensors, which the dropless path does not combine "
                         "with; use moe_path 'auto', 'einsum' or 'gather'.")
    moe = VisionMoE(cfg, rngs=model_rngs(seed))  # the router fresh from seed; the rest is overwritten
    moe_blocks = cfg.moe_blocks()
    is_moe_mlp = lambda path: path[0] == "blocks" and path[1] in moe_blocks and path[2] == "mlp"
    copied = [(path, v) for path, v in nnx.to_flat_state(nnx.state(dense_model)) if not is_moe_mlp(path)]
    nnx.update(moe, nnx.from_flat_state(copied))
    for i in moe_blocks:
        mlp, experts = dense_model.blocks[i].mlp, moe.blocks[i].mlp.experts
        dense = dict(w1=mlp.fc1.kernel[...], b1=mlp.fc1.bias[...], w2=mlp.fc2.kernel[...], b2=mlp.fc2.bias[...])
        tiled = dict(w1=expand_tile(dense["w1"], num_experts), b1=expand_tile(dense["b1"][None], num_experts),
                     w2=expand_tile(dense["w2"], num_experts), b2=expand_tile(dense["b2"][None], num_experts))
        if drop_ratio > 0:
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), DROP_STREAM), i)
            tiled = drop_reinit(tiled, dense, drop_ratio, key)
        for name, value in tiled.items():
            getattr(experts, name)[...] = value
        if renormalize:
            router = moe.blocks[i].mlp.router
            router.allocation = _renormalised(router.allocation)
    return moe
