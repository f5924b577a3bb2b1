"""Null experts in the router's choice set: :class:`NullGates`, the affinity over E real and Z null
experts, with the two ways the sources keep the real experts' share where it should be: AdaMoE's
null-aware balancing loss and LongCat-Flash's bias controller (:class:`RealBias`); and the
registered routers ``adamoe`` and ``longcat``. What a null expert computes (zero, identity,
constant) is the layer's business (:class:`mini_moe.layer.NullExperts`); which tokens pick one is
the router's. Re-exported by :mod:`mini_moe.routers`.

In eq. (2) a null expert is an expert that needs no slot: Token Choice over E + Z columns
(``TokenChoice(null_experts=Z)``) gives every token k picks, the real ones placed in buffers by
Algorithm 1, the null ones weighted directly (``RouterOutput.null_gates``). A token that picks j
null experts costs ``k - j`` experts' FLOPs, so the compute per token follows the router.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from mini_moe import losses
from mini_moe.routers.affinities import Affinity
from mini_moe.routers.allocations import TokenChoice
from mini_moe.routers.registry import Router, register
from mini_moe.routers.types import Affinities, Array, Budget
from mini_moe.validate import InputError, check_int


class RealBias(nnx.Variable):
    """LongCat-Flash's per-expert selection bias (real experts move, null experts stay at 0): a
    variable of its own type, not an ``nnx.Param``, so no gradient or optimizer touches it."""


class NullGates(Affinity):
    """Softmax over E real experts and Z null experts, ``p = softmax(XW)`` with ``W [D, E + Z]``
    (the null experts are the last Z columns); each token's k picks are its top k of ``p + b``.

    Balance (``balance``):

    * ``"null_aware"`` (AdaMoE, Zeng et al. 2024, arXiv 2406.13233): no bias; the auxiliary loss
      is :func:`mini_moe.losses.null_aware_switch_loss`, the Switch loss with the null experts
      pooled, which asks for ``Z / (E + Z)`` of the picks to go to null experts. With k picks,
      a token then uses ``k E / (E + Z)`` real experts on average, more for some tokens and
      fewer for others.
    * ``"controller"`` (LongCat-Flash, arXiv 2509.01322, Sec. 2.1): the real experts' bias (:class:`RealBias`) moves after every training call by
      ``b_i += bias_rate * (K_e / (k E) - T_i / (k T))`` (T_i the picks of real expert i among
      the call's T tokens), and the null experts' bias stays 0. At the fixed point every real
      expert gets ``K_e / E`` picks per token, so a token uses ``K_e = target_real`` real experts
      on average. This is the proportional term of the paper's PID controller; the integral and
      derivative terms are not given in the paper and are not implemented. LongCat-Flash also
      adds a device-level load-balancing loss across expert-parallel devices (the null experts
      one more group); with one device here it is left out, so this is the controller alone.
    * ``"none"``: neither (shows what the router does unchecked).

    Combine weights: the probabilities of the picks, not renormalised (V-MoE's convention: a token
    that gives weight to a null expert scales its real experts' output down, which is how the
    task's gradient reaches the choice between real and null). ``renormalize=True`` divides the
    real picks' weights by their sum, as AdaMoE's reference code does (their sum is then 1 for
    every token with a real pick); the null picks keep their probabilities.

    Under gradient accumulation (``defer = True``) the bias moves once per step, from the picks
    summed over the micro-batches (:meth:`deferred_update`; the protocol of
    :class:`~mini_moe.routers.StatefulAffinity`).

    Args:
      num_experts: E, the real experts.
      null_experts: Z >= 1.
      balance: ``"null_aware"``, ``"controller"`` or ``"none"``.
      target_real: K_e, the controller's target of real experts per token (0 < K_e <= min(k, E)).
      bias_rate: the controller's step.

    Metrics: ``null_aware_loss``, ``bias_spread`` (max - min of the real experts' bias), ``tokens``
    (the tokens routed in the call, which the deferred controller step sums).
    """

    BALANCES = ("null_aware", "controller", "none")

    @property
    def bias_moves(self) -> bool:
        """The real experts' bias moves in training (the ``"controller"`` balance, ``bias_rate > 0``)."""
        return self.balance == "controller" and self.bias_rate > 0

    def __init__(self, dim, num_experts, *, null_experts, balance="null_aware", target_real=None, bias_rate=0.1,
                 renormalize=False, deterministic=False, rngs: nnx.Rngs):
        check_int("num_experts", num_experts)
        check_int("null_experts", null_experts)
        super().__init__(dim, num_experts + null_experts, rngs=rngs)
        if balance not in self.BALANCES:
            raise InputError(f"balance must be one of {self.BALANCES}, got {balance!r}.")
        if balance == "controller" and (target_real is None or not 0 < target_real <= num_experts):
            raise InputError(f"balance='controller' needs target_real, the real experts per token to aim at, "
                             f"in (0, E={num_experts}]; got {target_real!r}.")
        if not bias_rate >= 0:
            raise InputError(f"bias_rate must be >= 0, got {bias_rate!r}.")
        self.real, self.null = num_experts, null_experts
        self.balance, self.renormalize, self.deterministic = balance, bool(renormalize), deterministic
        self.target_real = None if target_real is None else float(target_real)
        self.bias_rate = float(bias_rate)
        self.defer = False
        self.bias = RealBias(jnp.zeros((num_experts + null_experts,), jnp.float32))

    def check(self, k: int) -> None:
        if self.target_real is not None and self.target_real > k:
            raise InputError(f"target_real={self.target_real:g} real experts per token cannot exceed k={k} picks.")

    def update_bias(self, load: Array, tokens: Array) -> None:
        """One controller step from the picks per column ``load [E + Z]`` of a batch of ``tokens``
        tokens (each made k = sum(load) / tokens picks)."""
        k = jnp.sum(load) / tokens
        error = self.target_real / (k * self.real) - load[:self.real] / (k * tokens)
        self.bias[...] = self.bias[...].at[:self.real].add(self.bias_rate * error)

    def deferred_update(self, metrics: Sequence[dict]) -> None:
        """:class:`StatefulAffinity`'s step under gradient accumulation: one controller step from
        the picks summed over the micro-batches (each metrics dict has ``pick_load``)."""
        if self.balance == "controller" and self.bias_rate > 0:
            self.update_bias(sum(m["pick_load"] for m in metrics), sum(m["tokens"] for m in metrics))

    def __call__(self, x: Array, budget: Budget) -> Affinities:
        self.check(budget.k)
        probs = jax.nn.softmax(self.logits(x), axis=-1)  # [..., T, E + Z]
        selection = probs + self.bias[...] if self.balance == "controller" else probs
        chosen = jax.nn.one_hot(jax.lax.top_k(selection, budget.k)[1], self.num_experts, dtype=probs.dtype).sum(-2)
        combine = probs
        if self.renormalize:  # AdaMoE's code: the real picks' weights sum to 1 (a token with none keeps 0)
            real = probs[..., :self.real] * chosen[..., :self.real]
            total = jnp.sum(real, axis=-1, keepdims=True)
            combine = jnp.concatenate([real / jnp.where(total > 0, total, 1), probs[..., self.real:]], -1)
        tokens = jnp.asarray(chosen.size // self.num_experts, jnp.float32)
        if self.balance == "controller" and not self.deterministic and self.bias_rate > 0 and not self.defer:
            self.update_bias(chosen.reshape(-1, self.num_experts).sum(0), tokens)
        null_aware = losses.null_aware_switch_loss(probs, k=budget.k, null_experts=self.null)
        metrics = dict(null_aware_loss=null_aware, tokens=tokens,
                       bias_spread=jnp.max(self.bias[...][:self.real]) - jnp.min(self.bias[...][:self.real]))
        aux = null_aware if self.balance == "null_aware" else 0.0
        return Affinities(selection, combine=combine, probs=probs, aux_loss=aux, metrics=metrics)


def _null_router(dim, num_experts, null_experts, k, capacity_factor, batch_priority, affinity) -> Router:
    check_int("null_experts", null_experts)
    return Router(affinity, TokenChoice(k, capacity_factor, batch_priority, null_experts=null_experts))


@register("adamoe", allocation="token")
def adamoe(dim, num_experts, *, null_experts=4, k=2, capacity_factor=None, batch_priority=False, renormalize=False,
           deterministic=False, rngs: nnx.Rngs) -> Router:
    """AdaMoE (arXiv 2406.13233): E real experts, ``null_experts`` null ones, top-k over both and
    the null-aware balancing loss (:class:`NullGates` with ``balance="null_aware"``). ``num_experts``
    is E; the router's affinity has E + Z columns. The capacity (``capacity_factor``, default k)
    is per real expert."""
    affinity = NullGates(dim, num_experts, null_experts=null_experts, balance="null_aware", renormalize=renormalize,
                         deterministic=deterministic, rngs=rngs)
    return _null_router(dim, num_experts, null_experts, k, capacity_factor, batch_priority, affinity)


@register("longcat", allocation="token")
def longcat(dim, num_experts, *, null_experts=4, k=2, target_real=1.0, bias_rate=0.1, capacity_factor=None,
            batch_priority=False, renormalize=False, deterministic=False, rngs: nnx.Rngs) -> Router:
    """LongCat-Flash's zero-computation experts (arXiv 2509.01322): top-k over E real and
    ``null_experts`` null experts, with a bias controller that drives the real experts per token
    to ``target_real`` (:class:`NullGates` with ``balance="controller"``). The paper's
    device-level balance loss is left out (one device): this is its controller alone."""
    affinity = NullGates(dim, num_experts, null_experts=null_experts, balance="controller", target_real=target_real,
                         bias_rate=bias_rate, renormalize=renormalize, deterministic=deterministic, rngs=rngs)
    affinity.check(k)
    return _null_router(dim, num_experts, null_experts, k, capacity_factor, batch_priority, affinity)
