"""Fewer experts at deployment: one-shot pruning and merging of a trained MoE (issue 67).

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
   recomputed for the new E: ``C = round(c T / E')`` with c the capacity factor, c = k by
   default, :func:`mini_moe.routing.capacity`; larger than before).

4. Merging instead replaces each group of experts by one (:func:`merge`), the groups chosen from
   the calibration (:data:`GROUPINGS`):

   * ``"mc_smoe"`` (M-SMoE, Li et al. 2024, arXiv 2310.01334): the most frequently used experts
     of the layer are the groups' dominant experts, and every other expert joins the dominant one
     whose router logits over the calibration tokens are most similar (cosine); before averaging,
     each member's hidden units are permuted to match the dominant expert's (weight matching,
     :func:`align_hidden_units`);
   * ``"hc_smoe"`` (HC-SMoE, Chen et al. 2025, arXiv 2410.08589): agglomerative clustering, average
     linkage, of the experts' mean outputs over all calibration tokens (Euclidean distance), the
     members averaged as they are.

   Both average a group's weights with each member's frequency as its weight. Neither changes the
   router: it still scores all E original experts and routes as before, and every member of a group
   now computes the merged expert (:class:`TiedExperts`; the authors' code ties the members to one
   module the same way). So the buffers, and the FLOPs, stay those of E experts; what shrinks is
   the parameters stored. A token whose picks fall in one group gets the merged output times the sum
   of their gates, which is where the router loses its separate control of the members (REAP's
   argument against merging).

Only routers whose affinity is a softmax over experts (``softmax_choice``) with Token Choice at a
fixed k or Expert Choice are pruned or merged; any other raises ``InputError`` naming what it has.
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

#: The pruning criteria of :func:`saliency` (module docstring).
CRITERIA = ("frequency", "gate", "ean", "reap", "random")
#: The merging methods of :func:`group_experts` and :func:`merge` (module docstring).
GROUPINGS = ("mc_smoe", "hc_smoe")
#: What a pruned router does with the removed experts' logits (:func:`prune`).
DENOMINATORS = ("kept", "full")


@dataclasses.dataclass
class LayerRecord:
    """What one MoE layer's experts did on the calibration tokens (M tokens, E experts, width D).

    Attributes:
      inputs: ``[M, D]`` the layer's input tokens.
      logits: ``[M, E]`` the router's logits.
      probs: ``[M, E]`` the router's distribution over experts.
      gates: ``[M, E]`` the combine weight of each expert's output in each token's output (eq. 2:
        ``combine`` summed over slots; 0 where the expert did not process the token).
      routed: ``bool [M, E]`` the tokens each expert processed (a slot holds them).
      outputs: ``[M, E, D]`` every expert's output on every token, processed or not.
    """

    inputs: np.ndarray
    logits: np.ndarray
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
            for part, x, probs, rt in zip(parts, modes.recorded(model), out.probs, out.routings):
                b, tokens, dim = x.shape
                per_image = lambda a: np.asarray(a).reshape((b, tokens) + a.shape[2:])[:n].reshape((n * tokens,) + a.shape[2:])
                part.append({"inputs": per_image(x), "probs": per_image(probs),
                             "gates": per_image(rt.combine.sum(-1)), "routed": per_image(rt.dispatch.sum(-1) > 0)})
    records = []
    for part, layer in zip(parts, layers):
        fields = {key: np.concatenate([p[key] for p in part]) for key in part[0]}
        logits = np.concatenate([np.asarray(layer.router.logits(jnp.asarray(fields["inputs"][i:i + 4096])))
                                 for i in range(0, len(fields["inputs"]), 4096)])
        records.append(LayerRecord(**fields, logits=logits, outputs=expert_outputs(layer.experts, fields["inputs"])))
    return records


def expert_outputs(experts: MlpExperts, tokens: np.ndarray, *, chunk: int = 4096) -> np.ndarray:
    """Every expert on every token: ``tokens [M, D]`` -> ``[M, E, D_out]``, in chunks of tokens."""
    num_experts = experts.num_experts
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
    fine, kept_count = model.cfg.fine_grained, counts.pop()
    if kept_count % fine:
        raise InputError(f"with fine_grained={fine} the number of kept experts must be a multiple of {fine}, "
                         f"got {kept_count}.")
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
    pruned.cfg = dataclasses.replace(model.cfg, num_experts=kept_count // fine)
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


# ----------------------------------------------------------------------------------- merging


class TiedExperts(MlpExperts):
    """Merged experts: ``E'`` weight sets stored, ``E`` experts routed to, expert ``e`` computing
    weight set ``members[e]`` (:func:`merge`). Everything else is :class:`~mini_moe.layer.MlpExperts`."""

    def __init__(self, weights: dict, members: tuple[int, ...], *, kernel: str = "auto", block: int | None = None):
        count, dim, hidden = weights["w1"].shape
        super().__init__(count, dim, hidden, weights["w2"].shape[-1], rngs=nnx.Rngs(0), kernel=kernel, block=block)
        for name, value in weights.items():
            getattr(self, name)[...] = jnp.asarray(value)
        self.members = tuple(int(g) for g in members)

    @property
    def num_experts(self) -> int:
        return len(self.members)

    def _weights(self, dtype):
        index = jnp.asarray(self.members)
        return tuple(p[...][index].astype(dtype) for p in (self.w1, self.b1, self.w2, self.b2))


def _expert_weights(experts: MlpExperts) -> dict:
    """``{"w1": [E, D, H], "b1": [E, 1, H], "w2": [E, H, D], "b2": [E, 1, D]}`` as NumPy arrays, one
    row per routed expert (tied experts repeat their weight set)."""
    return dict(zip(("w1", "b1", "w2", "b2"), (np.asarray(w, np.float64) for w in experts._weights(jnp.float32))))


def align_hidden_units(weights: dict, member: int, dominant: int) -> np.ndarray:
    """The permutation of ``member``'s hidden units that best matches ``dominant``'s: the H x H
    assignment maximising the summed inner products of each unit's input weights and bias
    (``w1[:, :, h]``, ``b1[0, h]``) and output weights (``w2[h, :]``), solved exactly
    (``scipy.optimize.linear_sum_assignment``). Permuting an expert's hidden units leaves its
    function unchanged, so aligned experts can be averaged unit by unit (M-SMoE's weight matching)."""
    from scipy.optimize import linear_sum_assignment

    def units(e):  # [H, D + 1 + D]: each hidden unit's weights in and out
        return np.concatenate([weights["w1"][e].T, weights["b1"][e].T, weights["w2"][e]], axis=1)

    _, order = linear_sum_assignment(units(dominant) @ units(member).T, maximize=True)
    return order  # dominant's unit h is matched by member's unit order[h]


def group_experts(record: LayerRecord, num_groups: int, method: str) -> tuple[int, ...]:
    """Each expert's group ``[E]`` (0 .. num_groups - 1, numbered by each group's lowest expert) by
    ``method`` (:data:`GROUPINGS`, module docstring), from one layer's calibration."""
    if method not in GROUPINGS:
        raise InputError(f"method must be one of {GROUPINGS}, got {method!r}.")
    num_experts = record.routed.shape[1]
    if not 1 <= num_groups <= num_experts:
        raise InputError(f"num_groups must be in 1..{num_experts} (the layer's experts), got {num_groups!r}.")
    if method == "mc_smoe":
        dominant = keep_top(saliency(record, "frequency"), num_groups)
        z = record.logits.astype(np.float64).T  # [E, M]: each expert's logits over the calibration tokens
        z = z / np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12)
        similarity = z @ z[list(dominant)].T  # [E, groups]
        label = [dominant.index(e) if e in dominant else int(np.argmax(similarity[e])) for e in range(num_experts)]
    else:
        label = average_linkage(record.outputs.astype(np.float64).mean(0), num_groups)
    first = {}  # renumber the groups by their lowest expert
    return tuple(first.setdefault(g, len(first)) for g in label)


def average_linkage(points: np.ndarray, num_clusters: int) -> list[int]:
    """Agglomerative clustering of ``points [E, D]`` into ``num_clusters``, average linkage on
    Euclidean distances: repeatedly join the two clusters whose mean pairwise distance is smallest
    (ties: the pair with the lowest indices). Returns each point's cluster id."""
    distance = np.linalg.norm(points[:, None] - points[None], axis=-1)
    clusters = [[e] for e in range(len(points))]
    while len(clusters) > num_clusters:
        best = min((distance[np.ix_(a, b)].mean(), i, j) for i, a in enumerate(clusters)
                   for j, b in enumerate(clusters) if i < j)
        _, i, j = best
        clusters[i] = clusters[i] + clusters.pop(j)
    label = [0] * len(points)
    for c, members in enumerate(clusters):
        for e in members:
            label[e] = c
    return label


def merge_weights(weights: dict, groups: tuple[int, ...], frequency: np.ndarray, *, align: bool) -> dict:
    """Each group's experts averaged into one weight set, each member weighted by its ``frequency``
    (equal weights where the whole group has none); with ``align``, every member's hidden units are
    first permuted to match the group's most frequent member (:func:`align_hidden_units`).
    Returns ``{name: [groups, ...]}``."""
    merged = {name: [] for name in weights}
    for g in range(max(groups) + 1):
        members = [e for e, group in enumerate(groups) if group == g]
        share = np.asarray([frequency[e] for e in members], np.float64)
        share = share / share.sum() if share.sum() > 0 else np.full(len(members), 1 / len(members))
        dominant = members[int(np.argmax(share))]
        parts = {name: [] for name in weights}
        for e in members:
            order = align_hidden_units(weights, e, dominant) if align and e != dominant else np.arange(
                weights["w1"].shape[-1])
            parts["w1"].append(weights["w1"][e][:, order])
            parts["b1"].append(weights["b1"][e][:, order])
            parts["w2"].append(weights["w2"][e][order])
            parts["b2"].append(weights["b2"][e])
        for name, values in parts.items():
            merged[name].append(np.tensordot(share, np.stack(values), axes=1))
    return {name: np.stack(values).astype(np.float32) for name, values in merged.items()}


def merge(model, records: list[LayerRecord], num_groups: int, method: str):
    """A copy of ``model`` whose MoE layers keep ``num_groups`` merged experts each, grouped and
    merged by ``method`` (:data:`GROUPINGS`: ``"mc_smoe"`` aligns hidden units before averaging,
    ``"hc_smoe"`` does not; module docstring) from ``records`` (:func:`calibrate` of ``model``).
    The routers are unchanged; ``model`` is unchanged."""
    check_prunable(model)
    layers = modes.moe_layers(model)
    if len(records) != len(layers):
        raise InputError(f"records must hold one LayerRecord per MoE layer ({len(layers)}), got {len(records)}.")
    merged = copy.deepcopy(model)
    for layer, record in zip(modes.moe_layers(merged), records):
        if isinstance(layer.experts, TiedExperts):
            raise InputError("this model's experts are merged already; merge the original model.")
        groups = group_experts(record, num_groups, method)
        weights = merge_weights(_expert_weights(layer.experts), groups, saliency(record, "frequency"),
                                align=method == "mc_smoe")
        layer.experts = TiedExperts(weights, groups, kernel=layer.experts.kernel, block=layer.experts.block)
    return merged


def stored_expert_parameters(model) -> int:
    """The expert parameters the model stores (merged experts count once)."""
    return sum(int(np.prod(p.shape)) for layer in modes.moe_layers(model)
               for p in (layer.experts.w1, layer.experts.b1, layer.experts.w2, layer.experts.b2))


def original_ids(layer) -> tuple[int, ...]:
    """Which of the original experts each routed expert of a (pruned) MoE layer is."""
    affinity = layer.router.affinity
    return affinity.keep if isinstance(affinity, PrunedAffinity) else tuple(range(layer.router.num_experts))


def fidelity(model, compressed, records: list[LayerRecord], *, images_per_call: int = 64) -> list[dict]:
    """How closely each MoE layer of ``compressed`` follows ``model``'s on the calibration tokens,
    both fed the original model's inputs to that layer (``records``, :func:`calibrate` of ``model``):

    * ``reconstruction_error``: ||y - y'||^2 / ||y||^2 over the tokens, y and y' the two layers'
      outputs (the layer-output error REAP bounds);
    * ``routing_agreement``: the share of tokens whose picks, as original expert ids, are the same
      (Token Choice; ``None`` for an allocation that makes no per-token picks).
    """
    out = []
    with modes.eval_mode(model), modes.eval_mode(compressed):
        for layer, small, record in zip(modes.moe_layers(model), modes.moe_layers(compressed), records):
            tokens = model.cfg.num_patches
            images = images_per_call - images_per_call % modes.group_images(model)
            error, norm, same, total = 0.0, 0.0, 0, 0
            ids = np.asarray(original_ids(small))
            for start in range(0, len(record.inputs), images * tokens):
                x = jnp.asarray(record.inputs[start:start + images * tokens]).reshape(-1, tokens, record.inputs.shape[-1])
                if x.shape[0] % modes.group_images(model):
                    break  # a last partial group is not routed as in calibration
                y, a = layer(x)
                y_small, b = small(x)
                error += float(jnp.sum((y - y_small) ** 2))
                norm += float(jnp.sum(y ** 2))
                if a.picks is not None and b.picks is not None:
                    mapped = np.zeros(np.shape(a.picks), bool)
                    mapped[..., ids] = np.asarray(b.picks)
                    same += int(np.all(mapped == np.asarray(a.picks), axis=-1).sum())
                    total += int(np.prod(np.shape(a.picks)[:-1]))
            out.append({"reconstruction_error": error / norm if norm else float("nan"),
                        "routing_agreement": same / total if total else None})
    return out
