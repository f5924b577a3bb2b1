"""How long each page of the book takes to execute on this machine (issue 37: the instructor's page
glues these numbers).

Usage, from the repository root on an otherwise idle machine::

    .venv/bin/python mini_moe/results/chapter_times.py [--out mini_moe/results/chapter-times-<machine>.json]

Every ``book/NN_*.ipynb`` but the teaching page (which reads this file) is executed, one after
the other, in a fresh detached worktree of HEAD (so no run folder of an earlier execution is
reused: each chapter trains what it trains on a reader's first run), in one Jupyter kernel of this
environment started in the page's folder (as the book build does), with XLA's defaults. The file
records per page the wall seconds of the whole execution and the CPU seconds the kernel and its
children used, with the machine (:func:`mini_moe.bench.machine`) and the commit. The kernel imports
``mini_moe`` from that worktree (``PYTHONPATH``), so ``source_dirty`` only says whether the
checkout the command ran from held uncommitted changes; they do not reach the execution.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

import nbformat
from nbclient import NotebookClient

from mini_moe import bench

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEACHING = "15_teaching"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="the JSON file (default: chapter-times-<machine>.json here)")
    parser.add_argument("--machine", default="cpu-2core-epyc", help="the machine's label in the default file name")
    parser.add_argument("pages", nargs="*", help="only these pages (e.g. 14_labs), merged into the file's other "
                        "pages with their own commit; default: every book/NN_*.ipynb, a new file")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out or ROOT / "mini_moe" / "results" / f"chapter-times-{args.machine}.json")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "book", "mini_moe"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.strip())
    record = {"what": "wall and CPU seconds to execute each page of the book, one after the other, in a fresh "
                      "worktree (nothing trained beforehand)",
              "command": "python mini_moe/results/chapter_times.py", "machine": bench.machine(),
              "source_commit": commit, "source_dirty": dirty, "pages": {}}
    if args.pages and out.exists():
        # some pages again: the others keep their times, and each page re-timed names its own commit
        previous = json.loads(out.read_text())
        if previous["machine"]["cpu"] != record["machine"]["cpu"] or previous["machine"]["cores"] != record["machine"]["cores"]:
            sys.exit(f"{out} was measured on another machine ({previous['machine']['cpu']}); time every page here")
        record = previous
    with tempfile.TemporaryDirectory() as tmp:
        tree = pathlib.Path(tmp) / "book-tree"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), commit], cwd=ROOT, check=True)
        try:
            # the teaching page reads this file, so it is not timed itself
            pages = [p for p in sorted(tree.glob("book/[0-9][0-9]_*.ipynb")) if p.stem != TEACHING]
            if args.pages:
                pages = [p for p in pages if p.stem in args.pages]
            for page in pages:
                nb = nbformat.read(page, as_version=4)
                cpu, tick = _children_cpu(), time.perf_counter()
                NotebookClient(nb, timeout=3600, kernel_name="python3", resources={"metadata": {"path": str(page.parent)}}
                               ).execute(env={**os.environ, "PYTHONPATH": str(tree)})
                wall = time.perf_counter() - tick
                record["pages"][page.stem] = {"wall_seconds": round(wall, 1),
                                              "cpu_seconds": round(_children_cpu() - cpu, 1)}
                if args.pages:
                    record["pages"][page.stem] |= {"source_commit": commit, "source_dirty": dirty,
                                                   "date": bench.machine()["date"]}
                print(f"{page.stem}: {wall:.0f} s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
