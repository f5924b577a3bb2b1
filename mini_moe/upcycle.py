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
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mini_moe import routers as routers_lib
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
            **overrides) -> VisionMoE:
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
    num_experts = dense_model.cfg.num_experts if num_experts is None else num_experts
    cfg = upcycled_config(dense_model.cfg, router=router, num_experts=num_experts, router_kwargs=router_kwargs,
                          placement=placement, **overrides)
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
    return moe
