"""Execute every chapter once: nbval runs it, and the book is built from what nbval's kernel computed.

`make test` runs every chapter under nbval (DESIGN.md §5) and builds the whole book the way
`make book` does (``jupyter-book build . -W -n --keep-going``). Executing the chapters twice would
double the longest step of CI, so the two share one execution:

1. **record** (a pytest plugin): ``pytest -p nbval_record --nbval-record DIR --nbval-lax ...`` runs
   the chapters under nbval as before; for each chapter whose every cell passed, it writes the
   notebook with the outputs that nbval collected from its kernel (streams, displays, figures,
   glue data) to ``DIR/<path of the chapter>``. A chapter with a failing cell is not written.
2. **cache**: ``python .ci/nbval_record.py cache DIR CACHE`` adds those notebooks to a jupyter-cache
   folder, keyed as myst-nb keys them (the code cells' source and the kernelspec), and writes
   ``CACHE/_config.yml``: the repository's ``_config.yml`` with ``execute_notebooks: cache`` and
   ``cache: CACHE``. ``jupyter-book build . --config CACHE/_config.yml -W -n --keep-going`` then
   takes every chapter's outputs from the cache: a glue key defined twice, a broken reference or a
   missing figure fails it as it fails `make book`.
3. **verify**: ``python .ci/nbval_record.py verify CACHE`` fails if the build executed a notebook
   itself (a cache miss: the chapter's cells differ from the ones nbval ran), so "executed once"
   stays true.

nbval ignores ``clear_output`` messages, so a cell that clears its output keeps everything it
printed before; no chapter clears its output (training progress bars are off in the chapters).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# 1. record: the pytest plugin


def pytest_addoption(parser):
    parser.addoption("--nbval-record", metavar="DIR", default=None,
                     help="write each chapter that passed, with the outputs nbval's kernel produced, "
                          "under DIR (.ci/nbval_record.py)")


class _Recorder:
    def __init__(self, out: Path, root: Path):
        self.out, self.root = out, root
        self.cells: dict[Path, dict[int, list]] = {}   # notebook -> code cell number -> outputs
        self.failed: set[Path] = set()
        self.written: list[Path] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if not hasattr(item, "cell_num") or not hasattr(item.parent, "nb"):
            return  # not an nbval cell
        report = outcome.get_result()
        path = Path(str(item.parent.fspath))
        if report.failed or report.skipped:
            self.failed.add(path)
        elif call.when == "call":
            self.cells.setdefault(path, {})[item.cell_num] = list(getattr(item, "test_outputs", []))

    def pytest_runtest_teardown(self, item, nextitem):
        """After a notebook's last cell: write it (if every cell passed)."""
        if not hasattr(item, "cell_num") or (nextitem is not None and nextitem.parent is item.parent):
            return
        path = Path(str(item.parent.fspath))
        if path not in self.failed:
            self.written.append(write_executed(item.parent.nb, self.cells.get(path, {}), path,
                                               self.out, self.root))

    def pytest_runtest_logreport(self, report):
        """Failures as the terminal sees them (under pytest-xdist the cells run in workers, and
        only their reports reach this process)."""
        if report.failed and ".ipynb" in report.nodeid:
            self.failed.add(Path(report.nodeid.split("::")[0]))

    def pytest_terminal_summary(self, terminalreporter):
        # Counted on disk: with pytest-xdist (make nbval-book runs the chapters two at a time) the
        # workers write the notebooks, not this process.
        written = sorted(self.out.rglob("*.ipynb")) if self.out.exists() else []
        terminalreporter.write_line(f"nbval-record: {len(written)} executed notebook(s) under "
                                    f"{self.out}" + (f"; not written (a cell failed): "
                                                     f"{', '.join(sorted(p.name for p in self.failed))}"
                                                     if self.failed else ""))


def pytest_configure(config):
    out = config.getoption("--nbval-record", default=None)
    if out:
        config.pluginmanager.register(_Recorder(Path(out).resolve(), Path(str(config.rootpath))), "nbval_recorder")


def quiet(source: str) -> bool:
    """Whether IPython hides the value of a cell that ends in ``;``. nbval executes each cell with
    ``store_history=False``, and IPython decides by the last cell *stored in its history*, so under
    nbval ``ax.set_title("...");`` printed ``Text(0.5, 1.0, '...')`` into CI's book while `make
    book` (nbclient) printed nothing. The recorder applies IPython's own rule to the cell itself."""
    from IPython.core.displayhook import DisplayHook

    try:
        return DisplayHook.semicolon_at_end_of_expression(source)
    except Exception:  # a cell that does not tokenize (IPython magics are fine; this is belt and braces)
        return False


def write_executed(nb, outputs: dict[int, list], path: Path, out: Path, root: Path) -> Path:
    """``nb`` with the recorded outputs of its code cells (numbered in order), written under ``out``
    at ``path``'s place relative to ``root``; the path written."""
    from ipykernel.ipkernel import IPythonKernel  # the kernel nbval ran (--nbval-current-env)

    executed = copy.deepcopy(nb)
    executed.metadata["language_info"] = dict(IPythonKernel.language_info)
    count = 0
    for cell in executed.cells:
        if cell.cell_type != "code":
            continue
        cell.outputs = [nbformat.from_dict(o) for o in outputs.get(count, [])
                        if not (o["output_type"] == "execute_result" and quiet(cell.source))]
        count += 1
        cell.execution_count = count
        for output in cell.outputs:
            if output.output_type == "execute_result":
                output.execution_count = count
    nbformat.validate(executed)
    target = out / path.resolve().relative_to(root.resolve())
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(executed, target)
    return target


# ---------------------------------------------------------------------------------------------
# 2. cache and 3. verify


def absolute_extension_paths(settings: dict, root: Path) -> dict:
    """Jupyter Book finds ``sphinx.local_extensions`` relative to the _config.yml it reads: a copy
    written elsewhere names them by absolute path (``root``: the original's folder)."""
    local = settings.get("sphinx", {}).get("local_extensions") or {}
    for name, path in local.items():
        local[name] = str((root / path).resolve())
    return settings


def cache(executed: Path, cache_dir: Path, config: Path = ROOT / "_config.yml") -> list[Path]:
    """Add every notebook under ``executed`` to the jupyter-cache at ``cache_dir`` (as the notebook
    of the same path under the repository) and write ``cache_dir/_config.yml``; the notebooks."""
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    store = get_cache(str(cache_dir))
    notebooks = sorted(executed.rglob("*.ipynb"))
    for nb_path in notebooks:
        nb = nbformat.read(nb_path, as_version=4)
        store.cache_notebook_bundle(CacheBundleIn(nb, str(ROOT / nb_path.relative_to(executed)),
                                                  data={"executed_by": "nbval"}),
                                    check_validity=False, overwrite=True)
    settings = yaml.safe_load(config.read_text())
    settings.setdefault("execute", {}).update(execute_notebooks="cache", cache=str(cache_dir.resolve()))
    absolute_extension_paths(settings, config.parent)
    (cache_dir / "_config.yml").write_text(
        "# Written by .ci/nbval_record.py: _config.yml with the chapters' outputs taken from nbval's run.\n"
        + yaml.safe_dump(settings, sort_keys=False, allow_unicode=True))
    return notebooks


def executed_by_build(cache_dir: Path) -> list[str]:
    """The notebooks that the book build executed itself (cache misses)."""
    from jupyter_cache import get_cache

    return sorted(record.uri for record in get_cache(str(cache_dir)).list_project_records())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("cache", help="cache the executed notebooks, write the build's _config.yml")
    c.add_argument("executed", type=Path)
    c.add_argument("cache_dir", type=Path)
    c.add_argument("--expect", type=int, help="fail unless exactly this many notebooks were recorded")
    v = sub.add_parser("verify", help="fail if the book build executed a notebook itself")
    v.add_argument("cache_dir", type=Path)
    args = parser.parse_args(argv)
    if args.command == "cache":
        notebooks = cache(args.executed, args.cache_dir)
        print(f"nbval-record: {len(notebooks)} executed notebook(s) cached in {args.cache_dir}; "
              f"the book build reads {args.cache_dir / '_config.yml'}")
        if args.expect is not None and len(notebooks) != args.expect:
            print(f"nbval-record: expected {args.expect} executed notebooks, found {len(notebooks)}", file=sys.stderr)
            return 1
        return 0
    executed = executed_by_build(args.cache_dir)
    if executed:
        print("nbval-record FAILED: the book build executed these notebooks again (their cells differ from the "
              "ones nbval ran, or nbval did not run them): " + ", ".join(executed), file=sys.stderr)
        return 1
    print("nbval-record: the book build executed no notebook (every chapter came from nbval's run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
