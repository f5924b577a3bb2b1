"""Expert parallelism: experts sharded across devices, tokens exchanged with all_to_all.

A mesh has two axes, ``"data"`` and ``"expert"``. Every device holds a different slice of
the batch (the batch is split over both axes: data parallelism for everything outside the
experts) and ``E / n_expert`` of the experts of each MoE layer (replicated along
``"data"``). Inside an MoE layer, on each device (:func:`expert_parallel_moe`):

1. dispatch (eq. 2): the device's groups fill the slots of *all* E experts,
   ``[E, G_local, C, D]`` -- for sparse routers by gathering each slot's token row
   (:func:`mini_moe.layer.gather_slots`, O(E C D)), for Soft MoE by the dispatch einsum;
2. ``all_to_all`` over ``"expert"``: slot block ``j`` (the experts of device ``j``) goes to
   device ``j``, which now holds its own experts' slots from every device of its data
   row, ``[E / n_expert, n_expert * G_local, C, D]``;
3. the local experts run on those slots;
4. the reverse ``all_to_all`` returns each block of outputs to the device its tokens
   came from, ``[E, G_local, C, D]``;
5. combine (eq. 2) on the device: sparse routers scatter-add each slot's weighted output to
   its token (:func:`mini_moe.layer.scatter_slots`), Soft MoE uses the combine einsum.

Steps 2 and 4 are the only communication; each moves ``E * C * D`` numbers per group. Sparse
routings never build a ``[G, T, E, C]`` tensor on this path (their compact slot form travels
into ``shard_map`` instead), so its cost does not grow with T * E * C.

Usage: ``mesh = make_mesh(data=2, expert=4)``, ``shard_model(model, mesh)`` (places the
parameters as their sharding annotations say), then call ``model(images, mesh=mesh)`` on
batches placed by :func:`batch_sharding` (``mini_moe.train`` does all three when
``TrainConfig.mesh`` is set; the CLI's ``train --mesh 2x4``). On one host with a CPU,
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` simulates 8 devices; on several
hosts, call ``jax.distributed.initialize()`` first and the same code runs on the global mesh.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mini_moe.layer import EXPERT_AXIS, gather_slots, scatter_slots
from mini_moe.routing import Routing
from mini_moe.validate import InputError, check_int

Array = Any
AXES = ("data", EXPERT_AXIS)
BATCH = P(AXES)  # the leading (batch / group) axis split over every device


def make_mesh(data: int, expert: int, devices=None) -> Mesh:
    """A ``(data, expert)`` mesh over the first ``data * expert`` devices."""
    check_int("data", data)
    check_int("expert", expert)
    devices = jax.devices() if devices is None else list(devices)
    if data * expert > len(devices):
        raise InputError(
            f"a {data}x{expert} mesh needs {data * expert} devices, found {len(devices)}. On a CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={data * expert} before importing JAX."
        )
    return Mesh(np.asarray(devices[: data * expert]).reshape(data, expert), AXES)


def expert_parallel_moe(x: Array, routing: Routing, experts: nnx.Module, mesh: Mesh) -> Array:
    """Eq. (2) with the experts sharded over ``mesh``'s ``"expert"`` axis.

    Args:
      x: tokens ``[G, T, D]`` (G routing groups, split over all devices).
      routing: tensors ``[G, T, E, C]``.
      experts: an expert module whose parameters all have the expert axis first
        (e.g. :class:`~mini_moe.layer.MlpExperts`), applied to ``[E, N, D]``.
      mesh: a mesh with axes ``("data", "expert")`` (:func:`make_mesh`).

    Returns:
      ``[G, T, D_out]``, equal to ``mini_moe.layer.moe(x, routing, experts)``.
    """
    groups = np.shape(x)[0]
    if groups % mesh.size:
        raise InputError(
            f"the number of routing groups ({groups}) must be a multiple of the number of devices "
            f"({mesh.size}); use a batch of a multiple of {mesh.size} groups."
        )
    num_experts = np.shape(routing.dispatch)[-2]
    if num_experts % mesh.shape[EXPERT_AXIS]:
        raise InputError(
            f"num_experts={num_experts} must be a multiple of the mesh's expert axis ({mesh.shape[EXPERT_AXIS]})."
        )
    graphdef, state = nnx.split(experts)

    def run_experts(slots, state):  # [E, G_loc, C, D] -> [E, G_loc, C, D_out], experts on their devices
        slots = jax.lax.all_to_all(slots, EXPERT_AXIS, split_axis=0, concat_axis=1, tiled=True)
        e_local, g, c, d = slots.shape                                                   # [E/n, n*G_loc, C, D]
        out = nnx.merge(graphdef, state)(slots.reshape(e_local, g * c, d)).reshape(e_local, g, c, -1)
        return jax.lax.all_to_all(out, EXPERT_AXIS, split_axis=1, concat_axis=0, tiled=True)  # [E, G_loc, C, D]

    def dense(x, dispatch, combine, state):  # Soft MoE: every slot mixes every token
        slots = jnp.einsum("gtec,gtd->egcd", dispatch.astype(x.dtype), x)
        return jnp.einsum("gtec,egcd->gtd", combine.astype(x.dtype), run_experts(slots, state))

    def sparse(x, token, weight, state):  # one token per slot: gather and scatter-add, O(E C D)
        out = run_experts(jnp.moveaxis(gather_slots(x, token), -3, 0), state)
        return scatter_slots(jnp.moveaxis(out, 0, -3), token, weight, x.shape[-2])

    # The experts' parameters enter split as their sharding annotations say (expert axis first).
    in_specs = (BATCH, BATCH, BATCH, nnx.get_partition_spec(state))
    local, tensors = (sparse, routing.slots()) if routing.sparse else (dense, (routing.dispatch, routing.combine))
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=BATCH)(x, *tensors, state)


def state_shardings(tree, mesh: Mesh):
    """NamedShardings for a model or optimizer state, read from the parameters' Flax sharding
    annotations: a leaf annotated ``("expert", None, ...)`` (every parameter of
    :class:`~mini_moe.layer.MlpExperts`, and Adam's moments of it) is split along that axis over
    ``mesh``'s ``"expert"`` axis; a leaf without an annotation is replicated."""
    specs = nnx.get_partition_spec(tree)
    for path, (leaf, spec) in _annotated_leaves(tree, specs):
        for size, axis in zip(np.shape(leaf), spec):
            if axis is not None and size % mesh.shape[axis]:
                raise InputError(
                    f"{'/'.join(map(str, path))} has {size} entries along its {axis!r} axis, which must be a "
                    f"multiple of the mesh's {axis!r} axis ({mesh.shape[axis]}): choose num_experts accordingly."
                )
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def _annotated_leaves(tree, specs):
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return [(tuple(getattr(k, "key", getattr(k, "name", k)) for k in path), (leaf, spec))
            for (path, leaf), spec in zip(leaves, jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))
            if len(spec)]


def shard_model(model: nnx.Module, mesh: Mesh, optimizer: nnx.Optimizer | None = None) -> None:
    """Place ``model``'s (and ``optimizer``'s) state on ``mesh`` as its sharding annotations say:
    expert parameters split over ``"expert"``, the rest replicated. The layers are not changed:
    expert parallelism is switched on per call, ``model(images, mesh=mesh)``."""
    for obj in (model, optimizer):
        if obj is not None:
            state = nnx.state(obj)
            nnx.update(obj, jax.device_put(state, state_shardings(state, mesh)))


def model_mesh(model: nnx.Module) -> Mesh | None:
    """The mesh that :func:`shard_model` placed ``model``'s expert parameters on, or None."""
    state = nnx.state(model, nnx.Param)
    for _, (leaf, _) in _annotated_leaves(state, nnx.get_partition_spec(state)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and EXPERT_AXIS in sharding.mesh.axis_names:
            return sharding.mesh
    return None


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Where a batch goes: its leading axis split over every device of ``mesh``."""
    return NamedSharding(mesh, BATCH)
