"""Keep the book's chapter pairs honest.

Every chapter is written as ``book/NN_topic.md`` (MyST notebook) and committed together
with its jupytext twin ``book/NN_topic.ipynb``, which Colab opens and nbval runs. The
``.ipynb`` is committed without outputs. A chapter's checks are ``assert`` statements, so
nbval (``--nbval-lax``) and ``make book`` fail when a check fails; no stored output is needed.

    python .ci/notebooks.py check     # fail on drift, outputs, missing toc/config entries
    python .ci/notebooks.py strip     # drop every output and execution count

``make sync`` runs ``jupytext --sync`` and ``strip``; ``make test`` runs ``check``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import jupytext
import nbformat
import yaml

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"


def chapters() -> list[Path]:
    """The paired chapter sources book/NN_topic.md, in order."""
    return sorted(p for p in BOOK.glob("[0-9][0-9]_*.md"))


def strip(nb) -> bool:
    """Remove outputs, execution counts and timing metadata; True if anything changed."""
    before = nbformat.writes(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.metadata.pop("execution", None)
            cell.outputs = []
            cell.execution_count = None
    return nbformat.writes(nb) != before


def _cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def check() -> list[str]:
    problems = []
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    excluded = set(config.get("exclude_patterns", []))
    toc_text = (ROOT / "_toc.yml").read_text()
    for md in chapters():
        rel_md = md.relative_to(ROOT).as_posix()
        ipynb = md.with_suffix(".ipynb")
        rel_nb = ipynb.relative_to(ROOT).as_posix()
        text_nb = jupytext.read(md)
        formats = text_nb.metadata.get("jupytext", {}).get("formats", "")
        if "ipynb" not in formats.split(","):
            problems.append(f"{rel_md}: front matter must pair it with ipynb (formats: ipynb,md:myst)")
        if not ipynb.exists():
            problems.append(f"{rel_nb} is missing: run `make sync`")
            continue
        if rel_md not in excluded:
            problems.append(f"{rel_md} must be listed in exclude_patterns of _config.yml")
        if rel_nb not in toc_text and rel_nb[: -len(".ipynb")] not in toc_text:
            problems.append(f"{rel_nb} is not in _toc.yml")
        nb = nbformat.read(ipynb, as_version=4)
        if _cells(nb) != _cells(text_nb):
            problems.append(f"{rel_nb} and {rel_md} have drifted apart: run `make sync`")
        if strip(copy.deepcopy(nb)):
            problems.append(f"{rel_nb} has outputs or execution counts: run `make sync`")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["check", "strip"])
    args = parser.parse_args(argv)
    if args.command == "check":
        problems = check()
        for problem in problems:
            print("notebooks:", problem, file=sys.stderr)
        if not problems:
            print(f"notebooks: {len(chapters())} chapter pair(s) in sync, no stray outputs")
        return 1 if problems else 0
    for md in chapters():  # strip
        ipynb = md.with_suffix(".ipynb")
        if ipynb.exists():
            nb = nbformat.read(ipynb, as_version=4)
            if strip(nb):
                nbformat.write(nb, ipynb)
                print(f"stripped {ipynb.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
