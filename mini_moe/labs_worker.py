"""Runs a student's lab function on the grader's inputs and hands back only data (arrays, text).

This module imports nothing of ``mini_moe``: the grader (:func:`mini_moe.labs.check_file`) copies
it into a temporary folder and runs it as a script in a separate process, where the library is not
importable, with a time and a memory limit. :func:`mini_moe.labs.check` imports it to call a
function the same way in its own process (practice in a notebook).

As a script: ``python -I -S labs_worker.py JOB``, where the folder ``JOB`` holds ``job.json``
(the submission's file, the function's name, the lab's cases, which arguments are static, the
``sys.path`` to use) and ``inputs.npz`` (the cases' arrays). For each case it writes
``case-<i>.npz`` (the outputs) and one line of ``cases.jsonl`` (what happened), as it goes, so the
grader knows how far it got if the process is killed or exits early.
"""

from __future__ import annotations

import json
import sys
import traceback

#: The longest error message handed back.
MAX_MESSAGE = 400


def where(error: BaseException, source: str | None) -> str:
    """The line of the student's file where ``error`` arose ("file.py, line 5: code"), else the
    innermost line of the traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if source and f.filename == source]
    frame = (mine or frames or [None])[-1]
    if frame is None:
        return ""
    name = frame.filename.replace("\\", "/").rsplit("/", 1)[-1]
    return f"{name}, line {frame.lineno}: {(frame.line or '').strip()}"


def describe(error: BaseException, source: str | None) -> dict:
    """What ``error`` was, as data: its type's name, the first line of its message, and :func:`where`."""
    message = str(error).splitlines()[0] if str(error) else ""
    return {"error": type(error).__name__, "message": message[:MAX_MESSAGE], "where": where(error, source)}


def outputs(value) -> list:
    """The arrays of an output (a tuple of arrays, one array, a scalar; None: no array)."""
    import jax
    import numpy as np

    return [np.asarray(leaf) for leaf in jax.tree.leaves(value)]


def run_case(fn, kwargs: dict, static: list[str], source: str | None = None) -> dict:
    """Call ``fn(**kwargs)`` eagerly, then under ``jax.jit`` with the ``static`` arguments static,
    each on its own copy of the inputs. Returns ``{"eager": outcome, "jit": outcome}`` where an
    outcome is ``{"outputs": [arrays]}`` or :func:`describe` of what it raised. A function that
    raises eagerly is not tried under jit."""
    import copy

    import jax

    result = {}
    for mode in ("eager", "jit"):
        try:
            call = fn if mode == "eager" else jax.jit(fn, static_argnames=static)
            result[mode] = {"outputs": outputs(call(**copy.deepcopy(kwargs)))}
        except Exception as error:  # the student's code raised: say what and where
            result[mode] = describe(error, source)
            if mode == "eager":  # the eager call decides; jit is only tried on a function that runs
                break
    return result


def main(job_dir: str) -> int:
    """Run one lab's cases of the submission in ``job_dir`` (see the module's docstring)."""
    import pathlib

    job_dir = pathlib.Path(job_dir)
    job = json.loads((job_dir / "job.json").read_text())
    sys.path[:] = job["sys_path"]  # the library's folder is not on it: it cannot be imported
    import resource

    memory, cpu = job["limits"]["memory_bytes"], job["limits"]["cpu_seconds"]
    for kind, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu)):
        try:
            resource.setrlimit(kind, (value, value))
        except (ValueError, OSError):  # macOS refuses RLIMIT_AS: there only the wall clock limits it
            pass
    import runpy

    import numpy as np

    log = open(job_dir / "cases.jsonl", "a")

    def record(entry: dict) -> None:
        log.write(json.dumps(entry) + "\n")
        log.flush()

    try:
        namespace = runpy.run_path(job["source"], run_name="submission")
    except BaseException as error:  # SystemExit too: the file did not load
        record({"case": -1, "load": describe(error, job["source"])})
        return 0
    fn = namespace.get(job["function"])
    if not callable(fn):
        record({"case": -1, "load": {"error": "NameError", "message": f"the file defines no {job['function']}",
                                     "where": ""}})
        return 0
    with np.load(job_dir / "inputs.npz", allow_pickle=False) as arrays:
        inputs = {key: arrays[key] for key in arrays.files}
    for i, case in enumerate(job["cases"]):
        kwargs = {k: inputs[v["array"]] if "array" in v else v["value"] for k, v in case["kwargs"].items()}
        record({"case": i, "started": True})
        try:
            result = run_case(fn, kwargs, case["static"], job["source"])
        except BaseException as error:  # SystemExit or KeyboardInterrupt inside the student's function
            record({"case": i, "stopped": describe(error, job["source"])})
            return 0
        arrays = {f"{mode}_{j}": a for mode, r in result.items() for j, a in enumerate(r.get("outputs", []))}
        try:
            np.savez(job_dir / f"case-{i}.npz", **arrays)
        except (ValueError, TypeError) as error:  # e.g. an object array: not something the grader reads
            result = {mode: {"error": "TypeError", "message": f"the output is not an array of numbers ({error})",
                             "where": ""} for mode in result}
        record({"case": i, "result": {mode: {k: v for k, v in r.items() if k != "outputs"} | (
            {"count": len(r["outputs"])} if "outputs" in r else {}) for mode, r in result.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
