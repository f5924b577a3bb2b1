"""Expert-parallelism checks on 8 simulated CPU devices (run by tests/test_parallel.py, each in
a fresh process, because the device count is fixed when JAX starts)."""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from mini_moe import config, parallel, routers, train  # noqa: E402

from live_head import live_head  # noqa: E402

# Token Choice (k = 2, with drops), Expert Choice and Soft MoE: the three kinds of dispatch tensor.
ROUTERS = {"softmax_token_choice": {"k": 2}, "softmax_expert_choice": {}, "soft_moe": {"slots_per_expert": 2},
           "sigmoid_loss_free": {"k": 2}}


def tiny(router, **kw):
    fields = dict(batch_size=32, model_dim=16, model_heads=2, model_mlp_dim=32, model_depth=2, model_num_experts=8,
                  model_group_images=2, model_router_kwargs=ROUTERS[router])
    return config.get_config("quick", dataset="digits", router=router, **{**fields, **kw})


def loss_fn(model, images, mesh=None):
    out = model(images, mesh=mesh)
    return jnp.mean(out.logits ** 2) + out.aux_loss, out.logits


def check_equal_to_single_device():
    assert len(jax.devices()) == 8, jax.devices()
    mesh = parallel.make_mesh(2, 4)
    images = jax.random.normal(jax.random.key(0), (32, 8, 8, 1))
    # (router, training mode): softmax_token_choice trains with noisy logits (V-MoE), so the noise
    # drawn on the sharded model must equal the single-device model's.
    for router, training in [(r, False) for r in ROUTERS if r != "sigmoid_loss_free"] + [("softmax_token_choice", True)]:
        # the same live head on both: a zero head gives zero logits and zero expert gradients
        single, sharded = live_head(train.make_model(tiny(router))), live_head(train.make_model(tiny(router)))
        for m in (single, sharded):
            m.train() if training else m.eval()
        parallel.shard_model(sharded, mesh)
        w1 = sharded.blocks[1].mlp.experts.w1[...]
        assert w1.sharding.spec == jax.sharding.PartitionSpec("expert", None, None), w1.sharding
        assert len({s.device for s in w1.addressable_shards}) == 8 and w1.addressable_shards[0].data.shape[0] == 2
        assert parallel.model_mesh(sharded) == mesh and parallel.model_mesh(single) is None
        step = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True), static_argnums=2)
        (loss_a, logits_a), grads_a = step(single, images)
        (loss_b, logits_b), grads_b = step(sharded, jax.device_put(images, parallel.batch_sharding(mesh)), mesh)
        np.testing.assert_allclose(np.asarray(logits_a), np.asarray(logits_b), atol=1e-5, rtol=1e-5)
        if training:  # the noise is really drawn in training mode: without it the features differ
            noisy, quiet = train.make_model(tiny(router)), train.make_model(tiny(router))
            noisy.train()
            quiet.eval()
            assert not np.allclose(np.asarray(noisy(images).features), np.asarray(quiet(images).features), atol=1e-4)
        for ga, gb in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
            np.testing.assert_allclose(np.asarray(ga), np.asarray(gb), atol=1e-5, rtol=1e-4)
        graphdef, state = nnx.split(sharded)
        jaxpr = str(jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x, mesh=mesh).logits)(state, images))
        assert jaxpr.count("all_to_all") == 2 * len(sharded.cfg.moe_blocks()), router
        print(f"{router}{' (training, noisy)' if training else ''}: outputs and gradients equal on a 2x4 mesh")


def check_sparse_path_never_reads_dense_tensors():
    """Sparse routings go through shard_map in their compact slot form: with NaN dispatch and
    combine tensors the expert-parallel layer still equals the single-device gather path, for a
    Token Choice routing with drops and empty slots, and its gradient w.r.t. the tokens too."""
    from mini_moe import layer, routing

    mesh = parallel.make_mesh(2, 4)
    x = jax.random.normal(jax.random.key(1), (8, 12, 16))  # 8 groups of 12 tokens
    scores = jax.nn.softmax(jax.random.normal(jax.random.key(2), (8, 12, 8)), axis=-1)
    real = routing.token_choice(scores, k=2, capacity=2)  # C = 2 < kT/E = 3: drops
    assert bool(jnp.any(real.slot_token == 12)) and bool(jnp.any(jnp.sum(real.dispatch, axis=(-2, -1)) < 2))
    poisoned = real.replace(dispatch=jnp.full_like(real.dispatch, jnp.nan), combine=jnp.full_like(real.combine, jnp.nan))
    experts = layer.MlpExperts(8, 16, 32, rngs=nnx.Rngs(0))
    sharded = layer.MlpExperts(8, 16, 32, rngs=nnx.Rngs(0))
    parallel.shard_model(sharded, mesh)

    def single_loss(x):
        return jnp.sum(layer.moe(x, real, experts, path="gather") ** 2)

    def parallel_loss(x):
        return jnp.sum(parallel.expert_parallel_moe(x, poisoned, sharded, mesh) ** 2)

    value_a, grad_a = jax.jit(jax.value_and_grad(single_loss))(x)
    value_b, grad_b = jax.jit(jax.value_and_grad(parallel_loss))(jax.device_put(x, parallel.batch_sharding(mesh)))
    assert np.isfinite(float(value_b))
    np.testing.assert_allclose(float(value_a), float(value_b), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad_a), np.asarray(grad_b), atol=1e-5, rtol=1e-4)
    print("sparse expert parallelism: gather/scatter in shard_map, dense tensors never read")


def check_training_runs_sharded(tmp):
    cfg = tiny("soft_moe", steps=4, eval_every=4, checkpoint_every=2, mesh=(2, 4))
    history = train.train(cfg, tmp, resume=False, progress=False)
    assert len(history["eval"]) == 1 and np.isfinite(history["eval"][0]["test_accuracy"])
    model, loaded = train.load_trained(tmp)  # a mesh run loads on one device
    assert loaded.mesh == (2, 4) and parallel.model_mesh(model) is None
    # Same steps on one device give the same parameters (up to float reassociation).
    single = train.train(tiny("soft_moe", steps=4, eval_every=4, checkpoint_every=2), tmp + "-single",
                         resume=False, progress=False)
    assert single["eval"][0]["step"] == 4
    reference, _ = train.load_trained(tmp + "-single")
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(reference, nnx.Param))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
    print("sharded training matches single-device training")


def check_global_batch_balance_loss():
    """The global-batch Switch loss under shard_map on the library's own mesh (2 x 4, the batch
    split over both axes as parallel.BATCH splits it), its sums psum-ed over every axis that splits
    the batch (parallel.AXES), equals the loss of the whole batch on one device, value and
    gradient. With the data axis alone it is a partial sum (issue 35, review item 12)."""
    from jax.sharding import PartitionSpec as P

    from mini_moe import losses

    mesh = parallel.make_mesh(2, 4)
    # 8 groups of 16 tokens; group g sends most of its tokens to expert g % 4: unbalanced per
    # group, nearly balanced over the batch
    logits = jax.random.normal(jax.random.key(0), (8, 16, 4)) + 3.0 * jax.nn.one_hot(jnp.arange(8) % 4, 4)[:, None]

    def sharded(axis_name, k):
        def per_device(z):
            value, grad = jax.value_and_grad(
                lambda z: losses.switch_loss(jax.nn.softmax(z, -1), k=k, scope="batch", axis_name=axis_name))(z)
            return value[None], grad
        return jax.shard_map(per_device, mesh=mesh, in_specs=parallel.BATCH,
                             out_specs=(P(parallel.AXES), parallel.BATCH))(logits)

    for k in (1, 2):
        value, grad = jax.value_and_grad(lambda z: losses.switch_loss(jax.nn.softmax(z, -1), k=k, scope="batch"))(logits)
        local, local_grad = sharded(parallel.AXES, k)
        np.testing.assert_allclose(np.asarray(local), float(value), rtol=1e-6)  # every device: the global loss
        # each device's gradient of the (replicated) global loss with respect to its own part of the
        # batch: together, the gradient of the whole batch's loss
        np.testing.assert_allclose(np.asarray(local_grad), np.asarray(grad), rtol=1e-5, atol=1e-8)
        partial, _ = sharded("data", k)
        assert np.max(np.abs(np.asarray(partial) - float(value))) > 0.05, (partial, float(value))
        assert float(losses.switch_loss(jax.nn.softmax(logits, -1), k=k, scope="group")) > float(value) + 0.5
    print("global-batch balance loss under shard_map: value and gradient ok")


def check_loss_free_bias_however_the_batch_is_split():
    """DeepSeek-V3's bias update sees the load of the whole batch, however the batch is split
    (issue 36): one device, the 2 x 4 mesh (batch over 8 devices) and 4 micro-batches of
    gradient accumulation give the same bias after one training step's forward passes."""
    mesh = parallel.make_mesh(2, 4)
    kwargs = {"k": 2, "bias_rate": 0.05, "seq_balance": 1.0}
    images = jax.random.normal(jax.random.key(1), (32, 8, 8, 1))
    labels = jnp.arange(32) % 10
    biases = {}
    for name, cfg in [("one device", tiny("sigmoid_loss_free", model_router_kwargs=kwargs)),
                      ("2x4 mesh", tiny("sigmoid_loss_free", model_router_kwargs=kwargs)),
                      ("4 micro-batches", tiny("sigmoid_loss_free", model_router_kwargs=kwargs, grad_accum=4))]:
        model = train.make_model(cfg)
        if name == "2x4 mesh":
            parallel.shard_model(model, mesh)
            nnx.jit(lambda m, x: m(x, mesh=mesh).logits)(model, jax.device_put(images, parallel.batch_sharding(mesh)))
        elif cfg.grad_accum > 1:
            nnx.jit(lambda m, x, y: train.accumulated_grads(m, x, y, 0.01, 4)[1])(model, images, labels)
        else:
            nnx.jit(lambda m, x: m(x).logits)(model, images)
        biases[name] = [np.asarray(b) for b in jax.tree.leaves(nnx.state(model, routers.ExpertBias))]
    assert any(np.any(b != 0) for b in biases["one device"])
    for name in ("2x4 mesh", "4 micro-batches"):
        for a, b in zip(biases["one device"], biases[name]):
            np.testing.assert_allclose(b, a, atol=1e-7)
    print("loss-free bias: the same on one device, on the 2x4 mesh and over 4 micro-batches")


def check_errors():
    mesh = parallel.make_mesh(2, 4)
    for call, match in [
        (lambda: parallel.make_mesh(4, 4), "needs 16 devices"),
        (lambda: tiny("soft_moe", batch_size=12, mesh=(2, 4)), "batch_size=12 must be a multiple of 8"),
        (lambda: tiny("softmax_expert_choice", batch_size=24, mesh=(1, 3)), "multiple of the mesh's expert axis"),
        (lambda: parallel.expert_parallel_moe(jnp.ones((6, 4, 16)), None, None, mesh), "multiple of the number"),
        (lambda: parallel.shard_model(train.make_model(tiny("softmax_expert_choice", model_num_experts=6)), mesh),
         "multiple of the mesh's 'expert' axis (4)"),
    ]:
        try:
            call()
        except ValueError as e:
            assert match in str(e), (match, str(e))
        else:
            raise AssertionError(f"no ValueError for {match!r}")
    print("errors: ok")


if __name__ == "__main__":
    # parallel_check.py CHECK [TMP]: one check_* function (tests/test_parallel.py runs each in its own process)
    name = sys.argv[1]
    check = globals()[f"check_{name}"]
    check(*sys.argv[2:3]) if name == "training_runs_sharded" else check()
    print(f"{name}: OK")
