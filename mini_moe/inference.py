"""Routing at inference (issue 53): what one image's prediction owes to the other images of its
batch, how an attacker uses that, and how to route so that it owes them nothing.

A router whose allocation looks at a whole routing group (Token Choice with a capacity, Expert
Choice, Batch Prioritized Routing, and any affinity computed over the group: Sinkhorn plans, the
hash control's centring) makes image i's output a function of the group, ``y_i = f(x_i, x_group)``.
A router that sees one image at a time (Soft MoE's per-image slots, any router in groups of one
image) or one token at a time with nothing to run out of (dropless Token Choice over a per-token
affinity) makes it ``f(x_i)``: batch-invariant.

What this module measures, on a trained :class:`~mini_moe.model.VisionMoE` (the batch
dependence itself is :func:`mini_moe.evaluate.batch_dependence`; the batch-invariant modes and the
rule that says whether a configuration is one are :func:`mini_moe.modes.batch_invariant` and
:func:`mini_moe.modes.invariance`):

* :func:`capacity_sweep`: accuracy, dropped share and batch dependence against the capacity
  factor used at test time (V-MoE, arXiv 2106.05974, trades accuracy for compute this way);
* :func:`filler_attack`: Hayes, Shumailov and Yona's buffer overflow (arXiv 2402.05526): filler
  images that crowd a victim's experts, the victim's flip rate against a control that puts random
  fillers in the same places, the mitigations, and the run-twice check that flags it;
* :func:`serving_difference`: numerical batch dependence, what inference engines mean by batch
  invariance: the logits of the same images served in batches of different sizes;
* :func:`twin_fates`: two identical images in one group, whose patches meet different fates
  because of where they sit (the ties of ``jax.lax.top_k`` and of token order);
* :func:`precision_mismatch`: the share of tokens whose top-k set changes when the router
  computes in bfloat16 (Rollout Routing Replay, arXiv 2510.11370, reports ~10 % between engines);
  :func:`record_routing` and :func:`replay_routing` record one forward pass's routing and replay it,
  the selection only (R3, Megatron-LM) or dispatch and combine both.

Which experts a token picked is read from the router's own report
(:attr:`~mini_moe.routers.RouterOutput.picks`), never re-derived here.
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
import numpy as np

from mini_moe import evaluate, modes, stats
from mini_moe.validate import InputError, moved_names

#: :func:`filler_attack`'s mitigations: Hayes et al.'s randomised batch order and capacity slack
#: (their third, sampling experts from the gate weights, is not implemented here), and two this
#: book adds: Batch Prioritized Routing and per-image groups.
MITIGATIONS = (None, "random_order", "slack", "bpr", "per_image")


def _router_probs(model, images: np.ndarray, batch_size: int = 400) -> list[np.ndarray]:
    """Per MoE layer, ``[N, P, E]``: each patch's distribution over the experts, the images routed
    in their order."""
    parts = [[np.asarray(p[:n], np.float32) for p in out.probs]
             for out, n in evaluate.forward_batches(model, images, batch_size=batch_size)]
    return [np.concatenate(layer) for layer in zip(*parts)]


def _grouped_record(model, groups: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """``groups [V, g, H, W, C]`` routed one group each -> predicted classes ``[V, g]`` and, in MoE
    layer ``layer``, the share of each image's patches that some expert processes ``[V, g]``."""
    v, g = groups.shape[:2]
    flat = groups.reshape((v * g,) + groups.shape[2:])
    preds, layers = evaluate.routing_record(model, flat, batch_size=max(g, 256 - 256 % g))
    return preds.reshape(v, g), layers[layer]["hits"].any(-1).mean(-1).reshape(v, g)


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
    g = modes.group_images(model)
    position = g - 1 if position is None else position
    if pool_probs is None:
        pool_probs = _router_probs(model, pool)[layer]
    victim_probs = _router_probs(model, np.asarray(victim)[None])[layer][0]
    group = list(np.asarray(pool)[choose_fillers(victim_probs, pool_probs, g - 1)])
    group.insert(position, np.asarray(victim))
    return np.stack(group), position


def _mitigated(model, mitigation, slack):
    """The context in which :func:`filler_attack` routes under ``mitigation``."""
    if mitigation == "slack":
        factor = modes.trained_capacity(model)
        if factor is None:
            raise InputError("mitigation='slack' needs a router with a capacity factor (not Soft MoE or dropless).")
        return modes.capacity(model, factor * slack)
    if mitigation == "bpr":
        return modes.batch_priority(model)
    if mitigation == "per_image":
        return modes.per_image_groups(model)
    return contextlib.nullcontext()


def filler_attack(model, victims: np.ndarray, pool: np.ndarray, *, layer: int = 0, mitigation: str | None = None,
                  slack: float = 2.0, seed: int = 0, run_twice: bool = False) -> dict:
    """The buffer-overflow attack of Hayes, Shumailov and Yona (arXiv 2402.05526) on each victim.

    The threat model: the attacker knows the router's weights (white box) and the victim's image,
    fills the other ``g - 1`` places of the victim's routing group, and chooses the order (the
    victim last). For victim v it fills them with the images of ``pool`` that most want v's
    experts in MoE layer ``layer`` (:func:`choose_fillers`). Four groups per victim, each routed
    once:

    * ``attacked``: the chosen fillers, v at the attacker's place (last; random under
      ``"random_order"``);
    * ``control``: random pool images, v at the same place: what the place alone does (Token
      Choice serves a group's tokens in order, so the last image loses most);
    * ``benign``: random pool images, v at a random place: the reference prediction;
    * ``benign_again``: another such group: how much v's prediction changes with no attacker.

    ``mitigation``: None; ``"random_order"`` (the server shuffles each batch); ``"slack"``
    (``slack`` times the trained capacity factor); ``"bpr"`` (Batch Prioritized Routing, Token
    Choice); ``"per_image"`` (groups of one image). ``run_twice``: also route the attacked and the
    benign group once more in a new random order each and flag the victim when its two
    predictions differ (the check Hayes et al. suggest for sensitive queries).

    Returns the shares of victims whose prediction differs from the benign reference, each with a
    95 % Wilson interval (``flip_rate``: attacked; ``control_rate``: random fillers in the
    attacker's place; ``benign_change``), the attack's ``excess`` over its control (the paired
    mean of flip minus control per victim, with a 95 % t interval, and the exact McNemar p-value
    of the paired flips), ``victim_dropped`` (per kind of group, the mean share of the victim's
    patches that no expert of MoE layer ``layer`` processes: the mechanism) and, with
    ``run_twice``, ``flagged_attacked`` and ``flagged_benign``
    (the run-twice check's detection and false-alarm rates) and ``flagged_flips`` (the share of
    flipped victims it flags).
    """
    if mitigation not in MITIGATIONS:
        raise InputError(f"mitigation must be one of {MITIGATIONS}, got {mitigation!r}.")
    victims, pool = np.asarray(victims), np.asarray(pool)
    if victims.ndim != 4 or pool.ndim != 4:
        raise InputError(f"victims and pool must be images [N, H, W, C], got {victims.shape} and {pool.shape}.")
    rng = np.random.default_rng(seed)
    with _mitigated(model, mitigation, slack):
        g = modes.group_images(model)
        if len(pool) < 2 * g:
            raise InputError(f"pool must hold at least 2 x group_images = {2 * g} images, got {len(pool)}.")
        if g > 1:
            victim_probs = _router_probs(model, victims)[layer]
            pool_probs = _router_probs(model, pool)[layer]
        kinds = ("attacked", "control", "benign", "benign_again") + (("attacked_twice", "benign_twice") if run_twice else ())
        groups, where = [], []
        for v in range(len(victims)):
            if g == 1:  # alone in every group: nothing to fill
                members = {kind: ([], 0) for kind in kinds}
            else:
                fillers = choose_fillers(victim_probs[v], pool_probs, g - 1)
                place = int(rng.integers(g)) if mitigation == "random_order" else g - 1
                randoms = [rng.choice(len(pool), g - 1, replace=False) for _ in range(3)]
                members = {"attacked": (fillers, place), "control": (randoms[0], place),
                           "benign": (randoms[1], int(rng.integers(g))), "benign_again": (randoms[2], int(rng.integers(g)))}
                if run_twice:  # the same members in a new random order
                    for kind, again in (("attacked", "attacked_twice"), ("benign", "benign_twice")):
                        order = rng.permutation(g)
                        group = np.insert(np.asarray(members[kind][0], int), members[kind][1], -1)[order]
                        members[again] = (group[group >= 0], int(np.flatnonzero(group < 0)[0]))
            for kind in kinds:
                chosen, position = members[kind]
                group = list(pool[np.asarray(chosen, int)])
                group.insert(position, victims[v])
                groups.append(np.stack(group))
                where.append(position)
        preds, kept = _grouped_record(model, np.stack(groups), layer)
    rows = np.arange(len(groups))
    victim_preds = preds[rows, where].reshape(len(victims), len(kinds))
    victim_kept = kept[rows, where].reshape(len(victims), len(kinds))
    p = dict(zip(kinds, victim_preds.T))
    n = len(victims)
    flipped, control = p["attacked"] != p["benign"], p["control"] != p["benign"]
    excess = stats.paired_t((flipped.astype(float) - control).tolist()) if n > 1 else None
    out = {"mitigation": mitigation, "victims": n, "group_images": g, "layer": layer,
           "flip_rate": float(flipped.mean()), "flip_interval": stats.wilson(int(flipped.sum()), n),
           "control_rate": float(control.mean()), "control_interval": stats.wilson(int(control.sum()), n),
           "benign_change": float(np.mean(p["benign_again"] != p["benign"])),
           "benign_interval": stats.wilson(int(np.sum(p["benign_again"] != p["benign"])), n),
           "victim_dropped": {kind: float(1 - share) for kind, share in zip(kinds, victim_kept.mean(0))},
           "excess": None if excess is None else {"mean": excess["difference"], "low": excess["ci_low"],
                                                  "high": excess["ci_high"],
                                                  "p_value": stats.mcnemar(flipped, control)["p_value"]},
           "predictions": {kind: p[kind].tolist() for kind in kinds}}
    if run_twice:
        flag_attacked, flag_benign = p["attacked"] != p["attacked_twice"], p["benign"] != p["benign_twice"]
        out |= {"flagged_attacked": float(flag_attacked.mean()), "flagged_benign": float(flag_benign.mean()),
                "flagged_flips": float(flag_attacked[flipped].mean()) if flipped.any() else None}
    return out


def capacity_sweep(model, dataset, factors, *, regroupings: int = 4, seed: int = 0, batch_size: int = 400) -> list[dict]:
    """The test-time capacity trade-off (V-MoE, arXiv 2106.05974, Sec. 4): for each capacity
    factor of ``factors`` (what the model's configuration means by one), the test accuracy on
    ``dataset`` (``.images``, ``.labels``), per MoE layer the share of tokens no expert processes
    and the share of the router's picks dropped (:func:`mini_moe.evaluate.routing_summary`), and
    :func:`mini_moe.evaluate.batch_dependence` under random regrouping. A model without a
    capacity (Soft MoE, the dropless path) gives one row, ``capacity_factor`` None."""
    if not modes.has_capacity(model):
        factors = [None]
    rows = []
    for factor in factors:
        with modes.capacity(model, factor):
            preds, layers = evaluate.routing_record(model, dataset.images, batch_size=batch_size)
            summaries = [evaluate.routing_summary(layer) for layer in layers]
            dependence = evaluate.batch_dependence(model, dataset.images, regroupings=regroupings, permutations=0,
                                                   seed=seed, batch_size=batch_size, reference=preds)
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
    g = modes.group_images(model)
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


def _chosen_sets(model, images, batch_size) -> list[np.ndarray | None]:
    """Per MoE layer, ``bool [N, P, E (+ Z)]``: the experts each patch's router picked before any
    capacity, as the router reports them (:attr:`~mini_moe.routers.RouterOutput.picks`: Token
    Choice's top k with its balancing bias, ReLU's positive gates, top-p's selection, null
    experts included); for an allocation without per-token picks (Expert Choice) the top 1 of
    the router's distribution; None for a router that routes each image alone into slots (Soft
    MoE: no choice of experts to compare)."""
    parts = []
    for out, n in evaluate.forward_batches(model, images, batch_size=batch_size, routing=True):
        layers = []
        for mlp, probs, picks in zip(modes.moe_layers(model), out.probs, out.picks):
            if picks is not None:
                layers.append(np.asarray(picks[:n]))
            elif mlp.router.per_image:
                layers.append(None)
            else:
                p = np.asarray(probs[:n])
                layers.append(p == p.max(-1, keepdims=True))
        parts.append(layers)
    return [None if layer[0] is None else np.concatenate(layer) for layer in zip(*parts)]


def precision_mismatch(model, images: np.ndarray, *, dtype="bfloat16", batch_size: int = 400) -> list[dict]:
    """Per MoE layer, the share of patches whose set of picked experts changes when routers
    compute in ``dtype`` instead of float32 (the set the router reports):

    * ``"isolated"``: only this layer's router in ``dtype`` (the layers below are unchanged, so
      the difference is this router's own rounding);
    * ``"cascade"``: every router in ``dtype`` (what an engine with low-precision routers does:
      an earlier layer's changed routing changes this layer's input too).

    None for a Soft MoE layer."""
    images = np.asarray(images)
    reference = _chosen_sets(model, images, batch_size)
    with modes.router_dtype(model, dtype):
        cascade = _chosen_sets(model, images, batch_size)
    out = []
    for i, ref in enumerate(reference):
        if ref is None:
            out.append(None)
            continue
        with modes.router_dtype(model, dtype, layers=[i]):
            isolated = _chosen_sets(model, images, batch_size)[i]
        out.append({"isolated": float(np.mean(np.any(isolated != ref, -1))),
                    "cascade": float(np.mean(np.any(cascade[i] != ref, -1)))})
    return out


def record_routing(model, images: np.ndarray) -> tuple:
    """One eval-mode forward pass of ``images`` (whole routing groups), run op by op: per MoE layer
    the :class:`~mini_moe.routing.Routing` (dispatch and combine ``[G, T, E, C]``) it used."""
    modes.check_replayable(model)
    with modes.eval_mode(model):
        return tuple(model(jnp.asarray(images), return_routing=True).routings)


def replay_routing(model, images: np.ndarray, routings, *, variant: str = "selection") -> np.ndarray:
    """The logits ``[N, classes]`` of ``images`` with every MoE layer routing as the recorded
    ``routings`` (:func:`record_routing`) say, the router still running (:func:`mini_moe.modes.replay`):

    * ``variant="selection"``: the recorded experts and slots, the gate weights from the live
      router (Rollout Routing Replay, Megatron-LM): gradients still reach the router, and a live
      router that rounds differently still moves the output a little, through its weights;
    * ``variant="full"``: dispatch and combine both recorded: replaying a pass's own routing gives
      it back bit for bit, whatever the live router does, and no gradient reaches the router.

    Run op by op as :func:`record_routing` runs. ``routings=None`` runs the model's own routing
    the same way (the reference to compare a replay with)."""
    if routings is None:
        modes.check_replayable(model)
        with modes.eval_mode(model):
            return np.asarray(model(jnp.asarray(images)).logits)
    with modes.replay(model, routings, variant), modes.eval_mode(model):
        return np.asarray(model(jnp.asarray(images)).logits)


def serving_difference(model, images: np.ndarray, batch_sizes=(1, 8, 64), *, reference: int = 400,
                       fixed_batch: int | None = None) -> list[dict]:
    """Numerical batch dependence: ``images`` served in batches of each size of ``batch_sizes``
    against batches of ``reference`` images. Per size, ``max_logit_difference`` (the largest
    absolute difference of any logit), ``changed_predictions`` (images whose class differs) and
    per MoE layer ``changed_picks`` (the share of patches whose picked set differs, Token Choice
    and top-1 otherwise: a near-tie the rounding tipped).

    Even where routing makes a prediction depend on the image alone (:func:`mini_moe.modes.invariance`),
    a kernel's reduction order can depend on the batch's shape, so the last bits change with the
    serving batch size (what vLLM's and SGLang's batch-invariant modes remove on GPUs).
    ``fixed_batch``: every batch, the reference's too, is padded to ``fixed_batch`` images whatever
    the size served (one compiled shape; sizes above it are refused, and ``reference`` is ignored),
    the way to make the results bit-identical across batch sizes on this CPU. A batch of ``size``
    images is padded with copies of its own images to a whole number of routing groups (a batch of
    one image needs no padding where each image is its own group, :func:`mini_moe.modes.per_image_groups`)."""
    images = np.asarray(images)
    if fixed_batch is not None:
        if max(batch_sizes) > fixed_batch:
            raise InputError(f"batch_sizes must be at most fixed_batch={fixed_batch}, got {list(batch_sizes)}.")
        reference = fixed_batch
    group = modes.group_images(model)

    def serve(size):
        pad = size if fixed_batch is None else fixed_batch
        pad += -pad % group  # whole routing groups
        logits, picks = [], []
        for start in range(0, len(images), size):
            chunk = images[start:start + size]
            (out, n), = evaluate.forward_batches(model, chunk, batch_size=pad, routing=True)
            logits.append(np.asarray(out.logits[:n]))
            picks.append([None if p is None else np.asarray(p[:n]) for p in out.picks])
        return np.concatenate(logits), [None if layer[0] is None else np.concatenate(layer) for layer in zip(*picks)]

    ref_logits, ref_picks = serve(reference)
    rows = []
    for size in batch_sizes:
        logits, picks = serve(size)
        rows.append({"batch_size": size, "max_logit_difference": float(np.max(np.abs(logits - ref_logits))),
                     "changed_predictions": int(np.sum(logits.argmax(-1) != ref_logits.argmax(-1))),
                     "changed_picks": [None if p is None else float(np.mean(np.any(p != r, -1)))
                                       for p, r in zip(picks, ref_picks)]})
    return rows


# Moved after 0.4.0 (issue 64); the old names warn for one release.
__getattr__ = moved_names(__name__, {
    "batch_dependence": "mini_moe.evaluate:batch_dependence", "predictions": "mini_moe.evaluate:predictions",
    "within_group_permutation": "mini_moe.evaluate:within_group_permutation",
    "invariance": "mini_moe.modes:invariance", "batch_invariant": "mini_moe.modes:batch_invariant",
    "INVARIANT_MODES": "mini_moe.modes:INVARIANT_MODES", "router_dtype": "mini_moe.modes:router_dtype",
    "group_size": "mini_moe.modes:group_images"})
