"""mini_moe: routers in Vision Mixture-of-Experts, in JAX + Flax NNX.

Every module, in the order the book introduces them:

* :mod:`mini_moe.routing` — allocation: Token Choice (Algorithm 1), Expert Choice
  (Algorithm 2), Soft MoE's softmaxes; routing tensors ``[..., T, E, C]``.
* :mod:`mini_moe.transport` — affinity by optimal transport: Sinkhorn, the quadratic
  (SVMoE) plan, the sparsity-constrained plan of eq. (9).
* :mod:`mini_moe.layer` — the MoE layer of eq. (2) and batched MLP experts.
* :mod:`mini_moe.losses` — importance and load losses, the Switch loss, the router z-loss,
  Pairwise Router Consistency.
* :mod:`mini_moe.routers` — trainable routers as affinity x allocation, created by name with
  ``make_router`` or composed by hand; :func:`~mini_moe.routers.register` adds your own.
* :mod:`mini_moe.model` — the ViT whose MLPs can be MoE layers (V-MoE).
* :mod:`mini_moe.config` — the ``quick`` (CPU) and ``full`` (GPU/TPU) configurations.
* :mod:`mini_moe.data` — digits, Fashion-MNIST, tfds datasets, ``patch_vote`` (a task
  built to need capacity) and ``subtask_vote`` (a task whose right routing is known), and batches.
* :mod:`mini_moe.augment` — random resized crops that remember their geometry, and the patch
  correspondences of two views (paper 004).
* :mod:`mini_moe.train` — training with checkpoints and exact resume.
* :mod:`mini_moe.runs` — a run's folder (config, checkpoints): the one way to read it back.
* :mod:`mini_moe.upcycle` — sparse upcycling: a dense ViT's MLPs copied into experts (with
  Drop-Upcycling's partial re-initialisation).
* :mod:`mini_moe.compress` — fewer experts at deployment: what each expert did on calibration
  images, pruning criteria (frequency, gate, REAP), pruning with the router's two denominators, and
  merging (M-SMoE, HC-SMoE).
* :mod:`mini_moe.evaluate` — the one evaluation pass, accuracy, the 10-shot probe, routing
  records, batch dependence and mechanisms.
* :mod:`mini_moe.modes` — run a trained model differently for a block (eval mode, another
  capacity, dropless, per-image groups, the batch-invariant modes, a bfloat16 router, routing
  replay), each restored afterwards.
* :mod:`mini_moe.inference` — routing at inference: the test-time capacity sweep, the filler attack
  with its controls and mitigations, ties, a bfloat16 router, routing replay and numerical batch
  dependence across serving batch sizes.
* :mod:`mini_moe.diagnose` — a health report of a trained MoE, with verdicts and hints
  (``python -m mini_moe diagnose RUN``).
* :mod:`mini_moe.explorer` — the routing explorer: one image's patches by expert, dropped ones,
  the load against capacity, live controls in Jupyter and Colab (``explorer.explore(model, images)``).
* :mod:`mini_moe.labs` — graded labs: a student's router pieces checked against the library
  (``python -m mini_moe labs check FILE.py``), or a class (``labs grade FOLDER``); :mod:`mini_moe.labs.worker`
  runs a submission's code in a sandboxed process of its own.
* :mod:`mini_moe.study` — the head-to-head router study.
* :mod:`mini_moe.stats` — the statistics every comparison uses (paired t, Holm, Wilson, exact
  McNemar, bootstrap).
* :mod:`mini_moe.confirm` — the pre-registered confirmatory study on ``patch_vote``: its design
  as code, TOST, and the runner's bookkeeping.
* :mod:`mini_moe.subtasks` — the controlled experiment where the right routing is known.
* :mod:`mini_moe.parallel` — expert parallelism across devices (``all_to_all``).
* :mod:`mini_moe.bench` — benchmarks, and the results committed with the package.
* :mod:`mini_moe.figures` — pictures of routing tensors, of eq. (2) and of expert parallelism.
* :mod:`mini_moe.notebook` — ``glue`` for the book's chapters.
* :mod:`mini_moe.validate` — the argument checks every module shares, and ``InputError``, the
  one exception they raise (the command line prints it without a traceback).
* ``python -m mini_moe`` — the command line (``train``, ``evaluate``, ``diagnose``, ``bench``, ``study``, ...).
"""

from mini_moe import layer, losses, routers, routing, transport
from mini_moe.layer import MlpExperts, moe
from mini_moe.routers import ROUTERS, RouterOutput, make_router
from mini_moe.routing import Routing, capacity, expert_choice, soft_routing, token_choice
from mini_moe.validate import InputError

__all__ = [
    "layer", "losses", "routers", "routing", "transport",
    "MlpExperts", "moe", "ROUTERS", "RouterOutput", "make_router",
    "Routing", "capacity", "expert_choice", "soft_routing", "token_choice", "InputError",
]
__version__ = "0.4.0"
