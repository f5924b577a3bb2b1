"""The MoE layer of eq. (2): einsum path == gather path; eq. (2) recovers eq. (1) and Soft MoE."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mini_moe as mm
from mini_moe import layer, routing

D, E, H = 6, 4, 10


@pytest.fixture(scope="module")
def experts():
    return layer.MlpExperts(E, D, H, rngs=nnx.Rngs(0))


def _expert_apply(experts, r, x):
    """MLP_r on a single token x [D], written out from the weights (independent of moe())."""
    w1, b1, w2, b2 = (np.asarray(p[...], np.float64) for p in (experts.w1, experts.b1, experts.w2, experts.b2))
    h = np.asarray(jax.nn.gelu(jnp.asarray(x @ w1[r] + b1[r, 0])), np.float64)
    return h @ w2[r] + b2[r, 0]


def _sparse_routings(scores):
    return {
        "token_choice_k1": routing.token_choice(scores, capacity=2),
        "token_choice_k2_bpr": routing.token_choice(scores, capacity=3, k=2, batch_priority=True),
        "expert_choice": routing.expert_choice(scores, capacity=3),
    }


@pytest.mark.parametrize("name", ["token_choice_k1", "token_choice_k2_bpr", "expert_choice"])
def test_einsum_and_gather_paths_agree_with_gradients(experts, name):
    kx, ks = jax.random.split(jax.random.PRNGKey(3))
    x = jax.random.normal(kx, (3, 9, D))
    scores = jax.nn.softmax(jax.random.normal(ks, (3, 9, E)), axis=-1)
    rt = _sparse_routings(scores)[name]
    outs = {p: layer.moe(x, rt, experts, path=p) for p in ("einsum", "gather")}
    np.testing.assert_allclose(outs["einsum"], outs["gather"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.moe(x, rt, experts), outs["gather"])  # auto -> gather

    def loss(model, x, combine, path):
        out = layer.moe(x, routing.Routing(rt.dispatch, combine, sparse=True), model, path=path)
        return jnp.sum(jnp.sin(out))

    grad = nnx.jit(nnx.grad(loss, argnums=(0, 1, 2)), static_argnums=3)  # one compile per path
    grads = {p: grad(experts, x, rt.combine, p) for p in ("einsum", "gather")}
    g_e, g_g = grads["einsum"], grads["gather"]
    for a, b in zip(jax.tree.leaves(nnx.state(g_e[0])), jax.tree.leaves(nnx.state(g_g[0]))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(g_e[1], g_g[1], rtol=1e-4, atol=1e-5)  # wrt tokens
    mask = np.asarray(rt.dispatch) > 0  # wrt combine weights, where they are used
    np.testing.assert_allclose(np.asarray(g_e[2])[mask], np.asarray(g_g[2])[mask], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("k", [1, 2])
def test_softmax_token_choice_with_full_capacity_is_eq_1(experts, k):
    """Paper 000 eq. (3)-(4): with C = T no token is dropped and eq. (2) equals eq. (1)."""
    kx, kw = jax.random.split(jax.random.PRNGKey(k))
    tokens = 7
    x = jax.random.normal(kx, (tokens, D))
    router = mm.make_router("softmax_token_choice", D, E, k=k, capacity_factor=E, rngs=nnx.Rngs(5))
    router.eval()  # no noise: eq. (1) with epsilon = 0
    out = router(x)
    assert out.routing.dispatch.shape[-1] == tokens  # C = round(E * T / E) = T
    y = np.asarray(layer.moe(x, out.routing, experts, path="einsum"))
    logits = np.asarray(x, np.float64) @ np.asarray(router.affinity.dense.kernel[...], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    for t in range(tokens):
        gate = np.zeros(E)
        top = np.argsort(-probs[t])[:k]
        gate[top] = probs[t, top]  # top_k(softmax(Wx)): other entries set to zero
        expected = sum(gate[r] * _expert_apply(experts, r, np.asarray(x[t], np.float64)) for r in range(E))
        np.testing.assert_allclose(y[t], expected, rtol=1e-4, atol=1e-5)


def test_soft_moe_layer_is_paper_002_eq_1_2(experts):
    slots = 2
    x = jax.random.normal(jax.random.PRNGKey(7), (5, D))
    logits = jax.random.normal(jax.random.PRNGKey(8), (5, E, slots))
    y = np.asarray(layer.moe(x, routing.soft_routing(logits), experts))
    z = np.asarray(logits, np.float64).reshape(5, E * slots)  # [T, n*p], slots of expert r contiguous
    dispatch = np.exp(z) / np.exp(z).sum(axis=0, keepdims=True)
    combine = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    slot_in = dispatch.T @ np.asarray(x, np.float64)  # X~ = D^T X
    slot_out = np.stack([_expert_apply(experts, i // slots, slot_in[i]) for i in range(E * slots)])
    np.testing.assert_allclose(y, combine @ slot_out, rtol=1e-4, atol=1e-5)


def test_jit_and_vmap(experts):
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, D))
    rt = routing.expert_choice(jax.random.uniform(jax.random.PRNGKey(1), (2, 8, E)), capacity=2)
    eager = layer.moe(x, rt, experts)
    jitted = nnx.jit(lambda m, x, rt: layer.moe(x, rt, m))(experts, x, rt)
    np.testing.assert_allclose(eager, jitted, rtol=1e-5, atol=1e-6)
    single = [layer.moe(x[g], routing.Routing(rt.dispatch[g], rt.combine[g], sparse=True), experts) for g in range(2)]
    np.testing.assert_allclose(eager, np.stack(single), rtol=1e-5, atol=1e-6)


def test_bad_inputs(experts):
    x = jnp.ones((8, D))
    rt = routing.expert_choice(jnp.ones((8, E)), capacity=2)
    with pytest.raises(ValueError, match="path"):
        layer.moe(x, rt, experts, path="scatter")
    with pytest.raises(ValueError, match="routing tensors"):
        layer.moe(jnp.ones((9, D)), rt, experts)
    with pytest.raises(ValueError, match="gather"):
        layer.moe(x, routing.soft_routing(jnp.ones((8, E, 1))), experts, path="gather")
    with pytest.raises(ValueError, match="experts expect"):
        experts(jnp.ones((E + 1, 3, D)))


@pytest.mark.parametrize("k", [1, 2])
def test_moe_sorted_equals_dropless_token_choice(k):
    from mini_moe import layer, routing

    groups, T, D, E = 3, 16, 8, 4
    x = jax.random.normal(jax.random.key(0), (groups, T, D))
    scores = jax.nn.softmax(2 * jax.random.normal(jax.random.key(1), (groups, T, E)) + jnp.array([2.0, 0, 0, 0]))
    experts = layer.MlpExperts(E, D, 12, rngs=nnx.Rngs(2))
    # Token Choice with C = T drops nothing: eq. (2) through one-hot tensors is the reference.
    reference = layer.moe(x, routing.token_choice(scores, capacity=T, k=k), experts, path="einsum")
    np.testing.assert_allclose(layer.moe_sorted(x, scores, experts, k=k), reference, rtol=1e-5, atol=1e-5)

    # and the gradients with respect to the tokens, the router scores and the expert weights
    def loss(fn, params, x, scores):
        model = nnx.merge(graphdef, params)
        return jnp.sum(fn(x, scores, model) ** 2)

    graphdef, params = nnx.split(experts)
    sorted_fn = lambda x, s, m: layer.moe_sorted(x, s, m, k=k)  # noqa: E731
    einsum_fn = lambda x, s, m: layer.moe(x, routing.token_choice(s, capacity=T, k=k), m, path="einsum")  # noqa: E731
    g_sorted = jax.jit(jax.grad(lambda p, x, s: loss(sorted_fn, p, x, s), argnums=(0, 1, 2)))(params, x, scores)
    g_einsum = jax.jit(jax.grad(lambda p, x, s: loss(einsum_fn, p, x, s), argnums=(0, 1, 2)))(params, x, scores)
    for a, b in zip(jax.tree.leaves(g_sorted), jax.tree.leaves(g_einsum)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    # a popular expert overflows a buffer of T / E but not the sorted path: nothing is dropped
    assert int(jnp.bincount(jnp.argmax(scores.reshape(-1, E), -1), length=E).max()) > groups * T // E


def test_moe_sorted_rejects_bad_arguments():
    from mini_moe import layer

    experts = layer.MlpExperts(4, 8, 12, rngs=nnx.Rngs(2))
    x = jnp.zeros((16, 8))
    with pytest.raises(ValueError, match="scores must have shape"):
        layer.moe_sorted(x, jnp.zeros((16, 3)), experts)
    with pytest.raises(ValueError, match="k must be an int"):
        layer.moe_sorted(x, jnp.zeros((16, 4)), experts, k=5)
