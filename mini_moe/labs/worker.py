"""Runs a student's lab function on the grader's inputs, confined, and hands back only data.

This module imports nothing of ``mini_moe`` (only Python's standard library, then NumPy and JAX):
the grader (:mod:`mini_moe.labs.grader`) copies it into each lab's job folder and runs it as a
script, ``python -I -S labs_worker.py JOB``, in a process of its own. :func:`mini_moe.labs.check`
imports it to call a function the same way in the notebook's process (practice, no sandbox).

The folder ``JOB`` holds ``job.json`` (the submission's file, the function's name, the lab's
cases, which arguments are static, the ``sys.path`` to use, the limits and the paths the process
may read) and ``inputs.npz`` (the cases' arrays). Before it loads the submission the worker
imports NumPy and JAX and runs one jitted function (so nothing needs the disk later), then
confines itself (:func:`confine`) for good:

* **Landlock** (Linux 5.13+): it may read the standard library, the installed packages but
  ``mini_moe`` and the submission's file, and read and write only ``JOB``; nothing else on the
  disk (not the library's source or installation, not another student's folder, not ``/proc``, so
  not the grader's terminal either), no TCP, and (Linux 6.12+) no signal to a process outside the
  sandbox: it cannot kill the grader;
* **seccomp** (Linux on x86-64 and arm64): ``fork``, ``vfork``, ``clone3`` and a ``clone`` that
  is not a thread fail, so the submission starts no process that could outlive its lab;
* **resource limits**: address space, CPU seconds, and the size of any file it writes.

For each case it writes ``case-<i>.npz`` (the outputs) and one line of ``cases.jsonl`` (what
happened), as it goes, so the grader knows how far it got if the process is killed or exits early.
The submission can write these files too: the grader reads them as untrusted data (arrays of
numbers within a size bound, JSON of a known shape) and decides every verdict itself.
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


# ------------------------------------------------------------------------------------ the sandbox

# Landlock's filesystem rights (linux/landlock.h) by ABI version: 13 rights in ABI 1, REFER in 2,
# TRUNCATE in 3, IOCTL_DEV in 5; TCP bind/connect from ABI 4; signal and abstract-socket scoping from 6.
_FS_RIGHTS = {1: 13, 2: 14, 3: 15, 4: 15, 5: 16}
_FILE_RIGHTS = 1 | 2 | 4 | 1 << 14 | 1 << 15  # execute, write, read, truncate, ioctl: what a file (not a folder) takes
_READ = 1 | 4 | 8  # execute, read a file, read a folder
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # the same on every architecture
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


def _libc():
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """Landlock's ABI version on this machine; 0 where it is missing (not Linux, an older kernel,
    Landlock not enabled, or a container whose seccomp profile refuses the call)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        ctypes, libc = _libc()
        return max(0, int(libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))))
    except (OSError, AttributeError):
        return 0


def seccomp_arch():
    """``(audit arch, {name: syscall number})`` for the no-fork filter, or None where it is not written
    (not Linux, or a CPU other than x86-64 and arm64)."""
    import platform

    if not sys.platform.startswith("linux"):
        return None
    return {"x86_64": (0xC000003E, {"fork": 57, "vfork": 58, "clone": 56, "clone3": 435}),
            "aarch64": (0xC00000B7, {"clone": 220, "clone3": 435})}.get(platform.machine())


def _landlock(abi: int, readable: list[str], writable: list[str]) -> None:
    import os
    import struct

    ctypes, libc = _libc()
    handled = (1 << _FS_RIGHTS.get(abi, 16)) - 1
    attr = struct.pack("QQQ", handled, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)[:8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = libc.syscall(_SYS_CREATE_RULESET, attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    for paths, rights in ((readable, _READ), (writable, handled)):
        for path in paths:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:  # a path that does not exist here: nothing to allow
                continue
            allowed = rights & handled if os.path.isdir(path) else rights & handled & _FILE_RIGHTS
            rule = struct.pack("=Qi", allowed, fd)
            done = libc.syscall(_SYS_ADD_RULE, ruleset, ctypes.c_int(1), rule, ctypes.c_uint32(0))
            os.close(fd)
            if done < 0:
                raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) or libc.syscall(_SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)):
        raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    os.close(ruleset)


def _no_fork(arch) -> None:
    """A seccomp filter: another process cannot be started (threads can); a syscall of another
    architecture (32-bit calls from a 64-bit process) kills the process."""
    import struct

    ctypes, libc = _libc()
    audit, nr = arch
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys, kill = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38, 0x80000000
    # (code, true target, false target, k); targets are labels, resolved below
    program = [(ld, None, None, 4), (jeq, "nr", "kill", audit), ("kill",), ("nr",), (ld, None, None, 0),
               (jge, "eperm", None, 0x40000000)]
    program += [(jeq, "eperm", None, nr[name]) for name in ("fork", "vfork") if name in nr]
    program += [(jeq, "enosys", None, nr["clone3"]), (jeq, None, "allow", nr["clone"]), (ld, None, None, 16),
                (jset, "allow", "eperm", 0x00010000),  # CLONE_THREAD: a thread of this process
                ("allow",), (ret, None, None, allow), ("eperm",), (ret, None, None, eperm),
                ("enosys",), (ret, None, None, enosys)]
    program.insert(3, (ret, None, None, kill))
    labels, code = {}, []
    for item in program:
        if len(item) == 1:
            labels[item[0]] = len(code)
        else:
            code.append(item)
    filters = b""
    for i, (op, yes, no, k) in enumerate(code):
        jt = 0 if yes is None else labels[yes] - i - 1
        jf = 0 if no is None else labels[no] - i - 1
        filters += struct.pack("HBBI", op, jt, jf, k)

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = Program(len(code), filters)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) or libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER,
                                                                  ctypes.byref(prog), 0, 0):
        raise OSError(ctypes.get_errno(), "seccomp filter not installed")


def confine(readable: list[str], writable: list[str], *, require: dict | None = None) -> dict:
    """Confine this process for good (see the module's docstring): Landlock where the kernel has it,
    the no-fork seccomp filter where it is written for the CPU. Returns what is in force,
    ``{"landlock": ABI or 0, "signals": bool, "no_fork": bool}``; a part the machine refuses is
    left out, unless ``require`` asks for it (``{"landlock": True, "no_fork": True}``): then
    ``OSError``."""
    require = require or {}
    abi, arch = landlock_abi(), seccomp_arch()
    if require.get("landlock") and not abi:
        raise OSError("the grader requires Landlock, which this kernel does not offer")
    if require.get("no_fork") and arch is None:
        raise OSError("the grader requires the no-fork filter, which is not written for this machine")
    done = {"landlock": 0, "signals": False, "no_fork": False}
    for part, setup in (("landlock", lambda: _landlock(abi, readable, writable) if abi else None),
                        ("no_fork", lambda: _no_fork(arch) if arch is not None else None)):
        try:
            setup()
        except OSError:  # e.g. a container whose own seccomp profile refuses the call
            if require.get(part):
                raise
            continue
        if part == "landlock" and abi:
            done |= {"landlock": abi, "signals": abi >= 6}
        elif part == "no_fork" and arch is not None:
            done["no_fork"] = True
    return done


# ----------------------------------------------------------------------------------- one job


def main(job_dir: str) -> int:
    """Run one lab's cases of the submission in ``job_dir`` (see the module's docstring)."""
    import pathlib
    import resource

    job_dir = pathlib.Path(job_dir)
    job = json.loads((job_dir / "job.json").read_text())
    sys.path[:] = job["sys_path"]  # the library's folder is not on it: it cannot be imported
    sys.dont_write_bytecode = True
    limits = job["limits"]
    for kind, value in ((resource.RLIMIT_AS, limits["memory_bytes"]), (resource.RLIMIT_CPU, limits["cpu_seconds"]),
                        (resource.RLIMIT_FSIZE, limits["file_bytes"])):
        try:
            resource.setrlimit(kind, (value, value))
        except (ValueError, OSError):  # macOS refuses RLIMIT_AS: there only the wall clock limits it
            pass
    import runpy

    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.jit(lambda x: jnp.sort(x) @ x)(np.ones(4, np.float32)).block_until_ready()  # the backend, before confining
    log = open(job_dir / "cases.jsonl", "a")

    def record(entry: dict) -> None:
        log.write(json.dumps(entry) + "\n")
        log.flush()

    try:
        record({"case": -1, "sandbox": confine(job["readable"] + [job["source"]], [str(job_dir)],
                                               require=job.get("require"))})
    except OSError as error:  # the sandbox the grader asked for is not there: run nothing
        record({"case": -1, "sandbox_failed": str(error)[:300]})
        return 0
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
