"""mini_moe.notebook: the values chapters glue into their prose."""

import os
import re
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from mini_moe.notebook import glue, listing


@pytest.fixture
def glued(monkeypatch):
    """What glue hands myst-nb: {name: value} (a stand-in module, so that this runs without myst-nb,
    as in the floors' venv)."""
    import types

    values = {}
    fake = types.ModuleType("myst_nb")
    fake.glue = lambda name, value, display=True: values.update({name: value})
    monkeypatch.setitem(sys.modules, "myst_nb", fake)
    return values


def test_glue_turns_array_scalars_into_python_numbers_the_role_can_format(glued):
    assert glue("a", np.float32(0.25)) is None  # nothing for a cell to print under itself
    assert type(glued["a"]) is float and glued["a"] == 0.25
    glue("b", jnp.array(3))
    glue("c", "tokens 4 and 5")
    glue("d", np.bool_(True))
    glue("e", np.float64(0.0712))
    assert type(glued["b"]) is int and glued["b"] == 3
    assert glued["c"] == "tokens 4 and 5" and glued["d"] is True
    # myst-nb formats text/plain with format(); a Python float's repr round-trips through it
    assert format(glued["e"], ".1%") == "7.1%"


def test_glue_refuses_what_the_prose_cannot_show():
    with pytest.raises(ValueError, match="value must be a number or a string"):
        glue("x", np.arange(3))
    with pytest.raises(ValueError, match="name must be an identifier"):
        glue("not a name", 1.0)


def test_glue_prints_the_value_where_myst_nb_is_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "myst_nb", None)  # import fails, as on Colab
    assert glue("ch00_rate", 0.0712, fmt=".1%") is None
    assert capsys.readouterr().out.strip() == "[ch00_rate] 7.1%"


def test_listing_reads_like_prose():
    assert listing(np.array([4, 5, 6])) == "4, 5 and 6"
    assert listing([np.int64(1)]) == "1"
    assert listing(["a", "b"]) == "a and b"
    assert listing([]) == "none" and listing([], none="no token") == "no token"


def test_one_version_everywhere():
    """The package version and pyproject.toml's agree, and the CHANGELOG has an entry for it. (The
    chapters install a commit, not a version: .ci/pin.py and tests/test_pin.py.)"""
    import pathlib
    import tomllib

    import mini_moe

    root = pathlib.Path(__file__).parents[1]
    assert tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"] == mini_moe.__version__
    assert f"## {mini_moe.__version__} (" in (root / "CHANGELOG.md").read_text()


def _install_cell(pip_calls: list) -> str:
    """The chapters' install cell (as .ci/notebooks.py writes it) as plain Python: each ``%pip``
    line records its (expanded) arguments in ``pip_calls`` instead of running pip."""
    import ci_scripts

    source = ci_scripts.load("notebooks").install_cell().split("\n", 2)[2]  # without the ":tags:" line
    source = re.sub(r"^( *)%pip (.*)$", r"\1_pip(f'''\2''')", source, flags=re.M)
    assert "\n%" not in source and " %pip" not in source
    return "_pip = __pip_calls.append\n" + source


def _fake_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")


@pytest.mark.parametrize("gpu", [True, False])
def test_install_cell_warns_when_an_accelerator_is_attached_but_jax_sees_only_the_cpu(gpu, tmp_path, monkeypatch, capsys):
    """The install cell, run on this CPU-only machine where everything is installed and new enough:
    it runs no pip, prints JAX's backend and devices, and with an nvidia-smi on PATH (a GPU runtime
    whose JAX has no CUDA plugin) it shows the warning with the fix."""
    if gpu:
        _fake_nvidia_smi(tmp_path, monkeypatch)
    shown, pip_calls = [], []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj.data))
    exec(_install_cell(pip_calls), {"__pip_calls": pip_calls})
    assert pip_calls == []
    assert "on cpu:" in capsys.readouterr().out
    if gpu:
        assert len(shown) == 1 and "has a GPU, but JAX sees only the CPU" in shown[0] and "jax[cuda12]" in shown[0]
    else:
        assert shown == []


@pytest.mark.parametrize("backend", ["gpu", "tpu", "cpu"])
def test_install_cell_asks_for_full_float32_matmuls_on_an_accelerator(backend, monkeypatch, capsys):
    """On a GPU or TPU, XLA's default float32 matmul is TF32 or bfloat16 passes, and chapter 1's checks
    at 1e-5 failed on the H200 (mini_moe/results/device-check-gpu-h200.json): the install cell sets
    full precision there for the whole page, and leaves the CPU's default alone."""
    import jax

    before = jax.config.jax_default_matmul_precision
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setattr("IPython.display.display", lambda obj: None)
    try:
        exec(_install_cell([]), {"__pip_calls": []})
        assert jax.config.jax_default_matmul_precision == ("highest" if backend != "cpu" else before)
    finally:
        jax.config.update("jax_default_matmul_precision", before)
    assert f"on {backend}:" in capsys.readouterr().out


@pytest.mark.parametrize("accelerator, build", [("GPU", "jax[cuda12]"), ("TPU", "jax[tpu]"), (None, "jax")])
def test_install_cell_upgrades_an_old_jax_as_the_build_for_the_accelerator_and_restarts(
        accelerator, build, tmp_path, monkeypatch):
    """Colab's runtime (jax 0.7.2, flax 0.11.2, optax 0.2.8, orbax-checkpoint 0.12.0): the cell
    upgrades exactly the packages below the floors, JAX as the accelerator's build (so that pip
    installs the CUDA plugin or libtpu of the same version), and since this Python has already
    imported JAX it restarts the kernel and stops with the instruction to run the cell again."""
    import importlib.metadata

    from ci_scripts import load

    floors = load("notebooks").floors()
    colab = {"jax": "0.7.2", "flax": "0.11.2", "optax": "0.2.8", "orbax-checkpoint": "0.12.0"}
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: colab.get(name) or real_version(name))
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    if accelerator == "GPU":
        _fake_nvidia_smi(tmp_path, monkeypatch)
    elif accelerator == "TPU":
        monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-1")
    restarts, shown, pip_calls = [], [], []
    kernel = type("Kernel", (), {"do_shutdown": lambda self, restart: restarts.append(restart)})()
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj.data))
    with pytest.raises(RuntimeError, match="run this cell again"):
        exec(_install_cell(pip_calls), {"__pip_calls": pip_calls,
                                        "get_ipython": lambda: type("Shell", (), {"kernel": kernel})()})
    old = [p for p in floors if tuple(map(int, colab[p].split("."))) < tuple(map(int, floors[p].split(".")))]
    assert old == ["jax", "flax"]  # what Colab needs upgraded under today's floors
    assert pip_calls == [f'install -q -U "{build}>={floors["jax"]}" "flax>={floors["flax"]}"']
    assert restarts == [True] and "restarts now" in shown[0]


def test_visible_glue_lines_count_only_cells_a_reader_sees():
    import ci_scripts
    import nbformat

    notebooks = ci_scripts.load("notebooks")
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell('x = 1\nglue("a", x)\nglue("b", 2)'),
        nbformat.v4.new_code_cell('glue("c", 3)', metadata={"tags": ["remove-input"]}),
        nbformat.v4.new_code_cell('glue("d", 4)', metadata={"tags": ["hide-input"]}),
        nbformat.v4.new_markdown_cell('{glue:text}`a` and glue("e", 5)'),
    ])
    assert notebooks.visible_glue_lines(nb) == ['glue("a", x)', 'glue("b", 2)']


def test_a_glue_key_defined_twice_in_a_chapter_fails_the_static_check(tmp_path, monkeypatch):
    """Issue 33: chapter 13 glued ``ch13_ms_remoe`` in a loop over its arms and again by name, and
    myst-nb's duplicate-key warning failed `make book`. The check expands an f-string name over a
    loop whose list is written in the chapter, so it finds that case; templates it cannot expand
    (``ch08_{name}`` over a dict) are left to the build."""
    import ci_scripts

    notebooks = ci_scripts.load("notebooks")
    template = (
        "# T\n\n```{code-cell} ipython3\n:tags: [remove-input]\n\nARMS = [\"a\", \"remoe\"]\n"
        "for arm in ARMS:\n    glue(f\"ch99_ms_{arm}\", 1.0)\n```\n\n"
        "```{code-cell} ipython3\n%matplotlib inline\nfor k in (\"x\", \"y\"):\n    glue(f\"ch99_{k}_{k}\", 2)\n"
        "for name, v in {\"z\": 1}.items():\n    glue(f\"ch99_{name}\", v)\n"
        "glue(\"ch99_other\", 3)\nEXTRA```\n")

    def chapter(extra):
        return template.replace("EXTRA", extra)

    assert sorted(notebooks.glue_keys(chapter(""))) == [
        ("ch99_ms_a", "ch99_ms_remoe"), ("ch99_other",), ("ch99_x_x", "ch99_y_y"), ('f"ch99_{name}"',)]
    assert notebooks.glued_twice(chapter("")) == []
    assert notebooks.glued_twice(chapter("glue(\"ch99_ms_remoe\", 2.0)\n")) == ["ch99_ms_remoe (2 times)"]
    assert notebooks.glued_twice(chapter("glue(\"ch99_other\", 4)\n")) == ["ch99_other (2 times)"]
    assert notebooks.glued_twice(chapter("for name in names:\n    glue(f\"ch99_{name}\", 0)\n")) == [
        'f"ch99_{name}" (2 times)']

    # ... and `notebooks.py check` reports it for a chapter of the book (in a copy of the repository)
    book = tmp_path / "book"
    book.mkdir()
    for rel in ("_config.yml", "_toc.yml", "pyproject.toml"):
        (tmp_path / rel).write_bytes((notebooks.ROOT / rel).read_bytes())
    first = notebooks.chapters()[0]
    for twin in (first, first.with_suffix(".ipynb")):
        (book / twin.name).write_bytes(twin.read_bytes())
    md = book / first.name
    monkeypatch.setattr(notebooks, "ROOT", tmp_path)
    monkeypatch.setattr(notebooks, "BOOK", book)
    assert not [p for p in notebooks.check() if "defined twice" in p]
    md.write_text(md.read_text() + "\n```{code-cell} ipython3\nglue(\"ch01_x\", 1)\nglue(\"ch01_x\", 2)\n```\n")
    problems = [p for p in notebooks.check() if "defined twice" in p]
    assert len(problems) == 1 and "ch01_x (2 times)" in problems[0], problems
