"""CI checks itself: throw-away books must pass or fail `make nbval-book` for the right reason.

`make test` builds the book with `make nbval-book` (every chapter under nbval, then
``jupyter-book build . -W -n --keep-going`` from those executions) and checks it in Chromium. A
check that cannot fail protects nothing, so this script copies the repository's build machinery
(Makefile, .ci/, _config.yml, references.bib, _static, the introduction and the references page)
into temporary folders, each with one throw-away chapter, and runs the same make targets there with
this repository's venv:

- ``good``: the browser probe of .ci/browser_check.py (equations, LaTeX cell outputs, a glued
  LaTeX value, an equation reference, a figure, a table in the prose and one a cell displays, a
  long printed line, a plot cell ending in ``;``). `make nbval-book` and `make browser-check` pass.
- ``cell_error``: a cell raises. nbval fails (``Cell execution caused an exception``).
- ``glue_duplicate``: one key glued by two cells (through a name that the static check of
  .ci/notebooks.py cannot expand). The build fails on myst-nb's ``glue key ... duplicate``.
- ``broken_reference``: ``{ref}`` to a label that does not exist. The build fails (``undefined label``).
- ``missing_figure``: a ``{figure}`` whose file does not exist. The build fails
  (``image file not readable``).

The book builds, but a reader would see something wrong (issue 63); `make browser-check` fails:

- ``table_as_text``: a table displayed by a cell whose Markdown is rendered as CommonMark (no
  tables: what every displayed table looked like before), left as one paragraph of text.
- ``lone_value``: a cell whose last expression prints a bare number.
- ``wide_output``: a text output whose lines are cut at its box.
- ``missing_table``: the source displays a pipe table that never reaches the page as a ``<table>``.
- ``swallowed_prose``: display math in a list item with no blank line before it, so that the
  ``$$`` pair and the prose between become one run of italic letters (chapter 20's first build).

Each broken book must fail with its own message, and nothing else may be wrong with it (each is the
good book plus one breakage). Exit status 1 with what went wrong otherwise.

    python .ci/book_selfcheck.py            # all cases, two at a time
    python .ci/book_selfcheck.py good cell_error
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jupytext
import yaml

from browser_check import PROBE_PAGE  # .ci/ is on sys.path when this script runs

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = "book/01_browser_probe"
# A Markdown link to a numbered page of the book, e.g. [Labs](14_labs.ipynb).
PAGE_LINK = re.compile(r"\[([^\]]+)\]\(\d\d_[\w-]+\.(?:ipynb|md)\)")
COPIED = ("Makefile", "pyproject.toml", "references.bib", "book/intro.md", "book/references.md")

# Each case: text appended to the probe chapter, the make targets, and the text that the failing
# output must contain (None: every target must pass).
CASES = {
    "good": ("", ["nbval-book", "browser-check"], None),
    "cell_error": ("```{code-cell} ipython3\nraise ValueError('a deliberately failing cell')\n```\n",
                   ["nbval-book"], "Cell execution caused an exception"),
    "glue_duplicate": ("```{code-cell} ipython3\nfor name in {'probe_twice': 1}:\n    glue(f'{name}', 1)\n```\n\n"
                       "```{code-cell} ipython3\nglue('probe_twice', 2)\n```\n",
                       ["nbval-book"], "glue key 'probe_twice' duplicate"),
    "broken_reference": ("See {ref}`a-label-nobody-defined`.\n", ["nbval-book"], "undefined label"),
    "missing_figure": ("```{figure} no_such_figure.png\nA figure whose file is missing.\n```\n",
                       ["nbval-book"], "image file not readable"),
    "table_as_text": ("```{code-cell} ipython3\n---\nmystnb:\n  markdown_format: commonmark\n---\n"
                      "display(Markdown('| a | b |\\n|---|---|\\n| 1 | 2 |'))\n```\n",
                      ["nbval-book", "browser-check"], "Markdown table(s) left as text"),
    "lone_value": ("```{code-cell} ipython3\n3.743408203125\n```\n",
                   ["nbval-book", "browser-check"], "lone value the page never explains"),
    "wide_output": ("```{code-cell} ipython3\nfrom IPython.display import HTML\n\n"
                    "display(HTML('<pre style=\"white-space: pre\">' + 'a line too wide ' * 40 + '</pre>'))\n```\n",
                    ["nbval-book", "browser-check"], "wider than the column"),
    "missing_table": ("```{code-cell} ipython3\n"
                      "display(Markdown('<!--\\n| hidden | table |\\n|---|---|\\n| 1 | 2 |\\n-->'))\n```\n",
                      ["nbval-book", "browser-check"], "but its source displays"),
    "swallowed_prose": ("1. **A point** with a bound, and\n   $$\n   a \\le b.\n   $$\n"
                        "   The part of the bound that belongs to the removed expert alone is here.\n"
                        "   $$\n   c = d\n   $$\n   and the rest.\n",
                        ["nbval-book", "browser-check"], "holding a run of prose"),
}


def make_book(folder: Path, extra: str) -> None:
    """A copy of the repository's build machinery in ``folder`` with the probe chapter (plus
    ``extra``) as its one chapter, written as a MyST notebook and its .ipynb twin."""
    for rel in COPIED:
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, folder / rel)  # copy2: the venv's stamp stays newer than pyproject.toml
    # The introduction's links to the real book's pages would dangle here: keep their text only.
    intro = folder / "book/intro.md"
    intro.write_text(PAGE_LINK.sub(r"\1", intro.read_text()))
    shutil.copystat(ROOT / "book/intro.md", intro)
    shutil.copytree(ROOT / ".ci", folder / ".ci", ignore=shutil.ignore_patterns("__pycache__"))
    for rel in ("_static", "_ext"):  # the stylesheet, the book's Sphinx extension
        if (ROOT / rel).is_dir():
            shutil.copytree(ROOT / rel, folder / rel, ignore=shutil.ignore_patterns("__pycache__"))
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config["exclude_patterns"] = [p for p in config["exclude_patterns"] if not p.startswith("book/")] + [
        f"{CHAPTER}.md"]
    (folder / "_config.yml").write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    (folder / "_toc.yml").write_text(f"format: jb-book\nroot: book/intro\nchapters:\n  - file: {CHAPTER}.ipynb\n"
                                     "  - file: book/references\n")
    text = PROBE_PAGE + "\n" + extra
    (folder / f"{CHAPTER}.md").write_text(text)
    jupytext.write(jupytext.reads(text, fmt="md:myst"), folder / f"{CHAPTER}.ipynb")


def run_case(name: str, venv: Path, keep: bool) -> tuple[str, bool, str]:
    """Run one case; (name, as expected, what to report)."""
    extra, targets, expected = CASES[name]
    folder = Path(tempfile.mkdtemp(prefix=f"book-selfcheck-{name}-"))
    t0 = time.monotonic()
    try:
        make_book(folder, extra)
        outputs, failed = [], None
        for target in targets:
            done = subprocess.run(["make", "-C", str(folder), target, f"VENV={venv}"], capture_output=True,
                                  text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
            outputs.append(done.stdout + done.stderr)
            if done.returncode:
                failed = target
                break
        log = "\n".join(outputs)
        seconds = time.monotonic() - t0
        if expected is None:
            ok = failed is None
            why = f"passed {' and '.join(targets)} ({seconds:.0f} s)" if ok else \
                f"`make {failed}` failed on a good book:\n{log[-4000:]}"
        else:
            ok = failed == targets[-1] and expected in log  # the last target, for its own reason
            why = (f"`make {failed}` failed with {expected!r} ({seconds:.0f} s)" if ok else
                   f"expected `make {targets[-1]}` to fail with {expected!r}, but it "
                   + ("passed" if failed is None else "failed for another reason") + f":\n{log[-4000:]}")
        return name, ok, why
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", help=f"which cases (default: all of {', '.join(CASES)})")
    parser.add_argument("--venv", type=Path, default=Path(sys.executable).parent.parent,
                        help="the venv whose packages build the books (default: this Python's)")
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary books")
    args = parser.parse_args(argv)
    cases = args.cases or list(CASES)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}: expected some of {', '.join(CASES)}")
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda case: run_case(case, args.venv.resolve(), args.keep), cases))
    for name, ok, why in results:
        print(f"book self-check: {name}: {'ok' if ok else 'FAILED'}: {why}", file=sys.stdout if ok else sys.stderr)
    bad = [name for name, ok, _ in results if not ok]
    print(f"book self-check: {len(results) - len(bad)}/{len(results)} case(s) as expected in "
          f"{time.monotonic() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
