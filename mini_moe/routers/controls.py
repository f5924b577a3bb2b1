"""Routing controls, for experiments that ask whether the *learned* routing matters: a router
frozen at its initialisation (:func:`freeze`, :class:`FrozenWeight`), the hash router's
fixed random projection (:class:`HashProjection`) and the raw-key routers' fixed keys of the raw
patch (:class:`RawKey`). Re-exported by :mod:`mini_moe.routers`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mini_moe import data as data_lib
from mini_moe.routers.types import Affinities, Array, Budget
from mini_moe.validate import InputError, check_int

# ------------------------------------------------------------------------- routing controls


class FrozenWeight(nnx.Variable):
    """A router weight held at its initial value (a routing control): a variable of its own type,
    not an ``nnx.Param``, so no gradient reaches it and the optimizer (``wrt=nnx.Param``) keeps no
    state for it; checkpoints save it with the rest of the model's state."""


def freeze(router: nnx.Module) -> nnx.Module:
    """Hold every parameter of ``router``'s affinity at its current value (in place; returns it).

    The control of a learned-routing experiment: the experts train, the routing stays the one
    its random initialisation gives, so a frozen router differs from a learned one only in
    whether the routing learns. Each ``nnx.Param`` of the affinity (the router weights ``W``;
    Soft MoE's ``phi`` and scale) becomes a :class:`FrozenWeight` of the same value. What the
    affinity updates without a gradient (DeepSeek-V3's bias, ReMoE's lambda) still updates.
    ``make_router(..., frozen=True)`` and ``model_router_kwargs={"frozen": True}`` call it.
    """
    modules = nnx.iter_modules(router.affinity) if hasattr(nnx, "iter_modules") else router.affinity.iter_modules()
    for _, module in modules:
        for name, value in list(vars(module).items()):
            if isinstance(value, nnx.Param):
                setattr(module, name, FrozenWeight(value[...]))
    return router


class HashProjection(nnx.Module):
    """A hash router's affinity: a fixed random partition of the token space, not learned.

    The idea of Hash Layers (Roller et al. 2021, arXiv 2106.04426), where a token's expert is a
    fixed hash of its identity, carried to continuous tokens by locality-sensitive hashing: a
    random projection ``Q [D, E]`` with orthonormal columns (Gaussian columns of unit norm when
    ``D < E``), held fixed (:class:`FrozenWeight`), and each token goes to the ``k`` experts whose
    projections ``(x - mean) Q`` are largest, with combine weight ``1 / k``. ``mean`` is the mean
    token of the routing group: the tokens of a network share a large common component, which
    alone would send every token to the same expert (issue 34's pilot saw exactly that), so
    the hash looks at how a token differs from its group. Nearby tokens share experts; nothing
    about the task decides which, and no gradient reaches the choice (the gates are constants).

    Balance: for isotropic tokens (``x ~ N(m, I)``) and ``D >= E``, ``(x - m) Q ~ N(0, I_E)``, so
    every expert is equally likely, each token independently; the load of a group is
    multinomial. On a trained representation, which is not isotropic, the balance is whatever
    the data give (the router's ``max_violation`` metric shows it) and the capacity drops the
    overflow as for any Token Choice router.
    """

    per_token = False  # it centres each token on its group's mean
    learned = False  # a fixed partition: nothing about the task decides it

    def __init__(self, dim: int, num_experts: int, *, rngs: nnx.Rngs):
        check_int("dim", dim)
        check_int("num_experts", num_experts)
        self.dim, self.num_experts = dim, num_experts
        self.projection = FrozenWeight(_random_projection(rngs.params(), dim, num_experts))

    def logits(self, x: Array) -> Array:
        """The projections ``(x - mean_T x) Q``: ``[..., T, E]``."""
        return (x - jnp.mean(x, axis=-2, keepdims=True)) @ self.projection[...].astype(x.dtype)

    def __call__(self, x: Array, budget: Budget) -> Affinities:
        return _fixed_gates(self.logits(x), budget.k)


def _random_projection(key, dim: int, num_experts: int) -> Array:
    """``Q [dim, E]``: orthonormal columns (Gaussian columns of unit norm when ``dim < E``)."""
    gauss = jax.random.normal(key, (dim, num_experts), jnp.float32)
    if dim >= num_experts:
        return jnp.linalg.qr(gauss)[0]  # orthonormal columns
    return gauss / jnp.linalg.norm(gauss, axis=0, keepdims=True)


def _fixed_gates(scores: Array, k: int) -> Affinities:
    """A fixed router's affinities: each token's ``k`` largest ``scores`` picked, gate ``1 / k``
    each (``probs`` the same), so no gradient reaches the choice."""
    picks = jax.lax.top_k(scores, k)[1]  # [..., T, k]
    gates = jax.nn.one_hot(picks, scores.shape[-1], dtype=jnp.float32).sum(-2) / k  # [..., T, E]
    return Affinities(gates, probs=gates)


class RawKey(nnx.Module):
    """A raw-key router's affinity: a fixed key of the **raw patch**, which nothing above the
    patchify can steer (a routing control).

    Its input is the patch the model's embedding receives, the patchified standardised pixels
    ``[..., T, p*p*C]`` (:class:`mini_moe.model.VisionMoE` hands them to every MoE layer whose
    router is registered with ``reads="pixels"``), not the representation. Nothing in it is
    learned: its arrays are :class:`FrozenWeight` (no ``nnx.Param``), and each token goes to the
    ``k`` experts of largest score with gate ``1 / k``, as :class:`HashProjection`'s. So a model
    with a raw key keeps the routing of every patch from the first step to the last, whatever
    the layers below the MoE layer learn; a frozen learned router (:func:`freeze`) does not, as
    its input moves. Three keys (``key``):

    * ``"oracle"``: the right routing of :func:`mini_moe.data.subtask_vote`, the argmax of the
      patch's projections on the K = 8 unit sub-task signature directions ``q_k`` of the dataset
      named by ``dataset`` (``"subtask_vote"`` or ``"subtask_vote_d<d>_h<h>_s<s>"``; the directions
      do not depend on the separation). Expert k is sub-task k, so ``num_experts`` must be 8 and
      ``dim`` 49 (the dataset's 7x7 one-channel patches, ``patch_size=7``). Standardised with
      the training images' mean ``m`` and standard deviation ``sd``, a patch of sub-task t is
      ``(0.5 - m) / sd + (separation * q_t + content) / (8 sd)`` (clipping aside,
      :meth:`~mini_moe.data.SubtaskVoteTeacher.pixels`), and the content is orthogonal to every
      ``q_k``: key t leads the others by ``separation / (8 sd)``, and the grey level's constant
      adds ``(0.5 - m) / sd * sum(q_k)`` to key k. The key is not centred, because that offset is
      small: measured, it moves two keys apart by at most 0.2 against a lead of 5.7 (separation 4)
      down to 0.02 against 0.6 (separation 0.25), as ``m`` nears 0.5 with the separation.
      Centring each patch on its own mean would remove it, but mixes the content's mean into
      every key (agreement 0.986 instead of 1.0 at separation 0.25). Measured on the 160,000
      patches of a test split: the key is the patch's sub-task for every one of them
      (``tests/test_raw_key.py`` checks a slice).
    * ``"blind"``: a hash of the quantised raw patch (Hash Layers, Roller et al. 2021,
      arXiv 2106.04426, whose key is a token's identity): every standardised pixel to the integer
      ``floor(x / bin_width)``, the integer vector hashed once per expert with fixed random
      ``uint32`` multipliers and offsets (a sum that wraps modulo ``2**32`` in any order, so it is
      exact and deterministic, then MurmurHash3's finaliser), and the top 24 bits as a score in
      ``[0, 1)``. Patches whose pixels fall in the same bins go to the same experts; patches that
      never recur, as :func:`mini_moe.data.subtask_vote`'s, go to independent uniform random
      experts (1/8 routed home). On :func:`mini_moe.data.patch_vote`, whose patches recur, it is
      a true fixed assignment of each vocabulary patch.
    * ``"lsh"``: the argmax of a fixed random projection ``x Q`` (orthonormal columns, as
      :class:`HashProjection`) of the raw patch, *not* centred on its group (the standardised
      pixels have no large common component), so a patch's expert depends on that patch alone.
      Nearby patches share experts; whether the partition follows the task depends on the data
      (a locality-sensitive hash, the continuous form of Hash Layers).

    The confound of every comparison with a learned router: a fixed router's gates are 1 (1/k),
    a learned router's are its softmax probabilities, which also scale each expert's output.

    Args:
      dim: the raw patch's size ``p*p*C``.
      num_experts: E (8 for ``"oracle"``).
      key: ``"oracle"``, ``"blind"`` or ``"lsh"``.
      dataset: ``"oracle"`` only: the :func:`~mini_moe.data.subtask_vote` dataset whose signatures it reads.
      bin_width: ``"blind"`` only: the width of a pixel's quantisation bin, in standard deviations.
    """

    KEYS = ("oracle", "blind", "lsh")
    per_token = True  # a patch's key depends on that patch alone
    learned = False  # a fixed function of the raw pixels: nothing about the task is learned

    def __init__(self, dim: int, num_experts: int, *, key: str, dataset: str | None = None, bin_width: float = 0.5,
                 rngs: nnx.Rngs):
        check_int("dim", dim)
        check_int("num_experts", num_experts)
        if key not in self.KEYS:
            raise InputError(f"key must be one of {self.KEYS}, got {key!r}.")
        if dataset is not None and key != "oracle":
            raise InputError(f"dataset applies to key='oracle' only (the signatures it reads), got dataset={dataset!r} "
                             f"with key={key!r}.")
        self.dim, self.num_experts, self.key = dim, num_experts, key
        if key == "oracle":
            self.projection = FrozenWeight(_signature_directions(dataset, dim, num_experts))
        elif key == "lsh":
            self.projection = FrozenWeight(_random_projection(rngs.params(), dim, num_experts))
        else:
            if isinstance(bin_width, bool) or not isinstance(bin_width, (int, float)) or not 0 < bin_width < float("inf"):
                raise InputError(f"bin_width must be a finite number > 0 (standard deviations), got {bin_width!r}.")
            self.bin_width = float(bin_width)
            bits = jax.random.bits(rngs.params(), (dim + 1, num_experts), jnp.uint32)
            self.multipliers = FrozenWeight(bits[:dim] | jnp.uint32(1))  # odd: every bin step changes the hash
            self.offsets = FrozenWeight(bits[dim])  # so an all-zero patch gets different hashes per expert

    def logits(self, x: Array) -> Array:
        """Each patch's score per expert, ``[..., T, E]``: its projections (``"oracle"``,
        ``"lsh"``) or its hash in ``[0, 1)`` (``"blind"``)."""
        if self.key != "blind":
            return x @ self.projection[...].astype(x.dtype)
        bins = jnp.floor(x / self.bin_width).astype(jnp.int32).astype(jnp.uint32)  # [..., T, D], wraps
        h = jnp.sum(bins[..., None] * self.multipliers[...], axis=-2, dtype=jnp.uint32) + self.offsets[...]
        h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)  # MurmurHash3's 32-bit finaliser
        h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
        h = h ^ (h >> 16)
        return (h >> 8).astype(jnp.float32) * 2.0**-24  # the top 24 bits, exact in float32

    def __call__(self, x: Array, budget: Budget) -> Affinities:
        return _fixed_gates(self.logits(x), budget.k)


def _signature_directions(dataset, dim: int, num_experts: int) -> Array:
    """``[dim, K]``: the unit sub-task signature directions of the ``subtask_vote`` dataset ``dataset``."""
    options = data_lib.subtask_vote_options(dataset) if isinstance(dataset, str) else None
    if options is None:
        raise InputError(f"dataset must name a subtask_vote dataset ('subtask_vote' or 'subtask_vote_d<d>_h<h>_s<s>'), "
                         f"whose sub-task signatures key='oracle' reads, got {dataset!r}.")
    tasks = data_lib.SUBTASK_VOTE_TASKS
    if num_experts != tasks:
        raise InputError(f"num_experts must be {tasks} for key='oracle' (expert k is sub-task k of {dataset}), "
                         f"got {num_experts}.")
    signatures = np.asarray(data_lib.subtask_vote_teacher(**options).signatures, np.float64)  # [K, 49]
    if dim != signatures.shape[1]:
        raise InputError(f"dim must be {signatures.shape[1]} for key='oracle' (the raw 7x7 one-channel patches of "
                         f"{dataset}: patch_size=7), got {dim}.")
    return jnp.asarray((signatures / np.linalg.norm(signatures, axis=1, keepdims=True)).T, jnp.float32)
