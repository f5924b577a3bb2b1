"""The check to run first whenever an accelerator is lent (issue 55 §3): at most 8 minutes on one
H100 or H200, everything a reader on a GPU or TPU touches that the CPU runs cannot show.

1. ``units``: the unit tests of the accelerator path (routers, layer, dropless with ``ragged_dot``
   and the blocked kernel, precision, a training step and its resume), on the device;
2. ``bench``: ``mini_moe.bench`` on the device: each dropless kernel against gather, every router's
   forward + backward at the vmoe comparison's shapes, and training throughput against the dense
   ViT;
3. ``chapter``: one chapter executed at the full configuration (``MINI_MOE_SCALE=full``);

and writes one JSON with the device's name, each step's status, seconds, failing tests and output
tail, and the benchmark rows, rewritten after every step and every benchmark table, so that a run
stopped by the device's lease keeps what it measured. Each step has a time limit (:data:`LIMITS`)
that together fit 8 minutes; the first run (H200, 2026-11-28) showed that all five unit files take
over 240 s there (about 2 s of compiling per test), hence the selection below. ``--dry`` takes the same code path on the CPU
and checks the plan, so CI runs it and it cannot rot (``tests/test_device_check.py``): the unit step and
the chapter step collect what the device would run (``pytest --collect-only``: the selection finds
tests in every file, the chapter's cells are there; CI's unit and nbval stages execute them anyway),
and the benchmark runs every table at a tiny shape.

Usage, from the repository root (on the device tool: ``PYTHONPATH=.``)::

    python .ci/device_check.py --out mini_moe/results/device-check-gpu-h100.json   # on the device
    python .ci/device_check.py --dry --out /tmp/device-check.json                   # anywhere
    make device-check                                                              # the first, named by the device
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: In the order of what the runs so far have not covered: the second H200 run (2026-11-28) passed all of
#: tests/test_layer.py and (in a follow-up) tests/test_routers.py, so they come last; pytest stops where the
#: step's time runs out.
UNIT_FILES = ("tests/test_train.py", "tests/test_precision.py", "tests/test_dropless.py", "tests/test_layer.py",
              "tests/test_routers.py")
#: On the device: every test of the last four files, and of tests/test_train.py a training step and its resume.
DEVICE_UNITS = "not test_train or resume_ends_with_the_same"
#: Seconds each step may take on the device (units, benchmark tables started, chapter): 440 s in all.
LIMITS = {"units": 220, "bench": 140, "chapter": 80}
#: Chapter 1 at the full configuration (chapter 2's training there took over 240 s on the H200).
CHAPTER = "book/01_unified_formulation.ipynb"
#: Dry mode's benchmark shape (images per group, tokens, groups, D, H, E), for every bench table.
TINY_SHAPE = (2, 16, 2, 32, 64, 4)
BENCH_PARTS = ("dropless", "routers_reference", "training")


def run_step(name: str, command: list[str], env: dict, timeout: float) -> dict:
    """Run one step as a subprocess: status, seconds, and the last lines of its output."""
    tick = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        status, output = ("ok" if done.returncode == 0 else f"failed (exit {done.returncode})"), done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        partial = e.stdout or ""
        status, output = f"timed out after {timeout:.0f} s", partial if isinstance(partial, str) else partial.decode(errors="replace")
    seconds = round(time.perf_counter() - tick, 1)
    print(f"[{name}] {status} in {seconds} s", flush=True)
    lines = output.strip().splitlines()
    failures = [line[:300] for line in lines if " FAILED" in line or " ERROR" in line or line.startswith(("E ", "FAILED "))]
    row = {"step": name, "status": status, "seconds": seconds, "command": " ".join(command),
           "failures": failures[:80], "output_tail": "\n".join(lines[-15:])}
    if "--collect-only" in command:  # dry mode: how many tests (or cells) each file would run
        row["collected"] = {}
        for line in lines:
            if "::" in line:
                path = line.split("::")[0].strip()
                row["collected"][path] = row["collected"].get(path, 0) + 1
    return row


def bench_rows(dry: bool, repeats: int, save, limit: float) -> dict:
    """The device's benchmark tables (dry: every table at :data:`TINY_SHAPE`, one repeat); ``save``
    is called with the rows after each table, so that a run cut short keeps the tables it finished;
    no table starts once ``limit`` seconds have passed."""
    from mini_moe import bench

    if dry:
        bench.LAYER_SHAPES = {"tiny": TINY_SHAPE}
        bench.ROUTER_SHAPES = {"tiny": TINY_SHAPE}
        bench._SHAPES = {"tiny": TINY_SHAPE}
    out = {"machine": bench.machine()}
    start = time.perf_counter()
    for part in BENCH_PARTS:
        if dry and part == "training":
            continue  # the quick Fashion-MNIST model of every router: minutes on a CPU, nothing tiny about it
        if time.perf_counter() - start > limit:
            out[part] = f"not started: the benchmark's {limit:.0f} s had passed"
            continue
        tick = time.perf_counter()
        out[part] = bench.PARTS[part](repeats)
        out[f"{part}_seconds"] = round(time.perf_counter() - tick, 1)
        save(out)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--dry", action="store_true", help="check the plan on the CPU: collect the tests and the "
                        "chapter, run the benchmarks at a tiny shape")
    parser.add_argument("--repeats", type=int, default=None, help="benchmark repeats (default 10; dry 1)")
    args = parser.parse_args(argv)
    # Each step is a process of its own on the same accelerator: none may take 75 % of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    device = jax.devices()[0]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    python = sys.executable
    pytest = [python, "-m", "pytest", "-v", "--tb=line", "-p", "no:cacheprovider", "-p", "no:xdist"]
    collect = ["--collect-only", "-qq"] if args.dry else []  # with -v: one node id per line
    units = pytest + [*UNIT_FILES, "-k", DEVICE_UNITS, *collect]
    chapter_env = dict(env, MINI_MOE_SCALE="full")
    chapter = pytest + ["--nbval-lax", "--nbval-current-env", CHAPTER, *collect]
    limits = {step: 240 for step in LIMITS} if args.dry else LIMITS
    record = {"what": "issue 55 §3's device check: unit tests, one chapter at the full configuration, the benchmarks",
              "dry": args.dry, "device": device.device_kind, "platform": device.platform,
              "devices": len(jax.devices()), "jax": jax.__version__,
              "command": " ".join(["python", ".ci/device_check.py", *(argv or sys.argv[1:])]),
              "steps": [], "bench": {}}

    def save(rows=None):  # after every step: a run cut short (the device's lease) keeps what it measured
        if rows is not None:
            record["bench"] = rows
        pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n")

    steps = record["steps"]
    steps.append(run_step("units", units, env, limits["units"]))
    save()
    tick = time.perf_counter()
    try:
        bench_rows(args.dry, args.repeats or (1 if args.dry else 5), save, limits["bench"])
        steps.append({"step": "bench", "status": "ok", "seconds": round(time.perf_counter() - tick, 1)})
    except Exception as e:  # recorded; the JSON is still written
        steps.append({"step": "bench", "status": f"failed ({type(e).__name__}: {e})",
                      "seconds": round(time.perf_counter() - tick, 1)})
    save()
    steps.append(run_step("chapter", chapter, chapter_env, limits["chapter"]))
    save()
    print(f"wrote {args.out}: " + ", ".join(f"{s['step']} {s['status']}" for s in steps), flush=True)
    return 0 if all(s["status"] == "ok" for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
