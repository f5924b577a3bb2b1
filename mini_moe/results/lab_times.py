"""How long the grader takes to check each lab on this machine (issue 49: the labs page glues it).

Usage, from the repository root on an otherwise idle machine::

    .venv/bin/python mini_moe/results/lab_times.py [--out mini_moe/results/lab-times-<machine>.json]

For every lab of :data:`mini_moe.labs.LABS`, in the registry's order, one fresh Python process
imports ``mini_moe.labs`` and times ``labs.check(name, reference)`` with the library's own function
in the student's place (a right answer: every case runs, eagerly and under ``jax.jit``, so this is
the longest a check takes; a wrong answer stops at its first failing case). The process start and
the imports are timed apart (``import_seconds``): ``python -m mini_moe labs check FILE`` pays them
once for all the labs of a file. Records the machine (:func:`mini_moe.bench.machine`) and the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

from mini_moe import bench, labs

ROOT = pathlib.Path(__file__).resolve().parents[2]

ONE_LAB = """
import json, sys, time
tick = time.perf_counter()
from mini_moe import labs
imported = time.perf_counter() - tick
tick = time.perf_counter()
report = labs.check(sys.argv[1], labs.LABS[sys.argv[1]].reference)
print(json.dumps({"import_seconds": round(imported, 2), "check_seconds": round(time.perf_counter() - tick, 2),
                  "passed": bool(report.passed)}))
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="the JSON file (default: lab-times-<machine>.json here)")
    parser.add_argument("--machine", default="cpu-2core-epyc", help="the machine's label in the default file name")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out or ROOT / "mini_moe" / "results" / f"lab-times-{args.machine}.json")
    git = ["git", "-C", str(ROOT)]
    record = {"what": "seconds for labs.check(name, reference) of each lab, each in a fresh process (imports apart)",
              "command": "python mini_moe/results/lab_times.py", "machine": bench.machine(),
              "source_commit": subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                                              check=True).stdout.strip(),
              "source_dirty": bool(subprocess.run([*git, "status", "--porcelain", "--", "mini_moe"], capture_output=True,
                                                  text=True, check=True).stdout.strip()),
              "load_average_before": [round(x, 2) for x in os.getloadavg()], "labs": {}}
    for name in labs.LABS:
        result = subprocess.run([sys.executable, "-c", ONE_LAB, name], capture_output=True, text=True, check=True)
        record["labs"][name] = json.loads(result.stdout.strip().splitlines()[-1])
        if not record["labs"][name]["passed"]:
            sys.exit(f"lab_times: the library's own {name} fails its check: {result.stdout}")
        print(name, record["labs"][name], flush=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
