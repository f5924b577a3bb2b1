"""The Colab notebooks (.ci/colab.py): the executed chapters with glue and cite roles and math
blocks rendered, so that Colab, which shows MyST roles as raw text, reads like the book."""

import pathlib
import re

import ci_scripts
import nbformat
import pytest

ROOT = pathlib.Path(__file__).parents[1]
colab = ci_scripts.load("colab")


def _glue_output(name, text):
    """A display output as myst-nb's glue writes it into an executed notebook."""
    prefix = "application/papermill.record/"
    return nbformat.v4.new_output("display_data", data={prefix + "text/plain": text},
                                  metadata={"scrapbook": {"name": name, "mime_prefix": prefix}})


def test_an_executed_notebook_becomes_a_colab_notebook():
    code = nbformat.v4.new_code_cell("glue(...)")
    code.outputs = [_glue_output("acc", "0.91234"), _glue_output("seeds", "8"), _glue_output("verdict", "'no `detectable` difference'")]
    code.execution_count = 3
    text = ("Accuracy {glue:text}`acc:.1%` over {glue:text}`seeds:d` seeds: {glue:text}`verdict`, as "
            "{cite:t}`liu2024routers` found {cite:p}`zhou2022expert, liu2024routers` {cite}`liu2024routers`.\n\n"
            "```{math}\n:label: eq-x\nE \\sum_i f_i P_i\n```")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(text), code])
    out = colab.colab_notebook(nb, colab.bibliography(ROOT / "references.bib"), "a note")
    assert out.cells[0].source == "a note"
    assert out.cells[1].source == ("Accuracy 91.2% over 8 seeds: no `detectable` difference, as Liu et al. (2024) "
                                   "found (Zhou et al., 2022; Liu et al., 2024) (Liu et al., 2024).\n\n$$\nE \\sum_i f_i P_i\n$$")
    assert out.cells[2].outputs == [] and out.cells[2].execution_count is None
    assert nb.cells[1].outputs  # the input notebook is not modified


def test_an_admonition_becomes_a_quote_with_its_roles_rendered():
    text = ("Before.\n\n```{admonition} What could be read\n:class: note\nOnly the abstracts, as "
            "{cite:t}`liu2024routers` say.\nA second line.\n```\n\n```{note}\nUntitled.\n```\nAfter.")
    out = colab.render_markdown(text, {}, colab.bibliography(ROOT / "references.bib"))
    assert out == ("Before.\n\n> **What could be read**\n>\n> Only the abstracts, as Liu et al. (2024) say.\n"
                   "> A second line.\n\n> **Note**\n>\n> Untitled.\nAfter.")


def test_a_role_without_its_value_or_reference_is_an_error():
    refs = colab.bibliography(ROOT / "references.bib")
    with pytest.raises(KeyError, match="no value named 'x'"):
        colab.render_markdown("{glue:text}`x:.2f`", {}, refs)
    with pytest.raises(KeyError, match="not in references.bib"):
        colab.render_markdown("{cite:p}`nobody1999`", {}, refs)


@pytest.mark.parametrize("chapter", sorted(ROOT.glob("book/[0-9][0-9]_*.md")), ids=lambda p: p.stem)
def test_every_role_of_every_chapter_renders(chapter):
    """With a stand-in value for every glued key (an int where the role formats with d), no MyST
    role or math directive is left in the chapter's text."""
    text = chapter.read_text()
    values = {key: (1 if fmt.endswith("d") else 0.5)
              for key, fmt in re.findall(r"\{glue:text\}`([A-Za-z0-9_]+):?([^`]*)`", text)}
    rendered = colab.render_markdown(text, values, colab.bibliography(ROOT / "references.bib"))
    assert not re.search(r"\{(glue|cite)[:a-z]*\}`", rendered) and "{math}" not in rendered
    # no directive but code cells (the Colab script reads Markdown cells only, as .ci/colab.py's main checks)
    assert not re.search(r"```\{(?!code-cell)[a-z-]+\}", rendered), re.findall(r"```\{[a-z-]+\}[^\n]*", rendered)


def test_values_come_from_myst_nbs_glue_file_too():
    """An executed book notebook has no glue outputs left: myst-nb moves them to NAME.glue.json."""
    glue_data = {"acc": {"output_type": "display_data", "metadata": {}, "data": {"text/plain": "0.5"}}}
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("{glue:text}`acc:.0%`")])
    assert colab.colab_notebook(nb, {}, "note", glue_data).cells[1].source == "50%"


def test_a_glued_latex_output_renders_as_inline_math():
    """``{glue:}`key``` shows the glued output itself: a ``Math`` value becomes ``$...$`` on Colab."""
    prefix = "application/papermill.record/"
    code = nbformat.v4.new_code_cell("glue(...)")
    code.outputs = [nbformat.v4.new_output(
        "display_data", data={prefix + "text/latex": "$\\displaystyle \\tfrac{k T}{E}$", prefix + "text/plain": "<Math>"},
        metadata={"scrapbook": {"name": "c", "mime_prefix": prefix}}), _glue_output("n", "3")]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("C = {glue:}`c`, n = {glue}`n`."), code])
    assert colab.colab_notebook(nb, {}, "note").cells[1].source == "C = $\\displaystyle \\tfrac{k T}{E}$, n = 3."
    with pytest.raises(KeyError, match="no value named 'd'"):
        colab.render_markdown("{glue:}`d`", {}, {})


def test_the_script_writes_every_chapter(tmp_path):
    code = nbformat.v4.new_code_cell("x")
    code.outputs = [_glue_output("n", "3")]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("{glue:text}`n:d` runs"), code])
    nbformat.write(nb, tmp_path / "01_a.ipynb")
    assert colab.main(["--out", str(tmp_path / "colab"), str(tmp_path / "01_a.ipynb")]) == 0
    assert nbformat.read(tmp_path / "colab" / "01_a.ipynb", as_version=4).cells[1].source == "3 runs"
    nb.cells[0].source = "{glue:text}`missing` runs"
    nbformat.write(nb, tmp_path / "02_b.ipynb")
    with pytest.raises(KeyError, match="missing"):
        colab.main(["--out", str(tmp_path / "colab"), str(tmp_path / "02_b.ipynb")])


# ------------------------------------------------ .ci/colab_stack.py (Colab's runtime emulated)


def test_the_colab_emulation_refuses_an_upgrade_that_leaves_the_accelerator_build_behind():
    stack = ci_scripts.load("colab_stack")
    floor = stack.floors()["jax"]
    good = {"jax": "0.10.2", "jaxlib": "0.10.2", "jax-cuda12-plugin": "0.10.2", "jax-cuda12-pjrt": "0.10.2"}
    stack.check_accelerator_upgrade("GPU", good)
    stack.check_accelerator_upgrade("TPU", {"jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": "0.0.42.1"})
    for bad in ({**good, "jax-cuda12-plugin": "0.7.2"},  # `pip install -U jax`: the plugin stays old
                {k: v for k, v in good.items() if k != "jax-cuda12-pjrt"},
                {**good, "jax": floor.replace(floor.split(".")[1], "0", 1)}):  # below the floor
        with pytest.raises(SystemExit, match="colab-stack"):
            stack.check_accelerator_upgrade("GPU", bad)
    with pytest.raises(SystemExit, match="libtpu"):
        stack.check_accelerator_upgrade("TPU", {"jax": "0.10.2", "jaxlib": "0.10.2"})


def test_the_colab_emulation_installs_the_commit_the_install_cell_names():
    stack = ci_scripts.load("colab_stack")
    source = stack.cell_source()
    ref = ci_scripts.load("pin").install_ref((stack.ROOT / "book" / "16_explorer.md").read_text())
    # pip clones this repository at the pinned commit and builds the wheel from it, as on Colab;
    # chapter 16 reads Fashion-MNIST test images, hence the tfds extra
    assert f'MINI_MOE = "mini_moe[tfds] @ git+file://{stack.ROOT}@{ref}"' in source
    assert "%pip install -q -U {upgrade}" in source and '%pip install -q "{MINI_MOE}"' in source
