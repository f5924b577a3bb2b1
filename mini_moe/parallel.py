"""Expert parallelism: experts sharded across devices, tokens exchanged with all_to_all.

A mesh has two axes, ``"data"`` and ``"expert"``. Every device holds a different slice of
the batch (the batch is split over both axes: data parallelism for everything outside the
experts) and ``E / n_expert`` of the experts of each MoE layer (replicated along
``"data"``). Inside an MoE layer, on each device (:func:`expert_parallel_moe`):

1. dispatch (eq. 2): the device's groups fill the slots of *all* E experts,
   ``[E, G_local, C, D]``;
2. ``all_to_all`` over ``"expert"``: slot block ``j`` (the experts of device ``j``) goes to
   device ``j``, which now holds its own experts' slots from every device of its data
   row, ``[E / n_expert, n_expert * G_local, C, D]``;
3. the local experts run on those slots;
4. the reverse ``all_to_all`` returns each block of outputs to the device its tokens
   came from, ``[E, G_local, C, D]``;
5. combine (eq. 2) on the device.

Steps 2 and 4 are the only communication; each moves ``E * C * D`` numbers per group.
Sparse routers and Soft MoE share the code: only their dispatch/combine tensors differ.

Usage: ``mesh = make_mesh(data=2, expert=4)``, ``shard_model(model, mesh)``, then train
with batches placed by :func:`batch_sharding` (``mini_moe.train`` does this when
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

from mini_moe.routing import Routing
from mini_moe.validate import check_int

Array = Any
AXES = ("data", "expert")
BATCH = P(AXES)  # the leading (batch / group) axis split over every device


def make_mesh(data: int, expert: int, devices=None) -> Mesh:
    """A ``(data, expert)`` mesh over the first ``data * expert`` devices."""
    check_int("data", data)
    check_int("expert", expert)
    devices = jax.devices() if devices is None else list(devices)
    if data * expert > len(devices):
        raise ValueError(
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
        raise ValueError(
            f"the number of routing groups ({groups}) must be a multiple of the number of devices "
            f"({mesh.size}); use a batch of a multiple of {mesh.size} groups."
        )
    num_experts = np.shape(routing.dispatch)[-2]
    if num_experts % mesh.shape["expert"]:
        raise ValueError(
            f"num_experts={num_experts} must be a multiple of the mesh's expert axis ({mesh.shape['expert']})."
        )
    graphdef, state = nnx.split(experts)

    def local(x, dispatch, combine, state):
        slots = jnp.einsum("gtec,gtd->egcd", dispatch.astype(x.dtype), x)               # [E, G_loc, C, D]
        slots = jax.lax.all_to_all(slots, "expert", split_axis=0, concat_axis=1, tiled=True)
        e_local, g, c, d = slots.shape                                                   # [E/n, n*G_loc, C, D]
        out = nnx.merge(graphdef, state)(slots.reshape(e_local, g * c, d)).reshape(e_local, g, c, -1)
        out = jax.lax.all_to_all(out, "expert", split_axis=1, concat_axis=0, tiled=True)  # [E, G_loc, C, D]
        return jnp.einsum("gtec,egcd->gtd", combine.astype(out.dtype), out)

    return jax.shard_map(local, mesh=mesh, in_specs=(BATCH, BATCH, BATCH, P("expert")), out_specs=BATCH)(
        x, routing.dispatch, routing.combine, state)


def _is_expert_param(path) -> bool:
    return any(getattr(key, "key", getattr(key, "name", None)) == "experts" for key in path)


def state_shardings(tree, mesh: Mesh):
    """NamedShardings for a model or optimizer state: leaves under an ``experts``
    module split along their first (expert) axis over ``"expert"``, the rest replicated."""
    def spec(path, leaf):
        expert = _is_expert_param(path) and np.ndim(leaf) >= 1
        return NamedSharding(mesh, P("expert") if expert else P())

    return jax.tree_util.tree_map_with_path(spec, tree)


def shard_model(model: nnx.Module, mesh: Mesh, optimizer: nnx.Optimizer | None = None) -> None:
    """Put ``model`` (and ``optimizer``) on ``mesh``: experts sharded, the rest replicated,
    and make every MoE layer exchange tokens with all_to_all. In place."""
    from mini_moe.model import MoeMlp

    for _, module in nnx.iter_modules(model):
        if isinstance(module, MoeMlp):
            if module.experts.w1.shape[0] % mesh.shape["expert"]:
                raise ValueError(
                    f"num_experts={module.experts.w1.shape[0]} must be a multiple of the mesh's expert axis "
                    f"({mesh.shape['expert']})."
                )
            module.mesh = mesh
    for obj in (model, optimizer):
        if obj is not None:
            state = nnx.state(obj)
            nnx.update(obj, jax.device_put(state, state_shardings(state, mesh)))


def model_mesh(model: nnx.Module) -> Mesh | None:
    """The mesh a model was sharded onto by :func:`shard_model`, or None."""
    from mini_moe.model import MoeMlp

    return next((m.mesh for _, m in nnx.iter_modules(model) if isinstance(m, MoeMlp) and m.mesh is not None), None)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Where a batch goes: its leading axis split over every device of ``mesh``."""
    return NamedSharding(mesh, BATCH)
