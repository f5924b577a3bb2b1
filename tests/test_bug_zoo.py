"""A bug zoo: routing and balancing bugs that shipped in real MoE frameworks, as regression tests.

Each test cites the issue or pull request where the bug was reported or fixed, states its
symptom, checks the property the bug broke on ``mini_moe``, and then shows that the same check
fails on a *mutant*: the bug reintroduced, by a small monkeypatch of the library or by a function
that computes what the buggy code computed. So every test is shown able to fail.

Where ``mini_moe`` itself once had the bug, the test says so (and the CHANGELOG records it).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mini_moe import losses, modes, routers, routing
from mini_moe.layer import MlpExperts, moe
from mini_moe.model import MoeLayer

D, E, T = 16, 8, 64


def _x(seed=0, groups=2, tokens=T):
    return jax.random.normal(jax.random.key(seed), (groups, tokens, D))


def _loss_free(**kw):
    return routers.make_router("sigmoid_loss_free", D, E, rngs=nnx.Rngs(0), **kw)


def _sigmoid_scores(router, x):
    return np.asarray(jax.nn.sigmoid(x @ router.affinity.dense.kernel[...]))


# ------------------------------------------------------------------------------ loss-free bias


def _bias_follows_the_update_rule(router, x) -> bool:
    """One training call moves every bias by exactly ``rate * sign(mean load - load_e)``, with the
    load counted on the call's picks, and the bias is not a parameter (no gradient, no optimizer)."""
    before = np.asarray(router.affinity.bias[...]).copy()
    biased = _sigmoid_scores(router, x) + before
    picks = np.argsort(-biased, axis=-1)[..., :2].reshape(-1, 2)
    load = np.bincount(picks.ravel(), minlength=E)
    router(x)
    moved = np.asarray(router.affinity.bias[...]) - before
    expected = router.affinity.bias_rate * np.sign(load.mean() - load) if router.affinity.bias_rate else None
    rule = expected is not None and np.allclose(moved, 1e-3 * np.sign(load.mean() - load), atol=1e-7)
    return bool(rule and "bias" not in nnx.state(router, nnx.Param)["affinity"])


def test_maxtext_2494_the_loss_free_bias_is_updated():
    """AI-Hypercomputer/maxtext#2494: DeepSeek-V3's routing bias was declared (and described as
    learnable) but never updated. It only feeds the top-k, so it gets no gradient, and there was
    no update rule: the "loss-free" balancing did nothing. (The issue is closed; we found no
    change that fixes it for DeepSeek-V3, so none is cited.)"""
    x = _x(1) + 0.5  # an offset makes some experts popular
    assert _bias_follows_the_update_rule(_loss_free(bias_rate=1e-3), x)
    # The mutant: the bias exists but nothing updates it.
    assert not _bias_follows_the_update_rule(_loss_free(bias_rate=0.0), x)


def test_torchtitan_4148_evaluation_does_not_move_the_bias(monkeypatch):
    """pytorch/torchtitan#4148: forward passes in evaluation counted tokens per expert, so the
    validation batches leaked into the next bias update. Here eval mode switches the update off."""

    def eval_moves_bias() -> bool:
        router = _loss_free()
        with modes.eval_mode(router):
            router(_x(2) + 0.5)
        return bool(np.any(np.asarray(router.affinity.bias[...]) != 0))

    assert not eval_moves_bias()
    # The mutant: eval mode no longer reaches the router (its `deterministic` flag stays False).
    monkeypatch.setattr(routers.Router, "eval", lambda self, **kwargs: None)
    assert eval_moves_bias()


def test_transformers_41647_gates_come_from_the_unbiased_scores():
    """huggingface/transformers#41647 (and vllm-project/vllm#12002): DeepSeek-V3's gate values
    were gathered from ``sigmoid(logits) + bias``. V3 (Sec. 2.1.2) uses the bias for the selection
    only: the gates are the *unbiased* scores of the chosen experts, normalised over the k."""
    router = _loss_free(deterministic=True)
    router.affinity.bias[...] = jnp.linspace(-0.3, 0.4, E)  # a bias large enough to matter
    x = _x(3)
    scores = _sigmoid_scores(router, x)
    chosen = np.zeros_like(scores, bool)
    np.put_along_axis(chosen, np.argsort(-(scores + np.asarray(router.affinity.bias[...])), -1)[..., :2], True, -1)

    def right(gates) -> bool:
        expected = np.where(chosen, scores, 0) / np.where(chosen, scores, 0).sum(-1, keepdims=True)
        return np.allclose(gates, expected, rtol=1e-5, atol=1e-7)

    out = router(x)
    assert right(np.asarray(out.affinities.combine))
    biased = np.where(chosen, scores + np.asarray(router.affinity.bias[...]), 0)
    assert not right(biased / biased.sum(-1, keepdims=True))  # the mutant's gates


def test_torchtitan_1418_sigmoid_gates_are_normalised_over_the_k():
    """pytorch/torchtitan#1418 (fixed in #1419): with sigmoid gating the top-k scores were not
    renormalised, so a token's gates summed to anything in (0, k) instead of 1 as in DeepSeek-V3."""
    router = _loss_free(deterministic=True)
    x = _x(4)

    def sums_to_one(gates) -> bool:
        return np.allclose(np.asarray(gates).sum(-1), 1.0, atol=1e-6)

    assert sums_to_one(router(x).affinities.combine)
    scores = _sigmoid_scores(router, x)
    top = np.sort(scores, -1)[..., -2:]
    assert not sums_to_one(top)  # the mutant: the raw top-2 sigmoid scores


def test_vllm_13474_group_limited_routing_never_picks_an_excluded_expert(monkeypatch):
    """vllm-project/vllm#13474 (and sgl-project/sglang#3705): group-limited routing masked the
    experts of the dropped groups with 0 instead of -inf, so once the kept groups' biased scores
    were negative an expert of a dropped group could be picked. mini_moe had the same bug with a
    -1.0 fill until issue 35 (CHANGELOG): the bias drifts below -1 in long runs."""
    router = routers.make_router("group_limited", D, E, rngs=nnx.Rngs(0), deterministic=True, k=2,
                                 num_groups=4, top_groups=2)
    router.affinity.bias[...] = jnp.full((E,), -3.0)  # every biased score is negative
    x = _x(5)

    def picks_stay_in_kept_groups() -> bool:
        biased = _sigmoid_scores(router, x) - 3.0
        grouped = biased.reshape(*biased.shape[:-1], 4, 2)
        group_score = np.sort(grouped, -1)[..., -2:].sum(-1)
        kept = np.argsort(-group_score, -1)[..., :2]
        allowed = np.zeros(biased.shape[:-1] + (4,), bool)
        np.put_along_axis(allowed, kept, True, -1)
        allowed = np.repeat(allowed, 2, -1)
        reached = np.asarray(router(x).routing.dispatch).any(-1)
        return not np.any(reached & ~allowed)

    assert picks_stay_in_kept_groups()
    # The mutant: the excluded experts get 0 (vLLM's bug) instead of a score below any biased score.
    original = routers.SigmoidGates._limit_groups
    monkeypatch.setattr(routers.SigmoidGates, "_limit_groups",
                        lambda self, biased: jnp.where(jnp.isneginf(original(self, biased)), 0.0, biased))
    assert not picks_stay_in_kept_groups()


# ---------------------------------------------------------------------- softmax gates and losses


def _task_gradient(router, x) -> float:
    """max |d task / d W_router| through ``router(x)`` and the experts; no auxiliary loss."""
    experts = MlpExperts(E, D, 8, rngs=nnx.Rngs(1))

    def loss(router):
        return jnp.sum(moe(x, router(x).routing, experts) ** 2)

    return float(jnp.abs(nnx.grad(loss)(router).affinity.dense.kernel[...]).max())


def test_megatron_894_top1_router_gets_a_gradient_from_the_task(monkeypatch):
    """NVIDIA/Megatron-LM#894: with top-1 routing, taking the top-k first and the softmax after
    gives every kept token a gate of exactly 1, so the router's weights get no gradient from the
    task (the fix added softmax-before-top-k, ``--moe-router-pre-softmax``). V-MoE's eq. (1) takes
    the softmax first, as mini_moe's router does: the gradient is taken through the router."""
    router = lambda: routers.make_router("softmax_token_choice", D, E, rngs=nnx.Rngs(0), k=1, deterministic=True,
                                         balance_loss="none", capacity_factor=float(E))
    x = _x(6)
    assert _task_gradient(router(), x) > 1e-3

    # The mutant, in the library: the router's softmax over the top-1 logit only.
    real_softmax = jax.nn.softmax

    def softmax_after_top1(logits, axis=-1):
        keep = jax.nn.one_hot(jnp.argmax(logits, axis), logits.shape[axis], dtype=bool)
        return real_softmax(jnp.where(keep, logits, -jnp.inf), axis=axis)

    monkeypatch.setattr(routers.jax.nn, "softmax", softmax_after_top1)
    assert _task_gradient(router(), x) == 0.0


def test_transformers_28115_switch_loss_uses_the_full_softmax():
    """huggingface/transformers#28021/#28093 (fixed in #28115): Mixtral's balancing loss built P_i
    from the top-k routing weights instead of the softmax over all experts; with top-1 weights
    renormalised to 1, P_i = f_i and the loss was a constant with no gradient."""
    logits = jax.random.normal(jax.random.key(7), (T, E))

    def gradient(p_fn) -> float:
        def loss(z):
            probs = jax.nn.softmax(z, -1)
            return losses.switch_loss(p_fn(probs), k=1)
        return float(jnp.abs(jax.grad(loss)(logits)).max())

    probs = np.asarray(jax.nn.softmax(logits, -1))
    f = np.bincount(probs.argmax(-1), minlength=E) / T
    np.testing.assert_allclose(float(losses.switch_loss(jnp.asarray(probs), k=1)), E * np.sum(f * probs.mean(0)),
                               rtol=1e-5)
    assert gradient(lambda p: p) > 1e-4

    def top1_weights(p):  # the mutant: the renormalised top-1 weight of each token (always 1)
        keep = jax.nn.one_hot(jnp.argmax(p, -1), E)
        return keep * p / jnp.sum(keep * p, -1, keepdims=True)

    assert gradient(top1_weights) < 1e-6  # round-off of p / p


# ------------------------------------------------------------------------------ allocation


def _processed_per_expert(dispatch) -> np.ndarray:
    return np.asarray(dispatch).any(-1).sum(-2)  # [..., E]


def test_deepspeed_7986_a_full_expert_keeps_its_best_tokens_even_with_negative_logits(monkeypatch):
    """deepspeedai/DeepSpeed#7986: capacity dropping ranked each expert's tokens by
    ``mask * logits``, so a selected token with a negative logit ranked below the zeros of tokens
    that had not selected the expert; few selected tokens survived (experts per token fell to
    0.001). Every expert must keep min(C, tokens that chose it) tokens. mini_moe's allocation is
    given negative scores too: the loss-free router ranks ``sigmoid + bias``, and biases go negative."""
    capacity = 4
    logits = jax.random.normal(jax.random.key(8), (T, E)) - 5.0  # all negative, fed to the allocation as they are
    chosen = np.asarray(jnp.argmax(logits, -1))
    wanted = np.minimum(np.bincount(chosen, minlength=E), capacity)
    assert wanted.sum() < T  # some experts overflow: the ranking decides who stays

    def held():
        rt = routing.token_choice(logits, capacity=capacity, k=1, batch_priority=True)
        return _processed_per_expert(rt.dispatch)

    np.testing.assert_array_equal(held(), wanted)

    def mask_times_score_slots(scores, capacity, k, batch_priority, min_score=None):  # DeepSpeed's ranking
        """The mutant, in the library's slot assignment: each expert's buffer [E, C] takes the top C
        tokens of ``mask * score``, and keeps only those that chose it."""
        num_tokens, num_experts = scores.shape
        expert = jnp.argmax(scores, -1)  # [T]
        masked = jax.nn.one_hot(expert, num_experts) * jnp.max(scores, -1, keepdims=True)  # [T, E]
        ranked = jnp.argsort(-masked, axis=0, stable=True)[:capacity]  # [C, E]
        return jnp.where(expert[ranked] == jnp.arange(num_experts), ranked, num_tokens).T.astype(jnp.int32)

    monkeypatch.setattr(routing, "_token_choice_slots", mask_times_score_slots)
    assert held().sum() < wanted.sum()  # selected tokens lost to the zeros of tokens that chose elsewhere


def test_deepspeed_1658_tokens_over_capacity_are_dropped():
    """deepspeedai/DeepSpeed#1658: without random token selection, top-1 gating never dropped the
    tokens beyond an expert's capacity, so ``one_hot(location, capacity)`` failed (five tokens all
    preferring expert 0, capacity factor 1). No expert may ever hold more than C tokens."""
    logits = jnp.tile(jnp.array([[1.0, 0.0, 0.0, 0.0]]), (5, 1))
    capacity = routing.capacity(5, 4, 1.0)
    rt = routing.token_choice(jax.nn.softmax(logits, -1), capacity=capacity, k=1)
    held = _processed_per_expert(rt.dispatch)
    assert held.max() <= capacity and held[0] == capacity == 1
    mutant = np.bincount(np.asarray(jnp.argmax(logits, -1)), minlength=4)  # no drop: every pick placed
    assert mutant.max() > capacity


def test_jitter_and_noise_reach_the_router_only():
    """huggingface/transformers#33969: Switch Transformers' router jitter was applied to the
    hidden states in place, so the experts received the noisy tokens too; only the router's
    input should be perturbed. In mini_moe the training noise is on the logits: the experts see
    the clean tokens, whatever routing the noise chose."""
    router = routers.make_router("softmax_token_choice", D, E, rngs=nnx.Rngs(0), noise_std=5.0,
                                 capacity_factor=2.0)
    layer = MoeLayer(router, MlpExperts(E, D, 8, rngs=nnx.Rngs(1)))
    x = _x(9)

    def experts_see_clean_tokens(call) -> bool:
        y, out = call(x)
        return np.allclose(np.asarray(y), np.asarray(moe(x, out.routing, layer.experts)), atol=1e-5)

    assert experts_see_clean_tokens(layer)

    def jittered(x):  # the mutant: the router's jitter multiplies the tokens the experts receive
        noisy = x * jax.random.uniform(jax.random.key(10), x.shape, minval=0.8, maxval=1.2)
        out = layer.router(noisy)
        return moe(noisy, out.routing, layer.experts), out

    assert not experts_see_clean_tokens(jittered)


# ----------------------------------------------------------------- sequence-wise balance loss


def test_megatron_5798_the_sequence_wise_loss_does_not_depend_on_the_batch_size():
    """NVIDIA/Megatron-LM#5798: the sequence-level auxiliary loss was normalised by the sequence
    length instead of by sequence length x batch size, so a larger micro-batch silently weakened
    the balancing. The loss of a batch must be the mean of its sequences' losses."""
    scores = jax.nn.sigmoid(jax.random.normal(jax.random.key(11), (3, T, E)))
    chosen = jax.nn.one_hot(jax.lax.top_k(scores, 2)[1], E).sum(-2)
    one = float(losses.sequence_balance_loss(scores, chosen))
    many = float(losses.sequence_balance_loss(jnp.tile(scores, (4, 1, 1)), jnp.tile(chosen, (4, 1, 1))))
    assert one == pytest.approx(many, rel=1e-6)

    def summed_over_sequences(s, c):  # the mutant: per-sequence losses summed, not averaged
        return s.shape[0] * losses.sequence_balance_loss(s, c)

    assert float(summed_over_sequences(jnp.tile(scores, (4, 1, 1)), jnp.tile(chosen, (4, 1, 1)))) != pytest.approx(
        float(summed_over_sequences(scores, chosen)), rel=1e-3)


def test_megatron_1513_the_sequence_wise_loss_counts_the_top_k_not_what_capacity_kept():
    """NVIDIA/Megatron-LM#1513: the sequence-wise loss (DeepSeek-V2/V3) counted f_i on the
    dispatch mask after capacity dropping instead of on each token's top-k, so it read about 30 %
    low whenever tokens were dropped. mini_moe's f_i counts the unbiased top-k (issue 35); the
    loss must not change with the capacity."""
    x = _x(12) + 0.7  # popular experts: a small capacity drops many picks

    def loss_at(factor):
        router = _loss_free(deterministic=True, seq_balance=1.0, capacity_factor=factor)
        return router, router(x)

    (small_router, small), (_, ample) = loss_at(0.5), loss_at(float(E))
    assert float(small.aux_loss) == pytest.approx(float(ample.aux_loss), rel=1e-6)
    assert np.asarray(small.routing.dispatch).any(-1).sum() < np.asarray(ample.routing.dispatch).any(-1).sum()
    # The mutant: f_i from the dispatch that capacity left.
    scores = jnp.asarray(_sigmoid_scores(small_router, x))
    kept = jnp.asarray(np.asarray(small.routing.dispatch).any(-1), scores.dtype)
    mutant = losses.sequence_balance_loss(scores, kept)
    assert float(mutant) != pytest.approx(float(small.aux_loss), rel=1e-3)
