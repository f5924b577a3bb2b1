#!/usr/bin/env bash
# Issue 34's registered token-level runs (subtasks_controls.py confirm; the design is
# mini_moe/results/subtasks-controls-preregistration.md): every arm of each seed given, each cell
# committed as it finishes. Stop it at any time; the same command continues (a fresh clone skips the
# cells already in the committed JSON). From the repository root after `make venv`, one per core:
#   taskset -c 0 bash mini_moe/results/subtasks_controls.sh 100 102 104
#   taskset -c 1 bash mini_moe/results/subtasks_controls.sh 101 103 105
# Every cell trains with the same code: a detached worktree (runs/subtasks-controls-source) at
# SOURCE, by default the commit that last changed the registration.
set -euo pipefail
PY=${PY:-.venv/bin/python}
MACHINE=${MACHINE:-cpu-2core-epyc}
PREREG=mini_moe/results/subtasks-controls-preregistration.md
TREE=runs/subtasks-controls-source

SOURCE=${SOURCE:-$(git log -1 --format=%H -- "$PREREG")}
if [ -z "$SOURCE" ]; then
  echo "subtasks_controls.sh: commit $PREREG before any registered run" >&2
  exit 2
fi
source "$(dirname "$0")/commit_result.sh"
pin_source "$TREE" "$SOURCE"
# The pinned code writes its results into this checkout (RESULTS_DIR), not into the worktree.
SOURCE=$SOURCE MACHINE=$MACHINE COMMIT=${COMMIT:-1} RESULTS_DIR=$PWD/mini_moe/results \
  $RUN "$TREE/mini_moe/results/subtasks_controls.py" confirm "$@"
