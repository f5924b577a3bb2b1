#!/usr/bin/env bash
# Issue 54 §2's registered compute-per-patch comparison (compute_per_patch.py confirm; the design is
# mini_moe/results/compute-per-patch-preregistration.md): every arm of each seed given, seed by seed, each
# cell committed as it finishes into mini_moe/results/compute-per-patch-confirmatory-$MACHINE.json. Stop it
# at any time; the same command continues (an interrupted cell resumes from its last checkpoint under
# runs/compute-per-patch; a fresh clone skips the cells already in the committed JSON). From the repository
# root after `make venv`, one process per core:
#   taskset -c 0 bash mini_moe/results/compute_per_patch.sh 310 312 314 316
#   taskset -c 1 bash mini_moe/results/compute_per_patch.sh 311 313 315 317
# Every cell trains with the same code: a detached worktree (runs/compute-per-patch-source) at SOURCE: the
# commit of the first recorded cell, or before any, the last commit of the registration, the runner and
# the library files the arms train with (the routers with null experts and top-p, the layer, the model).
set -euo pipefail
PY=${PY:-.venv/bin/python}
MACHINE=${MACHINE:-cpu-2core-epyc}
PREREG=mini_moe/results/compute-per-patch-preregistration.md
RUNNER="mini_moe/results/compute_per_patch.py mini_moe/results/compute_per_patch.sh mini_moe/train.py mini_moe/model.py
  mini_moe/layer.py mini_moe/routers/__init__.py mini_moe/routers/null.py mini_moe/routers/adaptive.py mini_moe/inference.py"
DEST=mini_moe/results/compute-per-patch-confirmatory-$MACHINE.json
TREE=runs/compute-per-patch-source

for f in $PREREG $RUNNER; do
  if [ -z "$(git log -1 --format=%H -- "$f")" ] || ! git diff --quiet HEAD -- "$f"; then
    echo "compute_per_patch.sh: commit $f (the registration, the runner and the code it trains with)" \
      "before any registered cell" >&2
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
  $RUN "$TREE/mini_moe/results/compute_per_patch.py" confirm "$@"
