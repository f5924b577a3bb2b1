#!/usr/bin/env bash
# Issue 34's registered capacity-task runs (capacity_converged.py confirm; the design is
# mini_moe/results/patch_vote-converged-preregistration.md): every arm of each seed given, each cell
# committed as it finishes. Stop it at any time; the same command continues (a cell in progress
# resumes from its last checkpoint under runs/capacity-converged; a fresh clone retrains the cells
# that are not in the committed JSON). From the repository root after `make venv`, one per core:
#   taskset -c 0 bash mini_moe/results/capacity_converged.sh SEED ...
#   taskset -c 1 bash mini_moe/results/capacity_converged.sh SEED ...
# Every cell trains with the same code: a detached worktree (runs/capacity-converged-source) at
# SOURCE, by default the commit that last changed the registration.
set -euo pipefail
PY=${PY:-.venv/bin/python}
MACHINE=${MACHINE:-cpu-2core-epyc}
PREREG=mini_moe/results/patch_vote-converged-preregistration.md
TREE=runs/capacity-converged-source

SOURCE=${SOURCE:-$(git log -1 --format=%H -- "$PREREG")}
if [ -z "$SOURCE" ]; then
  echo "capacity_converged.sh: commit $PREREG before any registered run" >&2
  exit 2
fi
source "$(dirname "$0")/commit_result.sh"
pin_source "$TREE" "$SOURCE"
# The pinned code writes its results into this checkout (RESULTS_DIR), not into the worktree.
SOURCE=$SOURCE MACHINE=$MACHINE COMMIT=${COMMIT:-1} RESULTS_DIR=$PWD/mini_moe/results \
  $RUN "$TREE/mini_moe/results/capacity_converged.py" confirm "$@"
