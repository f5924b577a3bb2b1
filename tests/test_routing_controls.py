"""Routing controls (issue 34): a frozen router, a hash router, and the options that split the
confounds between Token Choice and Expert Choice (noise, auxiliary loss). Each option must change
exactly what it says and nothing else."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mini_moe import config as config_lib
from mini_moe import layer, losses, routers, train
from mini_moe.validate import InputError

D, E = 16, 4


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def _assert_same(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


def _train(router, steps=5, seed=0):
    """A few Adam steps of an MoE layer (router + experts) on a regression target."""
    experts = layer.MlpExperts(E, D, hidden=16, rngs=nnx.Rngs(1))
    model = nnx.List([router, experts]) if hasattr(nnx, "List") else [router, experts]
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(seed), (2, 32, D))
    y = jnp.sin(x)

    @nnx.jit
    def step(model, optimizer, x, y):
        def loss(model):
            r, e = model[0], model[1]
            out = r(x)
            return jnp.mean((layer.moe(x, out.routing, e) - y) ** 2) + 0.01 * out.aux_loss
        grads = nnx.grad(loss)(model)
        optimizer.update(model, grads)

    for _ in range(steps):
        step(model, optimizer, x, y)
    return experts, optimizer


@pytest.mark.parametrize("name", ["softmax_token_choice", "sigmoid_loss_free", "soft_moe"])
def test_a_frozen_router_keeps_its_initial_weights_while_the_experts_train(name):
    learned = routers.make_router(name, D, E, rngs=nnx.Rngs(0))
    frozen = routers.make_router(name, D, E, rngs=nnx.Rngs(0), frozen=True)
    initial = _leaves(nnx.state(learned.affinity, nnx.Param))
    assert initial and not nnx.state(frozen.affinity, nnx.Param)  # no parameter left to train
    _assert_same(_leaves(nnx.state(frozen.affinity, routers.FrozenWeight)), initial)
    experts_before = _leaves(nnx.state(layer.MlpExperts(E, D, hidden=16, rngs=nnx.Rngs(1)), nnx.Param))

    experts, optimizer = _train(frozen)
    _assert_same(_leaves(nnx.state(frozen.affinity, routers.FrozenWeight)), initial)
    assert any(np.any(a != b) for a, b in zip(_leaves(nnx.state(experts, nnx.Param)), experts_before))
    # the optimizer keeps no state for the frozen weights: only the experts' parameters have moments
    moments = sum(a.size for a in _leaves(nnx.state(optimizer)) if a.ndim)  # Adam: two per parameter
    assert moments == 2 * sum(a.size for a in _leaves(nnx.state(experts, nnx.Param)))
    # ... while the same router, learned, moves
    _train(learned)
    assert any(np.any(a != b) for a, b in zip(_leaves(nnx.state(learned.affinity, nnx.Param)), initial))


def test_frozen_routing_reaches_the_model_through_the_config_and_survives_a_checkpoint(tmp_path):
    cfg = config_lib.get_config("quick", dataset="digits", router="softmax_token_choice", steps=4, batch_size=16,
                                eval_every=2, checkpoint_every=2, eval_batch_size=32, model_dim=16, model_depth=2,
                                model_heads=2, model_mlp_dim=16, model_num_experts=4, model_group_images=4,
                                model_router_kwargs={"frozen": True})
    model = train.make_model(cfg)
    initial = _leaves(nnx.state(model, routers.FrozenWeight))
    assert len(initial) == len(cfg.model.moe_blocks()) and initial
    train.train(cfg, tmp_path, progress=False)
    trained, _ = train.load_trained(tmp_path)
    _assert_same(_leaves(nnx.state(trained, routers.FrozenWeight)), initial)
    with pytest.raises(InputError, match="frozen must be True or False"):
        routers.make_router("softmax_token_choice", D, E, rngs=nnx.Rngs(0), frozen="yes")


def test_the_hash_router_is_balanced_on_random_tokens_deterministic_and_learns_nothing():
    # 8,192 tokens in 16 routing groups of 512 (one group of 8,192 would build a [8192, 8, 2048]
    # dispatch tensor, half a gigabyte, for the same statistics)
    dim, experts, groups, tokens = 32, 8, 16, 512
    router = routers.make_router("hash", dim, experts, rngs=nnx.Rngs(3), capacity_factor=2.0)
    assert not nnx.state(router, nnx.Param)
    # tokens with a large common component per group (as a network's tokens have): the hash looks past it
    x = (jax.random.normal(jax.random.key(0), (groups, tokens, dim))
         + 10.0 * jax.random.normal(jax.random.key(1), (groups, 1, dim)))
    out = router(x)
    load = np.asarray(out.routing.dispatch.sum((0, 1, 3)))
    # no pick dropped at c = 2, and each expert's share within 5 binomial standard deviations of 1/E
    n = groups * tokens
    assert load.sum() == n
    sd = np.sqrt(n * (1 / experts) * (1 - 1 / experts))
    assert np.all(np.abs(load - n / experts) < 5 * sd), load
    # the expert is the argmax of the fixed projection of the group-centred token, combine weight 1,
    # and nothing random
    centred = np.asarray(x - x.mean(-2, keepdims=True))
    q = np.asarray(router.affinity.projection[...])
    expected = np.argmax(centred @ q, axis=-1)
    np.testing.assert_array_equal(np.asarray(out.routing.dispatch.sum(-1)).argmax(-1), expected)
    np.testing.assert_allclose(np.asarray(out.routing.combine.sum((-2, -1))), 1.0)
    again = routers.make_router("hash", dim, experts, rngs=nnx.Rngs(3), capacity_factor=2.0)(x)
    np.testing.assert_array_equal(np.asarray(again.routing.dispatch), np.asarray(out.routing.dispatch))
    np.testing.assert_allclose(q.T @ q, np.eye(experts), atol=1e-5)  # orthonormal columns
    # k = 2: the two largest projections, weight 1/2 each
    two = routers.make_router("hash", dim, experts, rngs=nnx.Rngs(3), k=2, capacity_factor=4.0)(x)
    top2 = np.sort(np.argsort(-(centred @ q), axis=-1)[..., :2], axis=-1)
    got = np.sort(np.argsort(-np.asarray(two.routing.combine.sum(-1)), axis=-1)[..., :2], axis=-1)
    np.testing.assert_array_equal(got, top2)
    np.testing.assert_allclose(np.asarray(two.routing.combine.sum((-2, -1))), 1.0)


def test_token_choice_without_noise_and_loss_changes_exactly_those():
    x = jax.random.normal(jax.random.key(0), (2, 32, D))
    plain = routers.make_router("softmax_token_choice", D, E, rngs=nnx.Rngs(0), noise_std=0.0, balance_loss="none")
    first, second = plain(x), plain(x)  # training mode: still deterministic without noise
    np.testing.assert_array_equal(np.asarray(first.routing.dispatch), np.asarray(second.routing.dispatch))
    assert float(first.aux_loss) == 0.0
    np.testing.assert_allclose(np.asarray(first.probs), np.asarray(jax.nn.softmax(plain.logits(x), -1)), rtol=1e-6)
    switch = routers.make_router("softmax_token_choice", D, E, rngs=nnx.Rngs(0), noise_std=0.0,
                                 balance_loss="switch")(x)
    np.testing.assert_allclose(float(switch.aux_loss), float(losses.switch_loss(first.probs, k=1)), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(switch.routing.dispatch), np.asarray(first.routing.dispatch))
    # with the default noise, the same weights route differently from call to call in training
    noisy = routers.make_router("softmax_token_choice", D, E, rngs=nnx.Rngs(0), balance_loss="none")
    assert np.any(np.asarray(noisy(x).probs) != np.asarray(first.probs))


def test_expert_choice_with_token_choices_noise():
    """``noise_std`` gives Expert Choice the noise of Token Choice (the same NoisySoftmax, no loss);
    in eval mode it is the paper's Expert Choice with the same weights."""
    x = jax.random.normal(jax.random.key(0), (2, 32, D))
    paper = routers.make_router("softmax_expert_choice", D, E, rngs=nnx.Rngs(0))
    noisy = routers.make_router("softmax_expert_choice", D, E, rngs=nnx.Rngs(0), noise_std=1.0)
    tc = routers.make_router("softmax_token_choice", D, E, rngs=nnx.Rngs(0), balance_loss="none")
    np.testing.assert_array_equal(np.asarray(noisy.affinity.dense.kernel[...]), np.asarray(paper.affinity.dense.kernel[...]))
    assert isinstance(noisy.affinity, routers.NoisySoftmax) and noisy.affinity.noise_std == tc.affinity.noise_std
    # training mode: the noisy probabilities are those Token Choice computes with the same noise key
    np.testing.assert_allclose(np.asarray(noisy(x).probs), np.asarray(tc(x).probs), rtol=1e-6)
    assert float(noisy(x).aux_loss) == 0.0
    noisy.eval()
    np.testing.assert_array_equal(np.asarray(noisy(x).routing.dispatch), np.asarray(paper(x).routing.dispatch))


def test_study_variants_set_exactly_their_options():
    from mini_moe import study

    base = {r: dict(study.cell_config(r, 1.0, 0, dataset="patch_vote", scale="quick").model.router_kwargs)
            for r in ("softmax_token_choice", "softmax_expert_choice")}
    expected = {"softmax_token_choice_frozen": {"frozen": True},
                "softmax_expert_choice_frozen": {"frozen": True},
                "softmax_token_choice_plain": {"noise_std": 0.0, "balance_loss": "none"},
                "softmax_token_choice_switch": {"balance_loss": "switch"},
                "softmax_expert_choice_noisy": {"noise_std": 1.0}}
    for variant, options in expected.items():
        cfg = study.cell_config(variant, 1.0, 0, dataset="patch_vote", scale="quick")
        router = study.VARIANTS[variant][0]
        assert cfg.model.router == router
        assert dict(cfg.model.router_kwargs) == base[router] | options
        model = train.make_model(cfg)  # the options reach the router
        moe = next(block.mlp.router for block in model.blocks if block.use_moe)
        for key, value in options.items():
            if key == "frozen":
                assert not nnx.state(moe, nnx.Param) and nnx.state(moe, routers.FrozenWeight)
            else:
                assert getattr(moe.affinity, key) == value


def test_the_controlled_experiment_trains_a_frozen_router_as_its_routing_control():
    """``subtasks.SubtaskConfig(router=<study variant>)``: chapter 9's experiment with the router's
    weights frozen, the token-level routing control of issue 34. The frozen layer starts from the
    same router weights as the learned one of the same seed, keeps them through training, and its
    experts still learn; an unknown name is refused with the variants in the message."""
    from mini_moe import subtasks

    small = dict(tasks=4, dim=8, hidden=8, group_tokens=32, groups=2, steps=3, eval_every=3, seed=3)
    learned = subtasks.SubtaskLayer(subtasks.SubtaskConfig(router="softmax_token_choice", **small),
                                    rngs=nnx.Rngs(params=3, noise=4))
    result, frozen, _ = subtasks.run(subtasks.SubtaskConfig(router="softmax_token_choice_frozen", **small),
                                     test_groups=2, return_layer=True)
    assert not nnx.state(frozen.router, nnx.Param)
    _assert_same(_leaves(nnx.state(frozen.router, routers.FrozenWeight)),
                 _leaves(nnx.state(learned.router, nnx.Param)))
    fresh = subtasks.SubtaskLayer(subtasks.SubtaskConfig(router="softmax_token_choice_frozen", **small),
                                  rngs=nnx.Rngs(params=3, noise=4))
    assert any(np.any(a != b) for a, b in zip(_leaves(nnx.state(frozen.experts, nnx.Param)),
                                              _leaves(nnx.state(fresh.experts, nnx.Param))))
    assert result["config"]["router"] == "softmax_token_choice_frozen" and 0 <= result["final"]["routing_accuracy"] <= 1
    with pytest.raises(InputError, match="softmax_expert_choice_frozen"):
        subtasks.SubtaskConfig(router="softmax_token_choice_frozn")
