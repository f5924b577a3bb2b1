"""Developer benchmark (issue 55 §1): mini_moe's routers against google-research/vmoe's, side by
side in one process, on the same inputs, at the router shapes of ``mini_moe.bench.ROUTER_SHAPES``
(G = 8 groups of T = 1024 or 392 tokens, E = 32, D = 768).

vmoe is not a dependency (CI has no vmoe): give the folder that holds its ``vmoe`` package::

    git clone https://github.com/google-research/vmoe /tmp/vmoe_src   # or any checkout
    python mini_moe/results/routers_vs_vmoe.py --vmoe /tmp/vmoe_src --repeats 10 --rounds 3 \
        --out mini_moe/results/routers_vs_vmoe-cpu-2core-epyc.json

(or set ``VMOE_PATH``). ``--cost-only`` skips the timing and reports XLA's cost analysis only.

Each pair computes the same thing: the router's dense combine tensor ``[G, T, E, C]`` plus its
auxiliary loss, reduced to ``sum(.^2)``; forward is that scalar, forward + backward its gradient
with respect to the router's parameters and the tokens (as ``mini_moe.bench.router_benchmarks``).
Both get the same tokens, the same router weights and the same capacity C (vmoe is given C, so
its default rounding up to a multiple of 4 does not enlarge its buffers). Noise: Token Choice
(V-MoE) draws its training noise in both; the other routers have none in mini_moe, so vmoe's
noise is off there too (``noise_std=0``).

vmoe's Sinkhorn routers import ``ott.core.sinkhorn``, which ott-jax removed; this script maps that
one call onto ott's current Sinkhorn solver (same options: ``lse_mode=False``, fixed iterations,
implicit differentiation) before importing vmoe.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import types

import jax
import jax.numpy as jnp
from flax import nnx

from mini_moe import bench

#: (label, mini_moe router and options, vmoe module path and class, vmoe options)
PAIRS = [
    ("TC k=1", "softmax_token_choice", {"k": 1},
     "vmoe.nn.routing", "NoisyTopExpertsPerItemRouter", {"num_selected_experts": 1}),
    ("TC k=2", "softmax_token_choice", {"k": 2},
     "vmoe.nn.routing", "NoisyTopExpertsPerItemRouter", {"num_selected_experts": 2}),
    ("EC", "softmax_expert_choice", {},
     "vmoe.nn.routing", "NoisyTopItemsPerExpertRouter", {"noise_std": 0.0}),
    ("Sinkhorn TC", "sinkhorn_token_choice", {},
     "vmoe.projects.sparsity_constrained_ot.kl_projection_routing", "KLProjectionNoisyTopExpertsPerItemRouter",
     {"num_selected_experts": 1, "noise_std": 0.0}),
    ("Sinkhorn EC", "sinkhorn_expert_choice", {},
     "vmoe.projects.sparsity_constrained_ot.kl_projection_routing", "KLProjectionNoisyTopItemsPerExpertRouter",
     {"noise_std": 0.0}),
    ("sparse EC", "sparsity_constrained_expert_choice", {},
     "vmoe.projects.sparsity_constrained_ot.sparse_projection_routing",
     "SparseProjectionTransportTopItemsPerExpertRouter", {"noise_std": 0.0}),
    ("Soft MoE", "soft_moe", {}, "vmoe.projects.soft_moe.router", "SoftRouter", {}),
]


def _ott_core_shim():
    """``ott.core.sinkhorn.sinkhorn(geom, ...)`` (the old functional API vmoe calls) on ott's
    current solver."""
    from ott.problems.linear import linear_problem
    from ott.solvers.linear import implicit_differentiation as implicit_lib
    from ott.solvers.linear import sinkhorn

    def old_sinkhorn(geom, a=None, b=None, *, lse_mode=True, implicit_differentiation=True,
                     min_iterations=0, max_iterations=2000):
        solver = sinkhorn.Sinkhorn(lse_mode=lse_mode, min_iterations=min_iterations, max_iterations=max_iterations,
                                   implicit_diff=implicit_lib.ImplicitDiff() if implicit_differentiation else None)
        return solver(linear_problem.LinearProblem(geom, a=a, b=b))

    core = types.ModuleType("ott.core")
    core.sinkhorn = types.SimpleNamespace(sinkhorn=old_sinkhorn)
    sys.modules.setdefault("ott.core", core)


def _vmoe_class(module: str, name: str):
    import importlib
    return getattr(importlib.import_module(module), name)


def _mini(name, shape, options):
    """mini_moe's router and tokens (``mini_moe.bench``'s construction)."""
    return bench._router_and_tokens(name, shape, nnx.Rngs(0), **options)


def _vmoe_fn(cls, options, router, x, capacity):
    """vmoe's router as ``loss(params, x)`` (the same scalar as mini_moe's), and its params
    holding mini_moe's weights."""
    if cls.__name__ == "SoftRouter":
        module = cls(num_experts=router.num_experts, num_slots=router.affinity.slots_per_expert, **options)
    else:
        dispatcher = {"name": "einsum", "capacity": capacity}
        if "TopExpertsPerItem" in cls.__name__:
            dispatcher["batch_priority"] = False
        module = cls(num_experts=router.num_experts, dispatcher=dispatcher, **options)
    key = jax.random.PRNGKey(1)
    params = module.init({"params": key, "gating": key}, x)["params"]
    if cls.__name__ == "SoftRouter":
        params = {"mu": jnp.asarray(router.affinity.phi[...]), "scale": jnp.asarray(router.affinity.scale[...])}
    else:
        params = {"dense": {"kernel": jnp.asarray(router.affinity.dense.kernel[...])}}

    def loss(params, x):
        dispatcher, metrics = module.apply({"params": params}, x, rngs={"gating": key})
        inner = getattr(dispatcher, "dispatcher", dispatcher)  # Soft MoE: Bfloat16Dispatcher
        return jnp.sum((inner.combine_weights + jnp.mean(metrics["auxiliary_loss"])) ** 2)

    return loss, params


def _cost(compiled) -> dict:
    """XLA's count of the FLOPs and bytes a compiled program moves (deterministic, unlike time)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"gflops": round(cost.get("flops", 0.0) / 1e9, 3),
            "gbytes_accessed": round(cost.get("bytes accessed", 0.0) / 1e9, 3)}


def compare(shape: str, repeats: int, rounds: int, cost_only: bool) -> list[dict]:
    """Every pair of :data:`PAIRS` at ``shape``: XLA's cost analysis and (unless ``cost_only``) the
    median over ``rounds`` of each program's median time over ``repeats`` calls."""
    rows = []
    for label, name, options, vmodule, vclass, voptions in PAIRS:
        router, x = _mini(name, shape, options)
        capacity = router.allocation.budget(x.shape[-2], router.num_experts).capacity
        loss, params = _vmoe_fn(_vmoe_class(vmodule, vclass), voptions, router, x, capacity)
        v_fwd, v_both = jax.jit(loss), jax.jit(jax.grad(loss, argnums=(0, 1)))
        m_both = bench._fwd_bwd(bench._routing_output)
        cost = {"mini_moe": _cost(m_both.lower(router, x).compile()), "vmoe": _cost(v_both.lower(params, x).compile())}
        row = {"shape": shape, "router": label, "mini_moe": name, "vmoe": vclass, "capacity": capacity,
               "tokens": list(x.shape), "cost_forward_backward": cost}
        if not cost_only:  # the four programs in turn, ``rounds`` times: drift hits both libraries alike
            calls = {("m", "forward_ms"): (bench._routing_loss, router),
                     ("m", "forward_backward_ms"): (m_both, router),
                     ("v", "forward_ms"): (v_fwd, params), ("v", "forward_backward_ms"): (v_both, params)}
            times = {key: [] for key in calls}
            for _ in range(rounds):
                for key, (fn, state) in calls.items():
                    times[key].append(bench.time_fn(fn, state, x, repeats=repeats))
            m, v = ({name: statistics.median(times[(lib, name)]) for lib, name in calls if lib == side}
                    for side in ("m", "v"))
            row.update({"mini_moe_ms": {k: round(t, 3) for k, t in m.items()},
                        "vmoe_ms": {k: round(t, 3) for k, t in v.items()},
                        "ratio_forward": round(m["forward_ms"] / v["forward_ms"], 3),
                        "ratio_forward_backward": round(m["forward_backward_ms"] / v["forward_backward_ms"], 3)})
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vmoe", default=os.environ.get("VMOE_PATH"),
                        help="folder holding vmoe's 'vmoe' package (default: $VMOE_PATH)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per program and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the four programs in turn")
    parser.add_argument("--shapes", nargs="+", default=list(bench.ROUTER_SHAPES), choices=list(bench.ROUTER_SHAPES))
    parser.add_argument("--cost-only", action="store_true", help="XLA's cost analysis only, no timing")
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args(argv)
    if not args.vmoe or not os.path.isdir(os.path.join(args.vmoe, "vmoe")):
        parser.error("give --vmoe (or VMOE_PATH): a folder that holds vmoe's 'vmoe' package")
    sys.path.insert(0, os.path.abspath(args.vmoe))
    _ott_core_shim()
    rows = [row for shape in args.shapes for row in compare(shape, args.repeats, args.rounds, args.cost_only)]
    result = {"machine": bench.machine(), "command": " ".join(["python"] + sys.argv), "repeats": args.repeats,
              "rounds": args.rounds, "routers_vs_vmoe": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
