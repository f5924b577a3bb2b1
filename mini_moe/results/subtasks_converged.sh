#!/usr/bin/env bash
# Chapter 9's controlled experiment trained to convergence (issue 25): every run stops when its
# validation FVU has not improved by 1 % within 1,000 steps (at most 20,000 steps), see
# mini_moe.subtasks.SubtaskConfig. Seed by seed, one run per command, and the results file is
# committed alone after every run; stop it at any time and run the same command to continue
# (runs already in the file are skipped). From the repository root after `make venv`:
#   taskset -c 1 bash mini_moe/results/subtasks_converged.sh
# Every run trains with the same code: a detached worktree (runs/subtasks-source) at SOURCE, by
# default the commit before the one that first committed the results file (HEAD when none).
# SEEDS (default 0-7) and MACHINE choose a share of the plan and its file, so that a second core
# can run other seeds into its own file at the same time, with the same code:
#   MACHINE=cpu-2core-xeon SOURCE=c5ef9f1 SEEDS="7 6 5" taskset -c 0 bash mini_moe/results/subtasks_converged.sh
set -euo pipefail
PY=${PY:-.venv/bin/python}
MACHINE=${MACHINE:-cpu-2core-epyc}
DEST=mini_moe/results/subtasks-converged-$MACHINE.json
ROUTERS="dense dense_wide softmax_token_choice sinkhorn_token_choice svmoe softmax_expert_choice
 sinkhorn_expert_choice sparsity_constrained_expert_choice soft_moe"

source "$(dirname "$0")/commit_result.sh"
if [ -z "${SOURCE:-}" ]; then
  FIRST=$(git log --diff-filter=A --format=%H -- "$DEST" | tail -1)
  SOURCE=${FIRST:+$FIRST^}
  SOURCE=${SOURCE:-$(git rev-parse HEAD)}
fi
pin_source runs/subtasks-source "$SOURCE"

for seed in ${SEEDS:-0 1 2 3 4 5 6 7}; do
  for freq in uniform skewed; do
    for router in $ROUTERS; do
      $RUN -m mini_moe subtasks --routers "$router" --frequencies "$freq" --seeds "$seed" --steps 20000 \
        --patience 1000 --out "$DEST" > /dev/null
      commit_result "$DEST" "subtasks to convergence: $router $freq seed $seed"
    done
  done
done
