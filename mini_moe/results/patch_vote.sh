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
TREE=runs/patch_vote-source
if [ "$(git -C "$TREE" rev-parse HEAD 2>/dev/null || true)" != "$(git rev-parse "$SOURCE")" ]; then
  git worktree remove --force "$TREE" 2>/dev/null || rm -rf "$TREE"
  git worktree prune
  git worktree add -q --detach "$TREE" "$SOURCE"
fi
echo "patch_vote.sh: training with the code of $(git -C "$TREE" rev-parse --short HEAD) in $TREE"
# PYTHONSAFEPATH: `python -m` must not put the current folder (this checkout's mini_moe) first.
RUN="env PYTHONSAFEPATH=1 PYTHONPATH=$PWD/$TREE $PY"
case "$($RUN -c 'import mini_moe; print(mini_moe.__file__)')" in
  "$PWD/$TREE/"*) ;;
  *) echo "patch_vote.sh: mini_moe does not import from $TREE" >&2; exit 2 ;;
esac

source "$(dirname "$0")/commit_result.sh"

for name in $($RUN -m mini_moe.confirm todo --dest "$DEST"); do
  $RUN -m mini_moe.confirm run "$name" --out "$OUT"
  $RUN -m mini_moe.confirm collect --out "$OUT" --dest "$DEST" --command "$COMMAND"
  commit_result "$DEST" "patch_vote confirmatory study: cell $name"
done
$RUN -m mini_moe.confirm collect --out "$OUT" --dest "$DEST" --command "$COMMAND"
commit_result "$DEST" "patch_vote confirmatory study: every cell"
