"""Issue 52 §4: the temporary memory XLA plans for one training step against the number of
micro-batches of gradient accumulation (``TrainConfig.grad_accum``), at 512 images of the quick
Fashion-MNIST model with Softmax Token Choice. Accumulation exists to lower the activation peak, so
with micro-batches in a ``lax.scan`` (``train.accumulated_grads``) the plan should shrink about as
1/n; the earlier unrolled loop planned 394 MiB at n = 1 and 315 MiB at n = 8 (code review
2026-11-27, D1).

Usage (compiles only; nothing is trained)::

    .venv/bin/python mini_moe/results/grad_accum_memory.py   # writes grad_accum_memory-<MACHINE>.json
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import jax.numpy as jnp
from flax import nnx

from mini_moe import bench, config, train

MACHINE = os.environ.get("MACHINE", "cpu-2core-epyc")
OUT = pathlib.Path(__file__).resolve().parent / f"grad_accum_memory-{MACHINE}.json"
BATCH = 512


def planned_memory(micro_batches: int) -> dict:
    """XLA's memory analysis of one compiled training step (gradients and the AdamW update) with
    ``micro_batches`` micro-batches: temporary, argument and output bytes, in MiB."""
    cfg = config.get_config("quick", dataset="fashion_mnist", router="softmax_token_choice", batch_size=BATCH,
                            grad_accum=micro_batches, steps=10)
    model = train.make_model(cfg)
    graphdef, state = nnx.split((model, train.make_optimizer(model, cfg)))

    def step(state, images, labels):
        model, optimizer = nnx.merge(graphdef, state)
        if micro_batches == 1:
            grads, (ce, _) = nnx.grad(train._loss_fn, has_aux=True)(model, images, labels, cfg.aux_loss_weight, None)
        else:
            grads, ce, *_ = train.accumulated_grads(model, images, labels, cfg.aux_loss_weight, micro_batches)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), ce

    m = cfg.model
    images = jnp.zeros((BATCH, m.image_size, m.image_size, m.channels), jnp.float32)
    labels = jnp.zeros((BATCH,), jnp.int32)
    analysis = jax.jit(step).lower(state, images, labels).compile().memory_analysis()
    mib = lambda b: round(b / 2**20, 1)
    return {"micro_batches": micro_batches, "temp_mib": mib(analysis.temp_size_in_bytes),
            "argument_mib": mib(analysis.argument_size_in_bytes), "output_mib": mib(analysis.output_size_in_bytes)}


if __name__ == "__main__":
    rows = [planned_memory(n) for n in (1, 2, 4, 8)]
    for row in rows:
        print(row, flush=True)
    ratio = rows[-1]["temp_mib"] / rows[0]["temp_mib"]
    OUT.write_text(json.dumps({
        "what": "XLA's planned memory of one training step against grad_accum micro-batches (issue 52 §4)",
        "model": "quick fashion_mnist, softmax_token_choice", "batch_size": BATCH, "rows": rows,
        "temp_ratio_8_to_1": round(ratio, 3), "target": "temp at n = 8 <= 0.3 x n = 1",
        "command": ".venv/bin/python mini_moe/results/grad_accum_memory.py", "machine": bench.machine()}, indent=1) + "\n")
    print(f"n = 8 / n = 1: {ratio:.3f}")
