"""What routers pass around: :class:`RouterOutput` (what a router returns), :class:`Budget` (what
an allocation grants a routing group) and :class:`Affinities` (what an affinity gives an
allocation). Re-exported by :mod:`mini_moe.routers`."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.struct

from mini_moe import routing

Array = Any


@flax.struct.dataclass
class RouterOutput:
    """What a router returns.

    Attributes:
      routing: :class:`~mini_moe.routing.Routing`, tensors ``[..., T, E, C]``.
      aux_loss: scalar auxiliary loss (0 for routers that need none).
      metrics: dict of scalars and ``[E]`` arrays (see ``routing.routing_metrics``).
      probs: ``[..., T, E]`` each token's distribution over experts: the (noisy) softmax
        of the router logits (paper 004's r_theta); for Soft MoE the combine weights
        summed over each expert's slots.
      affinities: the :class:`Affinities` the allocation worked from (what the dropless
        layer path sorts by).
      null_gates: ``[..., T, Z]`` the combine weights of the Z null experts (0 where a token
        did not pick one; see ``TokenChoice.null_experts``), or None without null experts. The
        routing tensors then cover the E real experts only.
      picks: ``bool [..., T, E (+ Z)]`` the experts each token picked, before any capacity cut
        (null experts' columns last), as the allocation made them: the one record of "which
        experts did this token choose" that evaluation reads; None for an allocation that makes
        no per-token picks (Expert Choice, Soft MoE). Under ``jit`` it costs nothing unless read.
    """

    routing: routing.Routing
    aux_loss: Array
    metrics: dict
    probs: Array
    affinities: Any = None
    null_gates: Any = None
    picks: Any = None


class Budget(NamedTuple):
    """What an allocation grants one routing group of T tokens: ``k`` experts per token
    (Token Choice; 1 otherwise) and ``capacity`` C slots per expert (Soft MoE: its slots)."""

    k: int
    capacity: int


@flax.struct.dataclass
class Affinities:
    """What an affinity gives an allocation.

    Attributes:
      scores: ``[..., T, E]`` what the allocation ranks (Soft MoE: slot logits ``[..., T, E, S]``).
      combine: ``[..., T, E]`` where the combine weights come from; ``None``: from ``scores``.
      probs: ``[..., T, E]`` each token's distribution over experts; ``None``: the combine
        tensor summed over slots.
      aux_loss: scalar auxiliary loss.
      metrics: dict of scalars.
    """

    scores: Array
    combine: Array | None = None
    probs: Array | None = None
    aux_loss: Array = 0.0
    metrics: dict = dataclasses.field(default_factory=dict)
