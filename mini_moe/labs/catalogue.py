"""The labs, one section per chapter: each lab's input generator (named edge cases first, then
random sizes), its properties and its :func:`~mini_moe.labs.register` call. A teacher adding a lab
adds a section here; the framework is :mod:`mini_moe.labs`, the grader :mod:`mini_moe.labs.grader`."""

from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp
import numpy as np

from mini_moe import losses, routing, transport
from mini_moe.labs import Lab, register



def _softmax(logits):
    z = logits - logits.max(-1, keepdims=True)
    p = np.exp(z)
    return (p / p.sum(-1, keepdims=True)).astype(np.float32)


def _score_cases(rng, *, with_capacity=True, k_values=(1,)):
    """Score matrices ``[T, E]`` (softmax of logits) with their capacity: edge cases first."""
    def case(label, logits, capacity=None, k=1):
        kwargs = {"scores": _softmax(np.asarray(logits, np.float64))}
        if with_capacity:
            kwargs["capacity"] = int(capacity)
        if k != 1 or len(k_values) > 1:
            kwargs["k"] = int(k)
        return label, kwargs

    cases = [
        case("one token, two experts", [[0.3, -0.2]], 1),
        case("ties: every score equal", np.zeros((4, 2)), 2),
        case("fewer tokens than experts", rng.normal(size=(2, 5)), 1),
        case("capacity 1", rng.normal(size=(6, 3)), 1),
        case("every token wants expert 0", rng.normal(size=(8, 4)) + np.array([4.0, 0, 0, 0]), 2),
        case("extreme logits", rng.normal(size=(6, 3)) * 300.0, 2),
    ]
    for k in k_values:
        if k > 1:
            cases.append(case(f"k = {k}, popular expert", rng.normal(size=(8, 4)) + np.array([2.0, 0, 0, 0]), 4, k))
    for i in range(6):
        t, e = int(rng.integers(2, 17)), int(rng.integers(2, 7))
        k = int(rng.choice([kk for kk in k_values if kk <= e]))
        cases.append(case(f"random {i}", rng.normal(size=(t, e)) * rng.uniform(0.5, 3.0),
                          rng.integers(1, max(2, math.ceil(1.5 * k * t / e)) + 1), k))
    return cases


def _capacity_cases(rng):
    """(T, E, factor) with factor * T / E a half (10/4: up, not to even), below a half (9/4: not up,
    as ceil would), above a half (11/4), under 1 (3/4, 1/4: never below 1), and six drawn from
    ``rng``."""
    fixed = [(10, 4, 1.0), (9, 2, 1.0), (9, 4, 1.0), (11, 4, 1.0), (6, 4, 1.0), (3, 4, 1.0), (1, 4, 1.0), (2, 8, 1.0),
             (14, 4, 1.0), (100, 8, 1.25), (7, 2, 2.0), (1, 16, 0.5)]
    drawn = [(int(rng.integers(1, 300)), int(rng.integers(1, 33)), float(rng.choice([0.5, 1.0, 1.25, 1.5, 2.0])))
             for _ in range(6)]
    return [(f"T={t}, E={e}, factor={f}", dict(num_tokens=t, num_experts=e, factor=f)) for t, e, f in fixed + drawn]


def _soft(rt):
    return rt.dispatch, rt.combine


def _holds_per_expert(kwargs, dispatch) -> bool:
    """No expert holds more than C tokens (a dispatch [T, E, C] is 0/1 with one token per slot)."""
    d = np.asarray(dispatch)
    return d.ndim == 3 and bool(np.all(d.sum(0) <= 1)) and d.shape[-1] == kwargs["capacity"]


def _k_per_token(kwargs, dispatch) -> bool:
    return bool(np.all(np.asarray(dispatch).sum((1, 2)) <= kwargs.get("k", 1)))


# ------------------------------------------------------------------------------------ the labs

register(Lab(
    name="ch01.capacity",
    signature="(num_tokens, num_experts, factor)",
    doc="The buffer capacity C = round(factor * T / E) (chapter 1, Algorithm 1): halves round up, never below 1. "
        "Returns an int.",
    reference=lambda num_tokens, num_experts, factor: routing.capacity(num_tokens, num_experts, factor),
    cases=lambda rng: _capacity_cases(rng),
    hint="chapter 1, 'The conventions we follow': which way does a half round, and what is the smallest C?",
))

register(Lab(
    name="ch02.token_choice",
    axes=(("token", "expert", "slot"),),
    signature="(scores, capacity, k)",
    doc="Algorithm 1 (paper 000): scores [T, E] -> dispatch [T, E, C] (0/1). Every token picks its k best experts; "
        "all first choices are placed (in token order) before any second choice; a pick finding its expert's C "
        "slots full is dropped.",
    reference=lambda scores, capacity, k: routing.token_choice(jnp.asarray(scores), capacity=capacity, k=k).dispatch,
    cases=lambda rng: _score_cases(rng, k_values=(1, 2)),
    properties=(("an expert holds more than C tokens", _holds_per_expert),
                ("a token reaches more than k experts", _k_per_token)),
    hint="chapter 2, 'Algorithm 1, one token at a time': the order of the rounds, and a token's slot is the number of "
         "tokens placed at that expert before it.",
))

register(Lab(
    name="ch02.token_choice_bpr",
    axes=(("token", "expert", "slot"),),
    signature="(scores, capacity)",
    doc="Algorithm 1 with Batch Priority Routing, k = 1: tokens visited by decreasing top-1 score (a stable sort: "
        "equal scores keep token order). scores [T, E] -> dispatch [T, E, C].",
    reference=lambda scores, capacity: routing.token_choice(jnp.asarray(scores), capacity=capacity,
                                                            batch_priority=True).dispatch,
    cases=lambda rng: _score_cases(rng),
    properties=(("an expert holds more than C tokens", _holds_per_expert),),
    hint="chapter 2, 'Batch Priority Routing': which token gets a slot first, and how are ties ordered?",
))

register(Lab(
    name="ch04.expert_choice",
    axes=(("token", "expert", "slot"),),
    signature="(scores, capacity)",
    doc="Algorithm 2: every expert takes the C tokens with its highest scores (ties: the earlier token), slot i "
        "holding its i-th best. scores [T, E] -> dispatch [T, E, C] (0/1).",
    reference=lambda scores, capacity: routing.expert_choice(jnp.asarray(scores), capacity=capacity).dispatch,
    cases=lambda rng: [c for c in _score_cases(rng) if c[1]["capacity"] <= c[1]["scores"].shape[0]],
    properties=(("an expert holds more or fewer than C tokens",
                 lambda kw, d: bool(np.all(np.asarray(d).sum((0, 2)) == kw["capacity"]))),),
    hint="chapter 4, 'Algorithm 2': along which axis does an expert rank, and in which order do "
         "its slots fill?",
))

register(Lab(
    name="ch02.switch_loss",
    signature="(probs, k)",
    doc="The Switch/GShard balance loss E * sum_i f_i P_i (chapter 2): probs [T, E] (softmax), f_i the fraction of "
        "the k T picks (each token's top k) that go to expert i, P_i the mean probability of expert i. A scalar.",
    reference=lambda probs, k: losses.switch_loss(jnp.asarray(probs), k=k),
    cases=lambda rng: [(label, {"probs": kw["scores"], "k": kw.get("k", 1)})
                       for label, kw in _score_cases(rng, with_capacity=False, k_values=(1, 2))],
    hint="chapter 2, 'Keeping experts busy: balancing losses': what f_i counts (picks, not probabilities) and "
         "what it is divided by.",
))

register(Lab(
    name="ch02.z_loss",
    signature="(logits)",
    doc="The router z-loss (ST-MoE, eq. 5): the mean over tokens of logsumexp(logits[t])^2. logits [T, E] -> scalar. "
        "It must stay finite for logits in the hundreds.",
    reference=lambda logits: losses.z_loss(jnp.asarray(logits)),
    cases=lambda rng: [("small", {"logits": rng.normal(size=(4, 3)).astype(np.float32)}),
                       ("extreme logits", {"logits": (rng.normal(size=(5, 4)) * 300).astype(np.float32)})]
    + [(f"random {i}", {"logits": (rng.normal(size=(int(rng.integers(1, 9)), int(rng.integers(2, 9)))) * 3)
                        .astype(np.float32)}) for i in range(8)],
    tolerance=(1e-4, 1e-4),
    hint="chapter 2, 'Keeping experts busy: balancing losses' (the z-loss): a log of a sum of exponentials "
         "overflows unless you subtract the maximum first.",
))

register(Lab(
    name="ch03.sinkhorn",
    axes=(("token", "expert"),),
    signature="(logits, num_iters)",
    doc="Log-domain Sinkhorn (eq. 8, epsilon = 1): logits [T, E] -> the plan [T, E]. Each iteration sets the row "
        "potentials f so every row sums to 1, then the column potentials g so every column sums to T/E; the plan is "
        "exp(logits + f + g). Start from f = g = 0.",
    reference=lambda logits, num_iters: transport.sinkhorn(jnp.asarray(logits), num_iters=num_iters),
    cases=lambda rng: [("one iteration", {"logits": rng.normal(size=(4, 2)).astype(np.float32), "num_iters": 1}),
                       ("extreme logits", {"logits": (rng.normal(size=(6, 3)) * 200).astype(np.float32),
                                           "num_iters": 5})]
    + [(f"random {i}", {"logits": (rng.normal(size=(int(rng.integers(2, 13)), int(rng.integers(2, 6)))) * 2)
                        .astype(np.float32), "num_iters": int(rng.integers(1, 20))}) for i in range(8)],
    properties=(("the columns do not sum to T/E",
                 lambda kw, p: np.allclose(np.asarray(p).sum(0), kw["logits"].shape[0] / kw["logits"].shape[1],
                                           rtol=1e-3)),),
    tolerance=(1e-4, 1e-5),
    hint="chapter 3, 'Why the log domain': rows first, then columns, and work with logsumexp, not exp.",
))

register(Lab(
    name="ch06.soft_routing",
    axes=(("token", "expert", "slot"), ("token", "expert", "slot")),
    signature="(logits)",
    doc="Soft MoE's dispatch and combine (paper 002, eq. 1-2): logits [T, E, S] -> (dispatch, combine), both "
        "[T, E, S]: dispatch is a softmax over the tokens (each slot's weights sum to 1), combine a softmax over all "
        "slots of all experts (each token's weights sum to 1).",
    reference=lambda logits: _soft(routing.soft_routing(jnp.asarray(logits))),
    cases=lambda rng: [(f"T={t}, E={e}, S={s}", {"logits": (rng.normal(size=(t, e, s)) * 2).astype(np.float32)})
                       for t, e, s in [(1, 1, 1), (3, 2, 1), (4, 2, 2), (7, 3, 2), (5, 4, 3)]],
    properties=(("a slot's dispatch weights do not sum to 1 over the tokens",
                 lambda kw, out: np.allclose(np.asarray(out[0]).sum(0), 1, atol=1e-5)),
                ("a token's combine weights do not sum to 1 over all slots",
                 lambda kw, out: np.allclose(np.asarray(out[1]).sum((1, 2)), 1, atol=1e-5))),
    hint="chapter 6, 'Slots in the unified formulation': which axis is each softmax over?",
))


def _prc_cases(rng):
    """View-1 / view-2 router distributions with their correspondences; edge cases first."""
    def case(label, b, p1, p2, e, valid=None):
        probs1 = _softmax(rng.normal(size=(b, p1, e)) * 2)
        probs2 = _softmax(rng.normal(size=(b, p2, e)) * 2)
        index = rng.integers(0, p2, size=(b, p1)).astype(np.int32)
        valid = rng.random((b, p1)) < 0.7 if valid is None else np.broadcast_to(valid, (b, p1)).copy()
        return label, dict(probs1=probs1, probs2=probs2, index=index, valid=valid)

    return [case("one expert", 1, 3, 2, 1, True), case("every pair valid", 2, 4, 3, 2, True),
            case("no valid pair", 1, 4, 4, 3, False), case("one valid pair", 1, 3, 3, 4, np.array([False, True, False]))] + [
        case(f"random {i}", int(rng.integers(1, 4)), int(rng.integers(2, 9)), int(rng.integers(2, 9)),
             int(rng.integers(2, 7))) for i in range(6)]


register(Lab(
    name="ch07.prc_loss",
    signature="(probs1, probs2, index, valid)",
    doc="Pairwise Router Consistency (paper 004, eq. 3-6; lambda_diag = 5e-3, lambda_offdiag = 5e-2): probs1 "
        "[B, P1, E] and probs2 [B, P2, E] router distributions of two views, index [B, P1] the view-2 partner of each "
        "view-1 patch, valid [B, P1] whether it has one. S = E / |U| * sum over valid pairs of r1 r2^T ([E, E]; "
        "|U| = the number of valid pairs, at least 1); the loss is lambda_diag / E * sum_i (1 - S_ii)^2 + "
        "lambda_offdiag / (E (E - 1)) * sum_{i != j} S_ij^2 (that denominator at least 1). A scalar.",
    reference=lambda probs1, probs2, index, valid: losses.pairwise_router_consistency(
        jnp.asarray(probs1), jnp.asarray(probs2), jnp.asarray(index), jnp.asarray(valid)),
    cases=_prc_cases,
    properties=(("the loss is negative", lambda kw, out: float(out) >= 0),),
    tolerance=(1e-5, 1e-7),
    hint="chapter 7, 'The loss, eq. (3)-(6)': which pairs count, what S is normalised by, and which sum runs over "
         "the diagonal only.",
))

register(Lab(
    name="ch12.bias_step",
    axes=(("expert",),),
    signature="(bias, load, rate)",
    doc="One update of auxiliary-loss-free balancing's expert bias (DeepSeek-V3, Sec. 2.1.2): bias [E], load [E] "
        "(picks per expert over the whole batch), rate u -> the new bias [E]: b_e + u * sign(mean load - load_e).",
    reference=lambda bias, load, rate: routing.loss_free_bias_step(jnp.asarray(bias), jnp.asarray(load), rate),
    cases=lambda rng: [
        ("every expert at the mean", dict(bias=np.zeros(4, np.float32), load=np.full(4, 3.0, np.float32), rate=1e-3)),
        ("one expert takes everything", dict(bias=np.zeros(4, np.float32), load=np.array([8.0, 0, 0, 0], np.float32),
                                             rate=1e-3)),
        ("an expert exactly at the mean", dict(bias=np.array([0.1, -0.2, 0.0], np.float32),
                                               load=np.array([1.0, 2.0, 3.0], np.float32), rate=0.01)),
    ] + [(f"random {i}", dict(bias=rng.normal(size=e).astype(np.float32) * 0.01,
                              load=rng.integers(0, 20, size=e).astype(np.float32), rate=float(rng.choice([1e-3, 0.1]))))
         for i, e in enumerate(rng.integers(2, 9, size=6))],
    properties=(("an overloaded expert's bias rose (it must fall)",
                 lambda kw, out: bool(np.all((np.asarray(out) - kw["bias"])[kw["load"] > kw["load"].mean()] <= 0))),),
    tolerance=(0, 1e-7),
    hint="chapter 12, 'The balance constraint and its dual': which way does an overloaded expert's bias move, and "
         "by how much?",
))

register(Lab(
    name="ch12.group_limit",
    axes=(("token", "expert"),),
    signature="(scores, num_groups, top_groups)",
    doc="Group-limited routing (DeepSeek-V3, Sec. 2.1.2; node-limited in V2): scores [T, E]; the E experts form "
        "num_groups equal groups of consecutive experts; a group scores the sum of its two highest scores (its highest "
        "when it holds one expert); each token keeps its top_groups best groups (ties: the lower group). Returns a "
        "bool [T, E], True where the expert's group is kept.",
    reference=lambda scores, num_groups, top_groups: routing.group_limit(jnp.asarray(scores), num_groups, top_groups),
    cases=lambda rng: [
        ("one group", dict(scores=rng.random((3, 4)).astype(np.float32), num_groups=1, top_groups=1)),
        ("one expert per group", dict(scores=rng.random((3, 4)).astype(np.float32), num_groups=4, top_groups=2)),
        ("ties between groups", dict(scores=np.full((2, 6), 0.5, np.float32), num_groups=3, top_groups=1)),
        ("a group with one strong expert", dict(scores=np.array([[0.9, 0.0, 0.0, 0.5, 0.5, 0.0]], np.float32),
                                                num_groups=2, top_groups=1)),
    ] + [(f"random {i}", dict(scores=rng.random((int(rng.integers(1, 7)), int(g * size))).astype(np.float32),
                              num_groups=int(g), top_groups=int(rng.integers(1, g + 1))))
         for i, (g, size) in enumerate(zip(rng.integers(2, 5, size=6), rng.integers(1, 4, size=6)))],
    properties=(("a token does not keep exactly top_groups groups",
                 lambda kw, out: bool(np.all(np.asarray(out).sum(-1) == kw["top_groups"] * kw["scores"].shape[-1]
                                             // kw["num_groups"]))),),
    hint="chapter 10, 'Limiting the devices a token reaches' (DeepSeek-V3, Sec. 2.1.2): a group's score is a sum "
         "of its two best, not its best "
         "alone, and the kept groups are those of the highest group scores.",
))

register(Lab(
    name="ch13.sort_by_expert",
    axes=(("row",), ("expert",)),
    signature="(expert, num_experts)",
    doc="The dropless layout: expert [M] int (the expert of each pick) -> (order [M], group_sizes [E]): order "
        "lists the picks grouped by expert (expert[order] sorted, picks of one expert in their original order), "
        "group_sizes[e] the number of picks of expert e.",
    reference=lambda expert, num_experts: routing.sort_by_expert(jnp.asarray(expert), num_experts),
    cases=lambda rng: [
        ("one pick", dict(expert=np.array([2], np.int32), num_experts=3)),
        ("every pick to one expert", dict(expert=np.full(5, 1, np.int32), num_experts=3)),
        ("an expert with no pick", dict(expert=np.array([0, 2, 0, 2], np.int32), num_experts=3)),
    ] + [(f"random {i}", dict(expert=rng.integers(0, e, size=int(rng.integers(1, 20))).astype(np.int32),
                              num_experts=int(e))) for i, e in enumerate(rng.integers(2, 9, size=6))],
    properties=(("expert[order] is not sorted",
                 lambda kw, out: bool(np.all(np.diff(kw["expert"][np.asarray(out[0])]) >= 0))),),
    hint="chapter 13, 'Dropless Token Choice': a stable sort keeps a token's place among its expert's rows; what "
         "counts the rows per expert?",
))


def _per_image_reference(scores, capacity, patches):
    """Token Choice (k = 1) run on each image's ``patches`` tokens alone: the library's function on
    the scores grouped ``[n, patches, E]`` (chapter 17's per-image groups)."""
    s = jnp.asarray(scores)
    dispatch = routing.token_choice(s.reshape(-1, patches, s.shape[-1]), capacity=capacity).dispatch
    return dispatch.reshape(s.shape[0], s.shape[-1], capacity)


def _per_image_cases(rng):
    """Groups of n images of P patches, scores [n P, E]: ties across images, one popular expert,
    a single image, and random sizes."""
    def case(label, logits, capacity, patches):
        return label, {"scores": _softmax(np.asarray(logits, np.float64)), "capacity": int(capacity), "patches": int(patches)}

    same = rng.normal(size=(3, 4))
    cases = [
        case("one image", rng.normal(size=(4, 3)), 1, 4),
        case("two identical images", np.concatenate([same, same]), 1, 3),
        case("every patch wants expert 0", rng.normal(size=(8, 4)) + np.array([4.0, 0, 0, 0]), 2, 4),
        case("capacity 1, four images", rng.normal(size=(8, 2)), 1, 2),
        # equal scores for every expert: the tie goes to the lowest expert index (jax.lax.top_k)
        case("patches that score every expert equally", np.concatenate([np.zeros((3, 3)), rng.normal(size=(3, 3))]), 1, 3),
    ]
    for i in range(6):
        n, p, e = int(rng.integers(2, 5)), int(rng.integers(2, 7)), int(rng.integers(2, 6))
        cases.append(case(f"random {i}", rng.normal(size=(n * p, e)) * rng.uniform(0.5, 3.0),
                          int(rng.integers(1, p + 1)), p))
    return cases


def _image_slots_hold_one_token_of_the_image(kwargs, dispatch) -> bool:
    """Every image's C slots per expert hold at most one of that image's patches."""
    d = np.asarray(dispatch)
    p, c = kwargs["patches"], kwargs["capacity"]
    return d.ndim == 3 and d.shape[-1] == c and bool(np.all(d.reshape(-1, p, d.shape[1], c).sum(1) <= 1))


register(Lab(
    name="ch17.per_image_token_choice",
    axes=(("token", "expert", "slot"),),
    signature="(scores, capacity, patches)",
    doc="Batch-invariant Token Choice (chapter 17): scores [n * patches, E] of n images, each image's patches in a "
        "row -> dispatch [n * patches, E, C] (0/1), k = 1, where every image is its own routing group: its patches "
        "compete only for its own C slots per expert (in its patch order), so that no image's routing depends on "
        "another's.",
    reference=_per_image_reference,
    cases=_per_image_cases,
    properties=(("an image's slots of one expert hold more than one of its patches each",
                 _image_slots_hold_one_token_of_the_image),),
    hint="chapter 17, 'Why a prediction can depend on its batch': which tokens may compete for a slot when the "
         "routing group is one image, and where does each image's slot count start?",
))


def _replay_selection_reference(logits, dispatch):
    """Selection replay (:func:`mini_moe.modes.replay_selection`) of a recorded ``dispatch`` under a
    live softmax router with ``logits``: V-MoE's affinity, whose combine weights come from its scores."""
    from mini_moe import modes  # here, not at the top: modes imports the model and the routers
    from mini_moe.routers.types import Affinities

    dispatch = jnp.asarray(dispatch, jnp.float32)
    live = types.SimpleNamespace(affinities=Affinities(scores=jax.nn.softmax(jnp.asarray(logits, jnp.float32), axis=-1)))
    return modes.replay_selection(routing.Routing(dispatch, jnp.zeros_like(dispatch), sparse=True), live).combine


def _replay_cases(rng):
    """Live logits [T, E] and a recorded dispatch [T, E, C]: picks the live router would not make,
    a dropped token, two picks per token, logits a naive softmax overflows on, and random ones."""
    def recorded(picks, num_experts, capacity):
        """dispatch [T, E, C] from (token, expert) picks, each expert's slots filled in token order."""
        d = np.zeros((len(picks), num_experts, capacity), np.float32)
        used = np.zeros(num_experts, int)
        for t, experts in enumerate(picks):
            for e in experts:
                if used[e] < capacity:
                    d[t, e, used[e]] = 1.0
                    used[e] += 1
        return d

    def case(label, logits, picks, capacity):
        logits = np.asarray(logits, np.float32)
        return label, {"logits": logits, "dispatch": recorded(picks, logits.shape[-1], capacity)}

    cases = [
        case("one token, one expert", [[0.3]], [[0]], 1),
        case("the live router prefers another expert", [[2.0, -1.0, 0.0], [0.5, 0.5, 0.0]], [[1], [2]], 2),
        case("a token the record dropped", [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], [[0], [], [1]], 1),
        case("two picks per token", [[1.0, 2.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]], [[2, 1], [0, 3]], 2),
        case("large logits (a naive exp overflows float32)", [[100.0, 98.0, -50.0], [-80.0, 120.0, 119.0]],
             [[0], [2]], 1),
    ]
    for i in range(6):
        t, e, k = int(rng.integers(2, 9)), int(rng.integers(2, 6)), int(rng.integers(1, 3))
        k = min(k, e)
        picks = [list(rng.choice(e, size=k, replace=False)) for _ in range(t)]
        cases.append(case(f"random {i}", rng.normal(size=(t, e)) * rng.uniform(0.5, 4.0), picks,
                          int(rng.integers(1, t + 1))))
    return cases


register(Lab(
    name="ch17.replay_selection",
    axes=(("token", "expert", "slot"),),
    signature="(logits, dispatch)",
    doc="Selection replay (chapter 17): the live router's logits [T, E] and a recorded "
        "dispatch [T, E, C] (0/1: which slot of which expert each token used in the recorded pass) -> combine "
        "[T, E, C]: the recorded slots, each weighted by the live router's gate for that expert, which for this "
        "router (V-MoE's) is the softmax of the token's logits over all E experts at that expert, not renormalised "
        "over the token's picks. A slot the record left empty has weight 0, whatever the live router prefers.",
    reference=_replay_selection_reference,
    cases=_replay_cases,
    properties=(("a weight where the recorded dispatch is 0",
                 lambda kw, out: bool(np.all(np.where(np.asarray(kw["dispatch"]) == 0, np.asarray(out), 0) == 0))),),
    hint="chapter 17, 'Replaying the routing': which of the two tensors does selection replay take from the record, "
         "and over which experts does V-MoE's softmax run?",
))


def _drop_upcycle_reference(w1, b1, w2, b2, chosen, noise_w1, noise_b1, noise_w2):
    """The library's upcycling of one dense MLP into E experts: tiled (:func:`mini_moe.upcycle.expand_tile`),
    then Drop-Upcycling's chosen units re-drawn (:func:`mini_moe.upcycle.reinit_units`)."""
    from mini_moe import upcycle  # here, not at the top: upcycle imports the model, which imports far more

    num_experts = np.asarray(chosen).shape[0]
    dense = {"w1": jnp.asarray(w1), "b1": jnp.asarray(b1), "w2": jnp.asarray(w2), "b2": jnp.asarray(b2)}
    tiled = {name: upcycle.expand_tile(x if x.ndim == 2 else x[None], num_experts) for name, x in dense.items()}
    out = upcycle.reinit_units(tiled, dense, chosen, {"w1": noise_w1, "b1": noise_b1, "w2": noise_w2})
    return out["w1"], out["b1"], out["w2"], out["b2"]


def _drop_upcycle_cases(rng):
    """Dense MLPs with a choice of units per expert and the normal draws; edge cases first."""
    def case(label, d, h, e, chosen=None, w1=None):
        w1 = rng.normal(size=(d, h)).astype(np.float32) * 0.5 + 0.1 if w1 is None else w1
        chosen = rng.random((e, h)) < 0.4 if chosen is None else np.broadcast_to(chosen, (e, h)).copy()
        return label, dict(w1=w1, b1=rng.normal(size=h).astype(np.float32) * 0.1,
                           w2=rng.normal(size=(h, d)).astype(np.float32) * 0.3 - 0.2,
                           b2=rng.normal(size=d).astype(np.float32), chosen=chosen,
                           noise_w1=rng.normal(size=(e, d, h)).astype(np.float32),
                           noise_b1=rng.normal(size=(e, 1, h)).astype(np.float32),
                           noise_w2=rng.normal(size=(e, h, d)).astype(np.float32))

    return [case("r = 0: plain copies", 3, 4, 2, False), case("r = 1: nothing kept", 2, 3, 3, True),
            case("one expert", 3, 5, 1), case("one unit of one expert", 2, 4, 3,
                                              np.array([[False] * 4, [False, True, False, False], [False] * 4])),
            case("a constant dense w1 (std 0)", 2, 3, 2, None, np.full((2, 3), 0.7, np.float32))] + [
        case(f"random {i}", int(rng.integers(1, 6)), int(rng.integers(1, 8)), int(rng.integers(1, 5)))
        for i in range(6)]


register(Lab(
    name="ch18.drop_upcycle",
    axes=(("expert", "input", "unit"), ("expert", "one", "unit"), ("expert", "unit", "output"),
          ("expert", "one", "output")),
    signature="(w1, b1, w2, b2, chosen, noise_w1, noise_b1, noise_w2)",
    doc="Sparse upcycling with Drop-Upcycling (chapter 18): a dense MLP w1 [D, H], b1 [H], w2 [H, D], b2 [D] -> E "
        "experts (W1 [E, D, H], B1 [E, 1, H], W2 [E, H, D], B2 [E, 1, D]), E = chosen.shape[0], each a copy of the "
        "MLP, except that where chosen[e, j] (bool [E, H]) expert e's hidden unit j is re-initialised: its column "
        "W1[e, :, j], its bias B1[e, 0, j] and its row W2[e, j, :] become mean + std * noise of the dense w1, b1 "
        "and w2 respectively (mean and population std over the whole dense matrix; noise_w1 [E, D, H], noise_b1 "
        "[E, 1, H], noise_w2 [E, H, D] standard normal draws). B2 is always copied.",
    reference=_drop_upcycle_reference,
    cases=_drop_upcycle_cases,
    properties=(("an expert's b2 is not the dense b2", lambda kw, out: np.allclose(np.asarray(out[3]), kw["b2"])),
                ("a unit that is not chosen differs from the dense MLP's",
                 lambda kw, out: np.allclose(np.where(kw["chosen"][:, None, :], kw["w1"], np.asarray(out[0])),
                                             kw["w1"]))),
    hint="chapter 18, 'Breaking the symmetry: Drop-Upcycling': which axis of each matrix is a hidden unit, and "
         "whose mean and standard deviation does a fresh entry take?",
))


def _top_p_reference(probs, threshold):
    from mini_moe.routers import adaptive  # here, not at the top: the routers import the layer

    return adaptive.top_p_mask(jnp.asarray(probs), threshold)


def _top_p_cases(rng):
    """Router distributions [T, E] with a threshold p; exact binary fractions where the rule's edge
    (mass before an expert equal to p) decides, float32 rows summing to just under 1 at p = 1."""
    uniform = np.full((2, 4), 0.25, np.float32)
    short = np.array([[0.7, 0.2, 0.0999999], [0.0999999, 0.2, 0.7]], np.float32)
    assert np.all(short.sum(-1, dtype=np.float32) < 1)
    cases = [("one expert", {"probs": np.ones((3, 1), np.float32), "threshold": 0.5}),
             ("uniform, p at a tie", {"probs": uniform, "threshold": 0.5}),
             ("mass before an expert exactly p", {"probs": np.array([[0.5, 0.25, 0.125, 0.125]], np.float32),
                                                   "threshold": 0.75}),
             ("p = 1, rows summing to just under 1", {"probs": short, "threshold": 1.0}),
             ("a small p: the top expert alone", {"probs": _softmax(rng.normal(size=(4, 5)) * 2), "threshold": 0.05})]
    shapes = [(int(rng.integers(1, 9)), int(rng.integers(2, 9))) for _ in range(6)]
    return cases + [(f"random {i}", {"probs": _softmax(rng.normal(size=shape) * float(rng.choice([0.5, 2.0, 5.0]))),
                                     "threshold": float(rng.choice([0.3, 0.5, 0.8, 0.9, 0.95]))})
                    for i, shape in enumerate(shapes)]


def _selects_a_prefix_of_the_ranking(kwargs, selected) -> bool:
    """Every token selects at least one expert, and none less probable than one it leaves out."""
    probs, selected = np.asarray(kwargs["probs"]), np.asarray(selected, bool)
    lowest_kept = np.where(selected, probs, np.inf).min(-1)
    highest_left = np.where(selected, -np.inf, probs).max(-1)
    return bool(selected.any(-1).all() and np.all(lowest_kept >= highest_left))


register(Lab(
    name="ch19.top_p",
    axes=(("token", "expert"),),
    signature="(probs, threshold)",
    doc="Top-p routing's choice (Huang et al. 2024; chapter 19): probs [T, E] (each row a distribution over the "
        "experts), threshold p in (0, 1] -> bool [T, E]: each token ranks its experts by decreasing probability (ties: "
        "the lower index first) and selects expert j when the probability of the experts ranked before j is below p. "
        "A token gets at least one expert, and at p = 1 every expert (but one whose probability is lost in the "
        "float32 rounding of the mass ranked before it).",
    reference=_top_p_reference,
    cases=_top_p_cases,
    properties=(("a token selects no expert, or leaves out an expert more probable than one it selects",
                 _selects_a_prefix_of_the_ranking),),
    tolerance=(0, 0),
    hint="chapter 19, 'Top-p: experts until the mass reaches p': is the expert that carries the mass past p "
         "selected, and what does the rule do at p = 1 when the rounded probabilities sum to less than 1?",
))


def _reap_reference(gates, routed, outputs):
    """The library's REAP saliency (:func:`mini_moe.compress.saliency`, ``"reap"``)."""
    from mini_moe import compress  # here, not at the top: compress imports the model

    m, e = np.shape(routed)
    record = compress.LayerRecord(inputs=np.zeros((m, 1)), logits=np.zeros((m, e)), probs=np.zeros((m, e)),
                                  gates=np.asarray(gates), routed=np.asarray(routed, bool), outputs=np.asarray(outputs))
    return compress.saliency(record, "reap")


def _reap_cases(rng):
    """Calibration records of one layer: M tokens, E experts, outputs of width D; a token's gates
    are zero where it was not routed (as :func:`mini_moe.compress.calibrate` records them)."""
    def case(label, m, e, d, k=1, routed=None, outputs=None, scale=1.0):
        logits = rng.normal(size=(m, e)) * 2
        probs = _softmax(logits)
        if routed is None:
            top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
            routed = np.zeros((m, e), bool)
            np.put_along_axis(routed, top, True, axis=-1)
        outputs = (rng.normal(size=(m, e, d)) * scale).astype(np.float32) if outputs is None else outputs
        return label, {"gates": np.where(routed, probs, 0).astype(np.float32), "routed": np.asarray(routed, bool),
                       "outputs": np.asarray(outputs, np.float32)}

    unused = np.zeros((5, 3), bool)
    unused[:, 0] = True
    unequal = np.zeros((6, 2), bool)
    unequal[:5, 0] = True
    unequal[5, 1] = True
    cases = [case("one token, one expert", 1, 1, 3),
             case("an expert no token reached", 5, 3, 4, routed=unused),
             case("one expert gets five tokens, the other one", 6, 2, 3, routed=unequal),
             case("width 1 (the norm is an absolute value)", 6, 3, 1),
             case("k = 2", 8, 4, 5, k=2),
             case("outputs of zero", 4, 3, 2, outputs=np.zeros((4, 3, 2))),
             case("large outputs", 6, 3, 4, scale=1e4)]
    return cases + [case(f"random {i}", int(rng.integers(2, 40)), int(rng.integers(2, 9)), int(rng.integers(1, 9)),
                         k=int(rng.integers(1, 3))) for i in range(6)]


register(Lab(
    name="ch20.reap_saliency",
    axes=(("expert",),),
    signature="(gates, routed, outputs)",
    doc="REAP's saliency of each expert (Lasby et al. 2025; chapter 20): gates [M, E] (the combine weight of "
        "expert e's output in token t's output, 0 where e did not process t), routed bool [M, E] (which tokens "
        "each expert processed), outputs [M, E, D] (every expert's output on every token) -> scores [E]: for each "
        "expert, the mean over the tokens it processed of its gate times the Euclidean norm of its output; "
        "0 for an expert that processed no token.",
    reference=_reap_reference,
    cases=_reap_cases,
    properties=(("a negative score", lambda kw, out: bool(np.all(np.asarray(out) >= 0))),
                ("a nonzero score for an expert that processed no token",
                 lambda kw, out: bool(np.all(np.where(np.asarray(kw["routed"]).any(0), 0, np.asarray(out)) == 0)))),
    hint="chapter 20, 'What pruning does to eq. (2)': over which tokens does REAP average, and which norm of "
         "which output does it weight by the gate?",
))
