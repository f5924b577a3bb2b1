#!/usr/bin/env bash
# Issue 51's registered cells (budget_study.py confirm; the design is
# mini_moe/results/budget-preregistration.md): every arm of each seed given, at every learning rate
# its budgets need, each run committed as it finishes. Stop it at any time; the same command
# continues (a run in progress resumes from its last checkpoint under runs/budget-study; a fresh
# clone retrains the runs that are not in the committed JSON). From the repository root after
# `make venv`, one per core:
#   taskset -c 0 bash mini_moe/results/budget_study.sh SEED ...
#   taskset -c 1 bash mini_moe/results/budget_study.sh SEED ...
# Every run trains with the same code: a detached worktree (runs/budget-study-source) at SOURCE, by
# default the commit that last changed the registration.
set -euo pipefail
PY=${PY:-.venv/bin/python}
MACHINE=${MACHINE:-cpu-2core-epyc}
PREREG=mini_moe/results/budget-preregistration.md
TREE=runs/budget-study-source

SOURCE=${SOURCE:-$(git log -1 --format=%H -- "$PREREG")}
if [ -z "$SOURCE" ]; then
  echo "budget_study.sh: commit $PREREG before any registered run" >&2
  exit 2
fi
source "$(dirname "$0")/commit_result.sh"
pin_source "$TREE" "$SOURCE"
# The pinned code writes its results into this checkout (RESULTS_DIR), not into the worktree.
SOURCE=$SOURCE MACHINE=$MACHINE COMMIT=${COMMIT:-1} RESULTS_DIR=$PWD/mini_moe/results \
  CELL_RUNS=$PWD/runs/budget-study $RUN "$TREE/mini_moe/results/budget_study.py" confirm "$@"
