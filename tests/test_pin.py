""".ci/pin.py: the commit a chapter's install cell installs holds what the chapter uses (issue 49).

The commit 986d03f is the one that set version 0.4.0 (the tag v0.4.0 that the install cells named
until issue 49): the review found that it lacks mini_moe.labs, mini_moe.explorer,
bench.soft_moe_expert_costs, layer.block_layout, MlpExperts(kernel=...) and later results files.
"""

import subprocess

import pytest

import ci_scripts

pin = ci_scripts.load("pin")
notebooks = ci_scripts.load("notebooks")
V040 = "986d03f"

#: A chapter written against today's package, with names that 986d03f has and names it lacks.
CHAPTER = '''---
jupytext:
  formats: ipynb,md:myst
---

# A chapter

```{{code-cell}} ipython3
{install}
```

```{{code-cell}} ipython3
import jax
from flax import nnx
import mini_moe
from mini_moe import bench, layer, routing
from mini_moe import labs                                  # added after 986d03f
from mini_moe.routing import token_choice, capacity

scores = jax.random.uniform(jax.random.key(0), (8, 4))
out = mini_moe.routing.token_choice(scores, capacity=capacity(8, 4, 1), k=1)
experts = layer.MlpExperts(4, 8, hidden=16, rngs=nnx.Rngs(0))
fast = layer.MlpExperts(4, 8, hidden=16, kernel="blocked", rngs=nnx.Rngs(0))   # kernel= came later
costs = bench.soft_moe_expert_costs([2, 4])                                    # came later
runs = bench.committed("dropless-cpu-2core-epyc.json")                         # committed later
old = bench.committed("layer-cpu-2core-xeon.json")
slots = {{e: bench.committed(f"soft_moe_slots-digits-E{{e}}-cpu-2core-xeon.json") for e in (4, 8)}}
```

```{{code-cell}} ipython3
def local(routing):          # a parameter that shadows the module: not mini_moe.routing
    return routing.not_a_function_of_mini_moe

routing = out                # so does a variable
routing.dispatch.shape
print(mini_moe.explorer)     # added after 986d03f
```
'''


def chapter_at(commit: str) -> str:
    install = notebooks.install_cell()
    ref = pin.install_ref("```{code-cell} ipython3\n" + install + "\n```\n")
    full = pin.resolve(commit)
    assert ref and full
    return CHAPTER.format(install=install.replace(f"@{ref}\"", f"@{full}\""))


def test_the_names_and_files_a_chapter_uses_are_checked_at_the_commit_it_installs():
    text = chapter_at(V040)
    assert pin.install_ref(text) == pin.resolve(V040)
    found = {(u.what, u.text) for u in pin.chapter_problems(text, pin.Package(pin.resolve(V040)))}
    assert found == {
        ("name", "from mini_moe import labs"),
        ("keyword", "layer.MlpExperts(..., kernel=...)"),
        ("name", "bench.soft_moe_expert_costs"),
        ("file", "dropless-cpu-2core-epyc.json"),
        ("name", "mini_moe.explorer"),
    }
    # at HEAD the same chapter has everything it uses
    assert pin.chapter_problems(text, pin.Package(pin.resolve("HEAD"))) == []


def test_the_check_fails_on_a_chapter_that_uses_a_name_added_after_its_pinned_commit(tmp_path, monkeypatch):
    md = tmp_path / "99_new.md"
    md.write_text(chapter_at(V040))
    monkeypatch.setattr(pin, "chapters", lambda: [md])
    problems = pin.check()
    assert any("uses from mini_moe import labs, which mini_moe at 986d03f" in p for p in problems), problems
    assert any("passes layer.MlpExperts(..., kernel=...)" in p for p in problems)
    assert any("reads dropless-cpu-2core-epyc.json" in p for p in problems)
    # and the package there is not this checkout's: the pin is stale
    assert any("differs from it in mini_moe/" in p and "make pin" in p for p in problems)
    assert pin.main(["check"]) == 1


def test_a_ref_that_names_no_commit_is_refused(tmp_path, monkeypatch):
    text = chapter_at("HEAD").replace(pin.resolve("HEAD"), "f" * 40)
    md = tmp_path / "99_new.md"
    md.write_text(text)
    monkeypatch.setattr(pin, "chapters", lambda: [md])
    [problem] = pin.check()
    assert "names no commit of this repository" in problem and "unshallow" in problem


def test_every_chapter_installs_one_commit_that_has_everything_it_uses():
    """The names, keywords and files part of `make check-pin`, on the real chapters. (That the
    package at that commit equals the checkout is the other part: it holds in a clean clone, where
    CI runs it, and not while a developer edits the package.)"""
    refs = {pin.install_ref(md.read_text()) for md in notebooks.chapters()}
    assert len(refs) == 1 and None not in refs
    [ref] = refs
    commit = pin.resolve(ref)
    assert commit is not None and len(ref) == 40 and commit == ref, "the install cells name a full commit"
    assert subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=pin.ROOT).returncode == 0
    package = pin.Package(commit)
    for md in notebooks.chapters():
        assert pin.chapter_problems(md.read_text(), package) == [], md.name


def test_package_drift_lists_the_files_that_differ_from_the_pinned_commit():
    drift = pin.package_drift(V040)
    assert "mini_moe/labs/__init__.py" in drift and "mini_moe/explorer.py" in drift
    assert all(path == "pyproject.toml" or path.startswith("mini_moe/") for path in drift)


@pytest.mark.parametrize("line, ref", [
    ('MINI_MOE = "mini_moe @ git+https://github.com/mini-moe/mini_moe@0123abc"', "0123abc"),
    ('MINI_MOE = "mini_moe[tfds] @ git+https://github.com/mini-moe/mini_moe@v0.4.0"', "v0.4.0"),
])
def test_the_ref_is_read_from_the_install_cell(line, ref):
    text = "```{code-cell} ipython3\n# Install cell: generated by `make sync`\n" + line + "\n```\n"
    assert pin.install_ref(text) == ref
