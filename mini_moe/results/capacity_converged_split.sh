#!/usr/bin/env bash
# One registered seed's arms split over two processes (one per core): the pinned module's
# confirm_cells with ARMS restricted to the arms named. Same code (pin_source), same cells.
#   taskset -c 0 bash mini_moe/results/capacity_converged_split.sh 116 dense softmax_expert_choice
# (used once, for seed 116 of issue 34's amendment; the registered runner is capacity_converged.sh)
set -euo pipefail
PY=.venv/bin/python
TREE=runs/capacity-converged-source
SOURCE=$(git log -1 --format=%H -- mini_moe/results/patch_vote-converged-preregistration.md)
source mini_moe/results/commit_result.sh
pin_source "$TREE" "$SOURCE"
seed=$1; shift
SOURCE=$SOURCE MACHINE=cpu-2core-epyc COMMIT=1 RESULTS_DIR=$PWD/mini_moe/results $RUN -c "
import importlib.util, sys
spec = importlib.util.spec_from_file_location('capacity_converged', '$TREE/mini_moe/results/capacity_converged.py')
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
keep = sys.argv[2:]
assert set(keep) <= set(module.ARMS), keep
module.ARMS = {arm: module.ARMS[arm] for arm in keep}
module.LEARNING_RATE = {arm: module.LEARNING_RATE[arm] for arm in keep}
module.confirm_cells([int(sys.argv[1])])
" "$seed" "$@"
