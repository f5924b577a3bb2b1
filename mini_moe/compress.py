"""Fewer experts at deployment: one-shot pruning of a trained MoE (issue 67).

An MoE layer stores E experts although each token uses few; pruning removes experts from a
trained model without training it again. Three steps, each a function:

1. :func:`calibrate` runs the model on calibration images and records, for every MoE layer, what
   each expert did: which tokens it processed (``routed [M, E]``), with which combine weight
   (``gates [M, E]``: the weight of expert e's output in token t's output, eq. 2), the router's
   distribution (``probs [M, E]``), and every expert's output on every token (``outputs [M, E, D]``).
2. :func:`saliency` scores the experts of a layer by a named criterion (:data:`CRITERIA`):

   * ``"frequency"``: the share of tokens the expert processed;
   * ``"gate"``: its gate summed over the tokens it processed, per calibration token (REAP's "soft
     frequency" baseline);
   * ``"ean"``: the mean norm of its output over the tokens it processed (REAP's expert activation
     norm baseline: the gate left out);
   * ``"reap"``: REAP's router-weighted activation norm (Lasby et al. 2025, arXiv 2510.13999): the
     mean, over the tokens the expert processed, of its gate times the norm of its output,
     ``S_e = mean_{t: routed[t, e]} gates[t, e] * ||outputs[t, e]||_2``;
   * ``"random"``: a seeded random score, the negative control.

   REAP's paper text could not be read here; the criteria follow its authors' code
   (``CerebrasResearch/reap``, ``src/reap/pruning_metrics.py``, commit 1970473), where the tokens
   averaged over are those whose top-k includes the expert. This library takes the tokens the
   expert processed (a slot held them) and their combine weights, which is the same for a
   dropless router and, with capacity, counts only what reached the layer's output.
   ``mini_moe/results/compress-sources.md`` records what each source says and where.

3. :func:`prune` keeps the ``keep`` experts of each layer (:func:`keep_top` picks them by score).
   The router still scores every original expert; what it does with the removed ones' logits is
   the ``denominator``:

   * ``"kept"``: the removed logits are dropped, so the softmax runs over the kept experts and every
     token's gates are renormalised by the probability mass the kept experts had. This is what
     removing the router's columns does, as pruned checkpoints are usually shipped.
   * ``"full"``: the removed experts stay in the softmax's denominator but can no longer be picked,
     so a token that picked only kept experts keeps its gates exactly.

   With a router that renormalises the gates over each token's picks the two agree; V-MoE's
   routers do not (the gate is the softmax probability itself), so under ``"kept"`` a pruned model
   changes every token's output a little, and under ``"full"`` it equals the original on every
   token that picked no removed expert, as long as no capacity cut moves (the buffers are
   recomputed for the new E: ``C = round(c k T / E')``, larger than before).

Only routers whose affinity is a softmax over experts (``softmax_choice``) with Token Choice at a
fixed k or Expert Choice are pruned; any other raises ``InputError`` naming what it has.
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mini_moe import evaluate, modes
from mini_moe.layer import MlpExperts
from mini_moe.routers import Affinities, Router
from mini_moe.validate import InputError

CRITERIA = ("frequency", "gate", "ean", "reap", "random")
DENOMINATORS = ("kept", "full")


@dataclasses.dataclass
class LayerRecord:
    """What one MoE layer's experts did on the calibration tokens (M tokens, E experts, width D).

    Attributes:
      inputs: ``[M, D]`` the layer's input tokens.
      probs: ``[M, E]`` the router's distribution over experts.
      gates: ``[M, E]`` the combine weight of each expert's output in each token's output (eq. 2:
        ``combine`` summed over slots; 0 where the expert did not process the token).
      routed: ``bool [M, E]`` the tokens each expert processed (a slot holds them).
      outputs: ``[M, E, D]`` every expert's output on every token, processed or not.
    """

    inputs: np.ndarray
    probs: np.ndarray
    gates: np.ndarray
    routed: np.ndarray
    outputs: np.ndarray


def check_prunable(model) -> None:
    """Refuse a model whose routers :func:`prune` cannot prune, naming what they are."""
    for i, layer in enumerate(modes.moe_layers(model)):
        affinity, allocation = layer.router.affinity, layer.router.allocation
        if isinstance(affinity, PrunedAffinity):
            continue
        if not getattr(affinity, "softmax_choice", False) or allocation.name not in ("token", "expert"):
            raise InputError(f"pruning needs a softmax affinity with Token or Expert Choice; MoE layer {i} has "
                             f"{type(affinity).__name__} with {type(allocation).__name__}.")
        if allocation.name == "token" and (allocation.min_score is not None or allocation.null_experts):
            raise InputError(f"pruning needs Token Choice with a fixed k and no null experts; MoE layer {i} has "
                             f"min_score={allocation.min_score}, null_experts={allocation.null_experts}.")


def calibrate(model, images: np.ndarray, *, batch_size: int = 400) -> list[LayerRecord]:
    """Run ``model`` on ``images [N, H, W, C]`` (normalised like its training data, routed in its
    groups, eval mode) and return one :class:`LayerRecord` per MoE layer, bottom to top."""
    layers = modes.moe_layers(model)
    parts: list[list[dict]] = [[] for _ in layers]
    with modes.recording(model):
        for out, n in evaluate.forward_batches(model, images, batch_size=batch_size, routing=True):
            for part, layer, x, probs, rt in zip(parts, layers, modes.recorded(model), out.probs, out.routings):
                b, tokens, dim = x.shape
                per_image = lambda a: np.asarray(a).reshape((b, tokens) + a.shape[2:])[:n].reshape((n * tokens,) + a.shape[2:])
                part.append({"inputs": per_image(x), "probs": per_image(probs),
                             "gates": per_image(rt.combine.sum(-1)), "routed": per_image(rt.dispatch.sum(-1) > 0)})
    records = []
    for part, layer in zip(parts, layers):
        fields = {key: np.concatenate([p[key] for p in part]) for key in part[0]}
        records.append(LayerRecord(**fields, outputs=expert_outputs(layer.experts, fields["inputs"])))
    return records


def expert_outputs(experts: MlpExperts, tokens: np.ndarray, *, chunk: int = 4096) -> np.ndarray:
    """Every expert on every token: ``tokens [M, D]`` -> ``[M, E, D_out]``, in chunks of tokens."""
    num_experts = experts.w1.shape[0]
    apply = jax.jit(lambda x: experts(jnp.broadcast_to(x, (num_experts,) + x.shape)))
    return np.concatenate([np.moveaxis(np.asarray(apply(jnp.asarray(tokens[i:i + chunk]))), 0, 1)
                           for i in range(0, len(tokens), chunk)])


def saliency(record: LayerRecord, criterion: str, *, seed: int = 0) -> np.ndarray:
    """Each expert's score ``[E]`` under ``criterion`` (:data:`CRITERIA`, module docstring); the
    lowest scores are pruned first. An expert that processed no token scores 0 under every
    criterion but ``"random"`` (it contributed nothing)."""
    if criterion not in CRITERIA:
        raise InputError(f"criterion must be one of {CRITERIA}, got {criterion!r}.")
    routed = record.routed.astype(np.float64)
    if criterion == "frequency":
        return routed.mean(0)
    if criterion == "gate":
        return (routed * record.gates).sum(0) / len(routed)
    norms = np.linalg.norm(record.outputs.astype(np.float64), axis=-1)  # [M, E]
    if criterion in ("ean", "reap"):
        contribution = norms if criterion == "ean" else record.gates * norms
        return (routed * contribution).sum(0) / np.maximum(routed.sum(0), 1)
    return np.random.default_rng(seed).random(routed.shape[1])


def keep_top(scores: np.ndarray, num_kept: int) -> tuple[int, ...]:
    """The ``num_kept`` experts with the highest ``scores [E]`` (ties: the lower index), in index order."""
    scores = np.asarray(scores)
    if not 1 <= num_kept <= len(scores):
        raise InputError(f"num_kept must be in 1..{len(scores)} (the layer's experts), got {num_kept!r}.")
    order = sorted(range(len(scores)), key=lambda e: (-scores[e], e))
    return tuple(sorted(order[:num_kept]))


class PrunedAffinity(nnx.Module):
    """A softmax affinity with only the experts ``keep`` left (module docstring, ``denominator``):
    the ``inner`` affinity still scores all E_0 original experts; this hands the allocation the kept
    columns, renormalised (``"kept"``) or as they were (``"full"``)."""

    def __init__(self, inner, keep: tuple[int, ...], denominator: str):
        if denominator not in DENOMINATORS:
            raise InputError(f"denominator must be one of {DENOMINATORS}, got {denominator!r}.")
        self.inner, self.keep, self.denominator = inner, tuple(int(e) for e in keep), denominator
        self.dim, self.num_experts = inner.dim, len(self.keep)
        self.per_token = inner.per_token
        self.softmax_choice = denominator == "kept"  # "full": the kept probabilities no longer sum to 1
        self.balances_group, self.balance_knob, self.pick_rule, self.bias_moves = False, None, None, False

    def logits(self, x):
        return self.inner.logits(x)[..., jnp.asarray(self.keep)]

    def __call__(self, x, budget) -> Affinities:
        full = self.inner(x, budget)
        kept = jnp.asarray(self.keep)
        probs = full.probs[..., kept]
        if self.denominator == "kept":
            probs = probs / jnp.sum(probs, axis=-1, keepdims=True)  # = softmax over the kept logits
        return Affinities(probs, probs=probs, aux_loss=full.aux_loss, metrics=full.metrics)


def prune(model, keep, *, denominator: str = "kept"):
    """A copy of ``model`` with only the experts ``keep[i]`` (a sequence of expert indices, the
    same number in every layer) in MoE layer ``i``; ``model`` is unchanged. The router's
    ``denominator`` is ``"kept"`` or ``"full"`` (module docstring); the buffers follow the new E.
    Keeping every expert in order returns the same function."""
    check_prunable(model)
    layers = modes.moe_layers(model)
    if len(keep) != len(layers):
        raise InputError(f"keep must name the kept experts of each of the {len(layers)} MoE layers, got {len(keep)}.")
    counts = {len(k) for k in keep}
    if len(counts) != 1:
        raise InputError(f"every MoE layer must keep the same number of experts (one num_experts), got {sorted(counts)}.")
    fine = model.cfg.fine_grained
    if counts.copy().pop() % fine:
        raise InputError(f"with fine_grained={fine} the number of kept experts must be a multiple of {fine}, "
                         f"got {counts.copy().pop()}.")
    pruned = copy.deepcopy(model)
    for layer, kept in zip(modes.moe_layers(pruned), keep):
        kept = tuple(int(e) for e in kept)  # positions among the layer's present experts
        present = layer.experts.w1.shape[0]
        if len(set(kept)) != len(kept) or not all(0 <= e < present for e in kept):
            raise InputError(f"keep must list distinct experts in 0..{present - 1}, got {kept}.")
        affinity, original = layer.router.affinity, kept
        if isinstance(affinity, PrunedAffinity):  # pruning a pruned model: the router indexes the original
            original, affinity = tuple(affinity.keep[e] for e in kept), affinity.inner
        layer.router = Router(PrunedAffinity(affinity, original, denominator), layer.router.allocation)
        layer.experts = _select_experts(layer.experts, kept)
    pruned.cfg = dataclasses.replace(model.cfg, num_experts=counts.pop() // fine)
    return pruned


def _select_experts(experts: MlpExperts, kept: tuple[int, ...]) -> MlpExperts:
    """The experts ``kept`` of ``experts``, in that order, as a new :class:`MlpExperts`."""
    _, dim, hidden = experts.w1.shape
    selected = MlpExperts(len(kept), dim, hidden, experts.w2.shape[-1], rngs=nnx.Rngs(0), kernel=experts.kernel,
                          block=experts.block)
    index = jnp.asarray(kept)
    for name in ("w1", "b1", "w2", "b2"):
        getattr(selected, name)[...] = getattr(experts, name)[...][index]
    return selected
