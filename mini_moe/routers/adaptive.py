"""Routers whose number of experts per token adapts to the token: top-p routing (Huang et al.
2024, "Harder Tasks Need More Experts: Dynamic Routing in MoE Models", arXiv 2403.07652, ACL
2024) with :class:`TopPGates`, its threshold :class:`TopPThreshold`, the selection rule
:func:`top_p_mask` and the registered router :func:`top_p`. Re-exported by
:mod:`mini_moe.routers`.

A top-k router gives every token the same k experts. Top-p gives a token as many experts as it
needs for its router to be confident: a token whose probability mass sits on one expert gets
one, a token that spreads its mass gets several. ReMoE (:class:`~mini_moe.routers.ReluGates`) is
the other token-adaptive router of the library; both run on :class:`TokenChoice` with ``k = E``
and ``min_score = 0``, the affinity setting to 0 the score of every expert it does not select.
"""

from __future__ import annotations

import math
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


def _real(name: str, value) -> float:
    """``value`` as a float if it is a real number (not a bool, not NaN), else :class:`InputError`."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or math.isnan(number):
        raise InputError(f"{name} must be a real number, got {value!r}.")
    return number


def top_p_mask(probs: Array, threshold) -> Array:
    """Top-p selection (Huang et al. 2024, arXiv 2403.07652): which experts each token selects.

    Each token ranks its experts by decreasing probability and selects the smallest prefix of
    that ranking whose cumulative probability reaches ``threshold`` p. Written as a test on each
    expert alone: expert j is selected when the probability of the experts ranked strictly before
    it is below p,

        selected[t, j]  <=>  sum_{i ranked before j} probs[t, i] < p.

    In exact arithmetic the two are the same set. The second is the one computed, because it
    needs no search for "the first place where the cumulative reaches p" and so it has no
    failure case under float round-off: the top expert (nothing before it, 0 < p) is always
    selected, so a token gets at least one expert and at most E, and the selected experts are a
    prefix of the ranking, since the mass before an expert only grows along it. At p = 1 the
    rounded probabilities may sum to slightly less than 1; there the cumulative never "reaches"
    p, and a search for that place would find none (``argmax`` of all-False gives the top-1
    alone), while this rule selects every expert, as p = 1 means. An expert whose probability is
    lost in the round-off of the mass before it (that mass already rounds to 1) is not selected.
    Ties are ranked by expert index (lower first), as ``jax.lax.top_k`` does.

    Args:
      probs: ``[..., T, E]`` each token's distribution over experts (rows sum to 1).
      threshold: p in (0, 1], a scalar (or an array broadcasting to ``probs[..., :1]``).

    Returns:
      bool ``[..., T, E]``; every row has between 1 and E True entries.
    """
    probs = jnp.asarray(probs)
    num_experts = probs.shape[-1]
    ranked, order = jax.lax.top_k(probs, num_experts)  # [..., T, E] decreasing; ties: lower index first
    total = jnp.cumsum(ranked, axis=-1)
    before = jnp.concatenate([jnp.zeros_like(total[..., :1]), total[..., :-1]], axis=-1)  # mass ranked before
    keep = before < jnp.asarray(threshold, probs.dtype)  # [..., T, E] in rank order
    rank = jnp.argsort(order, axis=-1)  # each expert's place in its token's ranking
    return jnp.take_along_axis(keep, rank, axis=-1)


class TopPThreshold(nnx.Variable):
    """The threshold p of top-p routing (:class:`TopPGates`; a controller moves it when a
    ``target_k`` is given): a variable of its own type, not an ``nnx.Param``, so no gradient or
    optimizer (nor weight decay) touches it. Saved with the model's state."""


class TopPGates(Affinity):
    """Top-p routing's affinity (Huang et al. 2024, arXiv 2403.07652): router probabilities
    ``P = softmax(x W)`` ``[..., T, E]``; each token selects the fewest top experts whose
    probabilities sum to at least the threshold p (:func:`top_p_mask`), so its number of experts
    varies from 1 to E with how confident the router is about it.

    The selected experts' combine weights are their probabilities ``P[t, e]``, **not
    renormalised** over the selection: a choice of this library, the convention that paper 000 and
    V-MoE's code fix for top-k, so a token's weights sum to at least p. The allocation is
    :class:`TokenChoice` with ``k = E`` and ``min_score = 0``: the affinity returns
    ``scores = where(selected, P, 0)`` and ``combine = P``, and as ``P > 0`` the picks made are
    exactly the selected experts (an expert whose probability underflows to 0 is not made, and
    not counted).

    The auxiliary loss is the paper's: a balancing loss plus a weighted "dynamic loss", the
    entropy ``-sum_e P_e log P_e`` of each token's distribution, averaged over tokens. Without it
    the router could lower its confidence, flattening P, to select more experts; minimising the
    entropy pushes it towards few, sure experts. The training loss multiplies the whole
    auxiliary loss by ``TrainConfig.aux_loss_weight``, so ``entropy_weight`` is the dynamic loss's
    weight relative to the balancing loss.

    Optionally the threshold follows a target number of experts per token: with ``target_k``,
    every training call (``deterministic`` False) moves p by the mean number of experts per token
    that the call selected, over all its tokens,

        p <- clip(p - threshold_rate * (mean_k - target_k), 1 / E, 1).

    This is a proportional (P) step, a simpler relative of the proportional-integral (PI)
    controller of DTop-p (arXiv 2512.13996), which has an integral term as well. p is then
    state (:class:`TopPThreshold`) and the affinity follows the protocol of
    :class:`~mini_moe.routers.StatefulAffinity`: under gradient accumulation (``defer``) no call
    moves p, the training step calls :meth:`deferred_update` once with every micro-batch's
    metrics. The lower end is 1/E: a token's top probability is at least 1/E, so any p <= 1/E
    selects its top expert alone, and going lower would only wind p down where nothing changes.

    Args:
      threshold: p in (0, 1] (the initial p with ``target_k``). The paper's reference code
        defaults to 0.4. p = 1 routes every token to every expert (a dense layer weighted by P).
      entropy_weight: weight (>= 0) of the dynamic loss inside the auxiliary loss, relative to
        the balancing loss; 0 turns it off.
      balance_loss: ``"switch"`` (or ``True``): the Switch Transformer loss
        ``E sum_e f_e P_e`` with ``f_e`` the share of the picks made that go to expert e (the
        selection, a variable number per token) and ``P_e`` the mean probability
        (:func:`mini_moe.losses.sequence_balance_loss`, which normalises ``f`` by the mean picks
        per token; 1 when balanced); ``"none"`` (or ``False``).
      balance_scope: where it counts ``f`` and ``P``: ``"group"`` (each routing group, averaged)
        or ``"batch"`` (every token of the call at once).
      target_k: None (the paper: a fixed p), or the mean number of experts per token, in
        [1, E], that the controller holds.
      threshold_rate: the controller's step (> 0) per expert of error.
      deterministic: evaluation mode (``model.eval()``): p does not move.

    Metrics: ``active_experts`` (the mean number of experts a token selects, before any capacity
    limit; the routing's ``experts_per_token`` counts the picks that find room), ``threshold``
    (the p this call used), ``entropy`` (the dynamic loss) and ``balance_loss``.
    """

    BALANCE_LOSSES = ("switch", "none")

    pick_rule = "top-p"

    def __init__(self, dim, num_experts, *, threshold=0.4, entropy_weight=1e-2, balance_loss="switch",
                 balance_scope="group", target_k=None, threshold_rate=0.01, deterministic=False, rngs: nnx.Rngs):
        super().__init__(dim, num_experts, rngs=rngs)
        threshold = _real("threshold", threshold)
        if not 0 < threshold <= 1:
            raise InputError(f"threshold must be in (0, 1] (top-p's cumulative probability), got {threshold!r}.")
        entropy_weight = _real("entropy_weight", entropy_weight)
        if not entropy_weight >= 0:
            raise InputError(f"entropy_weight must be >= 0, got {entropy_weight!r}.")
        if isinstance(balance_loss, bool):
            balance_loss = "switch" if balance_loss else "none"
        if balance_loss not in self.BALANCE_LOSSES:
            raise InputError(f"balance_loss must be one of {self.BALANCE_LOSSES} (or True/False), "
                             f"got {balance_loss!r}.")
        if balance_scope not in losses.BALANCE_SCOPES:
            raise InputError(f"balance_scope must be one of {losses.BALANCE_SCOPES}, got {balance_scope!r}.")
        if target_k is not None:
            target_k = _real("target_k", target_k)
            if not 1 <= target_k <= num_experts:
                raise InputError(f"target_k must be None or in [1, num_experts={num_experts}] (experts per token), "
                                 f"got {target_k!r}.")
        threshold_rate = _real("threshold_rate", threshold_rate)
        if not threshold_rate > 0:
            raise InputError(f"threshold_rate must be > 0, got {threshold_rate!r}.")
        self.entropy_weight, self.balance_loss, self.balance_scope = entropy_weight, balance_loss, balance_scope
        self.target_k, self.threshold_rate = target_k, threshold_rate
        self.deterministic = deterministic
        self.defer = False  # True under gradient accumulation: the training step moves p once
        self.threshold = TopPThreshold(jnp.asarray(threshold, jnp.float32))

    def step_threshold(self, mean_k: Array) -> None:
        """One controller step from the mean number of experts per token ``mean_k`` of a batch:
        ``p <- clip(p - threshold_rate * (mean_k - target_k), 1 / E, 1)``."""
        p = self.threshold[...] - self.threshold_rate * (jnp.asarray(mean_k, jnp.float32) - self.target_k)
        self.threshold[...] = jnp.clip(p, 1.0 / self.num_experts, 1.0)

    def deferred_update(self, metrics: Sequence[dict]) -> None:
        """:class:`StatefulAffinity`'s step under gradient accumulation: with a ``target_k``, one
        controller step from ``active_experts`` averaged over the micro-batches (``metrics``: this
        layer's metrics of each micro-batch; they are equal-sized). Without one, nothing moves."""
        if self.target_k is not None:
            self.step_threshold(jnp.mean(jnp.stack([jnp.asarray(m["active_experts"]) for m in metrics])))

    def __call__(self, x: Array, budget: Budget) -> Affinities:
        logits = self.logits(x)  # [..., T, E]
        probs = jax.nn.softmax(logits, axis=-1)
        threshold = self.threshold[...]
        selected = top_p_mask(jax.lax.stop_gradient(probs), threshold)
        scores = jnp.where(selected, probs, 0.0)  # TokenChoice(k=E, min_score=0) makes exactly these picks
        made = jax.lax.stop_gradient((scores > 0).astype(probs.dtype))  # [..., T, E] 0/1
        active = jnp.mean(jnp.sum(made, axis=-1))  # experts per token, every token of the call
        # The dynamic loss: each token's entropy, from log_softmax (finite where P underflows to 0).
        entropy = jnp.mean(-jnp.sum(probs * jax.nn.log_softmax(logits, axis=-1), axis=-1))
        if self.balance_scope == "batch":
            flat = lambda a: a.reshape(1, -1, self.num_experts)
            balance = losses.sequence_balance_loss(flat(probs), flat(made))
        else:
            balance = losses.sequence_balance_loss(probs, made)
        aux = (balance if self.balance_loss == "switch" else 0.0) + self.entropy_weight * entropy
        if self.target_k is not None and not self.deterministic and not self.defer:
            self.step_threshold(active)
        metrics = dict(active_experts=active, threshold=threshold, entropy=entropy, balance_loss=balance)
        return Affinities(scores, combine=probs, probs=probs, aux_loss=aux, metrics=metrics)


@register("top_p", allocation="token")
def top_p(dim, num_experts, *, k=2, capacity_factor=None, threshold=0.4, entropy_weight=1e-2, balance_loss="switch",
          balance_scope="group", target_k=None, threshold_rate=0.01, pick_bound=None, deterministic=False,
          rngs: nnx.Rngs) -> Router:
    """Top-p routing (Huang et al. 2024, arXiv 2403.07652): each token goes to the fewest top
    experts whose router probabilities reach ``threshold`` p, weighted by those probabilities
    (:class:`TopPGates`); :class:`TokenChoice` with ``k = E`` and ``min_score = 0`` makes exactly
    those picks. Options: :class:`TopPGates` (``target_k``: a controller that moves p towards a
    mean number of experts per token).

    ``k``: the number of experts per token that the buffers are sized for, as in ``remoe``: the
    capacity factor defaults to k (C = round(k T / E) slots per expert; what overflows is
    dropped, Algorithm 1's order), and a capacity study's ``k`` and ``capacity_factor``
    (:meth:`RouterSpec.capacity_options`) reach the router that way. k selects nothing: p does.
    ``moe_path="dropless"`` drops nothing. ``pick_bound``: None (the dropless path sorts all
    ``E`` pairs of every token, the unselected ones in no expert's group), or at most that many
    picks per token on average over a call (:class:`TokenChoice`; those of smallest probability
    go first)."""
    check_int("k", k)
    if k > num_experts:
        raise InputError(f"k must be <= num_experts={num_experts}, got k={k}.")
    affinity = TopPGates(dim, num_experts, threshold=threshold, entropy_weight=entropy_weight,
                         balance_loss=balance_loss, balance_scope=balance_scope, target_k=target_k,
                         threshold_rate=threshold_rate, deterministic=deterministic, rngs=rngs)
    return Router(affinity, TokenChoice(num_experts, k if capacity_factor is None else capacity_factor,
                                        min_score=0.0, pick_bound=pick_bound))
