"""mini_moe.notebook: the values chapters glue into their prose."""

import sys

import jax.numpy as jnp
import numpy as np
import pytest

from mini_moe.notebook import glue, listing


def test_glue_turns_array_scalars_into_python_numbers_the_role_can_format():
    assert type(glue("a", np.float32(0.25))) is float and glue("a", np.float32(0.25)) == 0.25
    assert type(glue("b", jnp.array(3))) is int and glue("b", jnp.array(3)) == 3
    assert glue("c", "tokens 4 and 5") == "tokens 4 and 5"
    assert glue("d", np.bool_(True)) is True
    # myst-nb formats text/plain with format(); a Python float's repr round-trips through it
    assert format(glue("e", np.float64(0.0712)), ".1%") == "7.1%"


def test_glue_refuses_what_the_prose_cannot_show():
    with pytest.raises(ValueError, match="value must be a number or a string"):
        glue("x", np.arange(3))
    with pytest.raises(ValueError, match="name must be an identifier"):
        glue("not a name", 1.0)


def test_glue_prints_the_value_where_myst_nb_is_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "myst_nb", None)  # import fails, as on Colab
    assert glue("ch00_rate", 0.0712, fmt=".1%") == 0.0712
    assert capsys.readouterr().out.strip() == "[ch00_rate] 7.1%"


def test_listing_reads_like_prose():
    assert listing(np.array([4, 5, 6])) == "4, 5 and 6"
    assert listing([np.int64(1)]) == "1"
    assert listing(["a", "b"]) == "a and b"
    assert listing([]) == "none" and listing([], none="no token") == "no token"


def test_one_version_everywhere():
    """The package version, pyproject.toml's and the git ref the chapters install on Colab agree,
    and the CHANGELOG has an entry for it."""
    import pathlib
    import tomllib

    import yaml

    import mini_moe

    root = pathlib.Path(__file__).parents[1]
    assert tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"] == mini_moe.__version__
    config = yaml.safe_load((root / "_config.yml").read_text())
    assert config["parse"]["myst_substitutions"]["mini_moe_ref"] == f"v{mini_moe.__version__}"
    assert f"## {mini_moe.__version__} (" in (root / "CHANGELOG.md").read_text()


@pytest.mark.parametrize("gpu", [True, False])
def test_install_cell_warns_when_an_accelerator_is_attached_but_jax_sees_only_the_cpu(gpu, tmp_path, monkeypatch, capsys):
    """The chapters' install cell (as .ci/notebooks.py writes it), run on this CPU-only machine:
    it prints JAX's backend and devices, and with an nvidia-smi on PATH (a GPU runtime whose JAX
    has no CUDA plugin) it shows the warning with the fix."""
    import ci_scripts

    source = ci_scripts.load("notebooks").install_cell().split("\n", 2)[2]  # without the ":tags:" line
    # mini_moe is installed here, so the cell's one IPython magic (pip) never runs.
    source = source.replace('%pip install -q "{MINI_MOE}"', "raise AssertionError('reinstalls mini_moe')")
    if gpu:
        fake = tmp_path / "nvidia-smi"
        fake.write_text("#!/bin/sh\n")
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj.data))
    exec(source, {})
    assert "on cpu:" in capsys.readouterr().out
    if gpu:
        assert len(shown) == 1 and "has a GPU, but JAX sees only the CPU" in shown[0] and "jax[cuda12]" in shown[0]
    else:
        assert shown == []


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
