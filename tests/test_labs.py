"""The graded labs (issue 37): every checker passes the library's own function and rejects the
wrong solutions students typically write; the grader command reports them."""

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mini_moe import labs, routing, transport


@pytest.mark.parametrize("name", sorted(labs.LABS))
def test_the_library_passes_its_own_lab(name):
    result = labs.check(name, labs.LABS[name].reference)
    assert result.passed and result.cases >= 5, str(result)


def _top1_dispatch(scores, capacity, order):
    """Token Choice k = 1 visiting tokens in ``order``: what a student's loop computes."""
    s = jnp.asarray(scores)
    num_tokens, num_experts = s.shape
    top = jnp.argmax(s, -1)
    d = jnp.zeros((num_tokens, num_experts, capacity))
    fill = jnp.zeros(num_experts, jnp.int32)
    for t in order:
        e = top[t]
        d = jnp.where(fill[e] < capacity, d.at[t, e, jnp.minimum(fill[e], capacity - 1)].set(1.0), d)
        fill = fill.at[e].add(1)
    return d


# Wrong solutions students write, per lab (each must be rejected).
MUTANTS = {
    "ch01.capacity": [
        lambda num_tokens, num_experts, factor: max(1, int(factor * num_tokens / num_experts)),  # floor
        lambda num_tokens, num_experts, factor: max(1, round(factor * num_tokens / num_experts)),  # banker's rounding
        lambda num_tokens, num_experts, factor: math.floor(factor * num_tokens / num_experts + 0.5),  # may be 0
        lambda num_tokens, num_experts, factor: max(1, math.ceil(factor * num_tokens / num_experts)),  # ceil
        # T/E rounded before the factor applies
        lambda num_tokens, num_experts, factor: max(1, math.floor(
            factor * math.floor(num_tokens / num_experts + 0.5) + 0.5)),
    ],
    "ch02.token_choice": [
        # capacity not enforced: every token keeps its first choice
        lambda scores, capacity, k: jnp.zeros(scores.shape + (capacity,)).at[
            jnp.arange(scores.shape[0]), jnp.argmax(scores, -1), 0].set(1.0),
        # token by token (a token's k picks together) instead of round by round
        lambda scores, capacity, k: routing.token_choice_loop(scores, capacity=capacity, k=1)[0] if k == 1 else
        _token_by_token(scores, capacity, k),
        # an off-by-one: one slot too few
        lambda scores, capacity, k: jnp.pad(routing.token_choice(jnp.asarray(scores), capacity=max(capacity - 1, 1),
                                                                 k=k).dispatch, ((0, 0), (0, 0), (0, 1)))
        if capacity > 1 else routing.token_choice(jnp.asarray(scores), capacity=capacity, k=k).dispatch * 0,
        # slots filled from the last one: the buffer's order reversed
        lambda scores, capacity, k: routing.token_choice(jnp.asarray(scores), capacity=capacity, k=k).dispatch[..., ::-1],
        # ties broken towards the higher expert
        lambda scores, capacity, k: routing.token_choice(jnp.asarray(scores)[:, ::-1], capacity=capacity,
                                                         k=k).dispatch[:, ::-1],
    ],
    "ch02.token_choice_bpr": [
        lambda scores, capacity: routing.token_choice(jnp.asarray(scores), capacity=capacity).dispatch,  # no BPR
        # ascending priority instead of descending
        lambda scores, capacity: _top1_dispatch(scores, capacity, jnp.argsort(jnp.max(scores, -1))),
        # ties broken towards the later token (a descending sort that is not stable)
        lambda scores, capacity: _top1_dispatch(
            scores, capacity, scores.shape[0] - 1 - jnp.argsort(-jnp.max(scores, -1)[::-1], stable=True)),
        # the last token first: reversed group order instead of priority
        lambda scores, capacity: _top1_dispatch(scores, capacity, jnp.arange(scores.shape[0])[::-1]),
        # priority by the score of expert 0, not by each token's top score
        lambda scores, capacity: _top1_dispatch(scores, capacity, jnp.argsort(-scores[:, 0], stable=True)),
    ],
    "ch04.expert_choice": [
        # top-C over the wrong axis: each token picks C experts
        lambda scores, capacity: jnp.zeros(scores.shape + (capacity,)).at[
            jnp.arange(scores.shape[0])[:, None], jax.lax.top_k(scores, min(capacity, scores.shape[1]))[1],
            jnp.arange(min(capacity, scores.shape[1]))[None]].set(1.0),
        # slots in ascending order of score
        lambda scores, capacity: routing.expert_choice(jnp.asarray(scores), capacity=capacity).dispatch[..., ::-1],
        # ties broken towards the later token
        lambda scores, capacity: routing.expert_choice(jnp.asarray(scores)[::-1], capacity=capacity).dispatch[::-1],
        # one token too few per expert
        lambda scores, capacity: jnp.pad(routing.expert_choice(jnp.asarray(scores), capacity=max(capacity - 1, 1))
                                         .dispatch, ((0, 0), (0, 0), (0, 1))) if capacity > 1 else
        jnp.zeros(scores.shape + (capacity,)),
        # a second softmax over the experts on scores that are already probabilities
        lambda scores, capacity: routing.expert_choice(jax.nn.softmax(jnp.asarray(scores) * 10, -1),
                                                       capacity=capacity).dispatch,
    ],
    "ch02.switch_loss": [
        # P from the kept (top-k) probabilities only
        lambda probs, k: probs.shape[-1] * jnp.sum(_f(probs, k) * jnp.mean(
            jnp.where(_picked(probs, k), probs, 0.0), 0)),
        lambda probs, k: jnp.sum(_f(probs, k) * jnp.mean(probs, 0)),  # missing the factor E
        lambda probs, k: probs.shape[-1] * jnp.sum(_f(probs, k) * k * jnp.mean(probs, 0)),  # f over T, not k T
        lambda probs, k: probs.shape[-1] * jnp.sum(_f(probs, 1) * jnp.mean(probs, 0)),  # first choices only
        lambda probs, k: probs.shape[-1] * jnp.sum(_f(probs, k) * jnp.sum(probs, 0)),  # P summed, not averaged
    ],
    "ch02.z_loss": [
        lambda logits: jnp.mean(jnp.log(jnp.sum(jnp.exp(logits), -1)) ** 2),  # overflows at extreme logits
        lambda logits: jnp.mean(jax.nn.logsumexp(logits, -1)),  # not squared
        lambda logits: jnp.sum(jax.nn.logsumexp(logits, -1) ** 2),  # summed, not averaged
        lambda logits: jnp.mean(jnp.max(logits, -1) ** 2),  # the max logit instead of logsumexp
        lambda logits: jnp.mean(jax.nn.logsumexp(logits, 0) ** 2),  # logsumexp over the tokens
    ],
    "ch03.sinkhorn": [
        lambda logits, num_iters: transport.sinkhorn(jnp.asarray(logits).T, num_iters=num_iters).T,  # columns first
        lambda logits, num_iters: jax.nn.softmax(logits, -1),  # no iterations at all
        lambda logits, num_iters: _plain_sinkhorn(logits, num_iters),  # not in the log domain
        lambda logits, num_iters: _log_sinkhorn(logits, num_iters, column_sum=1.0),  # columns summing to 1
        # one iteration short
        lambda logits, num_iters: _log_sinkhorn(logits, num_iters - 1),
    ],
    "ch06.soft_routing": [
        lambda logits: (jax.nn.softmax(logits, 1), jax.nn.softmax(logits.reshape(logits.shape[0], -1), -1)
                        .reshape(logits.shape)),  # dispatch over experts, not tokens
        lambda logits: (jax.nn.softmax(logits, 0), jax.nn.softmax(logits, -1)),  # combine within one expert's slots
        lambda logits: (jax.nn.softmax(logits, 0), jax.nn.softmax(logits, 0)),  # both over tokens
        lambda logits: (_joint(logits), _joint(logits)),  # both over (expert, slot): dispatch per token
        lambda logits: (_joint(logits), jax.nn.softmax(logits, 0)),  # the two swapped
    ],
    "ch07.prc_loss": [
        lambda probs1, probs2, index, valid: _prc(probs1, probs2, index, valid, pairs="all"),  # |U| counts every patch
        lambda probs1, probs2, index, valid: _prc(probs1, probs2, index, valid, offdiag_norm="E^2"),
        lambda probs1, probs2, index, valid: _prc(probs1, probs2, index, valid, partner="same index"),
        lambda probs1, probs2, index, valid: _prc(probs1, probs2, index, valid, weights=(5e-2, 5e-3)),  # swapped
        lambda probs1, probs2, index, valid: _prc(probs1, probs2, index, valid, offdiag="all"),  # diagonal too
    ],
    "ch12.bias_step": [
        lambda bias, load, rate: bias + rate * jnp.sign(load - jnp.mean(load)),  # the wrong way round
        lambda bias, load, rate: bias + rate * (jnp.mean(load) - load),  # proportional, not the sign
        lambda bias, load, rate: bias + rate * jnp.minimum(jnp.sign(jnp.mean(load) - load), 0),  # only lowers
        lambda bias, load, rate: bias + rate * jnp.sign(jnp.max(load) - load),  # against the busiest, not the mean
        lambda bias, load, rate: bias + rate * jnp.where(load < jnp.mean(load), 1.0, -1.0),  # a tie moves down
    ],
    "ch12.group_limit": [
        lambda scores, num_groups, top_groups: _group_limit(scores, num_groups, top_groups, best=1),  # best only
        lambda scores, num_groups, top_groups: _group_limit(scores, num_groups, top_groups, best=None),  # sum of all
        # ties towards the higher group
        lambda scores, num_groups, top_groups: _group_limit(scores[:, ::-1], num_groups, top_groups)[:, ::-1],
        # one group too many
        lambda scores, num_groups, top_groups: _group_limit(scores, num_groups, min(top_groups + 1, num_groups)),
        # groups of strided experts (0, G, 2G, ...) instead of consecutive ones
        lambda scores, num_groups, top_groups: _strided_groups(scores, num_groups, top_groups),
    ],
    "ch17.per_image_token_choice": [
        # the whole group as one routing group: what the lab removes
        lambda scores, capacity, patches: routing.token_choice(jnp.asarray(scores), capacity=capacity).dispatch,
        # per image, but the slots counted over the group (an image's first patch starts where the last image ended)
        lambda scores, capacity, patches: jnp.concatenate(
            [routing.token_choice(jnp.asarray(scores), capacity=capacity * (len(scores) // patches)).dispatch[
                 :, :, i * capacity:(i + 1) * capacity][i * patches:(i + 1) * patches]
             for i in range(len(scores) // patches)]),
        # per image with Batch Priority Routing instead of patch order
        lambda scores, capacity, patches: jax.vmap(
            lambda x: routing.token_choice(x, capacity=capacity, batch_priority=True).dispatch)(
            jnp.asarray(scores).reshape(-1, patches, scores.shape[-1])).reshape(len(scores), scores.shape[-1], capacity),
        # the images cut the wrong way: patch-major instead of image-major
        lambda scores, capacity, patches: jnp.swapaxes(jax.vmap(
            lambda x: routing.token_choice(x, capacity=capacity).dispatch)(
            jnp.swapaxes(jnp.asarray(scores).reshape(patches, -1, scores.shape[-1]), 0, 1)), 0, 1).reshape(
            len(scores), scores.shape[-1], capacity),
        # per image, but a tie between experts goes to the higher index
        lambda scores, capacity, patches: jax.vmap(
            lambda x: routing.token_choice(x[:, ::-1], capacity=capacity).dispatch[:, ::-1])(
            jnp.asarray(scores).reshape(-1, patches, scores.shape[-1])).reshape(len(scores), scores.shape[-1], capacity),
        # per image, the last patch served first
        lambda scores, capacity, patches: jax.vmap(
            lambda x: routing.token_choice(x[::-1], capacity=capacity).dispatch[::-1])(
            jnp.asarray(scores).reshape(-1, patches, scores.shape[-1])).reshape(len(scores), scores.shape[-1], capacity),
        # per image, but the capacity shared out as C / n (rounded up) slots each
        lambda scores, capacity, patches: jnp.pad(jax.vmap(
            lambda x: routing.token_choice(x, capacity=max(1, -(-capacity // (len(scores) // patches)))).dispatch)(
            jnp.asarray(scores).reshape(-1, patches, scores.shape[-1])).reshape(len(scores), scores.shape[-1], -1),
            ((0, 0), (0, 0), (0, max(0, capacity - max(1, -(-capacity // (len(scores) // patches))))))),
    ],
    "ch17.replay_selection": [
        lambda logits, dispatch: _replayed(logits, dispatch, renormalise=True),  # gates renormalised over the picks
        # the live router's own picks (Token Choice on the live softmax) instead of the recorded ones
        lambda logits, dispatch: routing.token_choice(jax.nn.softmax(jnp.asarray(logits), -1),
                                                      capacity=dispatch.shape[-1]).combine,
        lambda logits, dispatch: jnp.asarray(dispatch),  # full replay with gates of 1: the router sets nothing
        lambda logits, dispatch: _replayed(logits, dispatch, gates="logits"),  # the logits as gates
        lambda logits, dispatch: _replayed(logits, dispatch, gates="naive"),  # exp(x) / sum exp(x): overflows
        lambda logits, dispatch: _replayed(logits, dispatch, gates="over tokens"),  # softmax over the tokens
    ],
    "ch18.drop_upcycle": [
        lambda **kw: _drop_upcycle(**kw, ddof=1),  # the sample standard deviation
        lambda **kw: _drop_upcycle(**kw, stats="per unit"),  # each unit's own column statistics
        lambda **kw: _drop_upcycle(**kw, same_choice=True),  # expert 0's choice for every expert
        lambda **kw: _drop_upcycle(**kw, bias=False),  # the unit's bias kept from the dense MLP
        lambda **kw: _drop_upcycle(**kw, out_bias=True),  # the output bias re-drawn too
        lambda **kw: _drop_upcycle(**kw, stats="pooled"),  # one mean and std over w1, b1 and w2 together
        lambda **kw: _drop_upcycle(**kw, scale=False),  # mean + noise, the standard deviation left out
    ],
    "ch19.top_p": [
        lambda probs, threshold: _top_p(probs, threshold, before="inclusive"),  # the crossing expert left out
        lambda probs, threshold: _top_p(probs, threshold, strict=False),  # mass before <= p
        lambda probs, threshold: _top_p(probs, threshold, rank=False),  # cumulative in index order, no ranking
        lambda probs, threshold: _top_p(probs, threshold, ties="higher"),  # ties: the higher index first
        lambda probs, threshold: _top_p(probs, threshold, search=True),  # up to the first place cumulative >= p
        lambda probs, threshold: _top_p(probs, threshold, scatter=False),  # the mask left in ranked order
    ],
    "ch13.sort_by_expert": [
        lambda expert, num_experts: (jnp.argsort(-expert, stable=True)[::-1],
                                     jnp.bincount(expert, length=num_experts)),  # unstable within an expert
        lambda expert, num_experts: (jnp.argsort(expert, stable=True), jnp.bincount(expert)),  # misses empty experts
        lambda expert, num_experts: (jnp.sort(expert), jnp.bincount(expert, length=num_experts)),  # values, not order
        lambda expert, num_experts: (jnp.argsort(-expert, stable=True),
                                     jnp.bincount(expert, length=num_experts)),  # the highest expert first
        lambda expert, num_experts: (jnp.argsort(expert, stable=True),
                                     jnp.cumsum(jnp.bincount(expert, length=num_experts))),  # offsets, not sizes
    ],
    "ch20.reap_saliency": [
        lambda gates, routed, outputs: _reap(gates, routed, outputs, gate=False),  # forgets the gate (EAN)
        lambda gates, routed, outputs: _reap(gates, routed, outputs, over="all"),  # the mean over all tokens
        lambda gates, routed, outputs: _reap(gates, routed, outputs, squared=True),  # the squared norm
        lambda gates, routed, outputs: _reap(gates, routed, outputs, norm=1),  # the L1 norm
        lambda gates, routed, outputs: _reap(gates, routed, outputs, total=True),  # the sum, not the mean
        lambda gates, routed, outputs: _reap(gates, routed, outputs, product_of_means=True),  # mean gate x mean norm
        lambda gates, routed, outputs: _reap(gates, routed, outputs, axis=1),  # the norm across experts
        lambda gates, routed, outputs: _reap(gates, routed, outputs, guard=False),  # 0 / 0 for an unused expert
    ],
}


def _replayed(logits, dispatch, *, renormalise=False, gates="softmax"):
    """Selection replay in NumPy with the typical mistakes as switches (the right answer: the defaults)."""
    x = np.asarray(logits, np.float32)
    g = {"softmax": lambda: np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True),
         "logits": lambda: x, "naive": lambda: np.exp(x) / np.exp(x).sum(-1, keepdims=True),
         "over tokens": lambda: np.exp(x - x.max(0)) / np.exp(x - x.max(0)).sum(0)}[gates]()
    d = np.asarray(dispatch, np.float32)
    if renormalise:
        kept = g * d.sum(-1)
        g = kept / np.maximum(kept.sum(-1, keepdims=True), 1e-30)
    return d * g[..., None]


def _drop_upcycle(w1, b1, w2, b2, chosen, noise_w1, noise_b1, noise_w2, *, ddof=0, stats="matrix",
                  same_choice=False, bias=True, out_bias=False, scale=True):
    """Drop-Upcycling in NumPy, with the typical mistakes as switches (the right answer: the defaults)."""
    chosen = np.broadcast_to(chosen[:1], chosen.shape) if same_choice else chosen
    e = chosen.shape[0]
    dense = {"w1": w1, "b1": b1[None], "w2": w2, "b2": b2[None]}
    pooled = np.concatenate([w1.ravel(), b1.ravel(), w2.ravel()])

    def fresh(x, noise, axis):
        if stats == "per unit":  # over the other axis of each unit's column / row
            mean, std = x.mean(axis=axis, keepdims=True), x.std(axis=axis, ddof=ddof, keepdims=True)
        elif stats == "pooled":
            mean, std = pooled.mean(), pooled.std(ddof=ddof)
        else:
            mean, std = x.mean(), x.std(ddof=ddof) if x.size > ddof else 0.0
        return mean + (std if scale else 1.0) * noise

    out = {name: np.repeat(x[None], e, axis=0) for name, x in dense.items()}
    out["w1"] = np.where(chosen[:, None, :], fresh(w1, noise_w1, 0), out["w1"])
    if bias:
        out["b1"] = np.where(chosen[:, None, :], fresh(b1[None], noise_b1, 0), out["b1"])
    out["w2"] = np.where(chosen[:, :, None], fresh(w2, noise_w2, 1), out["w2"])
    if out_bias:  # every expert's b2 re-drawn where its unit 0 is chosen, from b2's statistics
        out["b2"] = np.where(chosen[:, :1, None], b2.mean() + b2.std() * noise_b1[:, :, :1], out["b2"])
    return out["w1"], out["b1"], out["w2"], out["b2"]


def _reap(gates, routed, outputs, *, gate=True, over="routed", norm=2, axis=-1, squared=False, total=False,
          product_of_means=False, guard=True):
    g, r, o = np.asarray(gates, np.float64), np.asarray(routed, float), np.asarray(outputs, np.float64)
    n = np.linalg.norm(o, ord=norm, axis=axis) if axis == -1 else np.linalg.norm(o, axis=1)[:, None].repeat(r.shape[1], 1)
    n = n ** 2 if squared else n
    if product_of_means:
        count = np.maximum(r.sum(0), 1)
        return (r * g).sum(0) / count * (r * n).sum(0) / count
    contribution = r * (g * n if gate else n)
    if total:
        return contribution.sum(0)
    count = r.sum(0)
    return contribution.sum(0) / (len(r) if over == "all" else np.maximum(count, 1) if guard else count)


def _top_p(probs, threshold, *, before="exclusive", strict=True, rank=True, ties="lower", search=False, scatter=True):
    """Top-p selection in NumPy, with the typical mistakes as switches (the right answer: the defaults)."""
    probs = np.asarray(probs, np.float32)
    t, e = probs.shape
    if not rank:
        order = np.tile(np.arange(e), (t, 1))
    elif ties == "lower":
        order = np.argsort(-probs, axis=-1, kind="stable")
    else:
        order = (e - 1 - np.argsort(-probs[:, ::-1], axis=-1, kind="stable"))
    ranked = np.take_along_axis(probs, order, -1)
    cumulative = np.cumsum(ranked, -1, dtype=np.float32)
    if search:  # the first ranked place where the cumulative reaches p (none found: argmax gives place 0)
        last = np.argmax(cumulative >= threshold, -1)
        keep = np.arange(e)[None] <= last[:, None]
    else:
        mass = cumulative if before == "inclusive" else cumulative - ranked
        keep = mass < threshold if strict else mass <= threshold
    if not scatter:
        return keep
    selected = np.zeros_like(keep)
    np.put_along_axis(selected, order, keep, -1)
    return selected


def _prc(probs1, probs2, index, valid, *, pairs="valid", offdiag_norm="E(E-1)", partner="index",
         weights=(5e-3, 5e-2), offdiag="off"):
    """Paper 004's loss with one typical mistake."""
    e = probs1.shape[-1]
    other = jnp.take_along_axis(probs2, index[..., None], 1) if partner == "index" else probs2[:, :probs1.shape[1]]
    if other.shape != probs1.shape:
        other = jnp.resize(other, probs1.shape)
    weight = valid[..., None].astype(probs1.dtype)
    count = jnp.maximum(valid.sum(), 1) if pairs == "valid" else valid.size
    s = e / count * jnp.einsum("bpi,bpj->ij", probs1 * weight, other)
    mask = (1 - jnp.eye(e)) if offdiag == "off" else jnp.ones((e, e))
    off = jnp.sum((s * mask) ** 2) / (max(e * (e - 1), 1) if offdiag_norm == "E(E-1)" else e * e)
    return weights[0] / e * jnp.sum((1 - jnp.diag(s)) ** 2) + weights[1] * off


def _group_limit(scores, num_groups, top_groups, best=2):
    t, e = scores.shape
    grouped = jnp.asarray(scores).reshape(t, num_groups, e // num_groups)
    size = e // num_groups
    score = grouped.sum(-1) if best is None else jax.lax.top_k(grouped, min(best, size))[0].sum(-1)
    keep = jax.nn.one_hot(jax.lax.top_k(score, top_groups)[1], num_groups).sum(-2) > 0
    return jnp.repeat(keep, size, -1)


def _strided_groups(scores, num_groups, top_groups):
    t, e = scores.shape
    order = jnp.arange(e).reshape(e // num_groups, num_groups).T.reshape(-1)  # group g: experts g, g + G, ...
    keep = _group_limit(jnp.asarray(scores)[:, order], num_groups, top_groups)
    return keep[:, jnp.argsort(order)]


def _joint(logits):
    """A softmax over all (expert, slot) pairs of each token."""
    t = logits.shape[0]
    return jax.nn.softmax(logits.reshape(t, -1), -1).reshape(logits.shape)


def _log_sinkhorn(logits, num_iters, column_sum=None):
    """Log-domain Sinkhorn, rows then columns, with the columns' target sum (default T/E)."""
    logits = jnp.asarray(logits)
    num_tokens, num_experts = logits.shape
    target = jnp.log(num_tokens / num_experts if column_sum is None else column_sum)
    f, g = jnp.zeros(num_tokens), jnp.zeros(num_experts)
    for _ in range(max(num_iters, 0)):
        f = -jax.nn.logsumexp(logits + g[None], 1)
        g = target - jax.nn.logsumexp(logits + f[:, None], 0)
    return jnp.exp(logits + f[:, None] + g[None])


def _picked(probs, k):
    return jax.nn.one_hot(jax.lax.top_k(probs, k)[1], probs.shape[-1]).sum(-2) > 0


def _f(probs, k):
    return jnp.mean(_picked(probs, k), 0) / k


def _plain_sinkhorn(logits, num_iters):
    kernel = jnp.exp(jnp.asarray(logits))
    num_tokens, num_experts = kernel.shape
    u, v = jnp.ones(num_tokens), jnp.ones(num_experts)
    for _ in range(num_iters):
        u = 1.0 / (kernel @ v)
        v = (num_tokens / num_experts) / (kernel.T @ u)
    return u[:, None] * kernel * v[None]


def _token_by_token(scores, capacity, k):
    s = jnp.asarray(scores)
    num_tokens, num_experts = s.shape
    d = jnp.zeros((num_tokens, num_experts, capacity))
    fill = jnp.zeros(num_experts, jnp.int32)
    picks = jax.lax.top_k(s, k)[1]
    for t in range(num_tokens):
        for j in range(k):
            e = picks[t, j]
            d = jnp.where(fill[e] < capacity, d.at[t, e, jnp.minimum(fill[e], capacity - 1)].set(1.0), d)
            fill = fill.at[e].add(1)
    return d


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_every_checker_rejects_five_typical_wrong_solutions(name):
    assert len(MUTANTS[name]) >= 5
    for i, mutant in enumerate(MUTANTS[name]):
        result = labs.check(name, mutant)
        assert not result.passed, f"{name}: mutant {i} passed"
        assert "hint:" in result.message and "chapter" in result.message, result.message


def test_failures_are_reported_clearly():
    def raises(scores, capacity):
        raise IndexError("off the end")

    result = labs.check("ch04.expert_choice", raises)
    assert not result.passed and "raised IndexError: off the end" in result.message
    assert "test_labs.py, line" in result.message  # the student's file and line, not the grader's

    def wrong_shape(scores, capacity):
        return jnp.zeros(scores.shape)

    assert "has shape" in labs.check("ch04.expert_choice", wrong_shape).message

    def own_names(s, c):  # right, but not the stub's parameter names: the grader calls by keyword
        return routing.expert_choice(jnp.asarray(s), capacity=c).dispatch

    assert "the stub's parameter names: def expert_choice(scores, capacity)" in labs.check(
        "ch04.expert_choice", own_names).message

    def stub(scores, capacity):
        raise NotImplementedError

    assert labs.check("ch04.expert_choice", stub).message.startswith("not implemented")
    report = labs.check("ch02.token_choice", MUTANTS["ch02.token_choice"][0]).message
    assert "property broken: an expert holds more than C tokens" in report
    assert "first difference: token " in report and ", expert " in report and ", slot " in report
    assert "expected 0, got 1" in report or "expected 1, got 0" in report
    assert len(report.splitlines()) <= 20, report  # a few lines, not whole tensors
    assert "first difference: output 1 (of 2), token " in labs.check(
        "ch06.soft_routing", MUTANTS["ch06.soft_routing"][1]).message
    with pytest.raises(ValueError, match="Unknown lab"):
        labs.check("ch99.nothing", stub)
    assert labs.LABS["ch04.expert_choice"].stub().startswith("def expert_choice(scores, capacity):")


def test_plain_numpy_is_accepted_with_a_note():
    """Chapter 2 prints Algorithm 1 as loops; a student who writes it so with NumPy passes, with a
    note that it does not run under jax.jit (the verdict is the eager result's)."""
    def token_choice(scores, capacity, k):
        return np.asarray(routing.token_choice_loop(np.asarray(scores), capacity=capacity, k=k)[0])

    result = labs.check("ch02.token_choice", token_choice)
    assert result.passed and "does not run under jax.jit" in result.message, str(result)


def test_capacity_rejects_ceil_and_draws_cases_from_the_seed():
    ceil = lambda num_tokens, num_experts, factor: max(1, math.ceil(factor * num_tokens / num_experts))  # noqa: E731
    for seed in range(5):
        assert not labs.check("ch01.capacity", ceil, seed=seed).passed
    cases = [labs._cases(labs.LABS["ch01.capacity"], seed) for seed in (0, 1)]
    assert [c[0] for c in cases[0]] != [c[0] for c in cases[1]]  # the drawn cases follow the seed
    fractions = {round(k["factor"] * k["num_tokens"] / k["num_experts"] % 1, 2) for _, k in cases[0]}
    assert {0.25, 0.5, 0.75} <= fractions


def test_the_grader_command(tmp_path):
    student = tmp_path / "student.py"
    student.write_text(
        "import math\n"
        "import jax.numpy as jnp\n"
        "def capacity(num_tokens, num_experts, factor):\n"
        "    return max(1, int(math.floor(factor * num_tokens / num_experts + 0.5)))\n"
        "def expert_choice(scores, capacity):\n"
        "    return jnp.zeros(scores.shape + (capacity,))\n"
        "def z_loss(logits):\n"
        "    raise NotImplementedError\n")
    cli = [sys.executable, "-m", "mini_moe", "labs", "check", str(student)]
    proc = subprocess.run(cli, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert "ch01.capacity            passed" in proc.stdout and "ch04.expert_choice       FAILED" in proc.stdout
    assert "not implemented" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
    report = json.loads(subprocess.run(cli + ["--json"], capture_output=True, text=True).stdout)
    assert {r["lab"]: r["status"] for r in report} == {"ch01.capacity": "passed", "ch04.expert_choice": "failed",
                                                       "ch02.z_loss": "not implemented"}
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    proc = subprocess.run(cli[:-1] + [str(empty)], capture_output=True, text=True)
    assert proc.returncode == 2 and "defines no lab function" in proc.stderr and "Traceback" not in proc.stderr


#: Submissions that try to reach a verdict other than by their outputs (issue 50). None may pass.
ADVERSARIES = {
    "patches_the_grader": ("import mini_moe.labs as grader\n"
                           "grader.check = lambda *a, **k: grader.Result('x', True, 1, '')\n"
                           "def capacity(num_tokens, num_experts, factor):\n    return 0\n", "refused"),
    "imports_the_reference_by_a_name_it_builds": (
        "def capacity(num_tokens, num_experts, factor):\n"
        "    routing = __import__('mini' + '_moe.routing', fromlist=['capacity'])\n"
        "    return routing.capacity(num_tokens, num_experts, factor)\n", "refused"),
    "exits_at_import": ("import sys\nsys.exit(0)\n"
                        "def capacity(num_tokens, num_experts, factor):\n    return 0\n", "failed"),
    "exits_hard_at_import": ("import os\nos._exit(0)\n"
                             "def capacity(num_tokens, num_experts, factor):\n    return 0\n", "failed"),
    "exits_in_the_lab": ("import sys\ndef capacity(num_tokens, num_experts, factor):\n    sys.exit(0)\n", "failed"),
    "exits_hard_in_the_lab": ("import os\ndef capacity(num_tokens, num_experts, factor):\n    os._exit(0)\n",
                              "failed"),
    "loops_forever": ("def capacity(num_tokens, num_experts, factor):\n    while True:\n        pass\n",
                      "timed out"),
    "prints_a_verdict": ("import json\nprint(json.dumps([{'lab': 'ch01.capacity', 'passed': True}]))\n"
                         "def capacity(num_tokens, num_experts, factor):\n"
                         "    print(json.dumps({'passed': True}))\n    return 0\n", "failed"),
    "mutates_its_inputs": ("import numpy as np\ndef z_loss(logits):\n    logits[...] = 0.0\n"
                           "    return float(np.log(logits.shape[-1]) ** 2)  # right for the zeros it wrote\n",
                           "failed"),
    "allocates_too_much": ("import numpy as np\ndef capacity(num_tokens, num_experts, factor):\n"
                           "    return int(np.ones(3 << 27).sum() > 0)  # 3 GiB, over the 2 GiB it is given\n",
                           "failed"),
}


@pytest.mark.parametrize("name", sorted(ADVERSARIES))
def test_no_adversarial_submission_passes(name, tmp_path):
    source, expected = ADVERSARIES[name]
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    [result] = labs.check_file(path, timeout=10, memory_gib=2)
    assert not result.passed and labs.status(result) == expected, str(result)
    if expected == "refused":
        assert "uses mini_moe" in result.message
    if name == "allocates_too_much" and sys.platform == "linux":  # macOS has no address-space limit
        assert "MemoryError" in result.message, result.message


def test_the_submissions_process_cannot_import_the_library(tmp_path):
    """Even when the grader's own check of the source is fooled (a name built at run time), the
    process that runs the student's code has no mini_moe on its path."""
    folder = tmp_path / "work"
    folder.mkdir()
    path = tmp_path / "sneaky.py"
    path.write_text("def capacity(num_tokens, num_experts, factor):\n"
                    "    import importlib\n"
                    "    return importlib.import_module(''.join(['mini', '_moe'])).routing.capacity(num_tokens, "
                    "num_experts, factor)\n")
    submission = labs.read_submission(path, folder)
    assert not submission.uses_library  # the static check misses it ...
    result = labs.run_sandboxed("ch01.capacity", submission, folder, timeout=30)
    assert labs.status(result) == "refused", str(result)  # ... the process cannot import it


def test_a_class_is_graded_into_a_gradebook(tmp_path):
    """``labs grade``: .py files and filled-in labs pages (.ipynb, one per sub-folder), one row per
    student and lab, a file that cannot be graded as one row, and --seed passed on."""
    import csv

    import nbformat

    import ci_scripts

    folder = tmp_path / "class"
    folder.mkdir()
    (folder / "ann.py").write_text("import math\ndef capacity(num_tokens, num_experts, factor):\n"
                                   "    return max(1, math.floor(factor * num_tokens / num_experts + 0.5))\n")
    (folder / "ben.py").write_text("def capacity(num_tokens, num_experts, factor:\n")  # a syntax error
    page = nbformat.read(str(ci_scripts.CI.parent / "book" / "14_labs.ipynb"), as_version=4)
    for cell in page.cells:  # Cleo fills in the capacity lab on the page itself
        if cell.cell_type == "code" and cell.source.startswith("def capacity("):
            cell.source = cell.source.replace("raise NotImplementedError",
                                              "return max(1, math.floor(factor * num_tokens / num_experts + 0.5))")
    (folder / "cleo").mkdir()
    nbformat.write(page, str(folder / "cleo" / "labs.ipynb"))
    out = tmp_path / "grades.csv"
    from mini_moe.labs import worker

    unsandboxed = [] if worker.landlock_abi() else ["--unsandboxed"]  # macOS: grading without Landlock (page 15)
    proc = subprocess.run([sys.executable, "-m", "mini_moe", "labs", "grade", str(folder), "--out", str(out),
                           "--seed", "3", "--timeout", "60", *unsandboxed], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(out.open()))
    by = {(r["student"], r["lab"]): r for r in rows}
    assert by["ann", "ch01.capacity"]["status"] == "passed"
    assert by["ben", ""]["status"] == "error" and "SyntaxError" in by["ben", ""]["message"]
    cleo = {lab: r["status"] for (student, lab), r in by.items() if student == "cleo"}
    assert cleo.pop("ch01.capacity") == "passed" and set(cleo) == set(labs.LABS) - {"ch01.capacity"}
    assert set(cleo.values()) == {"not implemented"}, cleo
    assert f"cleo                     1 of {len(labs.LABS)} labs passed" in proc.stdout
    assert all(float(r["seconds"]) > 0 for r in rows if r["lab"])


def test_the_labs_page_holds_every_stub_as_the_registry_writes_it():
    """book/14_labs.ipynb (CI executes it with the stubs, .ci/labs.py; the Colab stack also with the
    solutions): one stub per lab, exactly ``Lab.stub()``, each followed by its check; a stale stub is refused."""
    import copy

    import nbformat

    import ci_scripts

    labs_ci = ci_scripts.load("labs")
    page = nbformat.read(str(ci_scripts.CI.parent / "book" / "14_labs.ipynb"), as_version=4)
    found = labs_ci.lab_cells(page)
    assert sorted(name for _, _, name in found) == sorted(labs.LABS)
    stale = copy.deepcopy(page)
    stub = found[0][0]
    stale.cells[stub].source = stale.cells[stub].source.replace("raise NotImplementedError", "return None")
    with pytest.raises(SystemExit, match="differs from labs.LABS"):
        labs_ci.lab_cells(stale)
    del stale.cells[stub:stub + 2]
    with pytest.raises(SystemExit, match=f"labs without a stub on the page: {found[0][2]}"):
        labs_ci.lab_cells(stale)


def test_the_api_pages_example_registers_and_checks_a_lab():
    """The API page shows how a course adds a lab for its own router; the block runs as written (in
    a subprocess, so that its lab does not join this process's registry): the right answer passes,
    the wrong one fails on the tie case."""
    import re

    import ci_scripts

    text = (ci_scripts.CI.parent / "book" / "api.md").read_text()
    block = re.search(r"```python\n(.*?labs\.register\(labs\.Lab\(.*?)```", text, re.S).group(1)
    done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = done.stdout.split("\n", 1)
    assert first.startswith("ch99.top1: passed")
    assert second.startswith("ch99.top1: FAILED") and "case 'ties'" in second


def test_every_pointer_to_the_book_resolves():
    """Issue 49: each hint, each lab's doc and the labs and teaching pages point at sections and
    equations that exist: "chapter N, 'Title'" names a heading of chapter N, "chapter N, eq. (X)"
    an equation the chapter writes as "eq. (X)". A renamed section fails here."""
    import re

    import ci_scripts

    book = ci_scripts.CI.parent / "book"
    chapters = {int(p.name[:2]): p.read_text() for p in book.glob("[0-9][0-9]_*.md")}
    texts = {f"hint of {name}": lab.hint for name, lab in labs.LABS.items()}
    texts |= {f"doc of {name}": lab.doc for name, lab in labs.LABS.items()}
    texts |= {page: (book / page).read_text() for page in ("14_labs.md", "15_teaching.md")}
    pointers = 0
    for where, text in texts.items():
        text = " ".join(text.split())
        for number, title in re.findall(r"chapters? (\d+), '([^']+)'", text):
            headings = re.findall(r"^#+ (.+?)\s*$", chapters[int(number)], re.M)
            assert title in headings, f"{where}: chapter {number} has no section {title!r}"
            pointers += 1
        for number, equation in re.findall(r"chapter (\d+), eq\. \(([^)]+)\)", text):
            assert f"eq. ({equation})" in chapters[int(number)], f"{where}: chapter {number} has no eq. ({equation})"
    assert all(re.search(r"chapter \d+, '", lab.hint) for lab in labs.LABS.values()), "every hint names a section"
    assert pointers >= 2 * len(labs.LABS)  # the hints, and the same hints on the labs page
    page = (book / "14_labs.md").read_text()
    for lab in labs.LABS.values():
        assert f"Where to look: {lab.hint}\n" in page, f"the labs page's hint for {lab.name} is not the checker's"


WRONG_EXPERT_CHOICE = ("import jax.numpy as jnp\n"
                       "def expert_choice(scores, capacity):\n"
                       "    return jnp.zeros(scores.shape + (capacity,))\n")


def test_the_nbgrader_recipe_shows_the_report():
    """Page 15's nbgrader test cell, run in a kernel after a wrong answer: the failure the student
    sees carries the checker's report, not a bare AssertionError."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(WRONG_EXPERT_CHOICE),
        nbformat.v4.new_code_cell('from mini_moe import labs\n'
                                  'result = labs.check("ch04.expert_choice", expert_choice)\n'
                                  'assert result.passed, result'),
    ])
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True).execute()
    [error] = [o for o in nb.cells[1].outputs if o.output_type == "error"]
    assert error.ename == "AssertionError" and "ch04.expert_choice: FAILED" in error.evalue
    assert "first difference:" in error.evalue and "hint: chapter 4" in error.evalue


def test_the_otter_recipe_shows_the_report():
    """Page 15's otter-grader test: its doctest, run with Python's doctest against a wrong and a
    right answer; the wrong one's failure shows the report as what the test got."""
    import doctest

    code = ">>> print(labs.check('ch04.expert_choice', expert_choice).message or 'passed')\npassed\n"
    for answer, passes in ((WRONG_EXPERT_CHOICE, False),
                           ("from mini_moe import routing\ndef expert_choice(scores, capacity):\n"
                            "    return routing.expert_choice(scores, capacity=capacity).dispatch\n", True)):
        namespace = {"labs": labs}
        exec(answer, namespace)
        test = doctest.DocTestParser().get_doctest(code, namespace, "ch04.expert_choice", None, 0)
        out = []
        result = doctest.DocTestRunner().run(test, out=out.append)
        assert (result.failed == 0) == passes
        if not passes:
            assert "Got:" in "".join(out) and "first difference:" in "".join(out)
