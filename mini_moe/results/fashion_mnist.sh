#!/usr/bin/env bash
# Reproduces the committed Fashion-MNIST results (issue 3's accuracy targets) on an idle machine:
#   every router (and the dense ViT) with a 5-minute training budget, then the best router with 10.
# Run from the repository root after `make venv data`; takes about an hour on a 2-core CPU.
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/fashion_mnist}
MACHINE=${MACHINE:-cpu-2core-epyc}

$PY -m mini_moe study --dataset fashion_mnist --minutes 5 --capacities 1 --seeds 0 \
    --set eval_every=250 --out "$OUT/5min"
$PY -m mini_moe train --router soft_moe --dataset fashion_mnist --minutes 10 --set eval_every=250 \
    --out "$OUT/10min-soft_moe"
$PY -m mini_moe evaluate "$OUT/10min-soft_moe"

dest=mini_moe/results
cp "$OUT/5min/results.json" "$dest/fashion_mnist-5min-$MACHINE.json"
for f in accuracy_vs_train_seconds training_curves; do cp "$OUT/5min/$f.png" "$dest/fashion_mnist-5min-$f.png"; done
$PY - "$OUT/10min-soft_moe" "$dest/fashion_mnist-10min-soft_moe-$MACHINE.json" <<'PYEOF'
import json, pathlib, sys
from mini_moe import bench
run, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
out = {"command": "python -m mini_moe train --router soft_moe --dataset fashion_mnist --minutes 10 --set eval_every=250",
       "machine": bench.machine(), "config": json.loads((run / "config.json").read_text()),
       "history": json.loads((run / "history.json").read_text()),
       "evaluation": json.loads((run / "evaluation.json").read_text())}
dest.write_text(json.dumps(out, indent=1))
PYEOF
cp "$OUT/10min-soft_moe/expert_maps.png" "$dest/fashion_mnist-10min-soft_moe-expert_maps.png"
echo "results in $dest"
