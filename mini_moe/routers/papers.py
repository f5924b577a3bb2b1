"""The routers of the papers, registered by name (:data:`mini_moe.routers.ROUTERS`): each a
builder that composes one affinity with one allocation. Re-exported by :mod:`mini_moe.routers`."""

from __future__ import annotations

from flax import nnx

from mini_moe.routers.affinities import (NoisySoftmax, QuadraticPlan, SinkhornPlan, SlotLogits, Softmax,
                                        SparsityConstrainedPlan)
from mini_moe.routers.allocations import ExpertChoice, SoftRouting, TokenChoice
from mini_moe.routers.balancing import ReluGates, SigmoidGates
from mini_moe.routers.controls import HashProjection, RawKey
from mini_moe.routers.registry import Router, register
from mini_moe.validate import InputError


# ------------------------------------------------------- the routers of the papers, by name


@register("softmax_token_choice", allocation="token")
def softmax_token_choice(dim, num_experts, *, k=1, capacity_factor=None, batch_priority=False, noise_std=1.0,
                         balance_loss=True, z_loss=0.0, balance_scope="group", deterministic=False,
                         rngs: nnx.Rngs) -> Router:
    """Softmax Token Choice (paper 000, Sec. 2.1): the V-MoE router. Options: see
    :class:`NoisySoftmax` and :class:`TokenChoice`."""
    affinity = NoisySoftmax(dim, num_experts, noise_std=noise_std, balance_loss=balance_loss, z_loss=z_loss,
                            balance_scope=balance_scope, deterministic=deterministic, rngs=rngs)
    return Router(affinity, TokenChoice(k, capacity_factor, batch_priority))


@register("sigmoid_loss_free", allocation="token")
def sigmoid_loss_free(dim, num_experts, *, k=2, capacity_factor=None, batch_priority=False, bias_rate=1e-3,
                      seq_balance=0.0, balance_scope="group", num_groups=1, top_groups=1, deterministic=False,
                      rngs: nnx.Rngs) -> Router:
    """DeepSeek-V3's gating (arXiv 2412.19437, Sec. 2.1.2): sigmoid scores, top-k on scores plus
    a balancing bias updated without an auxiliary loss, gates normalised over the k; Token
    Choice (Algorithm 1) allocates. k = 2 by default; at k = 1 the gate is the chosen score, not
    normalised (normalised it would be 1, and the router would learn nothing from the task).
    Options: :class:`SigmoidGates`."""
    affinity = SigmoidGates(dim, num_experts, bias_rate=bias_rate, seq_balance=seq_balance, balance_scope=balance_scope,
                            num_groups=num_groups, top_groups=top_groups, deterministic=deterministic, rngs=rngs)
    affinity.check(k)
    return Router(affinity, TokenChoice(k, capacity_factor, batch_priority))


@register("group_limited", allocation="token")
def group_limited(dim, num_experts, *, k=2, capacity_factor=None, batch_priority=False, bias_rate=1e-3,
                  seq_balance=0.0, balance_scope="group", num_groups=2, top_groups=1, deterministic=False,
                  rngs: nnx.Rngs) -> Router:
    """Group-limited (device-limited) routing of DeepSeek-V2/V3: :func:`sigmoid_loss_free` with
    the experts in ``num_groups`` groups, of which each token uses its ``top_groups`` best (by
    default 2 groups, 1 kept: every token's k experts share a group)."""
    return sigmoid_loss_free(dim, num_experts, k=k, capacity_factor=capacity_factor, batch_priority=batch_priority,
                             bias_rate=bias_rate, seq_balance=seq_balance, balance_scope=balance_scope,
                             num_groups=num_groups, top_groups=top_groups, deterministic=deterministic, rngs=rngs)


@register("remoe", allocation="token")
def remoe(dim, num_experts, *, k=1, capacity_factor=None, l1_init=1e-8, l1_rate=1.2, l1_scope="model",
          active_bound=None, deterministic=False, rngs: nnx.Rngs) -> Router:
    """ReMoE (Wang et al. 2024, arXiv 2412.14711): ReLU gates with an adaptive, load-balanced
    L1 penalty that holds k active experts per token on average (:class:`ReluGates`); every
    positive gate is a pick (:class:`TokenChoice` with k = E, ``min_score = 0``). The number of
    experts varies per token, so buffers of ``capacity_factor`` (default k) drop what overflows;
    ``moe_path="dropless"`` drops nothing. The auxiliary loss is lambda times the penalty; the
    controller moves lambda until the sparsity is reached, whatever weight the training loss
    gives the auxiliary losses. ``l1_scope``: one lambda for the model (``"model"``, ReMoE's
    reference, moved by :class:`mini_moe.model.VisionMoE`) or one per layer (``"layer"``).

    ``active_bound``: None (the default, as in ReMoE's paper and reference code, which route every
    token to every expert whose gate is positive): the dropless path keeps every positive gate,
    and a token's output does not depend on the other tokens of the call; it sorts and stores all
    ``T E`` (token, expert) pairs of a call and computes the positive ones. A number opts in to a
    memory cap: at most ``active_bound * k`` picks per token on average over a call are sorted,
    stored and computed, the ones of largest gate over the whole call; the rest are dropped and
    the layer's ``overflow`` metric says how many. That changes ReMoE: its first steps, before
    lambda has grown (it starts at ``l1_init``), are nearly dense, and there a bound of 2 drops
    many picks, some tokens lose every pick to other tokens' larger gates, and a token's output
    depends on which tokens share its call (chapter 13 measures this at initialisation).
    ``mini_moe/results/remoe_sparse.py`` measures time and memory against dropless top-k.
    """
    affinity = ReluGates(dim, num_experts, target_k=k, l1_init=l1_init, l1_rate=l1_rate, l1_scope=l1_scope,
                         deterministic=deterministic, rngs=rngs)
    if active_bound is not None and not active_bound > 0:
        raise InputError(f"active_bound must be > 0 (picks per token, in units of k) or None, got {active_bound!r}.")
    return Router(affinity, TokenChoice(num_experts, k if capacity_factor is None else capacity_factor,
                                        min_score=0.0, pick_bound=None if active_bound is None else active_bound * k))


@register("hash", allocation="token")
def hash_router(dim, num_experts, *, k=1, capacity_factor=None, batch_priority=False, rngs: nnx.Rngs) -> Router:
    """A hash router (a routing control; Roller et al. 2021's Hash Layers for continuous tokens):
    each token to the k experts of a fixed random projection (:class:`HashProjection`), combine
    weight 1/k; Token Choice (Algorithm 1) allocates. Nothing in it is learned."""
    return Router(HashProjection(dim, num_experts, rngs=rngs), TokenChoice(k, capacity_factor, batch_priority))


@register("raw_oracle", allocation="token", reads="pixels", data="subtask_vote")
def raw_oracle(dim, num_experts, *, dataset=None, k=1, capacity_factor=None, batch_priority=False,
               rngs: nnx.Rngs) -> Router:
    """A raw-key router (a routing control, the positive one): each patch of a
    :func:`~mini_moe.data.subtask_vote` dataset (``dataset``, e.g. ``"subtask_vote_d8_h16"``; a
    configuration passes its own) to the expert of its sub-task, read from the raw pixels by the
    signatures (:class:`RawKey` ``key="oracle"``); E = 8, 7x7 patches. Gates of 1/k, not a softmax:
    a comparison with a learned router also compares the gates. Token Choice allocates."""
    return Router(RawKey(dim, num_experts, key="oracle", dataset=dataset, rngs=rngs),
                  TokenChoice(k, capacity_factor, batch_priority))


@register("raw_blind", allocation="token", reads="pixels")
def raw_blind(dim, num_experts, *, bin_width=0.5, k=1, capacity_factor=None, batch_priority=False,
              rngs: nnx.Rngs) -> Router:
    """A raw-key router (a routing control, the floor): each patch to the experts of a hash of
    its quantised raw pixels (:class:`RawKey` ``key="blind"``; Hash Layers, Roller et al. 2021,
    arXiv 2106.04426): recurring patches share an expert, fresh ones go to random experts. Gates
    of 1/k, not a softmax. Token Choice allocates."""
    return Router(RawKey(dim, num_experts, key="blind", bin_width=bin_width, rngs=rngs),
                  TokenChoice(k, capacity_factor, batch_priority))


@register("raw_lsh", allocation="token", reads="pixels")
def raw_lsh(dim, num_experts, *, k=1, capacity_factor=None, batch_priority=False, rngs: nnx.Rngs) -> Router:
    """A raw-key router (a routing control): each patch to the argmax of a fixed random
    projection of its raw pixels (:class:`RawKey` ``key="lsh"``, locality-sensitive hashing, the
    continuous form of Hash Layers, Roller et al. 2021, arXiv 2106.04426). Gates of 1/k, not a
    softmax. Token Choice allocates."""
    return Router(RawKey(dim, num_experts, key="lsh", rngs=rngs), TokenChoice(k, capacity_factor, batch_priority))


@register("sinkhorn_token_choice", allocation="token")
def sinkhorn_token_choice(dim, num_experts, *, k=1, capacity_factor=None, batch_priority=False,
                          softmax_combine=True, num_iters=20, epsilon=1.0, rngs: nnx.Rngs) -> Router:
    """Sinkhorn Token Choice (paper 000, Sec. 2.2; Clark et al. 2022): Algorithm 1 on the plan
    of eq. (8)."""
    affinity = SinkhornPlan(dim, num_experts, softmax_combine=softmax_combine, num_iters=num_iters,
                            epsilon=epsilon, rngs=rngs)
    return Router(affinity, TokenChoice(k, capacity_factor, batch_priority))


@register("svmoe", allocation="token")
def svmoe(dim, num_experts, *, k=2, capacity_factor=None, batch_priority=False, num_iters=20,
          rngs: nnx.Rngs) -> Router:
    """SVMoE (paper 001): Algorithm 1 on the quadratic plan of softmax(XW), gamma = 1/k."""
    return Router(QuadraticPlan(dim, num_experts, num_iters=num_iters, rngs=rngs),
                  TokenChoice(k, capacity_factor, batch_priority))


@register("softmax_expert_choice", allocation="expert")
def softmax_expert_choice(dim, num_experts, *, capacity_factor=1.0, noise_std=0.0, deterministic=False,
                          rngs: nnx.Rngs) -> Router:
    """Softmax Expert Choice (paper 000, Sec. 2.3; Zhou et al. 2022): Algorithm 2 on softmax(XW).

    ``noise_std > 0``: the experts rank ``softmax(XW + noise)`` with Token Choice's training noise
    N(0, (noise_std / E)^2) (:class:`NoisySoftmax`, no auxiliary loss), so that Expert Choice and
    Token Choice can be compared with the same noise; 0 (the paper's router): no noise."""
    if noise_std == 0:
        return Router(Softmax(dim, num_experts, rngs=rngs), ExpertChoice(capacity_factor))
    affinity = NoisySoftmax(dim, num_experts, noise_std=noise_std, balance_loss="none",
                            deterministic=deterministic, rngs=rngs)
    return Router(affinity, ExpertChoice(capacity_factor))


@register("sinkhorn_expert_choice", allocation="expert")
def sinkhorn_expert_choice(dim, num_experts, *, capacity_factor=1.0, softmax_combine=True, num_iters=20,
                           epsilon=1.0, rngs: nnx.Rngs) -> Router:
    """Sinkhorn Expert Choice (paper 000, Sec. 2.4): Algorithm 2 on the plan of eq. (8)."""
    affinity = SinkhornPlan(dim, num_experts, softmax_combine=softmax_combine, num_iters=num_iters,
                            epsilon=epsilon, rngs=rngs)
    return Router(affinity, ExpertChoice(capacity_factor))


@register("sparsity_constrained_expert_choice", allocation="expert")
def sparsity_constrained_expert_choice(dim, num_experts, *, capacity_factor=1.0, tol=1e-3, max_iters=30,
                                       rngs: nnx.Rngs) -> Router:
    """Sparsity-constrained Expert Choice (paper 000, Sec. 2.5): Algorithm 2 on the plan of
    eq. (9) with at most C tokens per expert."""
    return Router(SparsityConstrainedPlan(dim, num_experts, tol=tol, max_iters=max_iters, rngs=rngs),
                  ExpertChoice(capacity_factor))


@register("soft_moe", allocation="soft", placement="last2")
def soft_moe(dim, num_experts, *, slots_per_expert=1, normalize=True, ablation="soft", rngs: nnx.Rngs) -> Router:
    """Soft MoE (paper 002; paper 000, Sec. 2.6), for the tokens of one image. Options: see
    :class:`SlotLogits` and :class:`SoftRouting`."""
    allocation = SoftRouting(ablation)
    return Router(SlotLogits(dim, num_experts, slots_per_expert=slots_per_expert, normalize=normalize, rngs=rngs),
                  allocation)
