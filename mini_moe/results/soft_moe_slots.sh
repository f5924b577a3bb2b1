#!/usr/bin/env bash
# Paper 002, Section 3.5 / Figure 6 at small scale: Soft MoE with the same total number of
# slots (16 = the tokens of one 8x8 digit in 2x2 patches) split over E = 1, 2, 4, 8, 16 experts
# (16, 8, 4, 2, 1 slots per expert), six paired seeds, 400 steps, Every-2 placement.
# Each E is one study (capacity c = 1 gives E * S = T slots); resumable: rerun to continue.
# Run from the repository root after `make venv`; about 25 minutes on an idle 2-core CPU.
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/soft_moe_slots}
MACHINE=${MACHINE:-cpu-2core-xeon}
for E in 1 2 4 8 16; do
  dest=mini_moe/results/soft_moe_slots-digits-E$E-$MACHINE.json
  $PY -m mini_moe study --dataset digits --routers soft_moe --capacities 1 --seeds 0 1 2 3 4 5 --no-dense \
      --steps 400 --set model_num_experts=$E --out "$OUT/E$E" --done "$dest"
  cp "$OUT/E$E/results.json" "$dest"
done
