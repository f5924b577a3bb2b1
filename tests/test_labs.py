"""The graded labs (issue 37): every checker passes the library's own function and rejects the
wrong solutions students typically write; the grader command reports them."""

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
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
    ],
    "ch02.token_choice_bpr": [
        lambda scores, capacity: routing.token_choice(jnp.asarray(scores), capacity=capacity).dispatch,  # no BPR
        # ascending priority instead of descending
        lambda scores, capacity: _top1_dispatch(scores, capacity, jnp.argsort(jnp.max(scores, -1))),
        # ties broken towards the later token (a descending sort that is not stable)
        lambda scores, capacity: _top1_dispatch(
            scores, capacity, scores.shape[0] - 1 - jnp.argsort(-jnp.max(scores, -1)[::-1], stable=True)),
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
    ],
    "ch02.switch_loss": [
        # P from the kept (top-k) probabilities only
        lambda probs, k: probs.shape[-1] * jnp.sum(_f(probs, k) * jnp.mean(
            jnp.where(_picked(probs, k), probs, 0.0), 0)),
        lambda probs, k: jnp.sum(_f(probs, k) * jnp.mean(probs, 0)),  # missing the factor E
        lambda probs, k: probs.shape[-1] * jnp.sum(_f(probs, k) * k * jnp.mean(probs, 0)),  # f over T, not k T
    ],
    "ch02.z_loss": [
        lambda logits: jnp.mean(jnp.log(jnp.sum(jnp.exp(logits), -1)) ** 2),  # overflows at extreme logits
        lambda logits: jnp.mean(jax.nn.logsumexp(logits, -1)),  # not squared
        lambda logits: jnp.sum(jax.nn.logsumexp(logits, -1) ** 2),  # summed, not averaged
    ],
    "ch03.sinkhorn": [
        lambda logits, num_iters: transport.sinkhorn(jnp.asarray(logits).T, num_iters=num_iters).T,  # columns first
        lambda logits, num_iters: jax.nn.softmax(logits, -1),  # no iterations at all
        lambda logits, num_iters: _plain_sinkhorn(logits, num_iters),  # not in the log domain
    ],
    "ch06.soft_routing": [
        lambda logits: (jax.nn.softmax(logits, 1), jax.nn.softmax(logits.reshape(logits.shape[0], -1), -1)
                        .reshape(logits.shape)),  # dispatch over experts, not tokens
        lambda logits: (jax.nn.softmax(logits, 0), jax.nn.softmax(logits, -1)),  # combine within one expert's slots
        lambda logits: (jax.nn.softmax(logits, 0), jax.nn.softmax(logits, 0)),  # both over tokens
    ],
    "ch07.prc_loss": [
        lambda probs1, probs2, index, valid: _prc(probs1, probs2, index, valid, pairs="all"),  # |U| counts every patch
        lambda probs1, probs2, index, valid: _prc(probs1, probs2, index, valid, offdiag_norm="E^2"),
        lambda probs1, probs2, index, valid: _prc(probs1, probs2, index, valid, partner="same index"),
    ],
    "ch12.bias_step": [
        lambda bias, load, rate: bias + rate * jnp.sign(load - jnp.mean(load)),  # the wrong way round
        lambda bias, load, rate: bias + rate * (jnp.mean(load) - load),  # proportional, not the sign
        lambda bias, load, rate: bias + rate * jnp.minimum(jnp.sign(jnp.mean(load) - load), 0),  # only lowers
    ],
    "ch12.group_limit": [
        lambda scores, num_groups, top_groups: _group_limit(scores, num_groups, top_groups, best=1),  # best only
        lambda scores, num_groups, top_groups: _group_limit(scores, num_groups, top_groups, best=None),  # sum of all
        # ties towards the higher group
        lambda scores, num_groups, top_groups: _group_limit(scores[:, ::-1], num_groups, top_groups)[:, ::-1],
    ],
    "ch13.sort_by_expert": [
        lambda expert, num_experts: (jnp.argsort(-expert, stable=True)[::-1],
                                     jnp.bincount(expert, length=num_experts)),  # unstable within an expert
        lambda expert, num_experts: (jnp.argsort(expert, stable=True), jnp.bincount(expert)),  # misses empty experts
        lambda expert, num_experts: (jnp.sort(expert), jnp.bincount(expert, length=num_experts)),  # values, not order
    ],
}


def _prc(probs1, probs2, index, valid, *, pairs="valid", offdiag_norm="E(E-1)", partner="index"):
    """Paper 004's loss with one typical mistake."""
    e = probs1.shape[-1]
    other = jnp.take_along_axis(probs2, index[..., None], 1) if partner == "index" else probs2[:, :probs1.shape[1]]
    if other.shape != probs1.shape:
        other = jnp.resize(other, probs1.shape)
    weight = valid[..., None].astype(probs1.dtype)
    count = jnp.maximum(valid.sum(), 1) if pairs == "valid" else valid.size
    s = e / count * jnp.einsum("bpi,bpj->ij", probs1 * weight, other)
    off = jnp.sum((s * (1 - jnp.eye(e))) ** 2) / (max(e * (e - 1), 1) if offdiag_norm == "E(E-1)" else e * e)
    return 5e-3 / e * jnp.sum((1 - jnp.diag(s)) ** 2) + 5e-2 * off


def _group_limit(scores, num_groups, top_groups, best=2):
    t, e = scores.shape
    grouped = jnp.asarray(scores).reshape(t, num_groups, e // num_groups)
    size = e // num_groups
    score = grouped.sum(-1) if best is None else jax.lax.top_k(grouped, min(best, size))[0].sum(-1)
    keep = jax.nn.one_hot(jax.lax.top_k(score, top_groups)[1], num_groups).sum(-2) > 0
    return jnp.repeat(keep, size, -1)


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
def test_every_checker_rejects_three_typical_wrong_solutions(name):
    assert len(MUTANTS[name]) >= 3
    for i, mutant in enumerate(MUTANTS[name]):
        result = labs.check(name, mutant)
        assert not result.passed, f"{name}: mutant {i} passed"
        assert "hint:" in result.message and "chapter" in result.message, result.message


def test_failures_are_reported_clearly():
    def raises(scores, capacity):
        raise IndexError("off the end")

    result = labs.check("ch04.expert_choice", raises)
    assert not result.passed and "raised IndexError: off the end" in result.message and "line" in result.message

    def wrong_shape(scores, capacity):
        return jnp.zeros(scores.shape)

    assert "has shape" in labs.check("ch04.expert_choice", wrong_shape).message

    def not_jittable(scores, capacity):
        if float(jnp.max(scores)) > 2:  # Python control flow on an array value
            return None
        return routing.expert_choice(jnp.asarray(scores), capacity=capacity).dispatch

    assert "not jit-compatible" in labs.check("ch04.expert_choice", not_jittable).message

    def stub(scores, capacity):
        raise NotImplementedError

    assert labs.check("ch04.expert_choice", stub).message.startswith("not implemented")
    assert "property broken: an expert holds more than C tokens" in labs.check(
        "ch02.token_choice", MUTANTS["ch02.token_choice"][0]).message
    with pytest.raises(ValueError, match="Unknown lab"):
        labs.check("ch99.nothing", stub)
    assert labs.LABS["ch04.expert_choice"].stub().startswith("def expert_choice(scores, capacity):")


def test_the_grader_command(tmp_path):
    student = tmp_path / "student.py"
    student.write_text(
        "import math\n"
        "from mini_moe import routing\n"
        "def capacity(num_tokens, num_experts, factor):\n"
        "    return max(1, int(math.floor(factor * num_tokens / num_experts + 0.5)))\n"
        "def expert_choice(scores, capacity):\n"
        "    return routing.expert_choice(scores[::-1], capacity=capacity).dispatch[::-1]\n"
        "def z_loss(logits):\n"
        "    raise NotImplementedError\n")
    cli = [sys.executable, "-m", "mini_moe", "labs", "check", str(student)]
    proc = subprocess.run(cli, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert "ch01.capacity            passed" in proc.stdout and "ch04.expert_choice       FAILED" in proc.stdout
    assert "not implemented" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
    report = json.loads(subprocess.run(cli + ["--json"], capture_output=True, text=True).stdout)
    assert {r["lab"]: r["passed"] for r in report} == {"ch01.capacity": True, "ch04.expert_choice": False,
                                                       "ch02.z_loss": False}
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    proc = subprocess.run(cli[:-1] + [str(empty)], capture_output=True, text=True)
    assert proc.returncode == 2 and "defines no lab function" in proc.stderr and "Traceback" not in proc.stderr


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
