"""CI's check of the labs page (book/14_labs.ipynb, issue 37): it is executed twice.

* **As published, with the stubs:** every check cell must report "not implemented yet" for its
  lab, with no error output (a student's first run shows no traceback wall).
* **With the reference solutions:** each cell tagged ``lab-stub`` is replaced by the library's own
  function for that lab (``labs.LABS[name].reference``, never a copy), and every check must pass.

Before executing, it checks that the page holds one stub per lab of ``mini_moe.labs.LABS``, each
exactly ``Lab.stub()``, followed by a check cell for the same lab. Exit status 1 on any failure.

``--stubs-only`` (``make labs``, so ``make test``) leaves out the run with the solutions, 87 of the
98 s on one core of a 2-core AMD EPYC: with the page's structure checked here, each check cell is
exactly ``print(labs.check(NAME, FUNCTION))``, and the unit tests compute that same call with the
reference in both of CI's unit runs (tests/test_labs.py::test_the_library_passes_its_own_lab), so
the run repeats it. ``.ci/colab_stack.py`` keeps both runs (on Colab's older stack no unit test runs).

    .venv/bin/python .ci/labs.py [--notebook book/14_labs.ipynb] [--stubs-only]
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from mini_moe import labs

ROOT = Path(__file__).resolve().parent.parent
CHECK = re.compile(r'^print\(labs\.check\("([^"]+)", (\w+)\)\)$')


def lab_cells(nb) -> list[tuple[int, int, str]]:
    """``(stub index, check index, lab name)`` per lab, after checking the page's structure."""
    found, problems = [], []
    cells = nb.cells
    for i, cell in enumerate(cells):
        if "lab-stub" not in cell.metadata.get("tags", []):
            continue
        nxt = cells[i + 1] if i + 1 < len(cells) else None
        match = CHECK.match(nxt.source.strip()) if nxt is not None and nxt.cell_type == "code" else None
        if match is None:
            problems.append(f"cell {i}: a lab-stub cell must be followed by `print(labs.check(\"chNN.name\", name))`")
            continue
        name, function = match.groups()
        lab = labs.LABS.get(name)
        if lab is None or lab.function != function:
            problems.append(f"cell {i + 1}: {name!r} / {function!r} is not a lab of mini_moe.labs")
        elif cell.source.strip() != lab.stub().strip():
            problems.append(f"cell {i}: the stub of {name} differs from labs.LABS[{name!r}].stub()")
        found.append((i, i + 1, name))
    names = [name for _, _, name in found]
    missing = sorted(set(labs.LABS) - set(names))
    twice = sorted({n for n in names if names.count(n) > 1})
    if missing:
        problems.append(f"labs without a stub on the page: {', '.join(missing)}")
    if twice:
        problems.append(f"labs with more than one stub: {', '.join(twice)}")
    if problems:
        raise SystemExit("labs page:\n  " + "\n  ".join(problems))
    return found


def execute(nb, label: str):
    tick = time.perf_counter()
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "book")}}).execute()
    print(f"labs: executed the page {label} in {time.perf_counter() - tick:.0f} s", flush=True)
    return nb


def printed(cell) -> str:
    errors = [o for o in cell.outputs if o.output_type == "error"]
    if errors:
        return f"<error {errors[0].ename}: {errors[0].evalue}>"
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--notebook", default=str(ROOT / "book" / "14_labs.ipynb"))
    parser.add_argument("--stubs-only", action="store_true",
                        help="execute the page with its stubs only (the unit tests pass each lab's reference)")
    args = parser.parse_args(argv)
    page = nbformat.read(args.notebook, as_version=4)
    cells = lab_cells(page)
    failures = []

    stubbed = execute(copy.deepcopy(page), "with the stubs")
    for _, check, name in cells:
        out = printed(stubbed.cells[check])
        if out.strip() != f"{name}: NOT IMPLEMENTED (0 cases)\nnot implemented yet: fill in the function's body.":
            failures.append(f"stub run, {name}: expected 'not implemented yet', got {out.strip()[:300]!r}")

    if args.stubs_only:
        return report(failures, f"{len(cells)} labs, each 'not implemented yet' with its stub (solutions: "
                                "tests/test_labs.py::test_the_library_passes_its_own_lab)")
    solved = copy.deepcopy(page)
    for stub, _, name in cells:
        solved.cells[stub].source = f"{labs.LABS[name].function} = labs.LABS[{name!r}].reference  # CI: the solution"
    solved = execute(solved, "with the reference solutions")
    for _, check, name in cells:
        out = printed(solved.cells[check])
        if not out.startswith(f"{name}: passed ("):
            failures.append(f"solution run, {name}: expected 'passed', got {out.strip()[:300]!r}")

    return report(failures, f"{len(cells)} labs, each 'not implemented yet' with its stub and passed with the "
                            "library's solution")


def report(failures: list[str], success: str) -> int:
    if failures:
        print("labs: FAILED\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print(f"labs: {success}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
