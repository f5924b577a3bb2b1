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
