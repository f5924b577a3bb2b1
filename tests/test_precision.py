"""Mixed precision (``ModelConfig.dtype = "bfloat16"``): parameters float32, routers and losses
float32, the rest of the network in bfloat16; on CPU, against the float32 model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mini_moe import config as config_lib
from mini_moe import routers, train
from mini_moe.model import ModelConfig, MoeMlp, VisionMoE

SPARSE_ROUTERS = sorted(name for name, s in routers.ROUTERS.items() if s.allocation != "soft" and s.reads != "pixels")


@pytest.fixture(scope="module")
def digits():
    return train.load_data(config_lib.get_config("quick", dataset="digits"))


def _pair(router, **fields):
    """The same parameters in a float32 and a bfloat16 model (quick digits shape)."""
    base = config_lib.get_config("quick", dataset="digits", router=router).model
    f32 = VisionMoE(ModelConfig(**{**base.__dict__, **fields, "dtype": "float32"}), rngs=nnx.Rngs(0))
    bf16 = VisionMoE(ModelConfig(**{**base.__dict__, **fields, "dtype": "bfloat16"}), rngs=nnx.Rngs(1))
    # The head starts at zero (logits 0 for every image): give it random weights to compare logits.
    f32.head.kernel[...] = 0.5 * jax.random.normal(jax.random.key(2), f32.head.kernel.shape)
    nnx.update(bf16, nnx.state(f32))
    return f32, bf16


def test_dtype_is_validated_and_the_default_depends_on_scale_and_backend(monkeypatch):
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(dtype="float16")
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # the same answer on whichever backend runs it
    assert config_lib.get_config("quick", dataset="digits").model.dtype == "float32"
    assert config_lib.get_config("full", dataset="cifar10").model.dtype == "float32"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert config_lib.get_config("full", dataset="cifar10").model.dtype == "bfloat16"
    assert config_lib.get_config("quick", dataset="digits").model.dtype == "float32"
    assert config_lib.get_config("full", dataset="cifar10", model_dtype="float32").model.dtype == "float32"


@pytest.mark.parametrize("router", ["soft_moe", "softmax_token_choice", "softmax_expert_choice", None])
def test_bfloat16_forward_agrees_with_float32(router, digits):
    """Same parameters, same images: float32 logits, aux loss and router probabilities from the
    bfloat16 model; logits within 10 % of the float32 model's largest logit (bfloat16 keeps 8
    significant bits, about 0.4 % per rounding; measured on this CPU: 0.7 % for Soft MoE, 1.1 %
    dense, 4 % for the sparse routers, where a token near a routing tie changes expert)."""
    f32, bf16 = _pair(router)
    for m in (f32, bf16):
        m.eval()
    images = jnp.asarray(digits[1].images[:64])
    out32, out16 = f32(images), bf16(images)
    assert out16.logits.dtype == jnp.float32 and out16.aux_loss.dtype == jnp.float32
    assert out16.features.dtype == jnp.float32
    assert all(p.dtype == jnp.float32 for p in out16.probs)
    # Parameters stay float32 in the bfloat16 model.
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(bf16, nnx.Param)))
    scale = float(jnp.max(jnp.abs(out32.logits)))
    assert scale > 1.0
    np.testing.assert_allclose(np.asarray(out16.logits), np.asarray(out32.logits), atol=0.1 * scale)
    np.testing.assert_allclose(float(out16.aux_loss), float(out32.aux_loss), rtol=0.05, atol=1e-3)
    # The predictions agree on (nearly) every image.
    agree = np.mean(np.argmax(out16.logits, -1) == np.argmax(out32.logits, -1))
    assert agree >= 0.95, agree


def test_bfloat16_training_stays_finite_and_learns(tmp_path, digits):
    cfg = config_lib.get_config("quick", dataset="digits", router="softmax_expert_choice", steps=150,
                                batch_size=64, eval_every=150, checkpoint_every=150, learning_rate=3e-3,
                                model_dtype="bfloat16")
    history = train.train(cfg, tmp_path, progress=False, datasets=digits)
    losses = [row["loss"] for row in history["train"]]
    assert np.all(np.isfinite(losses)) and np.all(np.isfinite([row["aux_loss"] for row in history["train"]]))
    assert losses[-1] < 0.5 * losses[0]
    assert history["eval"][-1]["test_accuracy"] > 0.6  # chance is 0.1
    model, saved = train.load_trained(tmp_path)
    assert saved.model.dtype == "bfloat16"
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _separated_tokens(num_groups, num_tokens, dim, num_experts, seed=0):
    """Tokens whose router scores are far apart: token t is s_t times the unit vector of one
    expert (s_t distinct, 0.25 apart), and the router's weights are 4 x those unit vectors, so
    every logit gap is >= 1 (bfloat16 rounding moves a logit by < 0.1). Each expert is preferred
    by T/E tokens, so the balanced transport plans agree with the logits and are far apart too."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.normal(size=(dim, dim)))[0][:, :num_experts].T  # [E, D] orthonormal
    balanced = np.repeat(np.arange(num_experts), num_tokens // num_experts)
    expert = np.stack([rng.permutation(balanced) for _ in range(num_groups)])
    strength = 1.0 + 0.25 * np.stack([rng.permutation(num_tokens) for _ in range(num_groups)])
    tokens = strength[..., None] * basis[expert]
    return jnp.asarray(tokens, jnp.float32), jnp.asarray(4.0 * basis.T, jnp.float32)


@pytest.mark.parametrize("router", SPARSE_ROUTERS)
def test_sparse_routers_decide_the_same_on_bfloat16_tokens(router):
    """A bfloat16 model feeds its routers the bfloat16 residual stream (cast to float32): on
    well-separated scores every registered sparse router then sends the same tokens to the same
    experts with the same combine weights, the routing tensors stay float32 and the layer's
    output is bfloat16."""
    num_experts, dim, group_images, tokens_per_image = 4, 16, 2, 8
    # The sigmoid routers default to k = 2; on these tokens (orthogonal to every expert but one)
    # all second choices tie at sigmoid(0) = 0.5, so only the first choice is well separated.
    # The null-expert routers likewise at k = 1 (their null columns, padded with zeros below, tie).
    options = (("k", 1),) if router in ("sigmoid_loss_free", "group_limited", "adamoe", "longcat") else ()
    cfg = ModelConfig(image_size=8, channels=1, patch_size=2, dim=dim, depth=2, heads=2, mlp_dim=16,
                      router=router, num_experts=num_experts, group_images=group_images, router_kwargs=options)
    layer = MoeMlp(cfg, rngs=nnx.Rngs(0))
    layer.eval()
    x, kernel = _separated_tokens(2, group_images * tokens_per_image, dim, num_experts)
    affinity = layer.router.affinity
    if isinstance(affinity, routers.HashProjection):  # the routing control: a fixed projection, no dense
        affinity.projection[...] = kernel
    else:  # null experts' columns (adamoe, longcat) come after the real ones: zeros
        affinity.dense.kernel[...] = jnp.pad(kernel, ((0, 0), (0, affinity.num_experts - num_experts)))
    x = x.reshape(2 * group_images, tokens_per_image, dim)
    y32, out32 = layer(x)
    y16, out16 = layer(x.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16 and y32.dtype == jnp.float32
    assert out16.routing.dispatch.dtype == jnp.float32 and out16.routing.combine.dtype == jnp.float32
    # The decisions: which tokens each expert processes (the order of its buffer does not enter eq. 2,
    # and a transport plan can leave two of an expert's tokens within rounding of each other).
    assigned16, assigned32 = (np.asarray(o.routing.dispatch).sum(-1) for o in (out16, out32))
    assert assigned32.sum() > 0
    np.testing.assert_array_equal(assigned16, assigned32)
    np.testing.assert_allclose(np.asarray(out16.routing.combine).sum(-1), np.asarray(out32.routing.combine).sum(-1),
                               atol=2e-2)
    np.testing.assert_allclose(np.asarray(y16, np.float32), np.asarray(y32), atol=0.05 * float(jnp.max(jnp.abs(y32))))
