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
               combine_scores: Array | None = None) -> Array:
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
    _, picks = jax.lax.top_k(scores.reshape(-1, num_experts), k)  # [N, k]
    gates = jnp.take_along_axis(weights.reshape(-1, num_experts), picks, axis=-1)  # [N, k]
    expert = picks.reshape(-1)  # [N k], pick j of token n at n * k + j
    order, group_sizes = sort_by_expert(expert, num_experts)  # picks grouped by expert
    token = order // k
    rows = experts.ragged(tokens[token], expert[order], group_sizes)  # [N k, D_out]
    rows = rows * gates.reshape(-1)[order][:, None].astype(rows.dtype)
    out = jnp.zeros((tokens.shape[0], rows.shape[-1]), rows.dtype).at[token].add(rows)
    return out.reshape(x.shape[:-1] + (rows.shape[-1],))


GROUPED_KERNELS = ("auto", "ragged_dot", "megablox")


def grouped_matmul(rows: Array, weights: Array, group_sizes: Array, *, kernel: str = "auto") -> Array:
    """Rows sorted by group times their group's matrix: ``rows [M, K]``, ``weights [G, K, N]``,
    ``group_sizes [G]`` (int32; the first ``group_sizes[0]`` rows use ``weights[0]``, ...) ->
    ``[M, N]``.

    ``kernel="ragged_dot"``: ``jax.lax.ragged_dot``, lowered by XLA for the running backend (on a
    CPU, a generic lowering that does about G times a grouped matmul's FLOPs; ``python -m mini_moe
    bench --only dropless`` measures it). ``"megablox"``: the Pallas grouped-matmul kernel of
    ``jax.experimental.pallas.ops.tpu.megablox`` (differentiable; compiled on a TPU, run by
    Pallas' interpreter elsewhere, which is how the tests check it). ``"auto"``: megablox on a
    TPU, ragged_dot elsewhere.
    """
    if kernel not in GROUPED_KERNELS:
        raise InputError(f"kernel must be one of {GROUPED_KERNELS}, got {kernel!r}.")
    on_tpu = jax.default_backend() == "tpu"
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

    def __init__(self, num_experts: int, dim: int, hidden: int, out_dim: int | None = None, *, rngs: nnx.Rngs):
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
        and so on (``expert [M]`` names each row's expert, for the biases). Two grouped matmuls
        (:func:`grouped_matmul`: megablox's kernel on a TPU, ``jax.lax.ragged_dot`` elsewhere);
        returns ``[M, D_out]``."""
        w1, b1, w2, b2 = self._weights(rows.dtype)
        h = jax.nn.gelu(grouped_matmul(rows, w1, group_sizes) + b1[expert, 0])
        return grouped_matmul(h, w2, group_sizes) + b2[expert, 0]

    def _weights(self, dtype):
        """The parameters cast to the compute dtype (they are stored in float32)."""
        return tuple(p[...].astype(dtype) for p in (self.w1, self.b1, self.w2, self.b2))

    def __call__(self, x: Array) -> Array:
        if x.ndim != 3 or x.shape[0] != self.w1.shape[0] or x.shape[-1] != self.w1.shape[1]:
            raise InputError(f"experts expect inputs [E={self.w1.shape[0]}, N, D={self.w1.shape[1]}], got {x.shape}.")
        w1, b1, w2, b2 = self._weights(x.dtype)
        h = jax.nn.gelu(jnp.einsum("end,edh->enh", x, w1) + b1)
        return jnp.einsum("enh,ehd->end", h, w2) + b2
