"""A live classifier head for model-level comparisons (issue 52 §3, code review T1).

A fresh ``VisionMoE``'s head is zero (``model.py``), so its logits are 0 for every image and no
gradient reaches the experts or the routers through the task: two models that differ anywhere
below the head give the same logits and the same (zero) expert gradients. Tests that assert two
models are equal give both the same random head first.
"""

import jax


def live_head(model, seed: int = 0, scale: float = 0.5):
    """Set ``model.head.kernel [D, classes]`` to ``scale * N(0, 1)`` from ``seed``, in place;
    models given the same seed get the same head. Returns the model."""
    kernel = model.head.kernel
    kernel[...] = scale * jax.random.normal(jax.random.key(seed), kernel.shape, kernel.dtype)
    return model
