#!/usr/bin/env bash
# Issue 25's pre-registered confirmatory router study on patch_vote (mini_moe/confirm.py fixes the
# design; mini_moe/results/patch_vote-preregistration.md states it): the dense ViT and five router
# arms, seed by seed. After every finished cell the results JSON is rewritten (cells, and the
# contrasts on the complete seeds) and committed alone. Stop it at any time; the same command
# continues (an interrupted cell resumes from its last checkpoint; a fresh clone skips the cells
# already in the committed JSON). Run from the repository root after `make venv`, on one core:
#   taskset -c 1 bash mini_moe/results/patch_vote.sh
# About 2 minutes per cell on one core of the 2-core EPYC machine.
# Every cell trains with the same code: a detached worktree (runs/patch_vote-source) at SOURCE,
# by default the commit that trained the first committed cell (HEAD before the first cell), so
# later changes to mini_moe on main cannot reach a running study.
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/patch_vote-confirmatory}
MACHINE=${MACHINE:-cpu-2core-epyc}
DEST=mini_moe/results/patch_vote-confirmatory-$MACHINE.json
PREREG=mini_moe/results/patch_vote-preregistration.md
COMMAND="taskset -c 1 bash mini_moe/results/patch_vote.sh"

if [ -z "$(git log -1 --format=%H -- "$PREREG")" ]; then
  echo "patch_vote.sh: commit $PREREG before any confirmatory result" >&2
  exit 2
fi

if [ -z "${SOURCE:-}" ]; then
  SOURCE=$($PY -c "import json; c = json.load(open('$DEST'))['cells']; print(c[0]['source_commit'] if c else '')" \
    2>/dev/null || true)
  SOURCE=${SOURCE:-$(git rev-parse HEAD)}
fi
source "$(dirname "$0")/commit_result.sh"
pin_source runs/patch_vote-source "$SOURCE"

for name in $($RUN -m mini_moe.confirm todo --dest "$DEST"); do
  $RUN -m mini_moe.confirm run "$name" --out "$OUT"
  $RUN -m mini_moe.confirm collect --out "$OUT" --dest "$DEST" --command "$COMMAND"
  commit_result "$DEST" "patch_vote confirmatory study: cell $name"
done
$RUN -m mini_moe.confirm collect --out "$OUT" --dest "$DEST" --command "$COMMAND"
commit_result "$DEST" "patch_vote confirmatory study: every cell"
