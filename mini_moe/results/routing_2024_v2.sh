#!/usr/bin/env bash
# Issue 35's registered runs of chapters 12 and 13 (routing_2024.py with STUDY=v2; the design is
# mini_moe/results/routing_2024_v2-preregistration.md): ten arms on six paired seeds, seed by seed.
# After every run the results JSON is rewritten and committed alone. Stop it at any time; the same
# command continues (an interrupted run resumes from its last checkpoint under runs/routing_2024_v2;
# a fresh clone skips the runs already in the committed JSON). From the repository root after
# `make venv`, one process per core (SEEDS splits the seeds between them):
#   taskset -c 1 bash mini_moe/results/routing_2024_v2.sh
#   SEEDS="3 4 5" taskset -c 0 bash mini_moe/results/routing_2024_v2.sh
# Every run trains with the same code: a detached worktree (runs/routing_2024_v2-source) at SOURCE,
# by default the commit that trained the first committed run (HEAD before the first run).
set -euo pipefail
PY=${PY:-.venv/bin/python}
MACHINE=${MACHINE:-cpu-2core-epyc}
DEST=mini_moe/results/routing_2024_v2-$MACHINE.json
PREREG=mini_moe/results/routing_2024_v2-preregistration.md
TREE=runs/routing_2024_v2-source

if [ -z "$(git log -1 --format=%H -- "$PREREG")" ]; then
  echo "routing_2024_v2.sh: commit $PREREG before any registered run" >&2
  exit 2
fi
if [ -z "${SOURCE:-}" ]; then
  SOURCE=$($PY -c "import json; r = json.load(open('$DEST'))['runs']; print(r[0]['source_commit'] if r else '')" \
    2>/dev/null || true)
  SOURCE=${SOURCE:-$(git rev-parse HEAD)}
fi
source "$(dirname "$0")/commit_result.sh"
# pin_source leaves a worktree already at SOURCE as it is, so two processes (one per core) share it.
pin_source "$TREE" "$SOURCE"
STUDY=v2 SOURCE=$SOURCE MACHINE=$MACHINE COMMIT=${COMMIT:-1} $RUN "$TREE/mini_moe/results/routing_2024.py" "$@"
