"""Trainable routers: one affinity composed with one allocation (Flax NNX modules).

Paper 000's lesson is that a router is two choices: an **affinity**, the scores that say which
token suits which expert, and an **allocation**, the rule that turns scores into routing tensors
under a capacity. Here both are small first-class pieces and a :class:`Router` is one of each:

* affinities (modules with the router's parameters): :class:`Softmax` (softmax(XW)),
  :class:`NoisySoftmax` (V-MoE's noisy softmax with its balancing losses),
  :class:`SigmoidGates` (DeepSeek-V3's sigmoid scores with a balancing bias, no auxiliary loss),
  :class:`ReluGates` (ReMoE's ReLU gates with an adaptive L1 penalty),
  :class:`TopPGates` (top-p routing: each token's fewest top experts whose probabilities reach p),
  :class:`SinkhornPlan` (eq. 8), :class:`QuadraticPlan` (SVMoE), :class:`SparsityConstrainedPlan`
  (eq. 9), :class:`SlotLogits` (Soft MoE's l2-normalised slot logits),
  :class:`HashProjection` (a fixed random projection that nothing learns, a routing control) and
  :class:`RawKey` (a fixed key of the raw patch, before the embedding: the raw-key controls);
* allocations (frozen dataclasses, no parameters, on :class:`Allocation`): :class:`TokenChoice`
  (Algorithm 1, k and Batch Priority Routing), :class:`ExpertChoice` (Algorithm 2) and
  :class:`SoftRouting`.

Affinities and allocations declare what code outside the router needs to know (an affinity's
``per_token``, ``softmax_choice``, ``balance_knob``, ...; an allocation's ``name``, ``per_image``,
``supports_dropless``), and a router reports the picks it made (:attr:`RouterOutput.picks`), so
evaluation never asks which class a router is.

An affinity also says where the combine weights come from (the OT plans take positions from
the plan and, with ``softmax_combine=True``, weights from softmax(XW); paper 000 Sec. 3.4).
Every router maps tokens ``x [..., T, D]`` (leading axes: groups; for Soft MoE, images) to a
:class:`RouterOutput`. The routers of the papers are registered compositions, created by name::

    router = make_router("sinkhorn_expert_choice", dim=64, num_experts=8,
                         capacity_factor=2.0, rngs=nnx.Rngs(0))
    # the same router, composed by hand; any other pair is one line too
    router = Router(SinkhornPlan(64, 8, rngs=nnx.Rngs(0)), ExpertChoice(capacity_factor=2.0))

====================================== ======================================== ============================
name                                   affinity                                 allocation
====================================== ======================================== ============================
``softmax_token_choice``               :class:`NoisySoftmax`                    :class:`TokenChoice`
``sigmoid_loss_free``                  :class:`SigmoidGates`                    :class:`TokenChoice`
``group_limited``                      :class:`SigmoidGates` (``num_groups=2``) :class:`TokenChoice`
``remoe``                              :class:`ReluGates`                       :class:`TokenChoice` (k = E)
``top_p``                              :class:`TopPGates`                       :class:`TokenChoice` (k = E)
``sinkhorn_token_choice``              :class:`SinkhornPlan`                    :class:`TokenChoice`
``svmoe``                              :class:`QuadraticPlan`                   :class:`TokenChoice`
``softmax_expert_choice``              :class:`Softmax`                         :class:`ExpertChoice`
``sinkhorn_expert_choice``             :class:`SinkhornPlan`                    :class:`ExpertChoice`
``sparsity_constrained_expert_choice`` :class:`SparsityConstrainedPlan`         :class:`ExpertChoice`
``soft_moe``                           :class:`SlotLogits`                      :class:`SoftRouting`
``hash`` (a routing control)           :class:`HashProjection`                  :class:`TokenChoice`
``raw_oracle`` (reads pixels)          :class:`RawKey` (sub-task signatures)    :class:`TokenChoice`
``raw_blind`` (reads pixels)           :class:`RawKey` (hash of the patch)      :class:`TokenChoice`
``raw_lsh`` (reads pixels)             :class:`RawKey` (random projection)      :class:`TokenChoice`
``adamoe``                             :class:`NullGates` (null-aware loss)     :class:`TokenChoice` (null)
``longcat``                            :class:`NullGates` (bias controller)     :class:`TokenChoice` (null)
====================================== ======================================== ============================

Routing controls, for experiments that ask whether the *learned* routing matters: any router
can be frozen (``make_router(..., frozen=True)``, :func:`freeze`: its weights stay at their
initial values while the experts train), ``hash`` routes by a fixed random projection that
nothing learns, the raw-key routers route by a fixed key of the raw patch that the network cannot
steer (``raw_oracle``: the right routing of :func:`mini_moe.data.subtask_vote`, read from the
sub-task signatures; ``raw_blind``: a hash of the quantised patch, Hash Layers; ``raw_lsh``: a
fixed random projection of the patch; their gates are 1, a learned router's a softmax), and the
options ``noise_std`` and ``balance_loss`` of ``softmax_token_choice`` and
``noise_std`` of ``softmax_expert_choice`` give the two allocations the same noise and losses.

What the rest of the library needs to know about a registered router (how the capacity factor
reaches it, whether it routes each image on its own, where the model places its MoE layers,
whether it reads the representation or the raw pixels, the dataset family it is built for, if any) is
declared with :func:`register`, so a router registered outside the package trains through
:mod:`mini_moe.model`, :mod:`mini_moe.train`, :mod:`mini_moe.study` and :mod:`mini_moe.bench`.
An affinity with state that no gradient moves (DeepSeek-V3's bias, ReMoE's lambda) follows one
protocol, :class:`StatefulAffinity`: models move that state through :func:`after_forward`,
:func:`defer_updates` and :func:`after_step`, never by testing for a particular affinity, so
such an affinity registered outside the package trains, with or without gradient
accumulation, as the library's own do.

Training-time noise follows Flax's dropout convention: it is added while the module
is not ``deterministic`` (``model.train()``), and never under ``model.eval()``.

The package's modules, all re-exported here (``routers.X`` and ``from mini_moe.routers import X``
name every object): ``types.py`` (:class:`RouterOutput`, :class:`Budget`, :class:`Affinities`),
``affinities.py`` (the affinities that hold only their weights), ``balancing.py`` (the affinities
with state of their own: :class:`SigmoidGates`, :class:`ReluGates`), ``stateful.py`` (the
protocol through which models move such state: :class:`StatefulAffinity`), ``allocations.py``,
``controls.py`` (:func:`freeze`, :class:`HashProjection`, :class:`RawKey`), ``registry.py`` (:class:`Router` and the
registry), ``papers.py`` (the registered routers of the papers), ``null.py`` (null experts in
the choice set: :class:`NullGates`, ``adamoe``, ``longcat``) and ``adaptive.py`` (a number of
experts that adapts to the token: :class:`TopPGates`, :func:`top_p_mask`, ``top_p``).
"""

from __future__ import annotations

# The names the single module ``mini_moe/routers.py`` had besides its own objects (its imports),
# kept so that code written against it (``routers.jax``, ``routers.routing``, ...) still runs.
import dataclasses  # noqa: F401
import math  # noqa: F401
from typing import Any, Callable, NamedTuple  # noqa: F401

import flax  # noqa: F401
import flax.struct  # noqa: F401
import jax  # noqa: F401
import jax.numpy as jnp  # noqa: F401
import numpy as np  # noqa: F401
from flax import nnx  # noqa: F401

from mini_moe import losses, routing, transport  # noqa: F401
from mini_moe.routers.adaptive import TopPGates, TopPThreshold, top_p, top_p_mask
from mini_moe.routers.affinities import (Affinity, NoisySoftmax, QuadraticPlan, SinkhornPlan, SlotLogits, Softmax,
                                         SparsityConstrainedPlan, l2_normalize)
from mini_moe.routers.allocations import SOFT_MOE_ABLATIONS, Allocation, ExpertChoice, SoftRouting, TokenChoice
from mini_moe.routers.balancing import ExpertBias, L1Weight, ReluGates, SigmoidGates, update_l1_weights
from mini_moe.routers.controls import FrozenWeight, HashProjection, RawKey, freeze
from mini_moe.routers.papers import (group_limited, hash_router, raw_blind, raw_lsh, raw_oracle, remoe,
                                     sigmoid_loss_free, sinkhorn_expert_choice, sinkhorn_token_choice, soft_moe,
                                     softmax_expert_choice, softmax_token_choice, sparsity_constrained_expert_choice,
                                     svmoe)
from mini_moe.routers.null import NullGates, RealBias, adamoe, longcat
from mini_moe.routers.registry import (ALLOCATION_CLASSES, ALLOCATIONS, READS, Router, RouterSpec, general_routers,
                                       make_router, per_image, register, spec)
from mini_moe.routers.registry import ROUTERS as _ROUTERS
from mini_moe.routers.stateful import StatefulAffinity, after_forward, after_step, defer_updates
from mini_moe.routers.types import Affinities, Array, Budget, RouterOutput  # noqa: F401
from mini_moe.validate import InputError, check_int  # noqa: F401

#: Every registered router, by name, with its :class:`RouterSpec` (see :func:`register`).
ROUTERS = _ROUTERS

# What the API reference documents (book/api.md: ``automodule:: mini_moe.routers``), in the order
# it reads: with ``__all__``, autodoc documents these objects although they live in the submodules.
__all__ = [
    "RouterOutput", "Budget", "Affinities",
    "Affinity", "Softmax", "NoisySoftmax", "ExpertBias", "SigmoidGates", "L1Weight", "ReluGates",
    "update_l1_weights", "StatefulAffinity", "after_forward", "after_step", "defer_updates",
    "SinkhornPlan", "QuadraticPlan", "SparsityConstrainedPlan", "l2_normalize", "SlotLogits",
    "FrozenWeight", "freeze", "HashProjection", "RawKey",
    "Allocation", "TokenChoice", "ExpertChoice", "SOFT_MOE_ABLATIONS", "SoftRouting",
    "Router",
    "ALLOCATIONS", "ALLOCATION_CLASSES", "READS", "RouterSpec", "ROUTERS", "general_routers", "register", "make_router", "per_image",
    "spec",
    "softmax_token_choice", "sigmoid_loss_free", "group_limited", "remoe", "hash_router", "raw_oracle", "raw_blind",
    "raw_lsh", "sinkhorn_token_choice",
    "svmoe", "softmax_expert_choice", "sinkhorn_expert_choice", "sparsity_constrained_expert_choice", "soft_moe",
    "NullGates", "RealBias", "adamoe", "longcat",
    "TopPThreshold", "TopPGates", "top_p_mask", "top_p",
]
