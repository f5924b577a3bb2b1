"""CI's book: the README's two commands are what CI runs, and the book that CI builds comes from
nbval's executions (.ci/nbval_record.py), found by myst-nb's cache under the chapter's own key.

The end-to-end check (a good throw-away book passes, a failing cell, a glue key defined twice, a
broken reference and a missing figure each fail) is CI's self-check, `make book-selfcheck`
(.ci/book_selfcheck.py), which `make test` runs once; here are the parts that need no build."""

import re
import subprocess

import ci_scripts
import nbformat
import pytest

ROOT = ci_scripts.CI.parent
record = ci_scripts.load("nbval_record")


def _make_dry_run(target: str) -> list[str]:
    """The commands ``make TARGET`` runs (``make -n``: printed, not run)."""
    done = subprocess.run(["make", "-n", "-C", str(ROOT), "--no-print-directory", target],
                          capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def _readme_commands() -> list[str]:
    """The commands of the README's "Two commands on a fresh machine" block."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Two commands on a fresh machine", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_the_readme_names_the_two_commands_and_ci_runs_the_test_command():
    assert _readme_commands() == ["make book", "make test"]
    run = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
           if line.strip() and not line.lstrip().startswith("#")]
    assert any(re.fullmatch(r"(time )?make test( \S+=\S+)*( \S+=\"[^\"]*\")*", line) for line in run), run


def test_make_test_builds_the_whole_book_with_the_command_of_make_book():
    """`make book` and `make test` share BOOK_BUILD; make test adds only where the outputs come from
    (nbval's run, through the cache's _config.yml), then checks the build in the browser."""
    book = [line for line in _make_dry_run("book") if "jupyter-book build" in line]
    test = _make_dry_run("test")
    built = [line for line in test if "jupyter-book build" in line]
    assert len(book) == 1 and len(built) == 1, (book, built)
    assert built[0] == book[0] + " --config _build/.jupyter_cache/_config.yml"
    assert book[0].endswith("jupyter-book build . -W -n --keep-going")
    # the README says which build command that is
    assert "`jupyter-book build . -W -n --keep-going`" in (ROOT / "README.md").read_text()
    order = [next(i for i, line in enumerate(test) if needle in line) for needle in (
        "-m pytest -n auto tests",                              # the unit tests
        "--nbval-record _build/nbval --nbval-lax",              # every chapter under nbval, recorded
        "nbval_record.py cache _build/nbval _build/.jupyter_cache --expect",
        "jupyter-book build",                                   # the whole book from those executions
        "nbval_record.py verify",                               # ... executing none of them again
        "browser_check.py --html _build/html --screenshots _build/screenshots",  # opened in Chromium
        "book_selfcheck.py")]                                   # and CI's check of itself
    assert order == sorted(order), order
    chapters = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("book/[0-9][0-9]_*.ipynb"))
    nbval = next(line for line in test if "--nbval-record" in line)
    assert nbval.split()[-len(chapters):] == chapters
    assert "-n 2 --dist loadfile" in nbval  # two chapters at a time, one notebook per worker
    assert f"--expect {len(chapters)}" in next(line for line in test if "nbval_record.py cache" in line)


def _notebook():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# T"),
                                         nbformat.v4.new_code_cell("print(1)"),
                                         nbformat.v4.new_code_cell("from IPython.display import Math\nMath('x')",
                                                                   metadata={"tags": ["remove-input"]})])
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    return nb


def test_recorded_outputs_are_cached_under_the_key_myst_nb_looks_up(tmp_path, monkeypatch):
    """What nbval's kernel printed goes into the notebook, cell by cell, and jupyter-cache finds it
    from the unexecuted chapter, as myst-nb's ``execute_notebooks: cache`` looks it up."""
    from jupyter_cache import get_cache

    nb = _notebook()
    source = tmp_path / "book" / "01_t.ipynb"
    source.parent.mkdir()
    nbformat.write(nb, source)
    outputs = {0: [{"output_type": "stream", "name": "stdout", "text": "1\n"}],
               1: [{"output_type": "execute_result", "execution_count": 7, "metadata": {},
                    "data": {"text/plain": "<Math>", "text/latex": "$x$"}}]}
    written = record.write_executed(nbformat.read(source, as_version=4), outputs, source, tmp_path / "executed",
                                    tmp_path)
    assert written == tmp_path / "executed" / "book" / "01_t.ipynb"
    executed = nbformat.read(written, as_version=4)
    assert [c.get("execution_count") for c in executed.cells] == [None, 1, 2]
    assert executed.cells[1].outputs[0].text == "1\n" and executed.cells[2].outputs[0].execution_count == 2
    assert executed.metadata.language_info["name"] == "python"

    cache_dir = tmp_path / "cache"
    monkeypatch.setattr(record, "ROOT", tmp_path)  # the notebooks' repository
    assert record.cache(tmp_path / "executed", cache_dir, config=ROOT / "_config.yml") == [written]
    store = get_cache(str(cache_dir))
    _, merged = store.merge_match_into_notebook(nbformat.read(source, as_version=4))
    assert merged.cells[1].outputs[0].text == "1\n" and merged.cells[2].outputs[0].data["text/latex"] == "$x$"
    assert record.executed_by_build(cache_dir) == []
    config = (cache_dir / "_config.yml").read_text()
    assert "execute_notebooks: cache" in config and f"cache: {cache_dir.resolve()}" in config

    # a chapter whose code changed after nbval ran is not found: the build would execute it again
    nb.cells[1].source = "print(2)"
    with pytest.raises(KeyError):
        store.match_cache_notebook(nb)
    store.add_nb_to_project(str(source))  # what myst-nb does before executing a cache miss
    assert record.executed_by_build(cache_dir) == [str(source)]
    assert record.main(["verify", str(cache_dir)]) == 1


def test_the_browser_check_holds_chapters_not_the_course_kit_to_the_equation_and_figure_rule():
    """The labs page and the instructor's page (the TOC's "Course kit" part) are numbered like
    chapters but have no equation or figure to show; every other numbered page is a chapter."""
    browser_check = ci_scripts.load("browser_check")
    kit = browser_check.course_kit(ci_scripts.CI.parent / "_toc.yml")
    assert kit == {"book/14_labs.html", "book/15_teaching.html"}
    assert browser_check.course_kit(ci_scripts.CI.parent / "no_such_toc.yml") == set()


def test_the_browser_check_counts_the_tables_a_chapter_displays(tmp_path):
    """The <table> count a page must reach (issue 63): pipe tables in Markdown cells and in the
    Markdown that cells display, and HTML tables; not tables in fenced code, in removed outputs or
    in glue records."""
    browser_check = ci_scripts.load("browser_check")
    table = "| a | b |\n|---|:--:|\n| 1 | 2 |"
    assert browser_check.markdown_tables(table) == 1
    assert browser_check.markdown_tables("text\n\n" + table + "\n\n" + table.replace("a", "c")) == 2
    assert browser_check.markdown_tables("```text\n" + table + "\n```") == 0  # code, not a table
    assert browser_check.markdown_tables("a | b\n---|---\n1 | 2") == 1       # GFM allows outer pipes out
    assert browser_check.markdown_tables("---\ntitle: front matter\n---") == 0
    assert browser_check.markdown_tables("```{list-table}\n* - a\n```") == 1

    def shown(mime, text, **metadata):
        return nbformat.v4.new_output("display_data", data={mime: text}, metadata=metadata)

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# T\n\n" + table),
        nbformat.v4.new_markdown_cell(table, metadata={"tags": ["remove-cell"]}),
        nbformat.v4.new_code_cell("show()", outputs=[shown("text/markdown", "Caption.\n\n" + table),
                                                     shown("text/html", "<TABLE><tr><td>1</td></tr></table>")]),
        nbformat.v4.new_code_cell("show()", outputs=[shown("text/markdown", table)],
                                  metadata={"tags": ["remove-output"]}),
        nbformat.v4.new_code_cell("glue()", outputs=[shown("application/papermill.record/text/markdown", table)]),
        nbformat.v4.new_code_cell("print()", outputs=[nbformat.v4.new_output("stream", text=table)]),
    ])
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    assert browser_check.displayed_tables(path) == 3


def test_the_recorded_book_hides_the_value_of_a_cell_ending_in_a_semicolon(tmp_path):
    """nbval runs cells with store_history=False, so IPython's `;` rule looked at the wrong cell and
    CI's book printed ``Text(0.5, 1.0, '...')`` under plots; the recorder applies the rule itself."""
    record = ci_scripts.load("nbval_record")
    assert record.quiet('ax.set_title("t");') and record.quiet("f();  # a comment\n")
    assert not record.quiet("x = 1\nx") and not record.quiet("s = 'a;'\ns")
    nb = _notebook()
    nb.cells[1].source = "ax.set_title('t');"
    value = nbformat.v4.new_output("execute_result", data={"text/plain": "Text(0.5, 1.0, 't')"})
    printed = nbformat.v4.new_output("stream", text="shown\n")
    out = record.write_executed(nb, {0: [value, printed], 1: [value]}, tmp_path / "book" / "c.ipynb",
                                tmp_path / "out", tmp_path)
    cells = [c for c in nbformat.read(out, as_version=4).cells if c.cell_type == "code"]
    assert [o.output_type for o in cells[0].outputs] == ["stream"]   # the value hidden, the print kept
    assert [o.output_type for o in cells[1].outputs] == ["execute_result"]


def test_the_readme_layout_lists_every_module():
    """The README's Layout names every module of the library (issue 63 §4)."""
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    layout = layout[:layout.index("\n## ", 4)]
    modules = [p for p in (ROOT / "mini_moe").glob("*.py")] + [(ROOT / "mini_moe" / "explorer.js")] + [
        p for p in (ROOT / "mini_moe" / "routers").glob("*.py") if p.name != "__init__.py"]
    missing = sorted(p.relative_to(ROOT).as_posix() for p in modules
                     if not re.search(rf"^\s+{re.escape(p.name)}\s", layout, re.M))
    assert not missing, f"README.md's Layout does not list {missing}"
