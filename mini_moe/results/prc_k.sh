#!/usr/bin/env bash
# Paper 004's headline (Tables 2-3) at small scale: Pairwise Router Consistency with k = 1
# against the baseline (importance + load losses) with k = 2 and with k = 1. Softmax Token
# Choice on the 8x8 digits with random resized crops, Every-2 placement, six paired seeds of
# 400 steps. k = 1 is capacity c = 1 (C = round(T/E)); k = 2 is c = 2 (C = round(2T/E)).
# Each setting is one resumable study; rerun to continue. About 20 minutes on an idle 2-core CPU.
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/prc_k}
MACHINE=${MACHINE:-cpu-2core-xeon}
run() {  # name capacity extra-overrides...
  local name=$1 capacity=$2; shift 2
  local dest=mini_moe/results/prc_k-digits-$name-$MACHINE.json
  $PY -m mini_moe study --dataset digits --routers softmax_token_choice --capacities "$capacity" \
      --seeds 0 1 2 3 4 5 --no-dense --steps 400 --set augment=True "$@" --out "$OUT/$name" --done "$dest"
  cp "$OUT/$name/results.json" "$dest"
}
run baseline-k2 2
run baseline-k1 1
run prc-k1 1 --set prc=True
