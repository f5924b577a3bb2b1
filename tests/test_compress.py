"""mini_moe.compress (issue 67 §1): the criteria against NumPy on a hand-made layer, calibration
against the model's own routing, and pruning's exactness: no expert removed is the same function,
and under the "full" denominator a pruned layer equals the original on every token that picked no
removed expert (under "kept" those tokens' outputs are the original's divided by the kept mass)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mini_moe import compress, config as config_lib, evaluate, modes, routing, train

IMAGES = np.random.default_rng(0).normal(size=(32, 8, 8, 1)).astype(np.float32)


def _model(router="softmax_token_choice", **kwargs):
    cfg = config_lib.get_config("quick", dataset="digits", router=router, steps=1, **kwargs)
    model = train.make_model(cfg)
    model.head.kernel[...] = jax.random.normal(jax.random.key(1), model.head.kernel.shape)  # a live head
    return model


def _logits(model, images=IMAGES):
    return np.concatenate([np.asarray(o.logits[:n]) for o, n in evaluate.forward_batches(model, images, batch_size=16)])


def test_the_criteria_equal_numpy_on_a_hand_made_layer():
    # 4 tokens, 3 experts, D = 2: token 0 -> expert 0 (gate 0.5), token 1 -> expert 0 (0.25) and 2 (0.5),
    # token 2 -> expert 2 (0.75), token 3 dropped; expert 1 processes nothing.
    routed = np.array([[1, 0, 0], [1, 0, 1], [0, 0, 1], [0, 0, 0]], bool)
    gates = np.array([[0.5, 0, 0], [0.25, 0, 0.5], [0, 0, 0.75], [0, 0, 0]])
    probs = np.array([[0.5, 0.3, 0.2], [0.25, 0.25, 0.5], [0.1, 0.15, 0.75], [0.6, 0.2, 0.2]])
    outputs = np.zeros((4, 3, 2))
    outputs[0, 0], outputs[1, 0], outputs[1, 2], outputs[2, 2] = [3, 4], [0, 2], [6, 8], [0, 1]
    outputs[3] = 100.0  # a dropped token's outputs never count
    outputs[:, 1] = [1.0, 0.0]  # nor those of an expert that processed nothing
    record = compress.LayerRecord(np.zeros((4, 2)), np.log(probs), probs, gates, routed, outputs)
    np.testing.assert_allclose(compress.saliency(record, "frequency"), [2 / 4, 0, 2 / 4])
    # the gate summed over the routed tokens per calibration token (not the router's probs: 1.45, 0.9, 1.65)
    np.testing.assert_allclose(compress.saliency(record, "gate"), [0.75 / 4, 0, 1.25 / 4])
    np.testing.assert_allclose(compress.saliency(record, "ean"), [(5 + 2) / 2, 0, (10 + 1) / 2])  # no gate
    # REAP: expert 0: (0.5 * 5 + 0.25 * 2) / 2; expert 2: (0.5 * 10 + 0.75 * 1) / 2; expert 1: none routed
    np.testing.assert_allclose(compress.saliency(record, "reap"), [1.5, 0.0, 2.875])
    a, b = compress.saliency(record, "random", seed=3), compress.saliency(record, "random", seed=4)
    assert a.shape == (3,) and not np.allclose(a, b) and np.allclose(a, compress.saliency(record, "random", seed=3))
    assert compress.keep_top([1.5, 0.0, 2.875], 2) == (0, 2) and compress.keep_top([1, 1, 0], 1) == (0,)
    with pytest.raises(ValueError, match="criterion must be one of"):
        compress.saliency(record, "magnitude")
    with pytest.raises(ValueError, match="num_kept must be in 1..3"):
        compress.keep_top([1, 2, 3], 0)


def test_calibration_is_the_models_own_routing_and_experts():
    model = _model()
    records = compress.calibrate(model, IMAGES, batch_size=16)
    assert len(records) == len(modes.moe_layers(model)) == 2
    tokens = IMAGES.shape[0] * model.cfg.num_patches
    for record, layer in zip(records, modes.moe_layers(model)):
        assert record.inputs.shape == (tokens, model.cfg.dim) and record.outputs.shape == (tokens, 8, model.cfg.dim)
        # Token Choice k = 1: a routed token's gate is its router probability of that expert
        np.testing.assert_allclose(record.gates[record.routed], record.probs[record.routed], rtol=1e-6)
        assert np.all(record.gates[~record.routed] == 0) and record.routed.sum(1).max() == 1
        # every expert's output, computed here by hand from its weights
        w1, b1, w2, b2 = (np.asarray(p[...]) for p in (layer.experts.w1, layer.experts.b1, layer.experts.w2,
                                                          layer.experts.b2))
        t, e = 37, 5
        hidden = jax.nn.gelu(record.inputs[t] @ w1[e] + b1[e, 0])
        np.testing.assert_allclose(record.outputs[t, e], np.asarray(hidden) @ w2[e] + b2[e, 0], rtol=1e-4, atol=1e-5)
    # the first layer's input is the embedded patches after the first block's attention, normalised:
    # the routing the record holds is the one the model's forward pass returns
    first = next(evaluate.forward_batches(model, IMAGES[:16], batch_size=16, routing=True))[0]
    dispatch = np.asarray(first.routings[0].dispatch).reshape(16 * model.cfg.num_patches, 8, -1)
    np.testing.assert_array_equal(records[0].routed[:16 * model.cfg.num_patches], dispatch.sum(-1) > 0)


def test_keeping_every_expert_is_the_same_function():
    model = _model()
    for denominator in compress.DENOMINATORS:
        same = compress.prune(model, [tuple(range(8))] * 2, denominator=denominator)
        np.testing.assert_allclose(_logits(same), _logits(model), rtol=1e-6, atol=1e-6)
    shuffled = compress.prune(model, [(3, 1, 0, 2, 7, 6, 5, 4)] * 2)  # the experts in another order
    np.testing.assert_allclose(_logits(shuffled), _logits(model), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("router", ["softmax_token_choice", "softmax_expert_choice"])
def test_pruning_keeps_the_kept_experts_and_recomputes_the_buffers(router):
    model = _model(router)
    keep = [(0, 2, 5, 7), (1, 2, 3, 4)]
    pruned = compress.prune(model, keep)
    assert pruned.cfg.num_experts == 4 and model.cfg.num_experts == 8  # the original is untouched
    for layer, old, kept in zip(modes.moe_layers(pruned), modes.moe_layers(model), keep):
        np.testing.assert_array_equal(layer.experts.w2[...], old.experts.w2[...][np.array(kept)])
        assert layer.router.num_experts == 4 and old.router.num_experts == 8
        tokens = model.cfg.group_images * model.cfg.num_patches
        factor = old.router.capacity_factor
        budget = layer.router.allocation.budget(tokens, layer.router.num_experts)
        assert budget.capacity == min(tokens, routing.capacity(tokens, 4, factor))  # C for the new E
    assert np.all(np.isfinite(_logits(pruned)))
    twice = compress.prune(pruned, [(1, 3), (0, 1)])  # positions among the present experts
    assert [layer.router.affinity.keep for layer in modes.moe_layers(twice)] == [(2, 7), (1, 2)]


def _layer_outputs(model, pruned, layer_index=0):
    """One MoE layer's per-token output on the same inputs, original and pruned, and each token's picks."""
    records = compress.calibrate(model, IMAGES, batch_size=16)
    x = jnp.asarray(records[layer_index].inputs).reshape(IMAGES.shape[0], model.cfg.num_patches, -1)
    original, out = modes.moe_layers(model)[layer_index](x)
    new, _ = modes.moe_layers(pruned)[layer_index](x)
    return np.asarray(original).reshape(-1, x.shape[-1]), np.asarray(new).reshape(-1, x.shape[-1]), records


def test_full_denominator_is_exact_on_tokens_that_picked_no_removed_expert():
    """No capacity cut (c = E: every token fits), Token Choice k = 2: a token whose two picks are
    both kept has exactly its old output; one that picked a removed expert does not."""
    model = _model(model_router_kwargs={"k": 2, "capacity_factor": 8.0})
    model.eval()
    keep = [(0, 1, 2, 3, 4, 5), (0, 1, 2, 3, 4, 5)]
    full = compress.prune(model, keep, denominator="full")
    original, new, records = _layer_outputs(model, full)
    untouched = ~records[0].routed[:, 6:].any(1)
    assert records[0].routed.sum(1).min() == 2  # nothing dropped: every token has its two picks
    assert 0 < untouched.sum() < len(untouched)
    np.testing.assert_allclose(new[untouched], original[untouched], rtol=1e-5, atol=1e-6)
    assert np.abs(new[~untouched] - original[~untouched]).max(1).min() > 1e-4
    # "kept": the same picks, every gate divided by the probability mass the kept experts had
    kept = compress.prune(model, keep, denominator="kept")
    _, renormalised, _ = _layer_outputs(model, kept)
    mass = records[0].probs[:, :6].sum(1)
    np.testing.assert_allclose(renormalised[untouched], original[untouched] / mass[untouched, None], rtol=1e-4, atol=1e-5)


def test_unsupported_models_and_bad_plans_are_clear_errors():
    model = _model()
    with pytest.raises(ValueError, match="keep must name the kept experts of each of the 2 MoE layers"):
        compress.prune(model, [(0, 1)])
    with pytest.raises(ValueError, match="the same number of experts"):
        compress.prune(model, [(0, 1), (0, 1, 2)])
    with pytest.raises(ValueError, match="distinct experts in 0..7"):
        compress.prune(model, [(0, 0), (1, 2)])
    with pytest.raises(ValueError, match="distinct experts in 0..7"):
        compress.prune(model, [(0, 8), (1, 2)])
    with pytest.raises(ValueError, match="denominator must be one of"):
        compress.prune(model, [(0, 1), (1, 2)], denominator="none")
    with pytest.raises(ValueError, match="softmax affinity with Token or Expert Choice; MoE layer 0 has SlotLogits"):
        compress.prune(_model("soft_moe"), [(0,), (0,)])
    with pytest.raises(ValueError, match="MoE layer 0 has SigmoidGates"):
        compress.prune(_model("sigmoid_loss_free"), [(0,), (0,)])
    with pytest.raises(ValueError, match="MoE layer 0 has TopPGates"):
        compress.prune(_model("top_p"), [(0,), (0,)])
    variable = _model()
    layer = modes.moe_layers(variable)[1]
    layer.router.allocation = dataclasses.replace(layer.router.allocation, min_score=0.1)
    with pytest.raises(ValueError, match="fixed k and no null experts; MoE layer 1 has min_score=0.1"):
        compress.prune(variable, [(0,), (0,)])
    dense = train.make_model(config_lib.get_config("quick", dataset="digits", router=None, steps=1))
    with pytest.raises(ValueError, match="dense"):
        compress.calibrate(dense, IMAGES)
    assert nnx.state(model)  # the model these errors came from is still whole


# ----------------------------------------------------------------------------------- merging


def _weights(num_experts=4, dim=3, hidden=5, seed=0):
    rng = np.random.default_rng(seed)
    return {"w1": rng.normal(size=(num_experts, dim, hidden)), "b1": rng.normal(size=(num_experts, 1, hidden)),
            "w2": rng.normal(size=(num_experts, hidden, dim)), "b2": rng.normal(size=(num_experts, 1, dim))}


def _apply(weights, e, x):
    return np.asarray(jax.nn.gelu(x @ weights["w1"][e] + weights["b1"][e, 0])) @ weights["w2"][e] + weights["b2"][e, 0]


def test_merging_weighs_by_frequency_and_alignment_undoes_a_permutation_of_hidden_units():
    w = _weights()
    perm = np.random.default_rng(1).permutation(5)
    for name, axis in (("w1", -1), ("b1", -1), ("w2", 0)):  # expert 1: expert 0 with its hidden units shuffled
        w[name][1] = np.take(w[name][0], perm, axis=axis)
    w["b2"][1] = w["b2"][0]
    x = np.random.default_rng(2).normal(size=(7, 3))
    np.testing.assert_allclose(_apply(w, 1, x), _apply(w, 0, x), rtol=1e-10)  # the same function
    order = compress.align_hidden_units(w, 1, 0)
    np.testing.assert_array_equal(perm[order], np.arange(5))  # the shuffle, undone exactly
    aligned = compress.merge_weights(w, (0, 0, 1, 2), np.array([3.0, 1.0, 1.0, 1.0]), align=True)
    np.testing.assert_allclose(_apply(aligned, 0, x), _apply(w, 0, x), rtol=1e-5, atol=1e-5)
    plain = compress.merge_weights(w, (0, 0, 1, 2), np.array([3.0, 1.0, 1.0, 1.0]), align=False)
    assert np.abs(_apply(plain, 0, x) - _apply(w, 0, x)).max() > 1e-2  # unaligned averaging breaks it
    np.testing.assert_allclose(plain["w1"][0], 0.75 * w["w1"][0] + 0.25 * w["w1"][1], rtol=1e-6)
    np.testing.assert_allclose(plain["w2"][2], w["w2"][3], rtol=1e-6)  # a group of one is itself
    unused = compress.merge_weights(w, (0, 0, 1, 2), np.zeros(4), align=False)  # no frequency: equal weights
    np.testing.assert_allclose(unused["b2"][0], 0.5 * (w["b2"][0] + w["b2"][1]), rtol=1e-6)


def test_average_linkage_equals_scipy():
    from scipy.cluster.hierarchy import fcluster, linkage

    for seed in range(5):
        points = np.random.default_rng(seed).normal(size=(12, 4))
        for clusters in (1, 3, 6, 12):
            mine = compress.average_linkage(points, clusters)
            theirs = fcluster(linkage(points, method="average", metric="euclidean"), clusters, criterion="maxclust")
            same = {(a, b) for a in range(12) for b in range(12) if mine[a] == mine[b]}
            assert same == {(a, b) for a in range(12) for b in range(12) if theirs[a] == theirs[b]}, (seed, clusters)


def test_mc_smoe_groups_join_the_dominant_expert_with_the_closest_router_logits():
    # 6 tokens, 4 experts: experts 0 and 2 are the most used; expert 1's logits run with expert 2's,
    # expert 3's with expert 0's
    routed = np.array([[1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 1]], bool)
    base = np.random.default_rng(0).normal(size=(6, 1))
    logits = np.concatenate([base, -base + 0.01, -base, base + 0.02], axis=1)
    record = compress.LayerRecord(np.zeros((6, 2)), logits, np.zeros((6, 4)), routed.astype(float), routed,
                                  np.zeros((6, 4, 2)))
    assert compress.group_experts(record, 2, "mc_smoe") == (0, 1, 1, 0)
    assert compress.group_experts(record, 4, "mc_smoe") == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="num_groups must be in 1..4"):
        compress.group_experts(record, 5, "hc_smoe")
    with pytest.raises(ValueError, match="method must be one of"):
        compress.group_experts(record, 2, "kmeans")


def test_merging_identical_experts_is_the_same_function_and_stores_fewer_parameters():
    model = _model()
    for layer in modes.moe_layers(model):  # experts 1 and 5 are copies of 0 and 4
        for name in ("w1", "b1", "w2", "b2"):
            p = getattr(layer.experts, name)
            p[...] = p[...].at[1].set(p[...][0]).at[5].set(p[...][4])
    records = compress.calibrate(model, IMAGES, batch_size=16)
    merged = compress.merge(model, records, 6, "hc_smoe")  # the copies' mean outputs coincide: joined first
    groups = [layer.experts.members for layer in modes.moe_layers(merged)]
    assert all(g[0] == g[1] and g[4] == g[5] and len(set(g)) == 6 for g in groups), groups
    np.testing.assert_allclose(_logits(merged), _logits(model), rtol=1e-5, atol=1e-5)
    assert compress.stored_expert_parameters(merged) * 8 == compress.stored_expert_parameters(model) * 6
    halved = compress.merge(model, records, 4, "mc_smoe")
    assert [len(set(layer.experts.members)) for layer in modes.moe_layers(halved)] == [4, 4]
    assert np.all(np.isfinite(_logits(halved)))
    with pytest.raises(ValueError, match="merged already"):
        compress.merge(halved, records, 2, "hc_smoe")
    with pytest.raises(ValueError, match="one LayerRecord per MoE layer"):
        compress.merge(model, records[:1], 2, "hc_smoe")


def test_fidelity_is_zero_error_and_full_agreement_for_the_same_model_and_counts_moved_picks():
    model = _model(model_router_kwargs={"k": 2, "capacity_factor": 8.0})
    records = compress.calibrate(model, IMAGES, batch_size=16)
    same = compress.fidelity(model, compress.prune(model, [tuple(range(8))] * 2), records)
    assert all(f["reconstruction_error"] < 1e-10 and f["routing_agreement"] == 1.0 for f in same)
    keep = [(0, 1, 2, 3, 4, 5)] * 2
    full = compress.fidelity(model, compress.prune(model, keep, denominator="full"), records)
    for f, record in zip(full, records):  # a token's picks stay exactly when it picked no removed expert
        assert f["routing_agreement"] == pytest.approx(np.mean(~record.routed[:, 6:].any(1)))
        assert 0 < f["reconstruction_error"] < 1
    merged = compress.fidelity(model, compress.merge(model, records, 4, "hc_smoe"), records)
    assert all(f["routing_agreement"] == 1.0 and f["reconstruction_error"] > 0 for f in merged)  # router unchanged
