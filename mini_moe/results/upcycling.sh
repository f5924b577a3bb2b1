#!/usr/bin/env bash
# Issue 54's registered upcycling comparison (upcycling.py confirm; the design is
# mini_moe/results/upcycling-preregistration.md): every arm of each seed given, seed by seed, each cell
# committed as it finishes into mini_moe/results/upcycling-confirmatory-$MACHINE.json. Stop it at any
# time; the same command continues (an interrupted cell resumes from its last checkpoint under
# runs/upcycling; a fresh clone skips the cells already in the committed JSON, but an upcycled cell
# needs its seed's dense run folder). From the repository root after `make venv`, one process per core:
#   taskset -c 0 bash mini_moe/results/upcycling.sh 300 302 304 306 308
#   taskset -c 1 bash mini_moe/results/upcycling.sh 301 303 305 307
# Every cell trains with the same code: a detached worktree (runs/upcycling-source) at SOURCE: the
# commit of the first recorded cell, or before any, the last commit of the registration and the runner.
set -euo pipefail
PY=${PY:-.venv/bin/python}
MACHINE=${MACHINE:-cpu-2core-epyc}
PREREG=mini_moe/results/upcycling-preregistration.md
RUNNER="mini_moe/results/upcycling.py mini_moe/results/upcycling.sh mini_moe/train.py mini_moe/upcycle.py"
DEST=mini_moe/results/upcycling-confirmatory-$MACHINE.json
TREE=runs/upcycling-source

for f in $PREREG $RUNNER; do
  if [ -z "$(git log -1 --format=%H -- "$f")" ] || ! git diff --quiet HEAD -- "$f"; then
    echo "upcycling.sh: commit $f (the registration and the runner) before any registered cell" >&2
    exit 2
  fi
done
if [ -z "${SOURCE:-}" ]; then
  SOURCE=$($PY -c "import json; r = json.load(open('$DEST'))['runs']; print(r[0]['source_commit'] if r else '')" \
    2>/dev/null || true)
  # shellcheck disable=SC2086
  SOURCE=${SOURCE:-$(git log -1 --format=%H -- $PREREG $RUNNER)}
fi
source "$(dirname "$0")/commit_result.sh"
pin_source "$TREE" "$SOURCE"
# The pinned code writes its results into this checkout (RESULTS_DIR), not into the worktree.
SOURCE=$SOURCE MACHINE=$MACHINE COMMIT=${COMMIT:-1} RESULTS_DIR=$PWD/mini_moe/results \
  $RUN "$TREE/mini_moe/results/upcycling.py" confirm "$@"
