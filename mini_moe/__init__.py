"""mini_moe: routers in Vision Mixture-of-Experts, in JAX + Flax NNX.

The pieces, in the order the book introduces them:

* :mod:`mini_moe.routing` — allocation: Token Choice (Algorithm 1), Expert Choice
  (Algorithm 2), Soft MoE's softmaxes; routing tensors ``[..., T, E, C]``.
* :mod:`mini_moe.transport` — affinity by optimal transport: Sinkhorn, the quadratic
  (SVMoE) plan, the sparsity-constrained plan of eq. (9).
* :mod:`mini_moe.layer` — the MoE layer of eq. (2) and batched MLP experts.
* :mod:`mini_moe.losses` — importance and load losses, the Switch loss, the router z-loss,
  Pairwise Router Consistency.
* :mod:`mini_moe.routers` — trainable routers, created by name with ``make_router``.
* :mod:`mini_moe.figures` — pictures of routing tensors, of eq. (2) and of expert parallelism.
"""

from mini_moe import layer, losses, routers, routing, transport
from mini_moe.layer import MlpExperts, moe
from mini_moe.routers import ROUTERS, RouterOutput, make_router
from mini_moe.routing import Routing, capacity, expert_choice, soft_routing, token_choice

__all__ = [
    "layer", "losses", "routers", "routing", "transport",
    "MlpExperts", "moe", "ROUTERS", "RouterOutput", "make_router",
    "Routing", "capacity", "expert_choice", "soft_routing", "token_choice",
]
__version__ = "0.1.0"
