"""Graded labs: write a router's piece yourself, and check it against the library.

Each :class:`Lab` asks for one function from a chapter's equations. Its reference solution is
the library's own function (never a second copy), and :func:`check` compares a student's
function with it on generated inputs (a fixed seed, so every student sees the same cases) and on
named edge cases (ties, fewer tokens than experts, capacity 1, every token wanting one expert,
extreme logits). On a failure it reports the first failing case (named edge cases first, then
random sizes), where the output first differs, the property that broke, a call that rebuilds the
case (:func:`case`) and a hint that points to the chapter, never the solution::

    from mini_moe import labs

    def expert_choice(scores, capacity):      # the student's function
        ...

    print(labs.check("ch04.expert_choice", expert_choice))

``python -m mini_moe labs check FILE.py [--json]`` checks every lab function a file defines (a
function named after the lab's last part, e.g. ``expert_choice``) and exits with status 1 when
one fails; ``python -m mini_moe labs list`` lists the labs with their signatures.

The package: this module is the framework (:class:`Lab`, :func:`register`, :func:`check`, the
verdict and its report); :mod:`mini_moe.labs.catalogue` holds the labs, one section per chapter (a
new router's lab is one :func:`register` call there, with a reference, an input generator and a
hint); :mod:`mini_moe.labs.grader` grades files and classes, each lab in a sandboxed process that
runs :mod:`mini_moe.labs.worker`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np

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
      axes: per output, the names of its axes (``("token", "expert", "slot")``), so that a report
        says where the first difference is.
    """

    name: str
    signature: str
    doc: str
    reference: Callable
    cases: Callable[[np.random.Generator], list]
    hint: str
    properties: tuple = ()
    tolerance: tuple = (1e-5, 1e-6)
    axes: tuple = ()

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


#: The statuses a result can have, as the grader decides them (never read back from a message).
STATUSES = ("passed", "failed", "not implemented", "refused", "timed out", "error")


@dataclasses.dataclass(frozen=True)
class Result:
    """The outcome of checking one lab: ``passed``, the lab, the cases run, the report (on a pass, a
    note or nothing), the wall seconds the check took, and its ``status`` (:data:`STATUSES`; empty:
    passed or failed, as ``passed`` says)."""

    lab: str
    passed: bool
    cases: int
    message: str
    seconds: float = 0.0
    status: str = ""

    def __str__(self) -> str:
        return f"{self.lab}: {'passed' if self.passed else (self.status or 'failed').upper()} ({self.cases} cases)\n{self.message}".rstrip()


def _show(value) -> str:
    """A value in at most a few lines: small arrays whole, larger ones summarised."""
    if isinstance(value, (tuple, list)):  # several outputs, e.g. (order, group_sizes)
        return "(" + ", ".join(_show(v) for v in value) + ")"
    array = np.asarray(value)
    if array.ndim == 0:
        return repr(array.item())
    # enough digits to tell float32 neighbours apart (an edge case at a threshold differs in the last one)
    text = np.array2string(array, precision=9, floatmode="maxprec", suppress_small=False, max_line_width=100,
                           threshold=24, edgeitems=2)
    return text if text.count("\n") < 6 else f"an array of shape {array.shape} (rebuild it with the call below)"


def _equal(expected, actual, tolerance) -> bool:
    expected, actual = np.asarray(expected), np.asarray(actual)
    if expected.dtype == bool or np.issubdtype(expected.dtype, np.integer):  # counts, capacities: exact
        return np.array_equal(expected.astype(np.float64), actual.astype(np.float64))
    return np.allclose(actual, expected, rtol=tolerance[0], atol=tolerance[1])  # 0/1 dispatch is exact within it


def _first_difference(expected, actual, tolerance, axes) -> str:
    """Where two arrays of one shape first differ, e.g. "token 3, expert 1, slot 0: expected 1.0, got 0.0"
    (integer and boolean outputs exactly, as :func:`_equal` compares them)."""
    exact = np.asarray(expected).dtype == bool or np.issubdtype(np.asarray(expected).dtype, np.integer)
    expected, actual = np.asarray(expected, np.float64), np.asarray(actual, np.float64)
    if expected.ndim == 0:
        return f"expected {expected.item():.9g}, got {actual.item():.9g}"
    differs = expected != actual if exact else ~np.isclose(actual, expected, rtol=tolerance[0], atol=tolerance[1])
    index = tuple(int(i) for i in np.argwhere(differs)[0])
    names = axes if len(axes) == len(index) else [f"axis {d}" for d in range(len(index))]
    at = ", ".join(f"{name} {i}" for name, i in zip(names, index))
    return f"{at}: expected {expected[index]:.9g}, got {actual[index]:.9g}"


def _static(kwargs: dict) -> list[str]:
    """The arguments the library's functions take as Python numbers: static under ``jax.jit``."""
    return [k for k, v in kwargs.items() if isinstance(v, (int, float, bool)) and not isinstance(v, np.ndarray)]


def _cases(lab: Lab, seed: int) -> list:
    return lab.cases(np.random.default_rng(seed))


def case(name: str, label: str, *, seed: int = 0) -> dict:
    """The inputs of lab ``name``'s case ``label`` (as a report names it) under ``seed``: the
    keyword arguments the check called the function with, so ``fn(**labs.case(...))`` reruns it."""
    found = dict(_cases(_lab(name), seed))
    if label not in found:
        raise InputError(f"lab {name} has no case {label!r} with seed={seed}; its cases: {', '.join(found)}.")
    return found[label]


def _rebuild(lab: Lab, label: str, seed: int) -> str:
    return f"  rebuild it: {lab.function}(**labs.case({lab.name!r}, {label!r}" + (
        f", seed={seed}))\n" if seed else "))\n")


def check(name: str, fn: Callable, *, seed: int = 0) -> Result:
    """Check the student's ``fn`` for lab ``name`` against the library, in this process (practice:
    the labs page, nbgrader). The grader of a course runs :func:`mini_moe.labs.grader.check_file`
    instead, which keeps a submission in a sandboxed process of its own.

    Every case is called eagerly with NumPy arrays, which decides the verdict (plain NumPy is
    accepted), and then under ``jax.jit`` with the Python-number arguments static: a jitted result
    that differs fails, one that does not compile is noted. Returns a :class:`Result`; never raises
    for a wrong or crashing ``fn``.
    """
    from mini_moe.labs import worker

    lab = _lab(name)
    source = getattr(getattr(fn, "__code__", None), "co_filename", None)
    cases = _cases(lab, seed)
    runs = (worker.run_case(fn, kwargs, _static(kwargs), source) for _, kwargs in cases)
    tick = time.perf_counter()
    return dataclasses.replace(_grade(lab, cases, runs, seed), seconds=round(time.perf_counter() - tick, 3))


def _lab(name: str) -> Lab:
    if name not in LABS:
        raise InputError(f"Unknown lab {name!r}; expected one of: {', '.join(sorted(LABS))}.")
    return LABS[name]


REFUSED = ("refused: the file uses mini_moe, whose functions are the reference solutions; write the lab "
           "functions without importing it.")


def text(value, limit: int = 300) -> str:
    """Text from a submission's process, made safe to print and to parse around: one line, printable
    characters only (others as ``\\xNN``), at most ``limit`` characters. A student's message can then
    not start a line of its own in a report, a terminal or a log ("ch04.x: passed")."""
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value))
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _grade(lab: Lab, cases: list, runs, seed: int = 0) -> Result:
    """The verdict on ``runs``, one per case as :func:`mini_moe.labs.worker.run_case` returns it, or
    ``{"load" | "stopped": error}`` / ``{"timeout": seconds}`` / ``{"lost": reason}`` where the
    submission's process did not get that far. Computed here, from data only; never raises for what
    a submission returned (an output that cannot be compared fails its case)."""
    note = ""
    count = 0
    for count, ((label, kwargs), run) in enumerate(zip(cases, runs), 1):
        rebuild = _rebuild(lab, label, seed)
        if "load" in run:
            if "mini_moe" in str(run["load"].get("message", "")):
                return Result(lab.name, False, 0, REFUSED, status="refused")
            return Result(lab.name, False, 0, f"the file does not load: {_error(run['load'])}")
        if "timeout" in run:
            return Result(lab.name, False, count, f"case '{label}': timed out after {run['timeout']:g} s.\n"
                          f"  inputs: {_inputs(kwargs)}\n{rebuild}  hint: {lab.hint}", status="timed out")
        if "stopped" in run or "lost" in run:
            why = (f"its process ended without a result ({text(run['lost'])})" if "lost" in run else
                   _error(run["stopped"]).replace("\n ", ""))
            return Result(lab.name, False, count, f"case '{label}': the function stopped the check: {why}.\n{rebuild}")
        eager, jit = run["eager"], run.get("jit", {})
        if eager.get("error") == "NotImplementedError":
            return Result(lab.name, False, count - 1, "not implemented yet: fill in the function's body.",
                          status="not implemented")
        if eager.get("error") in ("ModuleNotFoundError", "ImportError", "PermissionError") and \
                "mini_moe" in str(eager.get("message", "")):
            return Result(lab.name, False, count, REFUSED, status="refused")
        if "error" in eager:
            return Result(lab.name, False, count, f"case '{label}' raised {_error(eager)}\n"
                          f"  inputs: {_inputs(kwargs)}\n{rebuild}{_signature_hint(lab, eager)}  hint: {lab.hint}")
        expected = lab.reference(**kwargs)
        report = _compare(lab, label, kwargs, expected, eager["outputs"], rebuild)
        if report:
            return Result(lab.name, False, count, report)
        if "error" in jit:
            note = note or (f"note: it does not run under jax.jit ({text(jit['error'], 80)}: "
                            f"{text(jit['message'], 120)}); the library's does, and a model needs that.")
            continue
        report = _compare(lab, label + " (under jax.jit)", kwargs, expected, jit["outputs"], rebuild)
        if report:
            return Result(lab.name, False, count, report)
    if count < len(cases):
        return Result(lab.name, False, count, "the check stopped before its last case.")
    return Result(lab.name, True, len(cases), note)


def _error(error: dict) -> str:
    where = f"\n  ({text(error['where'])})" if error.get("where") else ""
    return f"{text(error.get('error', '?'), 80)}: {text(error.get('message', ''))}{where}"


def _signature_hint(lab: Lab, error: dict) -> str:
    if error.get("error") == "TypeError" and "argument" in str(error.get("message", "")):
        return (f"  the grader calls your function by the stub's parameter names: "
                f"def {lab.function}{lab.signature}\n")
    return ""


def _inputs(kwargs) -> str:
    return "".join(f"\n    {k} = " + _show(v).replace("\n", "\n      ") for k, v in kwargs.items())


def _holds(prop, kwargs, actual) -> bool:
    """A property of the student's output; one it cannot even be evaluated on (an index out of
    range, a wrong type) is broken."""
    try:
        return bool(prop(kwargs, actual))
    except Exception:
        return False


def _numbers(a) -> bool:
    return isinstance(a, np.ndarray) and (a.dtype == bool or np.issubdtype(a.dtype, np.number)) \
        and not np.issubdtype(a.dtype, np.complexfloating)


def _compare(lab, label, kwargs, expected, actual: list, rebuild: str = "") -> str | None:
    """None when the outputs ``actual`` (a list of arrays) equal the reference's, else the report:
    the output and property broken, the first differing entry, the inputs and the call that
    rebuilds them, in a few lines. Outputs that are not arrays of numbers (strings, objects) fail."""
    expected_tree = jax.tree.leaves(expected)
    tail = f"  inputs: {_inputs(kwargs)}\n{rebuild}  hint: {lab.hint}"
    if len(actual) != len(expected_tree):
        got = "None" if not actual else f"{len(actual)} array(s)"
        return (f"case '{label}': expected {len(expected_tree)} output array(s), the function returned {got}.\n"
                f"  hint: {lab.hint}")
    name = (lambda i: f"output {i} (of {len(actual)})") if len(actual) > 1 else (lambda i: "the output")
    for i, (e, a) in enumerate(zip(expected_tree, actual)):
        if not _numbers(a):
            return (f"case '{label}': {name(i)} is not an array of numbers (dtype {text(getattr(a, 'dtype', type(a)), 40)}), "
                    f"expected {np.asarray(e).dtype} of shape {np.shape(e)}.\n{tail}")
        if np.shape(a) != np.shape(e):
            return f"case '{label}': {name(i)} has shape {np.shape(a)}, expected {np.shape(e)}.\n{tail}"
        if not np.all(np.isfinite(np.asarray(a, np.float64))):
            return f"case '{label}': {name(i)} holds NaN or inf.\n  actual: {_show(a)}\n{tail}"
    differs = [i for i, (e, a) in enumerate(zip(expected_tree, actual)) if not _equal(e, a, lab.tolerance)]
    if not differs:
        return None
    i = differs[0]
    axes = lab.axes[i] if i < len(lab.axes) else ()
    value = actual if len(actual) > 1 else actual[0]
    broken = next((what for what, holds in lab.properties if not _holds(holds, kwargs, value)), None)
    output = f"{name(i)}, " if len(actual) > 1 else ""
    return (f"case '{label}': the output differs from the library's.\n"
            + (f"  property broken: {broken}\n" if broken else "")
            + f"  first difference: {output}{_first_difference(expected_tree[i], actual[i], lab.tolerance, axes)}\n"
            + tail)


def status(result: Result) -> str:
    """One word for a result (:data:`STATUSES`), as the grader decided it."""
    return result.status or ("passed" if result.passed else "failed")


from mini_moe.labs import catalogue  # noqa: E402,F401  (registers the labs)
from mini_moe.labs.grader import (MEMORY_GIB, TIMEOUT, Submission, check_file, grade,  # noqa: E402,F401
                                  read_submission, run_sandboxed, write_gradebook)
