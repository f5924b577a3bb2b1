"""Gradient accumulation (``TrainConfig.grad_accum``, issue 36 §2): a step on B split into n
micro-batches equals one step on B, and the routers' own state moves once per step."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from mini_moe import config as config_lib
from mini_moe import modes, routers, train

from live_head import live_head

TINY = dict(steps=6, batch_size=32, eval_every=3, checkpoint_every=3, eval_batch_size=64, model_dim=16,
            model_depth=2, model_heads=2, model_mlp_dim=16, model_num_experts=4, model_group_images=4)


ACCUMULATED = nnx.jit(train.accumulated_grads, static_argnums=(3, 4))


@pytest.fixture(scope="module")
def digits():
    return train.load_data(config_lib.get_config("quick", dataset="digits"))


def _cfg(router, **kw):
    return config_lib.get_config("quick", dataset="digits", router=router, **{**TINY, **kw})


def _leaves(state):
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree.leaves(state)]


def _close(a, b, rtol=2e-5, atol=1e-6):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


CASES = {
    # dropless DeepSeek-V3 gating with its bias: nothing depends on the group's other tokens
    "loss_free_dropless": ("sigmoid_loss_free", dict(model_moe_path="dropless",
                                                      model_router_kwargs={"bias_rate": 0.05, "seq_balance": 1.0})),
    # capacity-limited Token Choice without noise: groups stay whole, so its drops are the same
    "token_choice_capacity": ("softmax_token_choice", dict(model_router_kwargs={"noise_std": 0.0})),
    # ReMoE, one lambda for the model
    "remoe": ("remoe", dict(model_router_kwargs={"l1_init": 1e-3, "l1_rate": 1.5})),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_accumulated_step_equals_one_step_on_the_whole_batch(case, digits):
    router, kw = CASES[case]
    whole_cfg, split_cfg = _cfg(router, **kw), _cfg(router, grad_accum=2, **kw)
    images, labels = (jax.numpy.asarray(a) for a in train.batch_at(digits[0], whole_cfg, 0))
    # gradients, losses and the routers' state after the forward passes, with the same live head
    # (a zero head gives zero logits and zero expert gradients, which would hide a wrong accumulation)
    whole, split = live_head(train.make_model(whole_cfg)), live_head(train.make_model(split_cfg))
    grads, (ce, out) = nnx.jit(nnx.grad(train._loss_fn, has_aux=True), static_argnums=(3, 4))(
        whole, images, labels, whole_cfg.aux_loss_weight, None)
    acc_grads, acc_ce, acc_aux, logits, _ = ACCUMULATED(split, images, labels, split_cfg.aux_loss_weight, 2)
    _close(_leaves(acc_grads), _leaves(grads))
    experts = [np.asarray(g) for path, g in jax.tree_util.tree_leaves_with_path(grads) if "experts" in jax.tree_util.keystr(path)]
    assert experts and all(np.abs(g).max() > 0 for g in experts)  # the task's gradient reaches the experts
    assert np.std(np.asarray(out.logits)) > 0.1  # logits that differ between images: their order is checked
    assert float(acc_ce) == pytest.approx(float(ce), rel=1e-5)
    if case == "remoe":
        # What differs: ReMoE's penalty weights each expert by f_e, counted over the tokens of one
        # forward call, so under accumulation f_e is each micro-batch's, not the batch's.
        assert float(acc_aux) != pytest.approx(float(out.aux_loss), rel=1e-4)
        assert float(acc_aux) == pytest.approx(float(out.aux_loss), rel=0.05)
    else:
        assert float(acc_aux) == pytest.approx(float(out.aux_loss), rel=1e-4, abs=1e-7)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(out.logits), rtol=1e-5, atol=1e-5)
    state = lambda m: _leaves(nnx.state(m, routers.ExpertBias, routers.L1Weight))
    if case != "token_choice_capacity":  # the routers with state of their own: it moved
        fresh = state(train.make_model(whole_cfg))
        assert state(whole) and not any(np.array_equal(a, b) for a, b in zip(state(whole), fresh))
    _close(state(split), state(whole), rtol=1e-6, atol=0)  # moved once, by the whole batch
    if case != "loss_free_dropless":
        return
    # one optimizer step each: the same parameters after it
    whole, split = live_head(train.make_model(whole_cfg)), live_head(train.make_model(split_cfg))
    train._step(whole, train.make_optimizer(whole, whole_cfg), (images, labels), whole_cfg)
    train._step(split, train.make_optimizer(split, split_cfg), (images, labels), split_cfg)
    # Every parameter but the attention keys' biases: a key bias adds the same q.b to all of a
    # query's logits, which the softmax ignores, so its true gradient is 0 and what is computed is
    # round-off (~1e-9), which Adam's first step, g / (|g| + 1e-8), turns into a step of either sign.
    # Those gradients are checked to be round-off instead.
    params = lambda m: [(jax.tree_util.keystr(p), np.asarray(v)) for p, v in
                        jax.tree_util.tree_leaves_with_path(nnx.state(m, nnx.Param))]
    key_bias = lambda path: "['key']['bias']" in path
    assert any(key_bias(p) for p, _ in params(whole))
    assert all(np.abs(g).max() < 1e-6 for p, g in jax.tree_util.tree_leaves_with_path(grads) if key_bias(jax.tree_util.keystr(p)))
    _close([v for p, v in params(split) if not key_bias(p)], [v for p, v in params(whole) if not key_bias(p)],
           rtol=1e-4, atol=1e-6)
    _close(state(split), state(whole), rtol=1e-6, atol=0)


def test_the_bias_moves_once_per_step_not_once_per_micro_batch(digits):
    """torchtitan#1304's bug: a bias updated by every micro-batch moves up to n times as far."""
    cfg = _cfg("sigmoid_loss_free", grad_accum=2, model_router_kwargs={"bias_rate": 0.05})
    model = train.make_model(cfg)
    images, labels = (jax.numpy.asarray(a) for a in train.batch_at(digits[0], cfg, 0))
    ACCUMULATED(model, images, labels, cfg.aux_loss_weight, 2)
    for bias in _leaves(nnx.state(model, routers.ExpertBias)):
        assert np.max(np.abs(bias)) == pytest.approx(0.05)  # one step of rate 0.05
    eager = train.make_model(dataclasses.replace(cfg, grad_accum=1))  # no deferral: the bug
    ACCUMULATED(eager, images, labels, cfg.aux_loss_weight, 2)
    assert max(np.max(np.abs(b)) for b in _leaves(nnx.state(eager, routers.ExpertBias))) > 0.05 + 1e-6


@pytest.mark.parametrize("target", ["between_the_mean_and_the_last", "between_the_first_and_the_mean"])
def test_remoe_lambda_moves_once_by_the_whole_batch_sparsity(target, digits):
    """Code review T3: lambda's step is a sign, so a test must put the controller's target
    between the whole batch's sparsity and one micro-batch's; otherwise a lambda stepped from the
    last (or the first) micro-batch moves the same way. Both placements are tested."""
    cfg = _cfg("remoe", grad_accum=2, model_router_kwargs={"l1_init": 1e-3, "l1_rate": 1.5})
    images, labels = (jax.numpy.asarray(a) for a in train.batch_at(digits[0], cfg, 0))
    # each micro-batch's sparsity as the controller reads it (averaged over the layers); a deferred
    # model's forward pass moves nothing, and lambda does not change which gates are zero
    probe, half = train.make_model(cfg), len(images) // 2
    first, last = (float(np.mean([m["sparsity"] for m in probe(images[i * half:(i + 1) * half]).metrics]))
                   for i in range(2))
    mean = (first + last) / 2
    assert abs(first - last) > 1e-3  # the micro-batches differ enough to tell them apart
    point = (mean + last) / 2 if target == "between_the_mean_and_the_last" else (first + mean) / 2
    model = train.make_model(cfg)
    gates = [n for _, n in nnx.iter_graph(model) if isinstance(n, routers.ReluGates)]
    assert gates
    for g in gates:  # target sparsity 1 - k / E at the chosen point
        g.target_k = g.num_experts * (1.0 - point)
    ACCUMULATED(model, images, labels, cfg.aux_loss_weight, 2)
    whole, one = np.sign(point - mean), np.sign(point - (last if target == "between_the_mean_and_the_last" else first))
    assert whole != one  # the placement separates the whole batch from that micro-batch
    for g in gates:
        assert float(g.l1_weight[...]) == pytest.approx(1e-3 * 1.5 ** whole, rel=1e-6)


def test_accumulation_is_checked_and_resumes_exactly(tmp_path, digits, monkeypatch):
    with pytest.raises(ValueError, match="multiple of grad_accum=3"):
        _cfg("softmax_token_choice", grad_accum=3)
    with pytest.raises(ValueError, match="balance_scope='batch'"):
        _cfg("softmax_token_choice", grad_accum=2, model_router_kwargs={"balance_scope": "batch"})
    cfg = _cfg("sigmoid_loss_free", grad_accum=2, model_router_kwargs={"bias_rate": 0.01})
    train.train(cfg, tmp_path / "straight", progress=False, datasets=digits)
    straight, _ = train.load_trained(tmp_path / "straight")

    from interrupted import train_interrupted_then_resumed

    train_interrupted_then_resumed(cfg, tmp_path / "resumed", digits, monkeypatch)
    resumed, _ = train.load_trained(tmp_path / "resumed")
    for a, b in zip(_leaves(nnx.state(straight)), _leaves(nnx.state(resumed))):
        np.testing.assert_array_equal(a, b)  # bit-exact: same process, same programs


# ----------------------------------------------------------------- invariances (issue 36 §1)

D, E = 16, 8


@pytest.mark.parametrize("name, kw", [
    ("softmax_token_choice", {"noise_std": 0.0}), ("softmax_token_choice", {"noise_std": 0.0, "balance_loss": "switch"}),
    ("sigmoid_loss_free", {"seq_balance": 1.0, "deterministic": True}), ("remoe", {"deterministic": True}),
])
def test_per_group_losses_do_not_depend_on_the_order_of_the_groups(name, kw):
    router = routers.make_router(name, D, E, rngs=nnx.Rngs(0), **kw)
    x = jax.random.normal(jax.random.key(0), (6, 32, D)) + jax.numpy.arange(6)[:, None, None] * 0.3
    order = np.array([3, 0, 5, 1, 4, 2])
    a, b = router(x), router(x[order])
    assert float(a.aux_loss) > 0
    assert float(b.aux_loss) == pytest.approx(float(a.aux_loss), rel=1e-5)
    np.testing.assert_array_equal(np.asarray(b.routing.dispatch), np.asarray(a.routing.dispatch)[order])


@pytest.mark.parametrize("name, kw", [
    ("softmax_token_choice", {}), ("sigmoid_loss_free", {"bias_rate": 0.05}), ("remoe", {"l1_scope": "layer"}),
])
def test_nothing_changes_in_eval_mode(name, kw):
    """Eval mode: no noise, no bias or lambda step, the same output twice; training mode moves them."""
    router = routers.make_router(name, D, E, rngs=nnx.Rngs(0), **kw)
    x = jax.random.normal(jax.random.key(1), (2, 32, D)) + 0.5
    before = _leaves(nnx.state(router))
    with modes.eval_mode(router):
        first, second = router(x), router(x)
    _close(_leaves(nnx.state(router)), before, rtol=0, atol=0)
    np.testing.assert_array_equal(np.asarray(first.routing.combine), np.asarray(second.routing.combine))
    router(x)  # training mode: the noise's RNG count, the bias or lambda moves
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(nnx.state(router)), before))


@pytest.mark.parametrize("case", ["loss_free_dropless", "token_choice_capacity"])
def test_an_accumulated_step_reports_the_whole_batchs_max_violation(case, digits):
    """Issue 52 §4: MaxVio (max load / mean load - 1) of an accumulated step is that of the whole
    batch's summed loads, as one step on the whole batch reports it. The mean of the micro-batches'
    MaxVio, logged before, is never smaller (max of a sum <= sum of maxes, and equal micro-batches
    have equal mean loads) and larger whenever their most loaded experts differ."""
    router, kw = CASES[case]
    whole_cfg, split_cfg = _cfg(router, **kw), _cfg(router, grad_accum=4, **kw)
    images, labels = train.batch_at(digits[0], whole_cfg, 0)
    whole, split = live_head(train.make_model(whole_cfg)), live_head(train.make_model(split_cfg))
    one = train._step(whole, train.make_optimizer(whole, whole_cfg), (images, labels), whole_cfg)
    accumulated = train._step(split, train.make_optimizer(split, split_cfg), (images, labels), split_cfg)
    assert float(accumulated["router"]["max_violation"]) == pytest.approx(float(one["router"]["max_violation"]), rel=1e-5)
    _, _, _, _, metrics = ACCUMULATED(live_head(train.make_model(split_cfg)), jax.numpy.asarray(images),
                                      jax.numpy.asarray(labels), split_cfg.aux_loss_weight, 4)
    mean_of_parts = np.mean([[float(layer["max_violation"]) for layer in m] for m in metrics])
    assert mean_of_parts > float(one["router"]["max_violation"]) + 1e-3
