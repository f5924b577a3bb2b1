"""How long the grader takes for a class (issue 50 §3: page 15 glues these numbers).

Usage, from the repository root on an otherwise idle machine::

    .venv/bin/python mini_moe/results/lab_grading.py [--students 4] [--out mini_moe/results/lab-grading-<machine>.json]

Grades ``--students`` copies of a full submission (every lab, right answers) exactly as
``python -m mini_moe labs grade`` does: every lab of every student in a process of its own
(:func:`mini_moe.labs.run_sandboxed`), as many at once as the machine has cores. A right answer
runs every case, eagerly and under ``jax.jit``, so this is the longest a submission takes. The
right answers are the library's own functions, which a real submission may not import: for this
measurement only, the submission's process gets the library on its path (the one difference from
grading a class; the time to start the process, import JAX and load the file is the same).
Records the machine (:func:`mini_moe.bench.machine`), the commit and the load average before the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from mini_moe import bench, labs

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: Every lab function, defined as the library's own (see the module docstring).
SUBMISSION = "from mini_moe.labs import LABS\n\n" + "".join(
    f"{lab.function} = LABS[{name!r}].reference\n" for name, lab in labs.LABS.items())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--students", type=int, default=4)
    parser.add_argument("--out", default=None, help="the JSON file (default: lab-grading-<machine>.json here)")
    parser.add_argument("--machine", default="cpu-2core-epyc", help="the machine's label in the default file name")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out or ROOT / "mini_moe" / "results" / f"lab-grading-{args.machine}.json")
    git = ["git", "-C", str(ROOT)]
    load = [round(x, 2) for x in os.getloadavg()]
    jobs = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        submissions = []
        for i in range(args.students):
            work = pathlib.Path(tmp) / f"s{i}"
            work.mkdir()
            (work / "student.py").write_text(SUBMISSION)
            submission = labs.read_submission(work / "student.py", work)
            submissions.append(dataclasses.replace(submission, student=f"student{i}", uses_library=False))
        tasks = [(s, pathlib.Path(s.source).parent, name) for s in submissions for name in s.labs]
        tick = time.perf_counter()
        with ThreadPoolExecutor(jobs) as pool:
            library = [str(ROOT), *sys.path]  # the library importable: see the module docstring
            results = list(pool.map(lambda t: labs.run_sandboxed(t[2], t[0], t[1], sys_path=library,
                                                                 readable=library), tasks))
        wall = time.perf_counter() - tick
    if not all(r.passed for r in results):
        sys.exit("lab_grading: the library's own functions failed: " + "; ".join(str(r) for r in results if not r.passed))
    per_lab = {}
    for r in results:
        per_lab.setdefault(r.lab, []).append(r.seconds)
    record = {"what": f"seconds to grade full submissions ({len(labs.LABS)} labs, right answers) as `labs grade` does, every lab "
                      "in its own process, as many at once as there are cores",
              "command": "python mini_moe/results/lab_grading.py", "machine": bench.machine(),
              "source_commit": subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                                              check=True).stdout.strip(),
              "source_dirty": bool(subprocess.run([*git, "status", "--porcelain", "--", "mini_moe"],
                                                  capture_output=True, text=True, check=True).stdout.strip()),
              "load_average_before": load, "students": args.students, "labs": len(labs.LABS), "jobs": jobs, "wall_seconds": round(wall, 1),
              "seconds_per_submission": round(wall / args.students, 1),
              "seconds_per_lab": round(sum(r.seconds for r in results) / len(results), 2),
              "lab_seconds": {name: sorted(v) for name, v in per_lab.items()}}
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k not in ("machine", "lab_seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
