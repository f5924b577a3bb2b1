"""Benchmarks (``python -m mini_moe bench``): ratios measured side by side in one run.

* ``routers`` — every router alone (logits, affinity, allocation: the routing tensors),
  forward and forward + backward, at the quick model's layer shape.
* ``layer`` — every router's MoE layer (router + experts + eq. 2), forward + backward,
  against a dense MLP with the same activated FLOPs (hidden H on every token; the MoE
  layer runs k = c = 1, i.e. about one expert of hidden H per token), at the quick
  model's shapes, at a B/32-like layer (8 images x 49 tokens, D=768, H=3072, E=32: about
  12 tokens per expert, so it measures weight traffic) and at a B/16-like group (16 images x
  196 tokens, E=8: 392 tokens per expert, so it measures routing). Each row also gives the
  achieved rate of useful FLOPs and its fraction of the machine's measured matmul peak.
  ``experts_only`` times the E experts on their E*C slots without any routing, so
  ``ratio_to_experts_only`` isolates what the router and dispatch/combine cost.
* ``soft_moe_experts`` — Soft MoE forward + backward as E goes from 8 to 256 with the
  total number of slots fixed (paper 002, Figure 6: the cost should stay flat).
* ``training`` — training images per second of each V-MoE and of the dense ViT at the
  quick configuration (random Fashion-MNIST-shaped data).

Times are medians over ``repeats`` calls after a warm-up (compilation excluded).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.resources
import io
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mini_moe
from mini_moe import layer as layer_lib
from mini_moe import routers as routers_lib
from mini_moe import routing as routing_lib
from mini_moe.model import DenseMlp, MoeLayer
from mini_moe.validate import InputError

#: The shapes of the layer benchmark by name, each (images per group, tokens per image, groups, D, H, E).
#: ``quick`` is the book's quick model, ``b32`` a B/32-like group and ``b16`` a B/16-like one.
LAYER_SHAPES = {
    "quick": (8, 49, 16, 64, 128, 8),
    "b32": (8, 49, 1, 768, 3072, 32),  # about 12 tokens per expert: measures weight traffic
    "b16": (16, 196, 1, 768, 3072, 8),  # 16 images of 196 tokens (B/16 at 224 px): 392 tokens per expert
}
#: The router shapes of issue 36 §5, where the routers were compared with google-research/vmoe's:
#: G = 8 routing groups of T = 1024 tokens (one 1024-token image each) or T = 392 (8 images of 49
#: tokens, B/32-like), E = 32 experts, D = 768 (same tuple layout as :data:`LAYER_SHAPES`).
ROUTER_SHAPES = {"g8_t1024": (1, 1024, 8, 768, 3072, 32), "g8_t392": (8, 49, 8, 768, 3072, 32)}
_SHAPES = {**LAYER_SHAPES, **ROUTER_SHAPES}


def committed(name: str) -> dict:
    """A results file committed with the package (``mini_moe/results/NAME``), e.g.
    ``committed("cpu-2core-epyc.json")``: works from a clone and from a pip install."""
    path = importlib.resources.files("mini_moe") / "results" / name
    if not path.is_file():
        available = sorted(p.name for p in (importlib.resources.files("mini_moe") / "results").iterdir()
                           if p.name.endswith(".json"))
        raise InputError(f"No committed results file {name!r}; available: {', '.join(available)}.")
    return json.loads(path.read_text())


def machine() -> dict:
    """The machine a result was measured on: CPU model, cores (``cores_used``: those this
    process may run on, e.g. 1 under ``taskset -c 0``), versions, backend, devices and date."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu, "cores": os.cpu_count(),
        "cores_used": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0], "jax": jax.__version__, "mini_moe": mini_moe.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def time_fn(fn, *args, repeats: int = 20) -> float:
    """Median wall time in milliseconds of ``fn(*args)`` (compiled once before timing)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def matmul_peak_gflops(n: int = 2048, repeats: int = 10) -> float:
    """The machine's measured float32 matmul rate (GFLOP/s): one ``[n, n] @ [n, n]`` product,
    ``2 n^3`` FLOPs, median of ``repeats`` timed calls. The yardstick for achieved FLOP/s."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n))
    ms = time_fn(jax.jit(jnp.dot), a, a, repeats=repeats)
    return 2 * n**3 / (ms * 1e-3) / 1e9


def mlp_flops(tokens: int, dim: int, hidden: int) -> int:
    """FLOPs of a two-layer MLP's forward + backward on ``tokens`` rows: two matmuls of
    ``2 tokens dim hidden`` forward, twice that backward (input and weight gradients). An MoE
    layer with one expert of hidden H per token (k = c = 1) does the same useful work."""
    return 3 * 2 * 2 * tokens * dim * hidden


def _fwd_bwd(module_fn):
    """jit(grad) of sum(out^2) w.r.t. the module's parameters and the input."""

    @nnx.jit
    def step(module, x):
        def loss(module, x):
            return jnp.sum(module_fn(module, x) ** 2)

        return nnx.grad(loss, argnums=(0, 1))(module, x)

    return step


def _router_and_tokens(name: str, shape: str, rngs: nnx.Rngs, **router_kwargs):
    """Router ``name`` at the ``LAYER_SHAPES[shape]`` (or ``ROUTER_SHAPES[shape]``) sizes and its
    input ``[G, T, D]``: ``groups`` routing groups of ``images x tokens`` tokens (Soft MoE: one
    group per image, S = C(tokens, E, 1) slots, :func:`mini_moe.routing.capacity`)."""
    if shape not in _SHAPES:
        raise InputError(f"shape must be one of {sorted(_SHAPES)}, got {shape!r}.")
    per_group, tokens, groups, dim, _, experts = _SHAPES[shape]
    spec = routers_lib.spec(name)
    if spec.allocation == "soft":
        router_kwargs.setdefault("slots_per_expert", routing_lib.capacity(tokens, experts, 1.0))
    router = routers_lib.make_router(name, dim, experts, rngs=rngs, **router_kwargs)
    x = jax.random.normal(jax.random.PRNGKey(0), (groups, per_group * tokens, dim))
    if spec.per_image:
        x = x.reshape(groups * per_group, tokens, dim)
    return router, x


def moe_layer_ms(name: str, shape: str = "quick", *, repeats: int = 20, hidden: int | None = None,
                 **router_kwargs) -> float:
    """Forward + backward time (ms, median) of one MoE layer with router ``name`` at the
    ``LAYER_SHAPES[shape]`` sizes (``hidden`` replaces its H): router + experts + eq. (2)."""
    rng = nnx.Rngs(0)
    router, x = _router_and_tokens(name, shape, rng, **router_kwargs)
    _, _, _, dim, shape_hidden, experts = LAYER_SHAPES[shape]
    hidden = hidden or shape_hidden
    null = router.allocation.null_experts
    module = MoeLayer(router, layer_lib.MlpExperts(experts, dim, hidden, rngs=rng),  # null experts: zero ones
                      null=layer_lib.NullExperts(("zero",) * null, dim, rngs=rng) if null else None)
    return time_fn(_fwd_bwd(_layer_output), module, x, repeats=repeats)


def _layer_output(layer, x):
    """An MoE layer's output as one array: eq. (2) plus the router's auxiliary loss."""
    y, out = layer(x)
    return y + out.aux_loss


def _routing_output(router, x):
    """A router's output as one array: its combine tensor plus its auxiliary loss."""
    out = router(x)
    return out.routing.combine + out.aux_loss


@nnx.jit
def _routing_loss(router, x):
    """The scalar whose gradient :func:`_fwd_bwd` takes (no ``[G, T, E, C]`` result to write)."""
    return jnp.sum(_routing_output(router, x) ** 2)


def router_benchmarks(repeats: int, shape: str = "quick") -> list[dict]:
    """Every router alone, forward and forward + backward (ms), at ``LAYER_SHAPES[shape]``:
    the combine tensor (plus the auxiliary loss) reduced to ``sum(.^2)``, and its gradient."""
    results = []
    for name in routers_lib.general_routers():
        router, x = _router_and_tokens(name, shape, nnx.Rngs(0))
        forward = time_fn(_routing_loss, router, x, repeats=repeats)
        both = time_fn(_fwd_bwd(_routing_output), router, x, repeats=repeats)
        results.append({"shape": shape, "router": name, "forward_ms": round(forward, 3),
                        "forward_backward_ms": round(both, 3)})
        print(f"  router {shape:5s} {name:36s} {forward:9.2f} ms fwd {both:9.2f} ms fwd+bwd", flush=True)
    return results


def reference_router_benchmarks(repeats: int) -> list[dict]:
    """:func:`router_benchmarks` at the :data:`ROUTER_SHAPES` (issue 36 §5: E = 32, D = 768,
    G = 8 groups of 1024 or 392 tokens)."""
    return [row for shape in ROUTER_SHAPES for row in router_benchmarks(repeats, shape)]


def dense_mlp_ms(shape: str = "quick", *, repeats: int = 20, hidden: int | None = None) -> float:
    """Forward + backward time (ms) of the dense MLP with the MoE layer's activated FLOPs
    (``hidden`` replaces the shape's H)."""
    per_group, tokens, groups, dim, shape_hidden, _ = LAYER_SHAPES[shape]
    hidden = hidden or shape_hidden
    x = jax.random.normal(jax.random.PRNGKey(0), (groups, per_group * tokens, dim))
    return time_fn(_fwd_bwd(lambda m, x: m(x)), DenseMlp(dim, hidden, rngs=nnx.Rngs(0)), x, repeats=repeats)


def experts_only_ms(shape: str = "quick", *, repeats: int = 20, hidden: int | None = None) -> float:
    """Forward + backward time (ms) of the E experts alone on their E * C slots (c = 1), no
    routing: the part of the layer no router can avoid (``hidden`` replaces the shape's H). On
    a CPU the E-fold larger expert weights (memory traffic) can make this alone exceed the
    dense MLP."""
    per_group, tokens, groups, dim, shape_hidden, experts = LAYER_SHAPES[shape]
    hidden = hidden or shape_hidden
    slots = jnp.ones((experts, groups * routing_lib.capacity(per_group * tokens, experts, 1.0), dim))
    module = layer_lib.MlpExperts(experts, dim, hidden, rngs=nnx.Rngs(0))
    return time_fn(_fwd_bwd(lambda m, x: m(x)), module, slots, repeats=repeats)


def equal_flops_options(name: str) -> dict:
    """Router options under which router ``name``'s layer activates the dense MLP's FLOPs:
    Token Choice at k = 1 (and c = 1, the routers' default capacity factor for k = 1); Expert
    Choice and Soft MoE at their defaults (c = 1, one slot per token on average)."""
    return {"k": 1} if routers_lib.spec(name).allocation == "token" else {}


#: The MLP widths H of :func:`layer_width_benchmarks` (the quick model's H = 128, then 4x and 16x).
LAYER_WIDTHS = (128, 512, 2048)


def layer_width_benchmarks(repeats: int, shape: str = "quick", widths=LAYER_WIDTHS) -> list[dict]:
    """What bounds an MoE layer against the dense MLP at a small shape: every router's layer,
    the experts alone on their slots and the dense MLP at ``LAYER_SHAPES[shape]`` with the
    hidden width H replaced by each of ``widths`` (forward + backward, ms). Routing, dispatch
    and combine work on ``[T, E]`` and ``[T, D]`` arrays whatever H is, so ``excess_ms`` (layer
    minus dense MLP) stays roughly fixed while the MLP's time grows with H. Token Choice routers
    run at k = 1 (c = 1), so that every layer activates the dense MLP's FLOPs."""
    results = []
    for hidden in widths:
        dense_ms = dense_mlp_ms(shape, repeats=repeats, hidden=hidden)
        experts_ms = experts_only_ms(shape, repeats=repeats, hidden=hidden)
        print(f"  width {shape:5s} H={hidden:5d} dense MLP {dense_ms:8.2f} ms, experts alone {experts_ms:8.2f} ms",
              flush=True)
        for name in routers_lib.general_routers():
            options = equal_flops_options(name)
            layer_ms = moe_layer_ms(name, shape, repeats=repeats, hidden=hidden, **options)
            results.append({"shape": shape, "hidden": hidden, "router": name, "options": options,
                            "dense_ms": round(dense_ms, 3), "experts_only_ms": round(experts_ms, 3),
                            "layer_ms": round(layer_ms, 3), "ratio": round(layer_ms / dense_ms, 3),
                            "excess_ms": round(layer_ms - dense_ms, 3)})
            print(f"  width {shape:5s} H={hidden:5d} {name:36s} {layer_ms:8.2f} ms  x{layer_ms / dense_ms:.2f}",
                  flush=True)
    return results


def layer_benchmarks(repeats: int) -> list[dict]:
    """Every router's MoE layer against the dense MLP of equal activated FLOPs at each of
    :data:`LAYER_SHAPES`, with the achieved rate of useful FLOPs (:func:`mlp_flops`) and its
    fraction of the measured matmul peak (:func:`matmul_peak_gflops`, first row). Token Choice
    routers run at k = 1 (:func:`equal_flops_options`)."""
    peak = matmul_peak_gflops()
    results = [{"shape": "-", "router": "matmul_peak", "gflops_per_s": round(peak, 2)}]
    print(f"  matmul peak {peak:.1f} GFLOP/s (float32, 2048^3)", flush=True)

    def rate(row, flops):
        row["gflops_per_s"] = round(flops / (row["ms"] * 1e-3) / 1e9, 2)
        row["fraction_of_peak"] = round(row["gflops_per_s"] / peak, 3)
        return row

    for shape_name, (per_group, tokens, groups, dim, hidden, experts) in LAYER_SHAPES.items():
        flops = mlp_flops(groups * per_group * tokens, dim, hidden)
        dense_ms = dense_mlp_ms(shape_name, repeats=repeats)
        results.append(rate({"shape": shape_name, "router": "dense_mlp", "ms": round(dense_ms, 3), "ratio": 1.0},
                            flops))
        experts_ms = experts_only_ms(shape_name, repeats=repeats)
        results.append(rate({"shape": shape_name, "router": "experts_only", "ms": round(experts_ms, 3),
                             "ratio": round(experts_ms / dense_ms, 3)}, flops))
        print(f"  layer {shape_name:5s} {'experts_only':36s} {experts_ms:9.2f} ms  x{experts_ms / dense_ms:.2f}", flush=True)
        for name in routers_lib.general_routers():
            options = equal_flops_options(name)
            ms = moe_layer_ms(name, shape_name, repeats=repeats, **options)
            results.append(rate({"shape": shape_name, "router": name, "options": options, "ms": round(ms, 3),
                                 "ratio": round(ms / dense_ms, 3), "ratio_to_experts_only": round(ms / experts_ms, 3)},
                                flops))
            print(f"  layer {shape_name:5s} {name:36s} {ms:9.2f} ms  x{ms / dense_ms:.2f}", flush=True)
    return results


#: The numbers of experts of the ``soft_moe_experts`` benchmark (E * S = 256 slots throughout).
SOFT_MOE_EXPERTS = (8, 16, 32, 64, 128, 256)


def _soft_moe_layer(experts: int, total_slots: int, dim: int, hidden: int) -> MoeLayer:
    rng = nnx.Rngs(0)
    router = routers_lib.make_router("soft_moe", dim, experts, slots_per_expert=total_slots // experts, rngs=rng)
    return MoeLayer(router, layer_lib.MlpExperts(experts, dim, hidden, rngs=rng))


def soft_moe_expert_costs(experts=SOFT_MOE_EXPERTS, total_slots: int = 256, images: int = 8, tokens: int = 64,
                          dim: int = 256, hidden: int = 1024) -> list[dict]:
    """XLA's cost analysis of the ``soft_moe_experts`` benchmark's compiled forward + backward,
    per number of ``experts`` (each must divide ``total_slots``): ``{"experts", "slots_per_expert",
    "flops", "bytes"}``, where ``bytes`` is XLA's "bytes accessed", what the compiled program reads
    and writes, parameters and gradients included. A compile-time count, the same on any machine
    with the same XLA; no timing."""
    x = jax.random.normal(jax.random.PRNGKey(0), (images, tokens, dim))
    out = []
    for num in experts:
        if total_slots % num:
            raise InputError(f"experts must divide total_slots={total_slots}, got {num}.")
        cost = compiled_cost(_fwd_bwd(_layer_output), _soft_moe_layer(num, total_slots, dim, hidden), x)
        out.append({"experts": num, "slots_per_expert": total_slots // num,
                    "flops": cost["flops"], "bytes": cost["bytes accessed"]})
    return out


def soft_moe_expert_benchmarks(repeats: int, total_slots: int = 256, images: int = 8, tokens: int = 64,
                               dim: int = 256, hidden: int = 1024) -> list[dict]:
    x = jax.random.normal(jax.random.PRNGKey(0), (images, tokens, dim))
    results = []
    for experts in SOFT_MOE_EXPERTS:
        module = _soft_moe_layer(experts, total_slots, dim, hidden)
        ms = time_fn(_fwd_bwd(_layer_output), module, x, repeats=repeats)
        results.append({"experts": experts, "slots_per_expert": total_slots // experts, "ms": round(ms, 3)})
        print(f"  soft_moe E={experts:4d} S={total_slots // experts:3d} {ms:9.2f} ms", flush=True)
    base = results[0]["ms"]
    for r in results:
        r["ratio_to_E8"] = round(r["ms"] / base, 3)
    return results


#: The shapes (groups, tokens per group, D, E) of the sparsity-constrained solver benchmark.
#: ``g1024`` is 8 groups of 1024 tokens; ``b32`` a B/32-like batch (8 images x 49 tokens in each group).
SOLVER_SHAPES = {"g1024": (8, 1024, 768, 32), "b32": (8, 392, 768, 32)}


def _pot_semi_dual_optimum(scores, max_nonzeros: int) -> dict:
    """POT's optimum of eq. (9)'s relaxations for one group ``[T, E]`` (``ot.smooth``, L-BFGS-B):
    the semi-dual and the dual, converted to our semi-dual F (minimised; POT maximises -F)."""
    try:
        import ot
    except ImportError as e:  # POT is a test dependency, not a runtime one
        raise InputError("The sparsity_solver benchmark compares with POT: pip install -e '.[test]'.") from e
    import numpy as np

    scores = np.asarray(scores, np.float64)
    num_tokens, num_experts = scores.shape
    a, b = np.ones(num_tokens), np.full(num_experts, num_tokens / num_experts)
    regul = ot.smooth.SparsityConstrained(max_nz=int(max_nonzeros), gamma=1.0)
    with contextlib.redirect_stdout(io.StringIO()):  # POT's k-sparse projection prints a debug shape per call
        alpha, semi = ot.smooth.solve_semi_dual(a, b, -scores, regul, tol=1e-10, max_iter=5000)
        _, _, dual = ot.smooth.solve_dual(a, b, -scores, regul, tol=1e-10, max_iter=5000)
        plan = ot.smooth.get_plan_from_semi_dual(alpha, b, -scores, regul)  # the plan at the semi-dual optimum
    return {"semi_dual": float(semi.fun), "dual": float(dual.fun), "best": float(min(semi.fun, dual.fun)),
            "mean_marginal_error": float(np.mean(np.abs(plan.sum(axis=1) - 1.0)))}


def sparsity_solver_benchmarks(repeats: int, pot_groups: int = 2) -> list[dict]:
    """The sparsity-constrained Expert Choice router against Softmax Expert Choice, forward +
    backward in one run, at :data:`SOLVER_SHAPES` and capacity factors 1 and 2; the solver's
    mean token-marginal error and semi-dual objective F, and F's gap to POT's optimum (the
    lower of its semi-dual and dual optima, on the first ``pot_groups`` groups), with the mean
    token-marginal error of the plan at POT's semi-dual optimum."""
    from mini_moe import transport

    results = []
    for shape, (groups, tokens, dim, experts) in SOLVER_SHAPES.items():
        x = jax.random.normal(jax.random.PRNGKey(0), (groups, tokens, dim))
        for factor in (1.0, 2.0):
            row = {"shape": shape, "groups": groups, "tokens": tokens, "dim": dim, "experts": experts,
                   "capacity_factor": factor}
            for name in ("softmax_expert_choice", "sparsity_constrained_expert_choice"):
                router = routers_lib.make_router(name, dim, experts, capacity_factor=factor, rngs=nnx.Rngs(0))
                row[f"{name}_ms"] = round(time_fn(_fwd_bwd(_routing_output), router, x, repeats=repeats), 3)
            row["ratio"] = round(row["sparsity_constrained_expert_choice_ms"] / row["softmax_expert_choice_ms"], 3)
            probs = jax.nn.softmax(router.logits(x), axis=-1)
            cap = router.allocation.budget(tokens, experts).capacity
            solver = router.affinity
            optima = [_pot_semi_dual_optimum(probs[g], cap) for g in range(pot_groups)]
            pot = [o["best"] for o in optima]
            for label, options in (("router", dict(tol=solver.tol, max_iters=solver.max_iters)), ("default", {})):
                _, info = transport.sparsity_constrained_plan(probs, max_nonzeros=cap, return_info=True, **options)
                row[f"{label}_iterations"] = int(jnp.max(info.iterations))
                row[f"{label}_mean_marginal_error"] = round(float(jnp.mean(info.mean_marginal_error)), 4)
                gaps = [float(info.objective[g]) - pot[g] for g in range(pot_groups)]
                row[f"{label}_objective_gap"] = [round(g, 5) for g in gaps]
                row[f"{label}_objective_relative_gap"] = [round(g / abs(p), 7) for g, p in zip(gaps, pot)]
            row["pot_objective"] = [round(p, 5) for p in pot]
            # F's optimum is not the most balanced plan: the error of POT's semi-dual solution, same groups.
            row["pot_mean_marginal_error"] = [round(o["mean_marginal_error"], 4) for o in optima]
            results.append(row)
            print(f"  solver {shape:5s} c={factor:g} EC {row['softmax_expert_choice_ms']:8.2f} ms  sparse "
                  f"{row['sparsity_constrained_expert_choice_ms']:8.2f} ms  x{row['ratio']:.2f}  "
                  f"error {row['router_mean_marginal_error']:.4f}  F gap {row['router_objective_relative_gap']}",
                  flush=True)
    return results


def training_benchmarks(repeats: int) -> list[dict]:
    from mini_moe import config as config_lib
    from mini_moe import train as train_lib

    results = []
    for name in [None] + routers_lib.general_routers():
        cfg = config_lib.get_config("quick", dataset="fashion_mnist", router=name)
        model = train_lib.make_model(cfg)
        optimizer = train_lib.make_optimizer(model, cfg)
        images = jax.random.normal(jax.random.PRNGKey(0), (cfg.batch_size, 28, 28, 1))
        labels = jnp.zeros((cfg.batch_size,), jnp.int32)

        def step(model, optimizer, images, labels):
            return train_lib.train_step(model, optimizer, images, labels, aux_weight=cfg.aux_loss_weight)["loss"]

        ms = time_fn(step, model, optimizer, images, labels, repeats=max(3, repeats // 2))
        results.append({"router": name or "dense_vit", "batch": cfg.batch_size, "ms_per_step": round(ms, 2),
                        "images_per_second": round(1e3 * cfg.batch_size / ms, 1)})
        print(f"  train {name or 'dense_vit':36s} {ms:8.1f} ms/step {1e3 * cfg.batch_size / ms:8.0f} img/s", flush=True)
    dense = results[0]["images_per_second"]
    for r in results:
        r["throughput_vs_dense"] = round(r["images_per_second"] / dense, 3)
    return results


def compiled_cost(fn, *args) -> dict:
    """XLA's cost analysis of the compiled ``fn(*args)``, ``args[0]`` an NNX module:
    ``{"flops", "bytes accessed"}`` (NaN where the backend does not report one; loops counted once)."""
    graphdef, state = nnx.split(args[0])
    cost = jax.jit(lambda state, *rest: fn(nnx.merge(graphdef, state), *rest)).lower(state, *args[1:]) \
        .compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {key: float(cost.get(key, float("nan"))) for key in ("flops", "bytes accessed")}


def compiled_flops(fn, *args) -> float:
    """XLA's FLOP count of the compiled ``fn(*args)`` (:func:`compiled_cost`)."""
    return compiled_cost(fn, *args)["flops"]


def _dropless_point(shape_name: str, k: int, path: str, kernel: str, repeats: int, block: int | None = None) -> dict:
    """One point of :func:`dropless_benchmarks`: Softmax Token Choice with ``k`` at
    ``LAYER_SHAPES[shape_name]``, the gather path (``path="gather"``) or the dropless path with the
    grouped-matmul ``kernel`` (``block``: the blocked kernel's rows per block, default
    :func:`mini_moe.layer.default_block`); forward + backward ``ms`` and ``gflop``, and for the
    blocked kernel its ``block``, used ``blocks`` and ``padding`` (padding rows over picks). The router
    runs without its training noise."""
    per_group, tokens, groups, dim, hidden, experts = LAYER_SHAPES[shape_name]
    rng = nnx.Rngs(0)
    router, x = _router_and_tokens("softmax_token_choice", shape_name, rng, k=k)
    module = MoeLayer(router, layer_lib.MlpExperts(experts, dim, hidden, rngs=rng, kernel=kernel, block=block),
                      path="gather" if path == "gather" else "dropless")
    module.eval()  # no router noise: every call routes alike, so the picks counted below are the timed ones
    out = {"ms": round(time_fn(_fwd_bwd(_layer_output), module, x, repeats=repeats), 3)}
    flops = compiled_flops(
        lambda m, x: nnx.grad(lambda m, x: jnp.sum(_layer_output(m, x) ** 2), argnums=(0, 1))(m, x), module, x)
    if kernel == "blocked":
        rows = groups * per_group * tokens * k
        size = layer_lib.default_block(rows, experts) if block is None else block
        load = routing_lib.pick_load(router(x, dropless=True).affinities.scores, k=k)
        used = int(np.sum(np.ceil(np.asarray(load) / size)))
        # the loop bodies were counted once: add the other used blocks' (forward, d rows, d weights)
        flops += (used - 1) * 3 * 2 * size * (dim * hidden + hidden * dim)
        out |= {"block": size, "blocks": used, "padding": round(used * size / rows - 1, 4)}
    return out | {"gflop": round(flops / 1e9, 4)}


def dropless_block_sweep(repeats: int) -> list[dict]:
    """The blocked kernel's trade-off (issue 66 §5): at every :data:`LAYER_SHAPES` size and k = 1, 2,
    its time and FLOPs relative to the gather path at half, once and twice the default block
    (:func:`mini_moe.layer.default_block`; at least 4 rows). Smaller blocks pad less and read each
    expert's weights more often."""
    results = []
    for shape_name in LAYER_SHAPES:
        for k in (1, 2):
            gather = _dropless_point(shape_name, k, "gather", "auto", repeats)
            per_group, tokens, groups, _, _, experts = LAYER_SHAPES[shape_name]
            default = layer_lib.default_block(groups * per_group * tokens * k, experts)
            for block in sorted({max(4, default // 2), default, 2 * default}):
                point = _dropless_point(shape_name, k, "blocked", "blocked", repeats, block=block)
                results.append({"shape": shape_name, "k": k, "block": block, "default": block == default,
                                "gather_ms": gather["ms"], "blocked_ms": point["ms"], "padding": point["padding"],
                                "time_ratio": round(point["ms"] / gather["ms"], 3),
                                "flop_ratio": round(point["gflop"] / gather["gflop"], 3)})
                print(f"  block sweep {shape_name:5s} k={k} block {block:4d}: x{results[-1]['time_ratio']:.2f} time "
                      f"x{results[-1]['flop_ratio']:.2f} FLOPs", flush=True)
    return results


def dropless_benchmarks(repeats: int) -> list[dict]:
    """Dropless Token Choice (the layer's ``"dropless"`` path: sort, grouped matmuls) against the
    gather path at its usual capacity (c = k), Softmax Token Choice with k = 1 and 2 at every
    :data:`LAYER_SHAPES` size: forward + backward time and FLOPs of the compiled step, for two
    grouped-matmul kernels. ``ragged_dot`` (``dropless_*``): the backend's lowering decides the
    FLOPs; a generic one computes every row against every expert (about E times a grouped matmul's
    work). ``blocked`` (``blocked_*``, :func:`mini_moe.layer.blocked_matmul`): its loops' bodies
    are counted once by XLA's cost analysis, so its FLOPs are the compiled count plus the bodies of
    the other used blocks (``blocked_blocks``, from this input's picks per expert): the FLOPs
    executed."""
    results = []
    for shape_name in LAYER_SHAPES:
        for k in (1, 2):
            row = {"shape": shape_name, "k": k, "backend": jax.default_backend()}
            for path, kernel in (("gather", "auto"), ("dropless", "ragged_dot"), ("blocked", "blocked")):
                point = _dropless_point(shape_name, k, path, kernel, repeats)
                row |= {f"{path}_ms": point["ms"], f"{path}_gflop": point["gflop"]}
                if kernel == "blocked":
                    row |= {f"blocked_{key}": point[key] for key in ("block", "blocks", "padding")}
            for path in ("dropless", "blocked"):
                row[f"{path}_time_ratio"] = round(row[f"{path}_ms"] / row["gather_ms"], 3)
                row[f"{path}_flop_ratio"] = round(row[f"{path}_gflop"] / row["gather_gflop"], 3)
            row["time_ratio"], row["flop_ratio"] = row["dropless_time_ratio"], row["dropless_flop_ratio"]
            results.append(row)
            print(f"  dropless {shape_name:5s} k={k} gather {row['gather_ms']:9.2f} ms | ragged_dot "
                  f"x{row['dropless_time_ratio']:.2f} time x{row['dropless_flop_ratio']:.2f} FLOPs | blocked "
                  f"(block {row['blocked_block']}) x{row['blocked_time_ratio']:.2f} time "
                  f"x{row['blocked_flop_ratio']:.2f} FLOPs", flush=True)
    return results


def loss_free_benchmarks(repeats: int, rounds: int = 7) -> list[dict]:
    """What auxiliary-loss-free balancing's bias update costs a training step: the quick
    Fashion-MNIST model with ``sigmoid_loss_free`` and ``group_limited``, bias update on
    (``bias_rate=1e-3``) and off (``bias_rate=0``). The two steps are timed in alternation,
    ``rounds`` times ``repeats`` calls each, so that a change of load on the machine hits both;
    ``overhead`` is the median over rounds of (with / without - 1)."""
    from mini_moe import config as config_lib
    from mini_moe import train as train_lib

    results = []
    for name in ("sigmoid_loss_free", "group_limited"):
        steps = {}
        for rate in (0.0, 1e-3):
            cfg = config_lib.get_config("quick", dataset="fashion_mnist", router=name,
                                        model_router_kwargs={"bias_rate": rate})
            model = train_lib.make_model(cfg)
            optimizer = train_lib.make_optimizer(model, cfg)
            images = jax.random.normal(jax.random.PRNGKey(0), (cfg.batch_size, 28, 28, 1))
            labels = jnp.zeros((cfg.batch_size,), jnp.int32)

            def step(model, optimizer, images, labels, weight=cfg.aux_loss_weight):
                return train_lib.train_step(model, optimizer, images, labels, aux_weight=weight)["loss"]

            steps[rate] = (step, (model, optimizer, images, labels))
        times = {rate: [] for rate in steps}
        for _ in range(rounds):
            for rate, (step, args) in steps.items():
                times[rate].append(time_fn(step, *args, repeats=repeats))
        ratios = [with_ / without - 1 for with_, without in zip(times[1e-3], times[0.0])]
        row = {"router": name, "no_update_ms": round(statistics.median(times[0.0]), 3),
               "update_ms": round(statistics.median(times[1e-3]), 3), "overhead": round(statistics.median(ratios), 4),
               "rounds": rounds}
        results.append(row)
        print(f"  loss-free {name:20s} {row['no_update_ms']:8.2f} ms without, {row['update_ms']:8.2f} ms with the "
              f"bias update ({100 * row['overhead']:+.1f} %, median of {rounds} alternating rounds)", flush=True)
    return results


#: The parts of :func:`run`, in order; ``python -m mini_moe bench --only`` offers these names.
PARTS = {"routers": router_benchmarks, "routers_reference": reference_router_benchmarks, "layer": layer_benchmarks,
         "layer_width": layer_width_benchmarks,
         "soft_moe_experts": soft_moe_expert_benchmarks, "training": training_benchmarks,
         "sparsity_solver": sparsity_solver_benchmarks, "dropless": dropless_benchmarks,
         "dropless_blocks": dropless_block_sweep,
         "loss_free": loss_free_benchmarks}


def run(repeats: int = 20, only: str | None = None) -> dict:
    """Run the benchmarks (all, or ``only`` one part of :data:`PARTS`) and return a JSON-able dict."""
    if only is not None and only not in PARTS:
        raise InputError(f"only must be one of {list(PARTS)}, got {only!r}.")
    results = {"machine": machine(), "command": " ".join(["python -m mini_moe"] + sys.argv[1:]),
               "repeats": repeats}
    for name, fn in PARTS.items():
        if only in (None, name):
            print(f"[{name}]", flush=True)
            results[name] = fn(repeats)
    return results


def summary(results: dict) -> str:
    lines = [f"machine: {results['machine']['cpu']} ({results['machine']['cores']} cores, "
             f"{results['machine']['backend']})"]
    for r in results.get("routers", []) + results.get("routers_reference", []):
        lines.append(f"router {r['shape']:5s} {r['router']:36s} {r['forward_ms']:9.2f} ms fwd "
                     f"{r['forward_backward_ms']:9.2f} ms fwd+bwd")
    for r in results.get("layer", []):
        if "ms" not in r:  # the matmul peak
            lines.append(f"layer matmul peak {r['gflops_per_s']:.1f} GFLOP/s")
            continue
        extra = f"  x{r['ratio_to_experts_only']:.2f} experts-only" if "ratio_to_experts_only" in r else ""
        lines.append(f"layer {r['shape']:5s} {r['router']:36s} {r['ms']:9.2f} ms  x{r['ratio']:.2f} dense{extra}"
                     f"  {r.get('gflops_per_s', 0):7.1f} GFLOP/s")
    for r in results.get("layer_width", []):
        lines.append(f"width {r['shape']:5s} H={r['hidden']:5d} {r['router']:36s} {r['layer_ms']:8.2f} ms  "
                     f"x{r['ratio']:.2f} dense, {r['excess_ms']:+.2f} ms over it")
    for r in results.get("soft_moe_experts", []):
        lines.append(f"soft_moe E={r['experts']:4d} {r['ms']:9.2f} ms  x{r['ratio_to_E8']:.2f} of E=8")
    for r in results.get("sparsity_solver", []):
        lines.append(f"solver {r['shape']:5s} c={r['capacity_factor']:g} sparse/EC x{r['ratio']:.2f} "
                     f"error {r['router_mean_marginal_error']:.4f} F gap {r['router_objective_relative_gap']}")
    for r in results.get("dropless", []):
        blocked = (f"; blocked x{r['blocked_time_ratio']:.2f} time x{r['blocked_flop_ratio']:.2f} FLOPs"
                   if "blocked_time_ratio" in r else "")
        lines.append(f"dropless {r['shape']:5s} k={r['k']} ragged_dot x{r['time_ratio']:.2f} time x{r['flop_ratio']:.2f} "
                     f"FLOPs{blocked} of gather ({r['backend']})")
    for r in results.get("loss_free", []):
        lines.append(f"loss-free {r['router']:20s} bias update {100 * r['overhead']:+.1f} % of a training step")
    for r in results.get("training", []):
        lines.append(f"train {r['router']:36s} {r['images_per_second']:8.0f} img/s  x{r['throughput_vs_dense']:.2f} dense")
    return "\n".join(lines)
