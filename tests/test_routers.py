"""Trainable routers: registry, semantics of each affinity/allocation pair, grads, jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mini_moe as mm
from mini_moe import layer, losses, routers, routing, transport

D, E, T, G = 8, 4, 12, 2
ALL = sorted(mm.ROUTERS)


def _x(seed=0, shape=(G, T, D)):
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


def _make(name, **kw):
    return mm.make_router(name, D, E, rngs=nnx.Rngs(0), **kw)


def test_registry_has_every_router_of_the_papers():
    assert set(ALL) == {
        "softmax_token_choice", "sinkhorn_token_choice", "softmax_expert_choice",
        "sinkhorn_expert_choice", "sparsity_constrained_expert_choice", "soft_moe", "svmoe",
        "sigmoid_loss_free", "group_limited",  # DeepSeek-V3 (issue 26)
        "remoe",  # ReLU routing (issue 26)
        "hash",  # a routing control: nothing learned (issue 34)
        "adamoe", "longcat",  # null experts in the choice set (issue 54)
        "raw_oracle", "raw_blind", "raw_lsh",  # routing controls on the raw patch (issue 65)
    } | ({"top_p"} if "top_p" in ALL else set())  # token-adaptive k (issue 54)
    with pytest.raises(ValueError, match="Unknown router 'topk'.*softmax_token_choice"):
        mm.make_router("topk", D, E, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("name", [n for n in ALL if mm.ROUTERS[n].data is None])  # raw_oracle: subtask_vote only
def test_every_router_routes_trains_and_jits(name):
    router = _make(name)
    experts = layer.MlpExperts(E, D, 16, rngs=nnx.Rngs(1))
    x = _x()
    out = router(x)
    d = np.asarray(out.routing.dispatch)
    assert d.shape[:3] == (G, T, E)
    assert np.isfinite(float(out.aux_loss))
    for key in ("dropped", "experts_per_token", "tokens_per_expert", "buffer_fill"):
        assert np.all(np.isfinite(np.asarray(out.metrics[key])))
    if out.routing.sparse:
        assert set(np.unique(d)) <= {0.0, 1.0}
        assert (d.sum(axis=1) <= 1).all()  # one token per slot, hence <= C per expert

    def loss(router, experts, x):
        o = router(x)
        return jnp.mean(layer.moe(x, o.routing, experts) ** 2) + o.aux_loss

    grads = nnx.grad(loss, argnums=(0, 1))(router, experts, x)
    leaves = jax.tree.leaves(nnx.state(grads))
    assert leaves and all(np.all(np.isfinite(g)) for g in leaves)
    router_grad = sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(nnx.state(grads[0])))
    if not getattr(router.affinity, "learned", True):  # the controls (hash, raw keys): nothing to learn
        assert not jax.tree.leaves(nnx.state(router, nnx.Param)) and router_grad == 0
    else:
        assert router_grad > 0  # the router learns through the combine weights

    router.eval()  # jit and eager agree (no noise in eval mode)
    eager = router(x)
    jitted = nnx.jit(lambda r, x: r(x))(router, x)
    np.testing.assert_allclose(eager.routing.combine, jitted.routing.combine, rtol=1e-4, atol=1e-6)


def test_softmax_token_choice_noise_and_losses():
    router = _make("softmax_token_choice", k=2)
    x = _x()
    a, b = router(x), router(x)  # training mode: fresh noise every call
    assert not np.allclose(a.routing.combine, b.routing.combine)
    router.eval()
    c, d = router(x), router(x)
    np.testing.assert_array_equal(c.routing.combine, d.routing.combine)
    logits = router.logits(x)
    expected = routing.token_choice(jax.nn.softmax(logits), capacity=routing.capacity(T, E, 2), k=2)
    np.testing.assert_allclose(c.routing.combine, expected.combine, rtol=1e-6)
    np.testing.assert_allclose(c.metrics["importance_loss"], losses.importance_loss(logits), rtol=1e-6)
    # In eval mode the noisy logits are the clean ones.
    np.testing.assert_allclose(
        c.metrics["load_loss"], losses.load_loss(logits, logits, k=2, noise_std=1.0), rtol=1e-6
    )
    np.testing.assert_allclose(c.aux_loss, (c.metrics["importance_loss"] + c.metrics["load_loss"]) / 2)
    off = _make("softmax_token_choice", balance_loss=False)
    assert float(off(x).aux_loss) == 0.0
    switch = _make("softmax_token_choice", k=2, balance_loss="switch", z_loss=0.1, deterministic=True)
    s = switch(x)
    np.testing.assert_allclose(s.metrics["switch_loss"], losses.switch_loss(jax.nn.softmax(logits), k=2), rtol=1e-6)
    np.testing.assert_allclose(s.metrics["z_loss"], losses.z_loss(logits), rtol=1e-6)
    np.testing.assert_allclose(s.aux_loss, s.metrics["switch_loss"] + 0.1 * s.metrics["z_loss"], rtol=1e-6)
    with pytest.raises(ValueError, match="balance_loss must be one of"):
        _make("softmax_token_choice", balance_loss="gshard")
    with pytest.raises(ValueError, match="z_loss must be >= 0"):
        _make("softmax_token_choice", z_loss=-1.0)


def test_softmax_token_choice_noise_has_std_noise_std_over_e():
    router = _make("softmax_token_choice", noise_std=1.0)
    x = _x(shape=(1, 2000, D))
    clean = jax.nn.softmax(router.logits(x))
    out = router(x)  # with T=2000 and C=T/E nothing we compare depends on drops
    # Recover the noisy softmax at the chosen expert of kept tokens: combine = softmax(noisy).
    kept = np.asarray(out.routing.dispatch).sum(axis=(-1,)) > 0
    noisy_p = np.asarray(out.routing.combine).sum(axis=-1)[kept]
    clean_p = np.asarray(clean)[kept]
    # log p_noisy - log p_clean = noise_r - logsumexp shift; its spread tracks the noise std.
    spread = np.std(np.log(noisy_p) - np.log(clean_p))
    assert 0.5 * (1.0 / E) < spread < 1.6 * (1.0 / E)


@pytest.mark.parametrize("name", ["sinkhorn_token_choice", "sinkhorn_expert_choice"])
def test_sinkhorn_routers_softmax_combine_switch(name):
    x = _x()
    with_sm = _make(name, softmax_combine=True, num_iters=30)
    without = _make(name, softmax_combine=False, num_iters=30)
    logits = with_sm.logits(x)
    plan = transport.sinkhorn(logits, num_iters=30)
    if "token" in name:
        expected = routing.token_choice(plan, capacity=routing.capacity(T, E, 1), combine_scores=jax.nn.softmax(logits))
    else:
        expected = routing.expert_choice(plan, capacity=routing.capacity(T, E, 1), combine_scores=jax.nn.softmax(logits))
    got = with_sm(x).routing
    np.testing.assert_array_equal(got.dispatch, expected.dispatch)  # positions from the plan
    np.testing.assert_allclose(got.combine, expected.combine, rtol=1e-5)  # values from softmax
    plain = without(x).routing
    np.testing.assert_array_equal(plain.dispatch, expected.dispatch)
    np.testing.assert_allclose(plain.combine, plain.dispatch * np.asarray(plan)[..., None], rtol=1e-4)


def test_sinkhorn_token_choice_balances_better_than_softmax():
    # Skewed logits: softmax top-1 sends most tokens to expert 0; Sinkhorn spreads them.
    router = _make("sinkhorn_token_choice", num_iters=50)
    x = _x(shape=(1, 64, D))
    bias = jnp.zeros((D, E)).at[:, 0].set(0.5)
    router.affinity.dense.kernel[...] = router.affinity.dense.kernel[...] + bias
    soft = _make("softmax_token_choice")
    soft.affinity.dense.kernel[...] = router.affinity.dense.kernel[...]
    soft.eval()
    dropped_sinkhorn = float(router(x).metrics["dropped"])
    dropped_softmax = float(soft(x).metrics["dropped"])
    assert dropped_sinkhorn < dropped_softmax


def test_svmoe_uses_quadratic_plan_with_gamma_one_over_k():
    router = _make("svmoe", k=2, num_iters=30)
    x = _x()
    probs = jax.nn.softmax(router.logits(x))
    plan = transport.quadratic_plan(probs, gamma=0.5, num_iters=30)
    expected = routing.token_choice(plan, capacity=routing.capacity(T, E, 2), k=2, combine_scores=probs)
    got = router(x).routing
    np.testing.assert_array_equal(got.dispatch, expected.dispatch)
    np.testing.assert_allclose(got.combine, expected.combine, rtol=1e-5)


def test_sparsity_constrained_router_dispatches_the_plan_support():
    router = _make("sparsity_constrained_expert_choice", capacity_factor=2.0)
    x = _x()
    out = router(x)
    probs = jax.nn.softmax(router.logits(x))
    cap = routing.capacity(T, E, 2.0)
    plan = transport.sparsity_constrained_plan(probs, max_nonzeros=cap, tol=router.affinity.tol, max_iters=router.affinity.max_iters)
    d = np.asarray(out.routing.dispatch).sum(-1)
    support = np.asarray(plan) > 0
    assert (d[support] == 1).all()  # every token of the plan's support is dispatched
    np.testing.assert_allclose(out.routing.combine, out.routing.dispatch * np.asarray(probs)[..., None], rtol=1e-5)
    assert int(out.metrics["solver_iterations"]) >= 1
    assert float(out.metrics["solver_marginal_error"]) >= 0


def test_expert_choice_capacity_factor():
    out = _make("softmax_expert_choice", capacity_factor=2.0)(_x())
    assert out.routing.dispatch.shape[-1] == routing.capacity(T, E, 2.0) == 6
    np.testing.assert_array_equal(np.asarray(out.metrics["tokens_per_expert"]), 6.0)  # buffers full
    np.testing.assert_allclose(float(out.metrics["buffer_fill"]), 1.0)


def test_soft_moe_normalisation_and_scale():
    router = _make("soft_moe", slots_per_expert=2)
    assert float(router.affinity.scale[...]) == 1.0
    x = _x(shape=(3, T, D))
    z = router.logits(x)
    assert z.shape == (3, T, E, 2)
    np.testing.assert_allclose(z, router.logits(7.0 * x), rtol=1e-4, atol=1e-5)  # l2 normalised tokens
    assert float(jnp.max(jnp.abs(z))) <= 1.0 + 1e-5  # cosine similarities times scale 1
    router.affinity.scale[...] = jnp.asarray(3.0)
    np.testing.assert_allclose(router.logits(x), 3.0 * z, rtol=1e-4, atol=1e-5)
    # l2_normalize keeps eps inside the root: zero vectors stay finite.
    assert np.all(np.isfinite(routers.l2_normalize(jnp.zeros((2, 3)), axis=-1)))
    raw = _make("soft_moe", normalize=False)
    np.testing.assert_allclose(raw.logits(x), jnp.einsum("gtd,des->gtes", x, raw.affinity.phi[...]), rtol=1e-5)
    out = router(x)
    np.testing.assert_allclose(out.routing.dispatch.sum(axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(out.routing.combine.sum(axis=(2, 3)), 1.0, rtol=1e-5)


@pytest.mark.parametrize("ablation", ["soft/uniform", "uniform/soft", "uniform", "identity"])
def test_soft_moe_ablations_of_paper_002_table_2(ablation):
    router = _make("soft_moe", slots_per_expert=T // E, ablation=ablation)
    x = _x()
    rt = router(x).routing
    soft = routing.soft_routing(router.logits(x))
    uniform_d, uniform_c = 1.0 / T, 1.0 / T  # E * S = T slots here
    if ablation == "identity":
        eye = np.eye(T).reshape(T, E, T // E)
        np.testing.assert_array_equal(rt.dispatch[0], eye)
        np.testing.assert_array_equal(rt.combine[1], eye)
        np.testing.assert_allclose(layer.moe(x, rt, lambda s: 2 * s), 2 * x, rtol=1e-6)  # token t -> slot t
        with pytest.raises(ValueError, match="identity routing needs"):
            _make("soft_moe", ablation="identity")(x)
        return
    d_kind, c_kind = (ablation.split("/") * 2)[:2]
    np.testing.assert_allclose(rt.dispatch, soft.dispatch if d_kind == "soft" else uniform_d, rtol=1e-6)
    np.testing.assert_allclose(rt.combine, soft.combine if c_kind == "soft" else uniform_c, rtol=1e-6)


@pytest.mark.parametrize(
    "name, kwargs, match",
    [
        ("softmax_token_choice", {"k": 0}, "k"),
        ("softmax_token_choice", {"k": E + 1}, "k must be <="),
        ("sinkhorn_token_choice", {"capacity_factor": 0.0}, "capacity_factor"),
        ("softmax_expert_choice", {"capacity_factor": -1.0}, "capacity_factor"),
        ("sinkhorn_expert_choice", {"epsilon": 0.0}, "epsilon"),
        ("softmax_token_choice", {"noise_std": -1.0}, "noise_std"),
        ("soft_moe", {"ablation": "random"}, "ablation"),
        ("soft_moe", {"slots_per_expert": 0}, "slots_per_expert"),
    ],
)
def test_bad_router_arguments(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _make(name, **kwargs)


@pytest.mark.parametrize("name", [n for n in ALL if mm.ROUTERS[n].data is None])  # raw_oracle: subtask_vote only
def test_wrong_token_dimension_raises(name):
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., T, D=8\]"):
        _make(name)(jnp.ones((G, T, D + 1)))


def test_registered_routers_outputs_are_unchanged():
    """Every registered router (and the options that change its computation) gives the outputs
    recorded in ``tests/data/router_golden.npz`` on the recorded inputs, on any CPU and JAX.

    What is exact: the routing decisions (which token sits in which slot: sparse dispatch masks,
    the support of the combine tensor, counts of dropped tokens). What is compared with a
    tolerance: every float. The recorded floats are reproduced only to round-off, because XLA
    picks other instructions on another CPU (AVX-512 vs AVX2 vs NEON: fused multiply-adds,
    vectorised exp and reductions in another order). The bound: float32's unit round-off is
    u = 6e-8; the longest chain here (an l2 norm and a dot product over D = 8, an exp of
    logits of magnitude up to ~10, whose relative error is the logit's absolute error, and a
    sum over up to T = 16 or E * S = 16 terms, twice for Soft MoE) accumulates at most about
    100 u, i.e. 6e-6, so rtol = 1e-5; atol = 1e-7 covers entries that are zero in one run and
    a few ulps of 1.0 away from zero in the other. Measured: at most 4.2e-7 relative (Soft
    MoE's combine) between the Intel Xeon that recorded the file and an AMD EPYC, also with
    ``XLA_FLAGS=--xla_cpu_max_isa=AVX2``."""
    import router_golden

    golden = np.load(router_golden.PATH)
    np.testing.assert_array_equal(golden["x"], router_golden.inputs())
    now = router_golden.outputs()
    recorded = {k: golden[k] for k in golden.files if k not in ("x", "jax_version")}
    # Since 0.2 the identity ablation also reports the slot logits' scale (the router is a
    # composition and the affinity runs); every recorded output is unchanged.
    added = {f"soft_identity/{mode}/metric_scale" for mode in ("train", "eval")}
    # Since 0.4 (issue 26) Token Choice routers also report their load's max violation (Wang et al.);
    # every recorded output is unchanged.
    added |= {key for key in now if key.endswith("/metric_max_violation")}
    # Since issue 52 §4 they also report the load itself (``pick_load``, [E]), from which an
    # accumulated step computes the whole batch's max violation; every recorded output is unchanged.
    added |= {key for key in now if key.endswith("/metric_pick_load")}
    assert sorted(set(now) - added) == sorted(recorded)
    # The sparsity-constrained solver changed on purpose (0.2: warm start, reused top-C sets, momentum):
    # its plan decides which tokens fill the slots, so those outputs must be as valid and no worse
    # balanced than the recorded ones; everything else about the router is unchanged.
    solver = {f"sparsity_ec/{mode}/{key}" for mode in ("train", "eval")
              for key in ("dispatch", "combine", "metric_dropped", "metric_solver_marginal_error")}
    for mode in ("train", "eval"):
        key = f"sparsity_ec/{mode}/"
        np.testing.assert_array_equal(now[key + "dispatch"].sum(axis=(1, 3)) > 0, True)  # [G, E]: every expert used
        np.testing.assert_array_equal(now[key + "dispatch"].sum(axis=1), recorded[key + "dispatch"].sum(axis=1))
        assert now[key + "metric_solver_marginal_error"] <= recorded[key + "metric_solver_marginal_error"]
        assert now[key + "metric_dropped"] <= recorded[key + "metric_dropped"] + 1e-6
    for key, value in recorded.items():
        if key in solver:
            continue
        np.testing.assert_allclose(now[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
        if key.endswith(("dispatch", "combine")) and not key.startswith("soft"):  # sparse: the decisions
            np.testing.assert_array_equal(now[key] != 0, value != 0, err_msg=key)
        if key.endswith("dispatch") and not key.startswith("soft"):
            np.testing.assert_array_equal(now[key], value, err_msg=key)  # a 0/1 mask


def test_registered_routers_are_named_compositions():
    """Each registered name is one affinity and one allocation (paper 000's table), and the
    same composition written by hand gives the same outputs."""
    table = {
        "softmax_token_choice": (routers.NoisySoftmax, routers.TokenChoice),
        "sinkhorn_token_choice": (routers.SinkhornPlan, routers.TokenChoice),
        "svmoe": (routers.QuadraticPlan, routers.TokenChoice),
        "softmax_expert_choice": (routers.Softmax, routers.ExpertChoice),
        "sinkhorn_expert_choice": (routers.SinkhornPlan, routers.ExpertChoice),
        "sparsity_constrained_expert_choice": (routers.SparsityConstrainedPlan, routers.ExpertChoice),
        "soft_moe": (routers.SlotLogits, routers.SoftRouting),
        "sigmoid_loss_free": (routers.SigmoidGates, routers.TokenChoice),
        "group_limited": (routers.SigmoidGates, routers.TokenChoice),
        "hash": (routers.HashProjection, routers.TokenChoice),
    }
    for name, (affinity, allocation) in table.items():
        router = _make(name)
        assert type(router.affinity) is affinity and type(router.allocation) is allocation, name
        assert mm.ROUTERS[name].allocation == {routers.TokenChoice: "token", routers.ExpertChoice: "expert",
                                               routers.SoftRouting: "soft"}[allocation]
        assert router.per_image == mm.ROUTERS[name].per_image == (name == "soft_moe")
    x = _x(3)
    by_name = _make("sinkhorn_expert_choice", capacity_factor=2.0)(x)
    by_hand = routers.Router(routers.SinkhornPlan(D, E, rngs=nnx.Rngs(0)), routers.ExpertChoice(2.0))(x)
    np.testing.assert_array_equal(by_name.routing.combine, by_hand.routing.combine)
    # A composition no paper names, in one line: the noisy V-MoE softmax with Expert Choice.
    noisy_ec = routers.Router(routers.NoisySoftmax(D, E, rngs=nnx.Rngs(0)), routers.ExpertChoice(1.0))
    out = noisy_ec(x)
    np.testing.assert_array_equal(np.asarray(out.routing.dispatch).sum(axis=(1, 3)), T // E)  # C tokens per expert
    assert float(out.aux_loss) > 0 and "load_loss" in out.metrics
    # The capacity factor can be changed on a built router (the allocation is replaced).
    router = _make("softmax_expert_choice")
    router.capacity_factor = 2.0
    assert router.allocation == routers.ExpertChoice(2.0) and router(x).routing.dispatch.shape[-1] == 2 * T // E


def test_release_0_1_router_classes_are_gone_since_0_4():
    for name in ("SoftmaxTokenChoice", "SoftmaxExpertChoice", "SoftMoE"):
        assert not hasattr(routers, name)
    with pytest.raises(ValueError, match="allocation must be one of"):
        routers.register("x", allocation="sideways")


def test_register_refuses_a_taken_name_unless_replace():
    before = mm.ROUTERS["softmax_expert_choice"]
    with pytest.raises(ValueError, match="already registered as 'softmax_expert_choice'.*replace=True"):
        routers.register("softmax_expert_choice", allocation="token")(lambda *a, **k: None)
    assert mm.ROUTERS["softmax_expert_choice"] is before  # untouched

    def build(dim, num_experts, *, capacity_factor=1.0, rngs):
        return routers.Router(routers.Softmax(dim, num_experts, rngs=rngs), routers.ExpertChoice(capacity_factor))

    try:
        routers.register("softmax_expert_choice", allocation="expert", replace=True)(build)
        assert mm.ROUTERS["softmax_expert_choice"].build is build
    finally:
        mm.ROUTERS["softmax_expert_choice"] = before


def test_per_image_is_decided_by_the_allocation_alone():
    """One home: a registered router's ``per_image`` is its allocation class's, for every name."""
    for name, spec in mm.ROUTERS.items():
        if spec.data is not None:  # raw_oracle: built for subtask_vote's patches only
            continue
        router = mm.make_router(name, D, E, rngs=nnx.Rngs(0))
        assert spec.per_image == router.per_image == type(router.allocation).per_image
    assert [a for a, cls in routers.ALLOCATION_CLASSES.items() if cls.per_image] == ["soft"]
