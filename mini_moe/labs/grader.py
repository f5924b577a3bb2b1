"""The grader: a student's file, or a class's folder, checked lab by lab, each lab in a sandboxed
process of its own (:mod:`mini_moe.labs.worker` says what the sandbox holds back).

Whoever audits the grader reads this file and the worker. The rules it keeps:

* **a submission reaches no verdict but its outputs**: the worker hands back arrays and short
  texts; every verdict is computed here, and every text from the worker is shown as one line of
  printable characters (:func:`mini_moe.labs.text`);
* **a bad submission costs only its own row**: whatever a file holds or its process does
  (returns a string, writes a forged or oversized output, is not UTF-8, kills its process), the
  student's row says ``error``, ``failed`` or ``timed out`` with the reason, and the others are
  graded; the gradebook is written row by row, so a crash of the grader keeps what was done;
* **students are kept apart**: each student's files and each lab's job live in a folder of their
  own, and under Landlock a lab's process reads and writes only its own job folder;
* **nothing outlives its lab**: the no-fork filter stops a submission from starting a process,
  and the job's process group is killed when the lab ends, however it ends.

``grade`` requires Landlock (Linux 5.13+) unless told otherwise (``sandbox="best"``, the CLI's
``--unsandboxed``): without it a submission runs with the student's rights, and could read the
library or other submissions and write the grader's files. Page 15 of the book compares this with
otter-grader and nbgrader.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time

import numpy as np

from mini_moe.labs import REFUSED, Result, _cases, _grade, _lab, _static, status, text
from mini_moe.validate import InputError

#: The seconds a submission's process may run for one lab, and the memory (GiB) it may take.
TIMEOUT, MEMORY_GIB = 120.0, 4.0
#: The largest submission read (bytes), the largest output file of one case the grader opens, and
#: the largest file a submission's process may write.
MAX_SOURCE_BYTES, MAX_OUTPUT_BYTES, MAX_FILE_BYTES = 1 << 20, 64 << 20, 256 << 20
#: A notebook's code runs after these imports (the labs page imports them in a cell that also
#: imports mini_moe, which the grader leaves out).
NOTEBOOK_PREAMBLE = "import math\n\nimport jax\nimport jax.numpy as jnp\nimport numpy as np\n\n"


@dataclasses.dataclass(frozen=True)
class Submission:
    """A student's file made ready for the grader: ``source`` is a Python file holding its code (a
    notebook's code cells, see :func:`read_submission`), ``labs`` the labs whose functions it defines,
    ``dropped`` the first lines of the notebook statements left out (they use the library)."""

    student: str
    path: str
    source: str
    labs: tuple[str, ...]
    uses_library: bool
    dropped: tuple[str, ...] = ()


def _decode(path: pathlib.Path) -> str:
    """A ``.py`` file's text: UTF-8 or the coding it declares (PEP 263), like Python reads it."""
    import io
    import tokenize

    raw = path.read_bytes()
    if len(raw) > MAX_SOURCE_BYTES:
        raise InputError(f"{path.name} is {len(raw):,} bytes; a submission may hold at most {MAX_SOURCE_BYTES:,}.")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        return raw.decode(encoding)
    except (SyntaxError, LookupError, UnicodeDecodeError) as e:
        raise InputError(f"{path.name} is not UTF-8 text (nor in the coding its first lines declare): "
                         f"{text(e, 160)}. Save it as UTF-8.") from None


def _uses_library(statement, names: set) -> bool:
    """Whether a top-level statement imports mini_moe or uses a name in ``names`` (``labs``,
    ``mini_moe``, and what earlier dropped statements bound, e.g. ``bench``), also inside
    ``print(...)``. A function or class definition never counts (its body runs only if called).
    A statement that counts adds the names it binds to ``names``."""
    import ast

    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return False
    uses = False
    for node in ast.walk(statement):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "mini_moe" for a in node.names):
            uses = True
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mini_moe":
            uses = True
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names:
            uses = True
    if uses:
        for node in ast.walk(statement):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return uses


def _main_guard(statement) -> bool:
    """``if __name__ == "__main__":``, a block that never runs under the grader."""
    import ast

    test = getattr(statement, "test", None)
    return (isinstance(statement, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and len(test.comparators) == 1
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == "__main__")


def _notebook_code(path: pathlib.Path) -> tuple[str, tuple[str, ...]]:
    """A notebook's code cells as one file, without the statements that use the library (the labs
    page's install, import and check cells) and without IPython magics; and those statements' first
    lines. A cell that does not parse is kept whole (its error is then reported)."""
    import ast

    raw = path.read_bytes()
    if len(raw) > 20 * MAX_SOURCE_BYTES:
        raise InputError(f"{path.name} is {len(raw):,} bytes; a notebook may hold at most {20 * MAX_SOURCE_BYTES:,}.")
    try:  # nbformat 4 is JSON: cells of a type and a source (a string or its lines)
        cells = [c["source"] if isinstance(c["source"], str) else "".join(c["source"])
                 for c in json.loads(raw.decode("utf-8"))["cells"] if c.get("cell_type") == "code"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InputError(f"{path.name} is not a readable notebook ({type(e).__name__}: {text(e, 160)}).") from None
    kept, dropped, names = [], [], {"mini_moe", "labs"}
    for cell in cells:
        code = "\n".join(line for line in cell.splitlines() if not line.lstrip().startswith(("%", "!")))
        try:
            tree = ast.parse(code)
        except SyntaxError:
            kept.append(code)
            continue
        lines = code.splitlines()
        out = []
        for statement in tree.body:
            segment = "\n".join(lines[statement.lineno - 1:statement.end_lineno])
            if _uses_library(statement, names):
                dropped.append(text(lines[statement.lineno - 1].strip(), 120))
            else:
                out.append(segment)
        kept.append("\n".join(out))
    return NOTEBOOK_PREAMBLE + "\n\n".join(kept) + "\n", tuple(dropped)


def read_submission(path, folder) -> Submission:
    """Read a student's ``.py`` file, or the ``.ipynb`` they filled in, into ``folder`` (as
    ``submission.py``).

    Of a notebook, the code cells are kept but for the statements that use the library (they are
    listed in ``dropped``), IPython magics are dropped, and :data:`NOTEBOOK_PREAMBLE` comes first.
    Raises ``InputError`` (never anything else) for a missing or oversized file, one that is not
    UTF-8 Python or a notebook, or one that defines no lab function."""
    import ast

    path = pathlib.Path(path)
    if not path.is_file():
        raise InputError(f"{path} is not a file; pass the student's .py file or filled-in .ipynb.")
    dropped: tuple[str, ...] = ()
    try:
        if path.suffix == ".ipynb":
            code, dropped = _notebook_code(path)
        elif path.suffix == ".py":
            code = _decode(path)
        else:
            raise InputError(f"{path}: expected a .py file or an .ipynb notebook.")
        tree = ast.parse(code, filename="submission.py")
    except SyntaxError as e:
        raise InputError(f"{path.name} does not run: SyntaxError: {text(e.msg, 160)} (line {e.lineno}).") from None
    except (OSError, ValueError, RecursionError, MemoryError) as e:
        if isinstance(e, InputError):
            raise
        raise InputError(f"{path.name} cannot be read: {type(e).__name__}: {text(e, 160)}.") from None
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    defined |= {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Name)}
    from mini_moe.labs import LABS

    names = tuple(sorted(name for name, lab in LABS.items() if lab.function in defined))
    if not names:
        raise InputError(f"{path.name} defines no lab function; expected one of: "
                         f"{', '.join(sorted(LABS[n].function for n in LABS))}.")
    # An import of mini_moe where it runs (not under `if __name__ == "__main__":`, not in a docstring):
    # refused up front with the reason. The sandbox keeps the library out of reach in any case.
    uses = any(isinstance(node, ast.Import) and any(a.name.split(".")[0] == "mini_moe" for a in node.names)
               or isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mini_moe"
               for top in tree.body if not _main_guard(top) for node in ast.walk(top))
    source = pathlib.Path(folder) / "submission.py"
    source.write_text(code, encoding="utf-8")
    return Submission(path.stem, str(path), str(source), names, uses, dropped)


# ------------------------------------------------------------------------- what a lab's process sees


def _package_entries() -> list[pathlib.Path]:
    """Every entry of the installed packages' folders but ``mini_moe``'s, an editable install's
    finder and the ``.pth`` files (which could put the library back on the path)."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    out = []
    for directory in map(pathlib.Path, sorted({*site.getsitepackages(), paths["purelib"], paths["platlib"]})):
        for entry in sorted(directory.iterdir()) if directory.is_dir() else []:
            key = entry.name.lower().replace("-", "_")
            if not (key.startswith(("mini_moe", "__editable__")) or entry.suffix == ".pth"):
                out.append(entry)
    return out


def readable_paths() -> list[str]:
    """What a lab's process may read under Landlock: the standard library and every entry of the
    installed packages' folders but ``mini_moe`` (and an editable install's finder and ``.pth``
    files). A folder that holds the library's source is never among them."""
    import importlib.util
    import sysconfig

    paths = sysconfig.get_paths()
    found = importlib.util.find_spec("mini_moe")
    library = pathlib.Path(found.origin).resolve().parent if found and found.origin else None
    out = [str(pathlib.Path(paths[key]).resolve()) for key in ("stdlib", "platstdlib")]
    out += [str(entry.resolve()) for entry in _package_entries()]
    if library is not None:  # e.g. the standard library's folder holding an installed mini_moe
        out = [p for p in out if not library.is_relative_to(p)]
    return list(dict.fromkeys(out))


def _library_free_path(folder) -> list[str]:
    """A ``sys.path`` for a lab's process: the standard library and every installed package but
    ``mini_moe`` (a folder of links to site-packages' entries, without mini_moe's and without the
    ``.pth`` files that an editable install adds). One per job, so no job can change another's."""
    import sys

    base = pathlib.Path(sys.base_prefix).resolve()
    stdlib = [p for p in sys.path if p and "-packages" not in p and pathlib.Path(p).resolve().is_relative_to(base)]
    links = pathlib.Path(folder) / "site-packages"
    links.mkdir(exist_ok=True)
    for entry in _package_entries():
        if not (links / entry.name).exists():
            (links / entry.name).symlink_to(entry)
    return [p for p in dict.fromkeys(stdlib) if pathlib.Path(p).is_dir()] + [str(links)]


def sandbox_available() -> dict:
    """What the sandbox can enforce on this machine: ``{"landlock": ABI or 0, "no_fork": bool}``."""
    from mini_moe.labs import worker

    return {"landlock": worker.landlock_abi(), "no_fork": worker.seccomp_arch() is not None}


# ------------------------------------------------------------------------------------- one lab


def run_sandboxed(name: str, submission: Submission, folder, *, seed: int = 0, timeout: float = TIMEOUT,
                  memory_gib: float = MEMORY_GIB, require: dict | None = None, sys_path: list[str] | None = None,
                  readable: list[str] = ()) -> Result:
    """Check lab ``name`` of ``submission`` with the student's code in a sandboxed process of its own,
    in the job folder ``folder/job-<name>``.

    That process (``python -I -S``, :mod:`mini_moe.labs.worker`) cannot import mini_moe, has
    ``timeout`` seconds and ``memory_gib`` GiB of address space, is confined as the worker says
    (``require``: the parts that must hold, else the lab is an ``error``), and hands back only
    arrays and text; the verdict is computed here. Whatever the student's code does (exit, loop,
    patch the grader, print a verdict, fork), it reaches no verdict but its outputs, and every
    process of the job is killed when it ends. ``sys_path`` and ``readable`` replace the process's
    ``sys.path`` and add paths it may read: for timing the grader on the library's own functions
    (``mini_moe/results/lab_grading.py``), never for grading."""
    import shutil
    import signal
    import subprocess
    import sys

    lab = _lab(name)
    tick = time.perf_counter()
    if submission.uses_library:
        return Result(name, False, 0, REFUSED, round(time.perf_counter() - tick, 3), status="refused")
    job = pathlib.Path(folder) / f"job-{name}"
    job.mkdir(parents=True)
    worker = job / "labs_worker.py"  # a fresh copy in the job's own folder: no submission can replace it
    shutil.copy(pathlib.Path(__file__).with_name("worker.py"), worker)
    cases = _cases(lab, seed)
    arrays, described = {}, []
    for i, (label, kwargs) in enumerate(cases):
        entry = {}
        for key, value in kwargs.items():
            if isinstance(value, np.ndarray):
                arrays[f"{i}_{key}"] = value
                entry[key] = {"array": f"{i}_{key}"}
            else:
                entry[key] = {"value": value}
        described.append({"label": label, "kwargs": entry, "static": _static(kwargs)})
    np.savez(job / "inputs.npz", **arrays)
    (job / "job.json").write_text(json.dumps({
        "source": submission.source, "function": lab.function, "cases": described,
        "sys_path": sys_path if sys_path is not None else _library_free_path(job),
        "readable": readable_paths() + [str(p) for p in readable], "require": require or {},
        # set by the worker before it loads the submission (CPU seconds: a backstop to the wall clock)
        "limits": {"memory_bytes": int(memory_gib * (1 << 30)), "cpu_seconds": int(timeout * (os.cpu_count() or 1)) + 10,
                   "file_bytes": MAX_FILE_BYTES}}))
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(job), "JAX_PLATFORMS": "cpu",
           **{k: v for k, v in os.environ.items() if k.startswith(("XLA_", "OPENBLAS_", "OMP_"))}}
    proc = subprocess.Popen([sys.executable, "-I", "-S", str(worker), str(job)], cwd=job, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        proc.wait(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # the whole group, also after a normal exit: a child left behind dies with its lab
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    try:
        runs = _read_runs(job, len(cases), timed_out, timeout)
        if runs and "sandbox_failed" in runs[0]:
            result = Result(name, False, 0, f"error: the sandbox could not be set up: {text(runs[0]['sandbox_failed'])}",
                            status="error")
        else:
            result = _grade(lab, cases, runs, seed)
    except Exception as e:  # a bug of the grader's own, on this submission's data: this row only
        result = Result(name, False, 0, f"error: the grader could not judge the outputs ({type(e).__name__}: "
                        f"{text(e, 200)})", status="error")
    return dataclasses.replace(result, seconds=round(time.perf_counter() - tick, 3))


def _read_runs(job, count: int, timed_out: bool, timeout: float) -> list[dict]:
    """What the lab's process wrote, as :func:`mini_moe.labs._grade` reads it. Its files are data from
    an untrusted process: JSON of a known shape and arrays of numbers within a size bound; anything
    else ends the run as "lost", with the reason."""
    runs: dict[int, dict] = {}
    path = job / "cases.jsonl"
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 20)
    except OSError:
        raw = b""
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            entry = json.loads(line)
            i = int(entry["case"])
            if "sandbox_failed" in entry:
                return [{"sandbox_failed": str(entry["sandbox_failed"])}]
            if "sandbox" in entry:
                continue
            if "load" in entry:
                return [{"load": _clean(entry["load"])}]
            if "stopped" in entry:
                runs[i] = {"stopped": _clean(entry["stopped"])}
            elif "result" in entry:
                runs[i] = _outputs(job, i, entry["result"])
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            break
    out = []
    for i in range(count):
        if i in runs:
            out.append(runs[i])
            if "stopped" in runs[i] or "lost" in runs[i]:
                break
        else:
            out.append({"timeout": timeout} if timed_out else {"lost": "no record of this case"})
            break
    return out


def _clean(error) -> dict:
    return {"error": text(error["error"], 80), "message": text(error["message"], 400), "where": text(error["where"], 300)}


def _outputs(job, i: int, result: dict) -> dict:
    """Case ``i``'s outputs from ``case-<i>.npz``, read only if it is a plain (stored, not compressed)
    archive of at most :data:`MAX_OUTPUT_BYTES` whose arrays' headers promise no more bytes than the
    archive holds; else ``{"lost": why}``."""
    import zipfile

    path = job / f"case-{i}.npz"
    run = {}
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_OUTPUT_BYTES:
            return {"lost": f"its output file case-{i}.npz is missing, a link, or over {MAX_OUTPUT_BYTES:,} bytes"}
        with zipfile.ZipFile(path) as archive:
            for member in archive.infolist():
                if member.compress_type != zipfile.ZIP_STORED or member.file_size > MAX_OUTPUT_BYTES:
                    return {"lost": f"its output file case-{i}.npz is not a plain archive of arrays"}
                with archive.open(member) as f:
                    version = np.lib.format.read_magic(f)
                    if version not in ((1, 0), (2, 0)):
                        return {"lost": f"its output file case-{i}.npz holds an array of an unknown format"}
                    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                    shape, _, dtype = read(f)
                    if dtype.hasobject or int(np.prod(shape, dtype=np.int64)) * dtype.itemsize > member.file_size:
                        return {"lost": f"its output file case-{i}.npz holds an array that is not numbers or "
                                        "larger than its data"}
        with np.load(path, allow_pickle=False) as arrays:
            for mode in ("eager", "jit"):
                if mode not in result:
                    continue
                if "error" in result[mode]:
                    run[mode] = _clean(result[mode])
                else:
                    count = int(result[mode]["count"])
                    if not 0 <= count <= 64:
                        return {"lost": "its record names more outputs than a lab has"}
                    run[mode] = {"outputs": [np.asarray(arrays[f"{mode}_{j}"]) for j in range(count)]}
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile, EOFError) as e:
        return {"lost": f"its output file case-{i}.npz cannot be read ({type(e).__name__})"}
    if "eager" not in run:
        return {"lost": "its record has no eager result"}
    return run


# ------------------------------------------------------------------------------ a file, a class


def _require(sandbox: str) -> dict:
    """``sandbox``: "required" (Landlock and, where written, the no-fork filter must hold, else an
    ``InputError`` before anything runs) or "best" (whatever this machine offers)."""
    if sandbox not in ("required", "best"):
        raise InputError(f"sandbox must be 'required' or 'best', got {sandbox!r}.")
    if sandbox == "best":
        return {}
    have = sandbox_available()
    if not have["landlock"]:
        raise InputError("grading needs Linux's Landlock (kernel 5.13 or later) to keep each submission from the "
                         "library, the grader and the other students; this machine does not offer it. Grade on Linux, "
                         "or pass --unsandboxed (sandbox='best') to grade with only the process limits (book page 15).")
    return {"landlock": True, "no_fork": have["no_fork"]}


def check_file(path, *, seed: int = 0, timeout: float = TIMEOUT, memory_gib: float = MEMORY_GIB,
               jobs: int = 1, sandbox: str = "best") -> list[Result]:
    """Check every lab function that a student's ``.py`` file or filled-in ``.ipynb`` defines, each
    in a process of its own (:func:`run_sandboxed`), ``jobs`` at a time; ``sandbox`` as in :func:`grade`
    (default "best": a student checking their own file)."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    require = _require(sandbox)
    with tempfile.TemporaryDirectory() as folder:
        submission = read_submission(path, folder)
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            return list(pool.map(lambda name: run_sandboxed(name, submission, folder, seed=seed, timeout=timeout,
                                                            memory_gib=memory_gib, require=require),
                                 submission.labs))


#: The gradebook's columns.
COLUMNS = ("student", "file", "lab", "status", "cases", "seconds", "message")


def _cell(value) -> str:
    """A gradebook cell that a spreadsheet shows as text: a leading ``=``, ``+``, ``-``, ``@``, tab or
    carriage return (a formula) gets a ``'`` before it (OWASP's advice on CSV injection)."""
    value = text(value, 500)
    return "'" + value if value[:1] in ("=", "+", "-", "@", "\t", "\r") else value


def write_gradebook(rows: list[dict], path) -> None:
    """Write ``rows`` as the gradebook CSV at ``path`` (:data:`COLUMNS`; every cell made safe by
    ``_cell``), through a temporary file, so a reader never sees half of it."""
    import csv

    path = pathlib.Path(path)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows({k: _cell(row[k]) for k in COLUMNS} for row in rows)
    partial.replace(path)


def grade(folder, *, seed: int = 0, timeout: float = TIMEOUT, memory_gib: float = MEMORY_GIB,
          jobs: int | None = None, out=None, sandbox: str = "required") -> list[dict]:
    """Grade a class: every ``.py`` or ``.ipynb`` in ``folder`` (or one in each of its sub-folders,
    named after the student) is a submission. Returns one row per student and lab: ``student``,
    ``file``, ``lab``, ``status`` (:data:`mini_moe.labs.STATUSES`; ``error`` with lab empty for a file
    that cannot be graded), ``cases``, ``seconds``, ``message`` (its first line). The labs run
    ``jobs`` at a time (default: the cores), each in its own sandboxed process; with ``out``, the
    gradebook CSV is rewritten there as each row comes in. ``sandbox``: "required" (default; see
    the module's docstring) or "best"."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor, as_completed

    require = _require(sandbox)
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder} is not a folder of submissions.")
    files = sorted(p for p in folder.iterdir() if p.suffix in (".py", ".ipynb") and p.is_file() and not p.is_symlink())
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()):
        found = sorted(p for p in sub.iterdir() if p.suffix in (".py", ".ipynb") and p.is_file() and not p.is_symlink())
        files += found[:1]
    if not files:
        raise InputError(f"{folder} holds no .py or .ipynb submission (directly or one per sub-folder).")
    rows, tasks = [], []

    def add(row: dict) -> None:
        rows.append(row)
        if out is not None:
            write_gradebook(sorted(rows, key=lambda r: (r["student"], r["lab"])), out)

    with tempfile.TemporaryDirectory() as tmp:
        for i, path in enumerate(files):
            student = path.parent.name if path.parent != folder else path.stem
            work = pathlib.Path(tmp) / f"s{i}"  # this student's own folder
            work.mkdir(mode=0o700)
            try:
                submission = dataclasses.replace(read_submission(path, work), student=student)
            except Exception as e:  # noqa: BLE001 - whatever the file is, it costs only its row
                message = str(e) if isinstance(e, InputError) else f"cannot be read: {type(e).__name__}: {e}"
                add({"student": student, "file": path.name, "lab": "", "status": "error", "cases": 0,
                     "seconds": 0.0, "message": text(message.splitlines()[0] if message else "", 300)})
                continue
            tasks += [(submission, work, name) for name in submission.labs]

        def one(task):
            submission, work, name = task
            try:
                return submission, run_sandboxed(name, submission, work, seed=seed, timeout=timeout,
                                                 memory_gib=memory_gib, require=require)
            except Exception as e:  # noqa: BLE001 - the grader's own failure on this lab: its row says so
                return submission, Result(name, False, 0, f"error: {type(e).__name__}: {text(e, 200)}", status="error")

        with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
            for future in as_completed([pool.submit(one, t) for t in tasks]):
                submission, r = future.result()
                add({"student": submission.student, "file": pathlib.Path(submission.path).name,
                     "lab": r.lab, "status": status(r), "cases": r.cases, "seconds": r.seconds,
                     "message": text(r.message.splitlines()[0] if r.message else "", 300)})
    return sorted(rows, key=lambda row: (row["student"], row["lab"]))
