"""Graded labs: write a router's piece yourself, and check it against the library.

Each :class:`Lab` asks for one function from a chapter's equations. Its reference solution is
the library's own function (never a second copy), and :func:`check` compares a student's
function with it on generated inputs (a fixed seed, so every student sees the same cases) and on
named edge cases (ties, fewer tokens than experts, capacity 1, every token wanting one expert,
extreme logits). On a failure it reports the first failing case (named edge cases first, then random sizes), the expected and the actual
output, the property that broke and a hint that points to the chapter, never the solution::

    from mini_moe import labs

    def expert_choice(scores, capacity):      # the student's function
        ...

    print(labs.check("ch04.expert_choice", expert_choice))

``python -m mini_moe labs check FILE.py [--json]`` checks every lab function a file defines (a
function named after the lab's last part, e.g. ``expert_choice``) and exits with status 1 when
one fails; ``python -m mini_moe labs list`` lists the labs with their signatures. A new router's
lab is one :func:`register` call with a reference, an input generator and a hint.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from mini_moe import losses, routing, transport
from mini_moe.validate import InputError

Array = Any


@dataclasses.dataclass(frozen=True)
class Lab:
    """One lab.

    Attributes:
      name: ``"chNN.function"``; the student's function is called ``function``.
      signature: the stub's signature, as the student writes it.
      doc: what to compute, with shapes and the equation.
      reference: the library's function (same arguments), the solution.
      cases: ``rng -> list of (label, kwargs)``: generated and named edge cases, smallest first.
      properties: ``[(what, fn(kwargs, output) -> bool)]``: invariants a right answer has; the
        first one a wrong answer breaks is named in the report.
      hint: where in the chapter to look.
      tolerance: ``(rtol, atol)`` for float outputs; integer outputs are compared exactly.
    """

    name: str
    signature: str
    doc: str
    reference: Callable
    cases: Callable[[np.random.Generator], list]
    hint: str
    properties: tuple = ()
    tolerance: tuple = (1e-5, 1e-6)

    @property
    def function(self) -> str:
        return self.name.split(".", 1)[1]

    def stub(self) -> str:
        """The code a student starts from."""
        return f'def {self.function}{self.signature}:\n    """{self.doc}"""\n    raise NotImplementedError\n'


LABS: dict[str, Lab] = {}


def register(lab: Lab) -> Lab:
    """Add a lab (a router registered with :func:`mini_moe.routers.register` gets its lab this
    way: a reference, a case generator, a hint)."""
    if lab.name in LABS:
        raise InputError(f"a lab named {lab.name!r} exists already.")
    LABS[lab.name] = lab
    return lab


@dataclasses.dataclass(frozen=True)
class Result:
    """The outcome of :func:`check`: ``passed``, the lab, the cases run, and the report."""

    lab: str
    passed: bool
    cases: int
    message: str

    def __str__(self) -> str:
        return f"{self.lab}: {'passed' if self.passed else 'FAILED'} ({self.cases} cases)\n{self.message}".rstrip()


def _show(value) -> str:
    if isinstance(value, (tuple, list)):  # several outputs, e.g. (order, group_sizes)
        return "(" + ", ".join(_show(v) for v in value) + ")"
    array = np.asarray(value)
    if array.ndim == 0:
        return repr(array.item())
    return np.array2string(array, precision=4, suppress_small=True, max_line_width=100, threshold=200)


def _equal(expected, actual, tolerance) -> bool:
    expected, actual = np.asarray(expected), np.asarray(actual)
    if expected.dtype == bool or np.issubdtype(expected.dtype, np.integer):  # counts, capacities: exact
        return np.array_equal(expected.astype(np.float64), actual.astype(np.float64))
    return np.allclose(actual, expected, rtol=tolerance[0], atol=tolerance[1])  # 0/1 dispatch is exact within it


def check(name: str, fn: Callable, *, seed: int = 0) -> Result:
    """Check the student's ``fn`` for lab ``name`` against the library (see the module docstring).

    Every case is called eagerly and, to check that ``fn`` is jit-compatible where the library's
    is, under ``jax.jit`` with the integer arguments static. Returns a :class:`Result`; never
    raises for a wrong or crashing ``fn``.
    """
    if name not in LABS:
        raise InputError(f"Unknown lab {name!r}; expected one of: {', '.join(sorted(LABS))}.")
    lab = LABS[name]
    cases = lab.cases(np.random.default_rng(seed))
    for count, (label, kwargs) in enumerate(cases, 1):
        expected = lab.reference(**kwargs)
        try:
            actual = fn(**kwargs)
        except NotImplementedError:
            return Result(name, False, count - 1, "not implemented yet: fill in the function's body.")
        except Exception as e:  # the student's code raised: say where, briefly
            frame = traceback.extract_tb(e.__traceback__)[-1]
            return Result(name, False, count, f"case '{label}' raised {type(e).__name__}: {e}\n"
                          f"  (line {frame.lineno}: {frame.line})\n  inputs: {_inputs(kwargs)}\n  hint: {lab.hint}")
        report = _compare(lab, label, kwargs, expected, actual)
        if report:
            return Result(name, False, count, report)
        static = [k for k, v in kwargs.items() if isinstance(v, (int, float, bool)) and not isinstance(v, np.ndarray)]
        try:
            jitted = jax.jit(fn, static_argnames=static)(**kwargs)
        except Exception as e:
            return Result(name, False, count, f"case '{label}': the function is not jit-compatible "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200]}). Use jnp operations and no Python "
                          f"control flow on array values.\n  hint: {lab.hint}")
        report = _compare(lab, label + " (under jax.jit)", kwargs, expected, jitted)
        if report:
            return Result(name, False, count, report)
    return Result(name, True, len(cases), "")


def _inputs(kwargs) -> str:
    return "; ".join(f"{k} = {_show(v)}" for k, v in kwargs.items())


def _holds(prop, kwargs, actual) -> bool:
    """A property of the student's output; one it cannot even be evaluated on (an index out of
    range, a wrong type) is broken."""
    try:
        return bool(prop(kwargs, actual))
    except Exception:
        return False


def _compare(lab, label, kwargs, expected, actual) -> str | None:
    expected_tree, actual_tree = jax.tree.leaves(expected), jax.tree.leaves(actual)
    if len(expected_tree) != len(actual_tree):
        return f"case '{label}': expected {len(expected_tree)} output array(s), got {len(actual_tree)}.\n  hint: {lab.hint}"
    for e, a in zip(expected_tree, actual_tree):
        if np.shape(a) != np.shape(e):
            return (f"case '{label}': the output has shape {np.shape(a)}, expected {np.shape(e)}.\n"
                    f"  inputs: {_inputs(kwargs)}\n  hint: {lab.hint}")
        if not np.all(np.isfinite(np.asarray(a, np.float64))):
            return (f"case '{label}': the output holds NaN or inf.\n  inputs: {_inputs(kwargs)}\n"
                    f"  actual: {_show(a)}\n  hint: {lab.hint}")
    if all(_equal(e, a, lab.tolerance) for e, a in zip(expected_tree, actual_tree)):
        return None
    broken = next((what for what, holds in lab.properties if not _holds(holds, kwargs, actual)), None)
    return (f"case '{label}': the output differs from the library's.\n"
            + (f"  property broken: {broken}\n" if broken else "")
            + f"  inputs: {_inputs(kwargs)}\n  expected: {_show(expected if len(expected_tree) > 1 else expected_tree[0])}\n"
            f"  actual:   {_show(actual if len(actual_tree) > 1 else actual_tree[0])}\n  hint: {lab.hint}")


# ----------------------------------------------------------------------------- input generators


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
    cases=lambda rng: [(f"T={t}, E={e}, factor={f}", dict(num_tokens=t, num_experts=e, factor=f)) for t, e, f in
                       [(10, 4, 1.0), (9, 2, 1.0), (6, 4, 1.0), (2, 8, 1.0), (14, 4, 1.0), (100, 8, 1.25), (7, 2, 2.0),
                        (1, 16, 0.5)]],
    hint="chapter 1, 'The conventions we follow': which way does a half round, and what is the smallest C?",
))

register(Lab(
    name="ch02.token_choice",
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


def lab_functions(namespace: dict) -> dict[str, Callable]:
    """The lab functions a student's module defines: ``{lab name: function}``."""
    by_function = {lab.function: name for name, lab in LABS.items()}
    return {by_function[k]: v for k, v in namespace.items() if k in by_function and inspect.isfunction(v)}


def check_file(path) -> list[Result]:
    """Run a student's file and check every lab function it defines (the grader)."""
    import pathlib
    import runpy

    path = pathlib.Path(path)
    if not path.is_file():
        raise InputError(f"{path} is not a file; pass the student's .py file.")
    try:
        namespace = runpy.run_path(str(path))
    except Exception as e:
        raise InputError(f"{path} does not run: {type(e).__name__}: {e}") from None
    found = lab_functions(namespace)
    if not found:
        raise InputError(f"{path} defines no lab function; expected one of: "
                         f"{', '.join(sorted(LABS[n].function for n in LABS))}.")
    return [check(name, fn) for name, fn in sorted(found.items())]
