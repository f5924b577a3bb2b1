"""One protocol for the affinities with state of their own, which no gradient moves (DeepSeek-V3's
bias, ReMoE's lambda): :class:`StatefulAffinity`, and the three places that move that state,
:func:`after_forward` (after a training forward pass), :func:`defer_updates` (gradient
accumulation) and :func:`after_step` (the end of an accumulated step). Models call these, never a
test for a particular affinity, so an affinity registered outside the package takes part too.
Re-exported by :mod:`mini_moe.routers`."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from flax import nnx


@runtime_checkable
class StatefulAffinity(Protocol):
    """An affinity that moves state of its own, outside the gradient, from what its calls saw.

    Its state moves in one of three places:

    * in its own training call, from that call's tokens, while ``defer`` is False (DeepSeek-V3's
      bias, :class:`SigmoidGates`; a layer-scope lambda of :class:`ReluGates`);
    * under gradient accumulation (``defer`` True, set by :func:`defer_updates`) never in a call,
      but once per training step in ``deferred_update(metrics)``, which :func:`after_step` calls
      with ``metrics``, this layer's router metrics of each micro-batch (a list, one dict per
      micro-batch), so the update sees the whole accumulated batch;
    * state shared by the layers of a model (ReMoE's one lambda for the model) in an optional
      class method ``model_update(layers)``, called once per forward pass of a model
      (:func:`after_forward`, unless ``defer``) or once per accumulated step (:func:`after_step`)
      with every layer of the model whose affinity has that method, as
      ``[(affinity, [metrics of each micro-batch]), ...]``. Models call it after evaluation passes
      too: like :meth:`ReluGates.model_update`, it leaves the state of a ``deterministic``
      (``model.eval()``) affinity alone.

    A class with ``defer`` and ``deferred_update`` follows the protocol (``isinstance`` checks
    them); every other affinity is stateless and none of the three functions touches it. The
    numbers a ``deferred_update`` needs must be in the metrics its affinity (or the allocation,
    e.g. Token Choice's ``pick_load``) reports.
    """

    defer: bool

    def deferred_update(self, metrics: Sequence[dict]) -> None:
        """One update of the state from the whole accumulated batch (``metrics``: this layer's
        metrics of each micro-batch)."""


def _model_groups(layers) -> dict:
    """``layers`` grouped by the class that defines their ``model_update`` (its subclasses with it),
    in the order of the layers; affinities without one are left out."""
    groups: dict = {}
    for affinity, metrics in layers:
        owner = next((c for c in type(affinity).__mro__ if "model_update" in vars(c)), None)
        if owner is not None:
            groups.setdefault(owner, []).append((affinity, metrics))
    return groups


def after_forward(layers) -> None:
    """The step of the routers' own state that no layer can take alone, after a training forward
    pass of any model that holds MoE layers (:class:`mini_moe.model.VisionMoE`, chapter 9's one-layer
    :class:`mini_moe.subtasks.SubtaskLayer`): ``layers`` lists ``(affinity, metrics)`` of every MoE
    layer of the pass. Each class with a ``model_update`` (:class:`StatefulAffinity`; today ReMoE's
    model-level lambda, :meth:`ReluGates.model_update`) gets one call with its layers, skipped under
    gradient accumulation (the training step moves it once from the whole batch, :func:`after_step`).
    A router whose state is its own layer's (DeepSeek-V3's bias, a layer-scope lambda) moves in its
    call."""
    for owner, group in _model_groups(layers).items():
        if not getattr(group[0][0], "defer", False):
            owner.model_update([(affinity, [metrics]) for affinity, metrics in group])


def after_step(layers) -> None:
    """After the micro-batches of one accumulated training step (routers in :func:`defer_updates`
    mode): one update of every router's own state from the whole batch. ``layers`` lists
    ``(affinity, metrics)`` of every MoE layer, ``metrics`` that layer's metrics of each
    micro-batch. Every :class:`StatefulAffinity`'s ``deferred_update`` is called once (DeepSeek-V3's
    bias moves by the picks summed over the micro-batches), then every ``model_update`` once with
    its layers (ReMoE's model-level lambda moves by the sparsity averaged over them). Stateless
    affinities are not touched."""
    for affinity, metrics in layers:
        if isinstance(affinity, StatefulAffinity):
            affinity.deferred_update(metrics)
    for owner, group in _model_groups(layers).items():
        owner.model_update(group)


def defer_updates(module, defer: bool = True) -> None:
    """Gradient accumulation: make every router in ``module`` that updates state in its own
    training call (a :class:`StatefulAffinity`: DeepSeek-V3's bias, :class:`SigmoidGates`; ReMoE's
    lambda, :class:`ReluGates`) leave it to the training step, which applies one update from the
    whole accumulated batch (:func:`after_step`, called by
    :meth:`mini_moe.model.VisionMoE.apply_deferred_updates`)."""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, StatefulAffinity):
            node.defer = bool(defer)
