"""Keep the book's chapter pairs honest.

Every chapter is written as ``book/NN_topic.md`` (MyST notebook) and committed together
with its jupytext twin ``book/NN_topic.ipynb``, which Colab opens and nbval runs. The
``.ipynb`` is committed without outputs, with one exception: a cell marked
``# NBVAL_CHECK_OUTPUT`` keeps the text it printed (and an execution count), because that
text is the reference nbval compares a fresh run against.

    python .ci/notebooks.py check     # fail on drift, stray outputs, missing toc/config entries
    python .ci/notebooks.py strip     # drop every output except the reference ones
    python .ci/notebooks.py refresh [--all]
                                      # run chapters whose reference outputs are missing
                                      # (or all of them) and store those outputs

``make sync`` runs ``jupytext --sync``, ``strip`` and ``refresh``; ``make test`` runs ``check``.
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
MARK = "# NBVAL_CHECK_OUTPUT"


def chapters() -> list[Path]:
    """The paired chapter sources book/NN_topic.md, in order."""
    return sorted(p for p in BOOK.glob("[0-9][0-9]_*.md"))


def is_reference_cell(cell) -> bool:
    return cell.cell_type == "code" and MARK in cell.source


def merged_streams(outputs):
    """Stream outputs only, consecutive ones of the same stream joined into one."""
    merged = []
    for out in outputs:
        if out.get("output_type") != "stream":
            continue
        if merged and merged[-1]["name"] == out["name"]:
            merged[-1]["text"] += out["text"]
        else:
            merged.append(nbformat.v4.new_output("stream", name=out["name"], text=out["text"]))
    return merged


def strip(nb) -> bool:
    """Remove outputs (except reference streams), execution counts and timing metadata."""
    before = nbformat.writes(nb)
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    for number, cell in enumerate(code_cells, start=1):
        cell.metadata.pop("execution", None)
        cell.outputs = merged_streams(cell.outputs) if is_reference_cell(cell) else []
        # nbval only compares cells that look executed, so a reference output keeps the
        # count a top-to-bottom run gives its cell; every other count is cleared.
        cell.execution_count = number if cell.outputs else None
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
        for i, cell in enumerate(nb.cells):
            if is_reference_cell(cell) and not cell.outputs:
                problems.append(f"{rel_nb} cell {i} ({MARK}) has no reference output: run `make sync`")
    return problems


def refresh(everything: bool) -> None:
    import nbclient

    for md in chapters():
        ipynb = md.with_suffix(".ipynb")
        nb = nbformat.read(ipynb, as_version=4)
        missing = any(is_reference_cell(c) and not c.outputs for c in nb.cells)
        if not (everything or missing):
            continue
        print(f"executing {ipynb.relative_to(ROOT)} to record its reference outputs", flush=True)
        run = copy.deepcopy(nb)
        nbclient.NotebookClient(run, timeout=600, resources={"metadata": {"path": str(BOOK)}}).execute()
        for cell, ran in zip(nb.cells, run.cells):
            if is_reference_cell(cell):
                cell.outputs = merged_streams(ran.outputs)
        strip(nb)
        nbformat.write(nb, ipynb)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["check", "strip", "refresh"])
    parser.add_argument("--all", action="store_true", help="refresh: run every chapter")
    args = parser.parse_args(argv)
    if args.command == "check":
        problems = check()
        for problem in problems:
            print("notebooks:", problem, file=sys.stderr)
        if not problems:
            print(f"notebooks: {len(chapters())} chapter pair(s) in sync, no stray outputs")
        return 1 if problems else 0
    if args.command == "strip":
        for md in chapters():
            ipynb = md.with_suffix(".ipynb")
            if ipynb.exists():
                nb = nbformat.read(ipynb, as_version=4)
                if strip(nb):
                    nbformat.write(nb, ipynb)
                    print(f"stripped {ipynb.relative_to(ROOT)}")
        return 0
    refresh(args.all)
    return 0


if __name__ == "__main__":
    sys.exit(main())
