"""Fixed inputs and the outputs every registered router gave on them, for the test that the
routers' outputs stay bit-identical across refactors (``tests/test_routers.py``).

Regenerate only when an output changes on purpose, and say why in the commit:
``python tests/router_golden.py`` writes ``tests/data/router_golden.npz``.
"""

import pathlib

import jax
import numpy as np
from flax import nnx

import mini_moe as mm

PATH = pathlib.Path(__file__).parent / "data" / "router_golden.npz"
D, E, T, G = 8, 4, 16, 2

# (label, registered name, options): every router at its defaults and the options that change
# its computation (k, Batch Priority Routing, the combine source, the ablations, capacities).
CASES = [
    ("stc", "softmax_token_choice", {}),
    ("stc_k2_bpr", "softmax_token_choice", {"k": 2, "batch_priority": True}),
    ("stc_switch_z", "softmax_token_choice", {"balance_loss": "switch", "z_loss": 0.1}),
    ("stc_noiseless", "softmax_token_choice", {"noise_std": 0.0, "balance_loss": "none"}),
    ("sinkhorn_tc", "sinkhorn_token_choice", {}),
    ("sinkhorn_tc_plan_combine", "sinkhorn_token_choice", {"softmax_combine": False, "k": 2}),
    ("svmoe", "svmoe", {}),
    ("sec", "softmax_expert_choice", {}),
    ("sec_c05", "softmax_expert_choice", {"capacity_factor": 0.5}),
    ("sinkhorn_ec", "sinkhorn_expert_choice", {"capacity_factor": 2.0}),
    ("sparsity_ec", "sparsity_constrained_expert_choice", {}),
    ("soft", "soft_moe", {"slots_per_expert": 2}),
    ("soft_unnormalized", "soft_moe", {"normalize": False}),
    ("soft_uniform_soft", "soft_moe", {"ablation": "uniform/soft"}),
    ("soft_identity", "soft_moe", {"slots_per_expert": 4, "ablation": "identity"}),
]


def inputs():
    """NumPy's generator: the same float32 inputs under every JAX version (``jax.random.normal``
    changed by an ulp between JAX 0.8 and 0.10)."""
    return np.random.default_rng(42).normal(size=(G, T, D)).astype(np.float32)


def outputs() -> dict[str, np.ndarray]:
    """Every case's routing tensors, auxiliary loss, probs and metrics, in training mode (noise
    drawn from the router's own stream) and in eval mode."""
    x, result = inputs(), {}
    for label, name, options in CASES:
        router = mm.make_router(name, D, E, rngs=nnx.Rngs(0), **options)
        for mode in ("train", "eval"):
            getattr(router, mode)()
            out = router(x)
            arrays = {"dispatch": out.routing.dispatch, "combine": out.routing.combine, "aux_loss": out.aux_loss,
                      "probs": out.probs, **{f"metric_{k}": v for k, v in out.metrics.items()}}
            for key, value in arrays.items():
                result[f"{label}/{mode}/{key}"] = np.asarray(value)
    return result


if __name__ == "__main__":
    PATH.parent.mkdir(exist_ok=True)
    np.savez_compressed(PATH, x=inputs(), jax_version=np.asarray(jax.__version__), **outputs())
    print(f"wrote {PATH}")
