"""Fine-grained and shared experts (DeepSeekMoE, arXiv 2401.06066): the routed budget keeps the
activated FLOPs of the coarse layer (counted by XLA), shared experts add to every token's output,
and bad settings are clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mini_moe import config as config_lib
from mini_moe import routing, train
from mini_moe.model import DenseMlp, ModelConfig, MoeMlp

BASE = dict(image_size=28, patch_size=7, dim=32, mlp_dim=64, num_experts=8, group_images=8)


def _flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


@pytest.mark.parametrize("router, kwargs, m, shared, expected", [
    ("softmax_token_choice", {}, 4, 1, {"k": 3, "capacity_factor": 3.0}),  # k = 1 by default
    ("softmax_token_choice", {"k": 2}, 4, 2, {"k": 6, "capacity_factor": 6.0}),  # capacity_factor defaults to k
    ("softmax_token_choice", {"k": 1, "capacity_factor": 1.25}, 2, 0, {"k": 2, "capacity_factor": 2.5}),
    ("sigmoid_loss_free", {}, 2, 1, {"k": 3, "capacity_factor": 3.0}),  # k = 2 by default
    ("softmax_expert_choice", {}, 4, 2, {"capacity_factor": 2.0}),
    ("softmax_expert_choice", {"capacity_factor": 0.5}, 4, 0, {"capacity_factor": 2.0}),
])
def test_routed_budget_is_m_times_minus_shared(router, kwargs, m, shared, expected):
    cfg = ModelConfig(**BASE, router=router, router_kwargs=tuple(kwargs.items()), fine_grained=m, shared_experts=shared)
    options = cfg.routed_options()
    assert {key: options[key] for key in expected} == expected
    assert cfg.routed_experts == 8 * m


@pytest.mark.parametrize("router, kwargs", [
    ("softmax_token_choice", {}), ("softmax_token_choice", {"k": 2}), ("softmax_expert_choice", {}),
])
def test_activated_expert_flops_equal_the_coarse_layer(router, kwargs):
    """XLA's FLOP count of the experts on their slots (and of the shared experts on every token)
    is the coarse layer's, for m = 4 with 0, 1 and 2 shared experts."""
    tokens = BASE["group_images"] * 16  # one routing group: 8 images of 16 patches
    counts = []
    for m, shared in ((1, 0), (4, 0), (4, 1), (4, 2)):
        cfg = ModelConfig(**BASE, router=router, router_kwargs=tuple(kwargs.items()), fine_grained=m,
                          shared_experts=shared)
        layer = MoeMlp(cfg, rngs=nnx.Rngs(0))
        opts = cfg.routed_options()
        slots = routing.capacity(tokens, cfg.routed_experts, opts.get("capacity_factor", opts.get("k", 1)))
        expert_in = jnp.ones((cfg.routed_experts, slots, cfg.dim))
        flops = _flops(lambda x: layer.experts(x), expert_in)
        if shared:
            assert isinstance(layer.shared, DenseMlp) and layer.shared.fc1.out_features == shared * cfg.mlp_dim // m
            flops += _flops(lambda x: layer.shared(x), jnp.ones((tokens, cfg.dim)))
        else:
            assert layer.shared is None
        counts.append(flops)
    assert counts[0] > 0
    np.testing.assert_allclose(counts, counts[0], rtol=1e-6)


def test_parameters_fine_grained_equal_and_shared_add():
    def count(**kw):
        layer = MoeMlp(ModelConfig(**BASE, router="softmax_token_choice", **kw), rngs=nnx.Rngs(0))
        return sum(v.size for v in jax.tree.leaves(nnx.state(layer.experts, nnx.Param))), layer
    coarse, _ = count()
    fine, layer = count(fine_grained=4)
    assert layer.experts.w1.shape == (32, 32, 16) and layer.router.num_experts == 32
    # Same weights; the biases of the hidden layers are split too, the output biases multiply by m.
    assert fine - coarse == (4 - 1) * 8 * BASE["dim"]


def test_shared_experts_add_to_the_routed_output():
    cfg = ModelConfig(**BASE, router="softmax_expert_choice", fine_grained=2, shared_experts=1)
    layer = MoeMlp(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (8, 16, cfg.dim))
    y, _ = layer(x)
    shared, layer.shared = layer.shared, None
    routed, _ = layer(x)
    np.testing.assert_allclose(y, routed + shared(x), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(shared(x)).mean()) > 0


def test_defaults_keep_the_coarse_layer():
    cfg = ModelConfig(**BASE, router="softmax_token_choice")
    assert cfg.routed_options() == {} and cfg.routed_experts == 8
    state = nnx.state(MoeMlp(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    assert "shared" not in state  # parameter paths of existing checkpoints unchanged


@pytest.mark.parametrize("kw, match", [
    (dict(router="soft_moe", fine_grained=2), "soft allocation"),
    (dict(router="softmax_token_choice", fine_grained=2, shared_experts=2), "no routed expert"),
    (dict(router="softmax_expert_choice", fine_grained=2, shared_experts=2), "no routed slots"),
    (dict(router="softmax_token_choice", fine_grained=3), "fine_grained=3 must divide mlp_dim=64"),
    (dict(router="softmax_token_choice", fine_grained=0), "fine_grained"),
    (dict(router="softmax_token_choice", shared_experts=-1), "shared_experts"),
])
def test_bad_fine_grained_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**BASE, **kw)


def test_trains_from_the_command_line(tmp_path, capsys):
    from mini_moe.__main__ import main

    out = tmp_path / "run"
    assert main(["train", "--router", "softmax_token_choice", "--dataset", "digits", "--config", "quick", "--steps", "3",
                 "--set", "model_fine_grained=2", "--set", "model_shared_experts=1", "--out", str(out)]) == 0
    model, cfg = train.load_trained(out)
    assert (cfg.model.fine_grained, cfg.model.shared_experts) == (2, 1)
    assert model.blocks[1].mlp.experts.w1.shape[0] == 16 and model.blocks[1].mlp.shared is not None
