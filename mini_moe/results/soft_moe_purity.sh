#!/usr/bin/env bash
# Chapter 9's Soft MoE slot purity at convergence, every seed (soft_moe_purity.py): one seed per
# command, the results file committed after each; run again to continue. From the repository root
# after `make venv`:  taskset -c 1 bash mini_moe/results/soft_moe_purity.sh [SEED ...]
# The code that trains is pinned (a detached worktree at SOURCE, by default the commit that last
# changed this script), so edits on main cannot reach a running measurement.
set -euo pipefail
PY=${PY:-.venv/bin/python}
DEST=mini_moe/results/subtasks-soft_moe-purity-${MACHINE:-cpu-2core-epyc}.json
source "$(dirname "$0")/commit_result.sh"
SOURCE=${SOURCE:-$(git log -1 --format=%H -- "$0")}
pin_source runs/purity-source "$SOURCE"
for seed in ${@:-0 1 2 3 4 5 6 7}; do
  SOURCE=$SOURCE $RUN mini_moe/results/soft_moe_purity.py "$seed"
  commit_result "$DEST" "chapter 9 Soft MoE slot purity at convergence: seed $seed"
done
