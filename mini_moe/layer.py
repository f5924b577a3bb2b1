"""The MoE layer of paper 000, eq. (2), for any routing tensors and any experts.

    MoE(X)[t] = sum_{r, c} combine[t, r, c] * expert_r( sum_s dispatch[s, r, c] * X[s] )

:func:`moe` evaluates it in one of two ways that the tests prove equal:

* ``path="einsum"`` — the formula as written: two one-hot (or soft) tensor products,
  O(T * E * C * D) each. Works for every routing, soft or sparse.
* ``path="gather"`` — for sparse routings only: every slot holds at most one token, so
  slot inputs are a gather of token rows and outputs a scatter-add, O(E * C * D).

``path="auto"`` picks gather for sparse routings and einsum for Soft MoE.

:func:`moe_sorted` is the third way production systems use, outside eq. (2): dropless Token
Choice with no buffers at all. The (token, expert) picks are sorted by expert and every expert
multiplies its contiguous block of rows (a grouped matmul, ``jax.lax.ragged_dot``), so nothing
is dropped and no slot is empty. :class:`mini_moe.model.MoeLayer` offers it as the
``"dropless"`` path. What ``ragged_dot`` costs depends on the backend's lowering:
``python -m mini_moe bench --only dropless`` reports its time and XLA's FLOP count against the
gather path.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mini_moe.routing import Routing, sort_by_expert
from mini_moe.validate import InputError

Array = Any

PATHS = ("auto", "einsum", "gather")
EXPERT_AXIS = "expert"  # the mesh axis (and sharding annotation) that expert parameters are split over


def moe(x: Array, routing: Routing, experts: Callable[[Array], Array], *, path: str = "auto") -> Array:
    """Apply eq. (2).

    Args:
      x: tokens ``[..., T, D]`` (leading axes: groups).
      routing: :class:`~mini_moe.routing.Routing` with tensors ``[..., T, E, C]``.
      experts: function from expert inputs ``[E, N, D]`` to outputs ``[E, N, D_out]``
        (row e goes through expert e; N = C times the number of groups).
      path: ``"einsum"``, ``"gather"`` or ``"auto"`` (see module docstring).

    Returns:
      ``[..., T, D_out]``.
    """
    if path not in PATHS:
        raise InputError(f"path must be one of {PATHS}, got {path!r}.")
    x_shape, r_shape = np.shape(x), np.shape(routing.dispatch)
    if len(x_shape) < 2 or len(r_shape) != len(x_shape) + 1 or r_shape[:-2] != x_shape[:-1]:
        raise InputError(
            f"routing tensors must have shape [..., T, E, C] matching x [..., T, D] = {x_shape}; "
            f"got dispatch of shape {r_shape}."
        )
    if path == "auto":
        path = "gather" if routing.sparse else "einsum"
    if path == "gather" and not routing.sparse:
        raise InputError("path='gather' needs a sparse routing (one token per slot); use 'einsum'.")

    lead = x_shape[:-2]
    num_experts, cap = r_shape[-2:]
    if path == "einsum":
        slots = jnp.einsum("...tec,...td->...ecd", routing.dispatch.astype(x.dtype), x)
    else:
        token, weight = routing.slots()  # [..., E, C]; token T marks an empty slot
        slots = gather_slots(x, token)

    # [..., E, C, D] -> [E, N, D]: every expert sees its slots of every group at once.
    expert_in = jnp.moveaxis(slots, -3, 0).reshape(num_experts, -1, slots.shape[-1])
    expert_out = experts(expert_in)
    out = jnp.moveaxis(expert_out.reshape((num_experts,) + lead + (cap, -1)), 0, -3)

    if path == "einsum":
        return jnp.einsum("...tec,...ecd->...td", routing.combine.astype(out.dtype), out)
    return scatter_slots(out, token, weight, x_shape[-2])


def gather_slots(x: Array, token: Array) -> Array:
    """The expert inputs of a sparse routing: ``x [..., T, D]`` gathered at ``token [..., E, C]``
    (the token in each slot, T for an empty slot, which gets zeros) -> ``[..., E, C, D]``."""
    lead, (num_experts, cap) = token.shape[:-2], token.shape[-2:]
    flat = jnp.take_along_axis(x, token.reshape(lead + (num_experts * cap, 1)), axis=-2, mode="fill", fill_value=0)
    return flat.reshape(lead + (num_experts, cap, x.shape[-1]))


def scatter_slots(out: Array, token: Array, weight: Array, num_tokens: int) -> Array:
    """The combine step of a sparse routing: every slot's output ``out [..., E, C, D]`` times its
    weight ``[..., E, C]``, added to the row of its token ``[..., E, C]`` -> ``[..., T, D]``
    (empty slots, token T, add nothing)."""
    lead = token.shape[:-2]
    contrib = (weight[..., None].astype(out.dtype) * out).reshape(lead + (-1, out.shape[-1]))
    result = jnp.zeros(lead + (num_tokens, out.shape[-1]), out.dtype)
    return _scatter_add_rows(result, token.reshape(lead + (-1,)), contrib)


def moe_sorted(x: Array, scores: Array, experts: "MlpExperts", *, k: int = 1,
               combine_scores: Array | None = None, min_score: float | None = None,
               max_picks: int | None = None) -> Array:
    """Dropless Token Choice by sorting: every token goes to its top-k experts, whatever the load.

    Equal to :func:`moe` with Token Choice at a capacity of T (no drops) and ``combine_scores``
    as combine weights, but with no ``[T, E, C]`` tensor and no buffer: the k picks of every token
    are sorted by expert, each expert applies its MLP to its contiguous block of rows
    (:meth:`MlpExperts.ragged`), and the weighted rows are scatter-added back to their tokens.
    Leading (group) axes are flattened: without capacity, groups do not interact.

    Args:
      x: tokens ``[..., T, D]``.
      scores: affinities ``[..., T, E]`` that choose the experts (top-k per token).
      experts: :class:`MlpExperts` with E experts.
      k: experts per token (1 <= k <= E).
      combine_scores: ``[..., T, E]`` combine weights read at the picks (default: ``scores``).
      min_score: None, or a pick whose score is not above it is not made (ReLU routing: k = E,
        ``min_score = 0``): it is sorted past every expert's rows, in no group, so a grouped
        matmul that skips those rows (the blocked kernel) computes only the picks made.
      max_picks: None (every token's k picks are sorted and stored: ``N k`` rows, N the tokens
        of all leading axes), or a static bound M on the picks made in the call: only the M picks
        with the largest scores are sorted, stored and computed (``M`` rows). With ReLU routing,
        where a token makes any number of picks, this is what keeps the layer sparse: ``N E``
        rows without it. When more than M picks are made, those with the smallest scores are
        dropped (the overflow rule; :func:`overflow` counts them).

    Returns:
      ``[..., T, D_out]``.
    """
    num_experts = experts.w1.shape[0]
    if np.shape(scores)[:-1] != np.shape(x)[:-1] or np.shape(scores)[-1] != num_experts:
        raise InputError(f"scores must have shape {tuple(np.shape(x)[:-1]) + (num_experts,)} "
                         f"(x's leading axes, E={num_experts}), got {np.shape(scores)}.")
    if not (isinstance(k, int) and 1 <= k <= num_experts):
        raise InputError(f"k must be an int in [1, E={num_experts}], got {k!r}.")
    weights = scores if combine_scores is None else combine_scores
    tokens = x.reshape(-1, x.shape[-1])  # [N, D]
    values, picks = jax.lax.top_k(scores.reshape(-1, num_experts), k)  # [N, k]
    gates = jnp.take_along_axis(weights.reshape(-1, num_experts), picks, axis=-1)  # [N, k]
    made = jnp.ones(picks.shape, bool)
    if min_score is not None:  # picks not made go to a sentinel expert E, sorted last, in no group
        made = values > min_score
        picks, gates = jnp.where(made, picks, num_experts), jnp.where(made, gates, 0)
    expert, gates, made = picks.reshape(-1), gates.reshape(-1), made.reshape(-1)  # [N k]: pick j of token n at n k + j
    token = jnp.arange(expert.shape[0]) // k
    if max_picks is not None and not (isinstance(max_picks, int) and max_picks >= 1):
        raise InputError(f"max_picks must be an int >= 1 (a static bound on the picks made), got {max_picks!r}.")
    if max_picks is not None and max_picks < expert.shape[0]:  # the M picks of largest score; the rest are not made
        keep = jax.lax.top_k(jnp.where(made, values.reshape(-1), -jnp.inf), max_picks)[1]  # [M]
        expert, gates, made, token = expert[keep], gates[keep], made[keep], token[keep]
        expert = jnp.where(made, expert, num_experts)
    order, group_sizes = sort_by_expert(expert, num_experts + (min_score is not None or max_picks is not None))
    group_sizes = group_sizes[:num_experts]
    token = token[order]
    chosen = made[order][:, None]  # [rows, 1]: the sorted rows that belong to a group
    rows = experts.ragged(jnp.where(chosen, tokens[token], 0), expert[order], group_sizes)  # [N k, D_out]
    # A grouped matmul need not write the rows outside every group (megablox leaves them as they
    # were: NaN under Pallas' interpreter, forward and backward), so those rows are selected away
    # on the way in and out, never multiplied by a zero gate (NaN * 0 = NaN): a select's gradient
    # sends nothing to the rows it drops.
    rows = jnp.where(chosen, rows, 0) * gates[order][:, None].astype(rows.dtype)
    out = jnp.zeros((tokens.shape[0], rows.shape[-1]), rows.dtype).at[token].add(rows)
    return out.reshape(x.shape[:-1] + (rows.shape[-1],))


def overflow(scores: Array, *, k: int, min_score: float | None, max_picks: int | None) -> Array:
    """The share of the picks made that :func:`moe_sorted`'s bound ``max_picks`` drops (0 when
    there is no bound or it holds): ``max(made - M, 0) / made`` over all tokens of ``scores
    [..., T, E]``, a float32 scalar."""
    values = jax.lax.top_k(scores, k)[0]
    made = jnp.sum(values > min_score) if min_score is not None else jnp.asarray(values.size)
    if max_picks is None:
        return jnp.zeros((), jnp.float32)
    return (jnp.maximum(made - max_picks, 0) / jnp.maximum(made, 1)).astype(jnp.float32)


GROUPED_KERNELS = ("auto", "ragged_dot", "megablox", "blocked")


def block_layout(group_sizes: Array, num_rows: int, block: int) -> tuple[Array, Array, int]:
    """The block-sparse layout of rows sorted by group (MegaBlocks, arXiv 2211.15841): every
    group's rows padded to a whole number of ``block``-row blocks.

    ``group_sizes [G]`` (int; their sum at most ``num_rows``) -> ``(dest [M], block_group [B],
    B)``: row i goes to padded row ``dest[i]`` (``B * block`` when it belongs to no group),
    block j holds rows of group ``block_group[j]`` (G for a block no group uses), and
    ``B = ceil(M / block) + G - 1`` is the static bound on the blocks (each group adds at most
    one partial block).
    """
    num_groups = group_sizes.shape[0]
    num_blocks = -(-num_rows // block) + num_groups - 1
    padded = -(-group_sizes // block) * block  # each group's rows rounded up to whole blocks
    ends, padded_ends = jnp.cumsum(group_sizes), jnp.cumsum(padded)
    row = jnp.arange(num_rows)
    group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), num_groups - 1)
    offset = row - (ends - group_sizes)[group]  # the row's place within its group
    dest = jnp.where(row < ends[-1], (padded_ends - padded)[group] + offset, num_blocks * block)
    block_group = jnp.searchsorted(padded_ends, jnp.arange(num_blocks) * block, side="right")
    return dest, block_group, num_blocks


def _per_block(fn, blocks, block_group, num_groups, out_shape, dtype):
    """``fn(block, g)`` for every block of a used group, zeros for the unused ones (not computed)."""
    def one(args):
        x, g = args
        return jax.lax.cond(g < num_groups, lambda: fn(x, jnp.minimum(g, num_groups - 1)),
                            lambda: jnp.zeros(out_shape, dtype))
    return jax.lax.map(one, (blocks, block_group))


def blocked_matmul(rows: Array, weights: Array, group_sizes: Array, block: int) -> Array:
    """Block-sparse grouped matmul in plain JAX: ``rows [M, K]`` sorted by group, ``weights
    [G, K, N]``, ``group_sizes [G]`` -> ``[M, N]``, the rows of group g times ``weights[g]``.

    The rows are laid out in blocks of ``block`` rows, each holding one group's rows
    (:func:`block_layout`), and every used block is multiplied by its own group's matrix only
    (``jax.lax.map`` over the blocks, a ``cond`` skipping the unused ones): the work is that of the
    rows plus at most ``block - 1`` padding rows per group, against G times the rows for a generic
    ``ragged_dot``. The backward pass (a custom VJP) has the same layout: ``d rows`` block by
    block, ``d weights[g]`` accumulated over group g's blocks in place. XLA's cost analysis counts
    a loop's body once, so ``python -m mini_moe bench --only dropless`` reports the executed FLOPs
    from the used blocks instead.
    """
    return _blocked(rows, weights, group_sizes, block)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _blocked(rows, weights, group_sizes, block):
    return _blocked_forward(rows, weights, group_sizes, block)[0]


def _blocked_forward(rows, weights, group_sizes, block):
    (m, k), (g, _, n) = rows.shape, weights.shape
    dest, block_group, num_blocks = block_layout(group_sizes, m, block)
    blocks = jnp.zeros((num_blocks * block, k), rows.dtype).at[dest].set(rows, mode="drop")
    blocks = blocks.reshape(num_blocks, block, k)
    out = _per_block(lambda x, e: x @ weights[e], blocks, block_group, g, (block, n), rows.dtype)
    out = out.reshape(num_blocks * block, n).at[dest].get(mode="fill", fill_value=0)
    return out, (blocks, weights, dest, block_group)


def _blocked_bwd(block, residuals, d_out):
    blocks, weights, dest, block_group = residuals
    (num_blocks, _, k), (g, _, n) = blocks.shape, weights.shape
    d_blocks = jnp.zeros((num_blocks * block, n), d_out.dtype).at[dest].set(d_out, mode="drop")
    d_blocks = d_blocks.reshape(num_blocks, block, n)
    d_rows = _per_block(lambda dy, e: dy @ weights[e].T, d_blocks, block_group, g, (block, k), d_out.dtype)
    d_rows = d_rows.reshape(num_blocks * block, k).at[dest].get(mode="fill", fill_value=0)

    def accumulate(d_weights, args):  # the cond yields one block's product, the carry is updated in place
        x, dy, e = args
        product = jax.lax.cond(e < g, lambda: x.T @ dy, lambda: jnp.zeros((k, n), weights.dtype))
        return d_weights.at[jnp.minimum(e, g - 1)].add(product), None

    d_weights, _ = jax.lax.scan(accumulate, jnp.zeros(weights.shape, weights.dtype), (blocks, d_blocks, block_group))
    return d_rows.astype(blocks.dtype), d_weights, None


_blocked.defvjp(_blocked_forward, _blocked_bwd)


def default_block(num_rows: int, num_groups: int) -> int:
    """The block size of :func:`blocked_matmul` when none is given: the largest power of two at
    most ``M / (2 G)`` (between 1 and 128), so that the padding, about ``block / 2`` rows per
    group, stays near a quarter of the rows at most (an eighth to a quarter)."""
    target = max(1, min(128, num_rows // (2 * num_groups)))
    return 1 << (target.bit_length() - 1)


def grouped_matmul(rows: Array, weights: Array, group_sizes: Array, *, kernel: str = "auto",
                   block: int | None = None) -> Array:
    """Rows sorted by group times their group's matrix: ``rows [M, K]``, ``weights [G, K, N]``,
    ``group_sizes [G]`` (int32; the first ``group_sizes[0]`` rows use ``weights[0]``, ...) ->
    ``[M, N]``.

    ``kernel="ragged_dot"``: ``jax.lax.ragged_dot``, lowered by XLA for the running backend (on a
    CPU, a generic lowering that does about G times a grouped matmul's FLOPs; ``python -m mini_moe
    bench --only dropless`` measures it). ``"megablox"``: the Pallas grouped-matmul kernel of
    ``jax.experimental.pallas.ops.tpu.megablox`` (differentiable; compiled on a TPU, run by
    Pallas' interpreter elsewhere, which is how the tests check it). ``"blocked"``:
    :func:`blocked_matmul`, plain JAX on any backend (``block`` rows per block, default
    :func:`default_block`). ``"auto"``: megablox on a TPU, ragged_dot on a GPU (XLA's GPU
    lowering), blocked on a CPU, where ragged_dot's generic lowering does about G times the work
    (``mini_moe/results/dropless-cpu-2core-epyc.json``: blocked is 2.7-4.9x faster than ragged_dot at E = 8 and 32).
    """
    if kernel not in GROUPED_KERNELS:
        raise InputError(f"kernel must be one of {GROUPED_KERNELS}, got {kernel!r}.")
    if kernel == "blocked":
        size = default_block(rows.shape[0], weights.shape[0]) if block is None else block
        if not (isinstance(size, int) and size >= 1):
            raise InputError(f"block must be an int >= 1, got {block!r}.")
        return blocked_matmul(rows, weights, jnp.asarray(group_sizes, jnp.int32), size)
    backend = jax.default_backend()
    if kernel == "auto" and backend == "cpu":
        return grouped_matmul(rows, weights, group_sizes, kernel="blocked", block=block)
    on_tpu = backend == "tpu"
    if kernel == "ragged_dot" or (kernel == "auto" and not on_tpu):
        return jax.lax.ragged_dot(rows, weights, group_sizes)
    from jax.experimental.pallas.ops.tpu.megablox import ops

    (m, k), n = rows.shape, weights.shape[-1]
    tiling = (min(128, m), min(128, k), min(128, n))
    padded = jnp.pad(rows, ((0, -m % tiling[0]), (0, 0)))  # the kernel wants whole row tiles
    out = ops.gmm(padded, weights.astype(rows.dtype), group_sizes.astype(jnp.int32), rows.dtype, tiling,
                  None, None, False, not on_tpu)
    return out[:m]


def _scatter_add_rows(base, index, rows):
    """base[..., index[..., j], :] += rows[..., j, :] over any leading axes (out-of-range rows dropped)."""
    flat_base = base.reshape((-1,) + base.shape[-2:])
    flat_index = index.reshape((-1, index.shape[-1]))
    flat_rows = rows.reshape((-1,) + rows.shape[-2:])
    added = jax.vmap(lambda b, i, r: b.at[i].add(r, mode="drop"))(flat_base, flat_index, flat_rows)
    return added.reshape(base.shape)


class MlpExperts(nnx.Module):
    """E independent two-layer MLPs (GELU), applied to ``[E, N, D]`` -> ``[E, N, D_out]``.

    Weights are stacked along a leading expert axis (``w1: [E, D, H]``, ``w2: [E, H,
    D_out]``), so all experts run as one batched matmul and the expert axis is the one
    to shard across devices. They are stored in float32 and the experts compute in their
    input's dtype (bfloat16 inputs: bfloat16 matmuls, mixed precision).
    """

    def __init__(self, num_experts: int, dim: int, hidden: int, out_dim: int | None = None, *, rngs: nnx.Rngs,
                 kernel: str = "auto"):
        if kernel not in GROUPED_KERNELS:
            raise InputError(f"kernel must be one of {GROUPED_KERNELS}, got {kernel!r}.")
        self.kernel = kernel  # the grouped matmul of the dropless path (:meth:`ragged`)
        out_dim = dim if out_dim is None else out_dim
        # Every parameter is annotated with its leading expert axis (Flax sharding metadata), which
        # is what mini_moe.parallel.shard_model reads; nothing is placed until then.
        lecun = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        init = nnx.with_partitioning(lecun, (EXPERT_AXIS, None, None))
        zeros = nnx.with_partitioning(nnx.initializers.zeros, (EXPERT_AXIS, None, None))
        key1, key2 = rngs.params(), rngs.params()
        self.w1 = nnx.Param(init(key1, (num_experts, dim, hidden)), eager_sharding=False)
        self.b1 = nnx.Param(zeros(None, (num_experts, 1, hidden)), eager_sharding=False)
        self.w2 = nnx.Param(init(key2, (num_experts, hidden, out_dim)), eager_sharding=False)
        self.b2 = nnx.Param(zeros(None, (num_experts, 1, out_dim)), eager_sharding=False)

    def ragged(self, rows: Array, expert: Array, group_sizes: Array) -> Array:
        """Apply expert e to its block of ``rows`` ``[M, D]``, sorted by expert: the first
        ``group_sizes[0]`` rows go through expert 0, the next ``group_sizes[1]`` through expert 1,
        and so on (``expert [M]`` names each row's expert, for the biases; a row past every group
        names E, gets no bias and sends no gradient to any). Two grouped matmuls
        (:func:`grouped_matmul` with this module's ``kernel``); returns ``[M, D_out]``."""
        w1, b1, w2, b2 = self._weights(rows.dtype)
        bias = lambda b: b.at[expert, 0].get(mode="fill", fill_value=0)
        h = jax.nn.gelu(grouped_matmul(rows, w1, group_sizes, kernel=self.kernel) + bias(b1))
        return grouped_matmul(h, w2, group_sizes, kernel=self.kernel) + bias(b2)

    def _weights(self, dtype):
        """The parameters cast to the compute dtype (they are stored in float32)."""
        return tuple(p[...].astype(dtype) for p in (self.w1, self.b1, self.w2, self.b2))

    def __call__(self, x: Array) -> Array:
        if x.ndim != 3 or x.shape[0] != self.w1.shape[0] or x.shape[-1] != self.w1.shape[1]:
            raise InputError(f"experts expect inputs [E={self.w1.shape[0]}, N, D={self.w1.shape[1]}], got {x.shape}.")
        w1, b1, w2, b2 = self._weights(x.dtype)
        h = jax.nn.gelu(jnp.einsum("end,edh->enh", x, w1) + b1)
        return jnp.einsum("enh,ehd->end", h, w2) + b2
