"""Data: image datasets and batching.

Everything here is plain NumPy, so it is fast on a CPU and neutral about the framework
that consumes the arrays (``jnp.asarray(batch)`` puts a batch on the device).

Datasets (:func:`load`), in the order "works offline first" (DESIGN.md, Section 4):

* ``"digits"`` — scikit-learn's 8x8 digits; ships inside scikit-learn, no network, no
  extra install. A fixed stratified split: 1497 train / 300 test images.
* ``"fashion_mnist"`` — 28x28x1, 60000 / 10000. Read from the four IDX files of
  ``data_dir``, else of ``/usr/share/datasets/fashion-mnist`` (Debian/Ubuntu:
  ``sudo apt-get install dataset-fashion-mnist``), else through tensorflow-datasets.
* ``"cifar10"``, ``"cifar100"`` — 32x32x3, 50000 / 10000, through tensorflow-datasets'
  ``tfds.data_source`` (random access to prepared ArrayRecord files; TensorFlow is not
  needed to read them). Install with ``pip install "mini_moe[tfds]"``.
* ``"patch_vote"`` — 28x28x1, 60000 / 10000, synthetic (:func:`patch_vote`): a task built
  to need capacity, generated with NumPy in about a second, no files, no network.
  ``"patch_vote_v<V>"`` (e.g. ``"patch_vote_v512"``) is the same task with a vocabulary of
  V patches instead of 4096; the names in :data:`DATASETS` are the ones the command line
  offers, :func:`load` accepts any V >= 10.
* ``"subtask_vote"`` — 28x28x1, 60000 / 10000, synthetic (:func:`subtask_vote`): a task whose
  right routing is known (every patch belongs to one of 8 sub-tasks, each with its own
  function). ``"subtask_vote_d<d>_h<h>_s<s>"`` sets the content dimension, the teachers' width and the signatures' norm.

Every :class:`Dataset` holds ``images`` as ``float32 [N, H, W, C]`` in ``[0, 1]`` and
``labels`` as ``int32 [N]``.

Batches (:func:`batches`): the order of an epoch depends only on ``(seed, epoch)``, so a
run is reproducible and a resumed run continues exactly where it stopped.

Augmentation with known geometry (random resized crops and the patch correspondences of
paper 004) lives in :mod:`mini_moe.augment`.

Why one module of some 800 lines: every dataset's loader, its synthetic generator and the
ground truth the chapters measure against (e.g. :func:`subtask_vote_tasks`) must change together;
split, a generator and its truth could drift apart.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import math
import os
import pathlib
import re
from typing import Iterator, Sequence

import numpy as np

from mini_moe.validate import DataNotFoundError, InputError, MissingPackageError

__all__ = [
    "DATASETS", "Dataset", "load", "validation_split", "read_idx", "normalize", "batches", "num_batches",
    "patch_vote", "patch_vote_vocabulary", "patch_vote_options", "patch_vote_patch_values",
    "subtask_vote", "subtask_vote_options", "subtask_vote_tasks", "subtask_vote_teacher", "SubtaskVoteTeacher",
]

#: The datasets :func:`load` knows (and the command line offers). :func:`load` also accepts
#: ``"patch_vote_v<V>"`` for any vocabulary size V >= 10 (:func:`patch_vote_options`) and
#: ``"subtask_vote_d<d>_h<h>"`` for any content dimension and teacher width (:func:`subtask_vote_options`).
DATASETS = ("digits", "fashion_mnist", "cifar10", "cifar100",
            "patch_vote", "patch_vote_v512", "patch_vote_v1024", "patch_vote_v16384", "subtask_vote")
SPLITS = ("train", "test")

#: Where Debian's package ``dataset-fashion-mnist`` installs the four ``.gz`` IDX files.
FASHION_MNIST_DIR = pathlib.Path("/usr/share/datasets/fashion-mnist")

_NUM_CLASSES = {"digits": 10, "fashion_mnist": 10, "cifar10": 10, "cifar100": 100}
_DIGITS_NUM_TEST = 300
_DIGITS_SEED = 0

_TFDS_HINT = 'pip install "mini_moe[tfds]" (i.e. pip install tensorflow-datasets)'
_TFDS_PREPARE = (
    "tensorflow-datasets downloads and prepares a dataset once, which needs network\n"
    "access and, to encode the images, TensorFlow (pip install tensorflow); reading the\n"
    "prepared files later needs neither. Or prepare it on another machine\n"
    "(tfds build NAME --file_format=array_record) and pass that folder as data_dir.")
_FASHION_HINT = (
    "Fashion-MNIST was not found. Get it in one of these ways:\n"
    "  * Debian/Ubuntu: sudo apt-get install dataset-fashion-mnist\n"
    f"    (puts the four IDX files in {FASHION_MNIST_DIR});\n"
    f"  * {_TFDS_HINT}\n"
    "    and network access once: the data goes to data_dir (default\n"
    "    ~/tensorflow_datasets or $TFDS_DATA_DIR); preparing it also needs TensorFlow;\n"
    "  * or put train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,\n"
    "    t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz (plain or .gz) in a folder\n"
    '    and call load("fashion_mnist", data_dir=that_folder).'
)


# --------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """One split of an image classification dataset, held in memory.

    Attributes:
      images: ``float32 [N, H, W, C]``, values in ``[0, 1]``.
      labels: ``int32 [N]``, values in ``[0, num_classes)``.
      num_classes: number of classes.
      name: one of :data:`DATASETS` (or a ``"patch_vote_v<V>"``).
      split: ``"train"`` or ``"test"``.
    """

    images: np.ndarray
    labels: np.ndarray
    num_classes: int
    name: str
    split: str

    def __post_init__(self):
        if self.images.ndim != 4:
            raise InputError(f"images must be [N, H, W, C], got shape {self.images.shape}")
        if self.labels.shape != self.images.shape[:1]:
            raise InputError(
                f"labels must be [N] with N = {self.images.shape[0]}, "
                f"got shape {self.labels.shape}")

    @property
    def image_size(self) -> int:
        """H, the image height (all datasets here have square images)."""
        return self.images.shape[1]

    @property
    def channels(self) -> int:
        """C, the number of colour channels."""
        return self.images.shape[3]

    def __len__(self) -> int:
        return self.images.shape[0]

    def __repr__(self) -> str:
        return (f"Dataset(name={self.name!r}, split={self.split!r}, "
                f"images={self.images.shape}, num_classes={self.num_classes})")


def load(name: str, split: str = "train", *, data_dir: str | os.PathLike | None = None
         ) -> Dataset:
    """Loads one split of a dataset into memory.

    Args:
      name: one of :data:`DATASETS`, or ``"patch_vote_v<V>"`` (:func:`patch_vote` with
        ``vocab_size=V``; ``"patch_vote"`` is V = 4096), or ``"subtask_vote_d<d>_h<h>"``
        (:func:`subtask_vote` with ``content=d, teacher=h``).
      split: ``"train"`` or ``"test"``.
      data_dir: for ``"fashion_mnist"``, a folder with the four IDX files (plain or
        ``.gz``); if they are not there, it is used as the tensorflow-datasets
        ``data_dir``. For ``"cifar10"`` / ``"cifar100"``, the tensorflow-datasets
        ``data_dir`` (default ``~/tensorflow_datasets`` or ``$TFDS_DATA_DIR``).
        Ignored for ``"digits"`` and the synthetic tasks.

    Returns:
      A :class:`Dataset` with ``float32 [N, H, W, C]`` images in ``[0, 1]`` and
      ``int32 [N]`` labels.

    Raises:
      ValueError: unknown ``name`` or ``split``.
      FileNotFoundError: the data is not available; the message says how to get it.
      ImportError: CIFAR needs tensorflow-datasets, which is not installed.
    """
    vote = patch_vote_options(name) if isinstance(name, str) else None
    routed = subtask_vote_options(name) if isinstance(name, str) else None
    if name not in DATASETS and vote is None and routed is None:
        raise InputError(f"unknown dataset name {name!r}; expected one of {DATASETS}, "
                         "'patch_vote_v<V>' (V >= 10: the vocabulary size) or 'subtask_vote_d<d>_h<h>_s<s>'")
    if split not in SPLITS:
        raise InputError(f"unknown split {split!r}; expected 'train' or 'test'")
    if vote is not None:
        return dataclasses.replace(patch_vote(split, **vote), name=name)
    if routed is not None:
        return dataclasses.replace(subtask_vote(split, **routed), name=name)
    if name == "digits":
        images, labels = _load_digits(split)
    elif name == "fashion_mnist":
        images, labels = _load_fashion_mnist(split, data_dir)
    else:
        images, labels = _load_tfds(name, split, data_dir)
    return Dataset(images=images, labels=labels, num_classes=_NUM_CLASSES[name],
                   name=name, split=split)


def _load_digits(split: str) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (np.asarray(digits.images, np.float32) / 16.0)[..., None]  # [1797, 8, 8, 1]
    labels = np.asarray(digits.target, np.int32)
    test = _stratified_test_mask(labels, _DIGITS_NUM_TEST, seed=_DIGITS_SEED)
    keep = test if split == "test" else ~test
    return images[keep], labels[keep]


def _stratified_test_mask(labels: np.ndarray, num_test: int, *, seed: int) -> np.ndarray:
    """A boolean mask choosing exactly ``num_test`` examples, stratified by label.

    The examples are shuffled with a fixed seed, grouped by class (stable sort, so each
    class stays shuffled) and every (N / num_test)-th one is taken: each class gets its
    proportional share, within one example.
    """
    n = labels.shape[0]
    order = np.random.default_rng(seed).permutation(n)
    order = order[np.argsort(labels[order], kind="stable")]
    rank = np.arange(n)
    take = (rank + 1) * num_test // n > rank * num_test // n  # exactly num_test Trues
    mask = np.zeros(n, bool)
    mask[order[take]] = True
    return mask


_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Reads an IDX file (the MNIST / Fashion-MNIST format), plain or gzip-compressed.

    The header is two zero bytes, a type code (``0x08`` = uint8, ``0x09`` = int8, ``0x0B``
    = int16, ``0x0C`` = int32, ``0x0D`` = float32, ``0x0E`` = float64), the number of
    dimensions, then each dimension as a big-endian uint32; the data follows, big-endian.

    Returns:
      The array, with the file's shape and type (native byte order).
    """
    path = pathlib.Path(path)
    with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise InputError(f"{path} is not an IDX file (header {data[:4].hex()})")
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    ndim = data[3]
    offset = 4 + 4 * ndim
    dims = tuple(int(d) for d in np.frombuffer(data, ">u4", count=ndim, offset=4))
    if len(data) - offset != math.prod(dims) * dtype.itemsize:
        raise InputError(f"{path}: header says shape {dims} of {dtype}, "
                         f"but the file holds {len(data) - offset} data bytes")
    array = np.frombuffer(data, dtype, offset=offset).reshape(dims)
    return array.astype(dtype.newbyteorder("="))


def _find_idx_files(folder: pathlib.Path, split: str) -> tuple[pathlib.Path, pathlib.Path] | None:
    prefix = "train" if split == "train" else "t10k"
    found = []
    for stem in (f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"):
        candidates = [folder / stem, folder / f"{stem}.gz"]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            return None
        found.append(path)
    return found[0], found[1]


def _load_fashion_mnist(split, data_dir) -> tuple[np.ndarray, np.ndarray]:
    folder = pathlib.Path(data_dir) if data_dir is not None else FASHION_MNIST_DIR
    files = _find_idx_files(folder, split)
    if files is not None:
        images, labels = read_idx(files[0]), read_idx(files[1])
        if images.ndim != 3 or labels.shape != images.shape[:1]:
            raise InputError(f"{files[0]} / {files[1]}: expected images [N, H, W] and labels "
                             f"[N], got {images.shape} and {labels.shape}")
        return _to_unit_float(images)[..., None], labels.astype(np.int32)
    try:
        return _load_tfds("fashion_mnist", split, data_dir)
    except (ImportError, FileNotFoundError) as e:
        cause = e.__cause__ if isinstance(e, FileNotFoundError) and e.__cause__ else e
        raise DataNotFoundError(
            f"{_FASHION_HINT}\n(No IDX files in {folder}; the tensorflow-datasets fallback "
            f"failed with {_short(cause)})") from e


def _import_tfds():
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise MissingPackageError(f"this dataset needs tensorflow-datasets: {_TFDS_HINT}") from e
    return tfds


def _short(e: BaseException, limit: int = 300) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[:limit] + " ..."


def _load_tfds(name, split, data_dir) -> tuple[np.ndarray, np.ndarray]:
    """Reads a whole split through ``tfds.data_source`` (no TensorFlow needed to read)."""
    tfds = _import_tfds()
    try:
        source = tfds.data_source(
            name, split=split, data_dir=None if data_dir is None else os.fspath(data_dir))
    except Exception as e:  # download / preparation failures come from deep inside tfds
        raise DataNotFoundError(
            f"tensorflow-datasets could not provide {name!r} split {split!r} "
            f"(data_dir={data_dir or '~/tensorflow_datasets or $TFDS_DATA_DIR'}).\n"
            f"{_TFDS_PREPARE.replace('NAME', name)}\nCause: {_short(e)}") from e
    n = len(source)
    if n == 0:
        raise DataNotFoundError(f"tensorflow-datasets returned an empty {name!r} {split!r}")
    first = source[0]
    image0 = np.asarray(first["image"])
    images = np.empty((n, *image0.shape), np.uint8)
    labels = np.empty((n,), np.int32)
    for i in range(n):  # BaseDataSource.__getitem__: one decoded example (a dict)
        example = first if i == 0 else source[i]
        images[i] = example["image"]
        labels[i] = example["label"]
    if images.ndim == 3:
        images = images[..., None]
    return _to_unit_float(images), labels


def _to_unit_float(images: np.ndarray) -> np.ndarray:
    """uint8 -> float32 in [0, 1], in one pass over a fresh array."""
    out = images.astype(np.float32)
    np.divide(out, 255.0, out=out)
    return out


# --------------------------------------------------------------------------------------
# patch_vote: a synthetic task that needs capacity
# --------------------------------------------------------------------------------------

PATCH_VOTE_VOCAB = 4096  # V of "patch_vote"
PATCH_VOTE_GRID = 4  # the image is a 4x4 grid of patches
PATCH_VOTE_PATCH = 7  # of 7x7 pixels: 28x28 images, 16 patches
PATCH_VOTE_VOTES = 6  # patches that carry the label's value
PATCH_VOTE_MAX_OTHER = 3  # most patches any other value may have
_PATCH_VOTE_NAME = re.compile(r"patch_vote(?:_v([0-9]+))?")


def patch_vote_options(name: str) -> dict | None:
    """The :func:`patch_vote` options a dataset name stands for: ``{"vocab_size": 4096}`` for
    ``"patch_vote"``, ``{"vocab_size": V}`` for ``"patch_vote_v<V>"``, None for any other name.
    The vocabulary size is checked by :func:`patch_vote`."""
    match = _PATCH_VOTE_NAME.fullmatch(name)
    if match is None:
        return None
    return {"vocab_size": PATCH_VOTE_VOCAB if match.group(1) is None else int(match.group(1))}


def _check_option(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InputError(f"{name} must be an integer >= {low}, got {value!r}.")
    return int(value)


@functools.lru_cache(maxsize=4)
def patch_vote_vocabulary(vocab_size: int = PATCH_VOTE_VOCAB, seed: int = 0
                          ) -> tuple[np.ndarray, np.ndarray]:
    """The vocabulary of :func:`patch_vote`: ``(patches float32 [V, 7, 7] in [0, 1],
    values int32 [V] in 0..9)``, read-only arrays, the same for every call with these
    arguments.

    Each patch is ``clip(0.5 + z / 8, 0, 1)`` of a standard Gaussian ``z`` (an affine map
    that clips only beyond 4 standard deviations, about 6 pixels in 100,000). The values are
    a random permutation of ``0, 1, ..., 9, 0, 1, ...``: every value has ``V // 10`` or
    ``V // 10 + 1`` patches (so every value exists when V >= 10).
    """
    vocab_size = _check_option("vocab_size", vocab_size, 10)
    seed = _check_option("seed", seed, 0)
    rng = np.random.default_rng((seed, 0))
    z = rng.standard_normal((vocab_size, PATCH_VOTE_PATCH, PATCH_VOTE_PATCH))
    patches = np.clip(0.5 + z / 8.0, 0.0, 1.0).astype(np.float32)
    values = rng.permutation(np.arange(vocab_size) % 10).astype(np.int32)
    patches.flags.writeable = False
    values.flags.writeable = False
    return patches, values


def patch_vote(split: str = "train", *, vocab_size: int = PATCH_VOTE_VOCAB, num_train: int = 60000,
               num_test: int = 10000, seed: int = 0) -> Dataset:
    """A synthetic 10-class image task that needs a per-patch lookup table: chapter 8's
    capacity control. Unlike chapter 9's task it has no sub-tasks, so no routing is right.

    Each 28x28x1 image is a 4x4 grid of 7x7 patches, each drawn from a fixed vocabulary of
    V random Gaussian patches (:func:`patch_vote_vocabulary`); every vocabulary patch has a
    value in 0..9. The label is the value that exactly 6 of the 16 patches share; the other
    10 patches have other values, none of which appears more than 3 times, so the label is
    the value of the (unique) majority. Per image: the label uniform in 0..9, the other 10
    values uniform over the 9 others (drawn again while one appears 4 or more times), each
    patch uniform among the vocabulary patches of its value, the 16 in a random order.

    What it tests: to classify, a model must recognise each patch (a table of V entries:
    patch -> value; the patches are random, so nothing generalises from one patch to
    another) and then count the values over the image. With the 7x7 patches of the ViT
    configuration each patch is one token, so the table is a per-token map, exactly what an
    MLP (or MoE) layer computes. A dense MLP of fixed width can hold only so much of a table
    of V entries; E experts of the same width, each one seeing the tokens routed to it, hold
    about E times more at the same activated FLOPs. The task was built so that capacity would
    be the limit, a positive control for sparse MoE: after chapter 8's 2,000 steps the sparse
    routers beat the dense model of equal activated FLOPs, but a dense model trained twice as
    long learns about as much of the table (the pilot), so at that budget the limit is capacity
    and training speed together. Its patches carry no sub-task, so no routing is right: it tests
    whether experts add capacity, not whether a router learns where to send a token
    (:func:`subtask_vote` is built for that). A router that mixes tokens (Soft MoE's slots are
    weighted averages of tokens) may blur a per-token table: a hypothesis written after Soft MoE
    lost in chapter 8's pilot, measured there on one cell only.
    Train and test images come from the same vocabulary (the table is learnable), the
    images themselves are different draws.

    Deterministic: the vocabulary depends only on ``(vocab_size, seed)``, the training
    images on ``(vocab_size, num_train, seed)``, the test images on ``(vocab_size, num_test,
    seed)``. Both splits are generated once per process (``functools.lru_cache``) and held
    as read-only arrays.

    Args:
      split: ``"train"`` or ``"test"``.
      vocab_size: V >= 10, the number of vocabulary patches.
      num_train, num_test: images per split (>= 1).
      seed: the seed of the vocabulary and of the images (>= 0).

    Returns:
      A :class:`Dataset`: ``float32 [N, 28, 28, 1]`` images in ``[0, 1]`` (the vocabulary's
      pixels, unchanged) and ``int32 [N]`` labels; ``name="patch_vote"``.

    Raises:
      ValueError: a bad ``split`` or option; the message names it.
    """
    if split not in SPLITS:
        raise InputError(f"patch_vote: unknown split {split!r}; expected 'train' or 'test'")
    vocab_size = _check_option("vocab_size", vocab_size, 10)
    counts = {"train": _check_option("num_train", num_train, 1), "test": _check_option("num_test", num_test, 1)}
    seed = _check_option("seed", seed, 0)
    images, labels = _patch_vote_split(vocab_size, counts[split], seed, SPLITS.index(split) + 1)
    return Dataset(images=images, labels=labels, num_classes=10, name="patch_vote", split=split)


def patch_vote_patch_values(images: np.ndarray, vocab_size: int = PATCH_VOTE_VOCAB, seed: int = 0
                            ) -> np.ndarray:
    """The value (0..9) of each of the 16 patches of ``images`` ``[N, 28, 28, 1]`` (row-major
    grid order), found by looking every patch up in the vocabulary; ``-1`` for a patch that
    is not a vocabulary patch (an image of another vocabulary). Returns ``int32 [N, 16]``."""
    patches, values = patch_vote_vocabulary(vocab_size, seed)
    g, p = PATCH_VOTE_GRID, PATCH_VOTE_PATCH
    images = np.asarray(images, np.float32).reshape(-1, g, p, g, p)
    tiles = images.transpose(0, 1, 3, 2, 4).reshape(-1, p * p)  # [N * 16, 49]
    vocab = patches.reshape(-1, p * p)
    w = np.random.default_rng(12345).standard_normal(p * p)  # a random projection as a hash key
    keys, tile_keys = vocab.astype(np.float64) @ w, tiles.astype(np.float64) @ w
    order = np.argsort(keys)
    at = np.clip(np.searchsorted(keys[order], tile_keys), 0, len(keys) - 1)
    index = order[at]
    found = np.all(vocab[index] == tiles, axis=1)  # exact match, not just the hash
    return np.where(found, values[index], -1).astype(np.int32).reshape(-1, g * g)


@functools.lru_cache(maxsize=4)
def _patch_vote_split(vocab_size: int, count: int, seed: int, stream: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """``count`` images and labels of the random stream ``stream`` (1: train, 2: test)."""
    patches, values = patch_vote_vocabulary(vocab_size, seed)
    rng = np.random.default_rng((seed, stream))
    labels, cell_values = _vote_values(rng, count)
    # Each patch uniform among the vocabulary patches of its value.
    by_value = np.argsort(values, kind="stable")
    sizes = np.bincount(values, minlength=10)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    pick = (rng.random(cell_values.shape) * sizes[cell_values]).astype(np.int64)
    index = by_value[starts[cell_values] + pick]  # [N, 16]
    g, p = PATCH_VOTE_GRID, PATCH_VOTE_PATCH
    images = patches[index].reshape(count, g, g, p, p).transpose(0, 1, 3, 2, 4)
    images = np.ascontiguousarray(images.reshape(count, g * p, g * p, 1))
    labels = labels.astype(np.int32)
    images.flags.writeable = False
    labels.flags.writeable = False
    return images, labels


def _vote_values(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` labels ``[N]`` uniform in 0..9 and the values ``[N, 16]`` of the 16 patches of
    each image, in a random order: 6 patches with the label's value, the 10 others uniform over
    the 9 other values, drawn again while one of them appears more than 3 times."""
    labels = rng.integers(0, 10, size=count)
    others = np.empty((count, 16 - PATCH_VOTE_VOTES), np.int64)
    todo = np.arange(count)
    while todo.size:
        draw = rng.integers(0, 9, size=(todo.size, others.shape[1]))
        draw += draw >= labels[todo, None]  # skip the label's value
        most = (draw[..., None] == np.arange(10)).sum(axis=1).max(axis=1)
        ok = most <= PATCH_VOTE_MAX_OTHER
        others[todo[ok]] = draw[ok]
        todo = todo[~ok]
    cell_values = np.concatenate([np.repeat(labels[:, None], PATCH_VOTE_VOTES, axis=1), others], axis=1)
    shuffle = np.argsort(rng.random(cell_values.shape), axis=1)  # a random order of the 16 patches
    return labels, np.take_along_axis(cell_values, shuffle, axis=1)


# --------------------------------------------------------------------------------------
# subtask_vote: a synthetic task with a known right routing
# --------------------------------------------------------------------------------------

SUBTASK_VOTE_TASKS = 8  # K sub-tasks (the quick model's E experts)
SUBTASK_VOTE_CONTENT = 4  # d, the dimension of a patch's content
SUBTASK_VOTE_TEACHER = 16  # h, the width of each sub-task's teacher MLP
SUBTASK_VOTE_SEPARATION = 4.0  # the norm of a sub-task's signature, in content standard deviations
_SUBTASK_VOTE_NAME = re.compile(r"subtask_vote(?:_d([0-9]+))?(?:_h([0-9]+))?(?:_s([0-9]+(?:\.[0-9]+)?))?")


def subtask_vote_options(name: str) -> dict | None:
    """The :func:`subtask_vote` options a dataset name stands for: ``{}`` for ``"subtask_vote"``,
    ``{"content": d, "teacher": h, "separation": s}`` for ``"subtask_vote_d<d>_h<h>_s<s>"`` (each
    part optional, in this order; ``s`` may have decimals, e.g. ``_s1.5``); None for any other name."""
    match = _SUBTASK_VOTE_NAME.fullmatch(name)
    if match is None:
        return None
    options = {key: int(text) for key, text in zip(("content", "teacher"), match.groups()[:2]) if text is not None}
    if match.group(3) is not None:
        options["separation"] = float(match.group(3))
    return options


@dataclasses.dataclass(frozen=True, eq=False)
class SubtaskVoteTeacher:
    """The fixed parts of :func:`subtask_vote`, drawn from ``seed`` alone.

    Attributes:
      signatures: ``float32 [K, 49]``, sub-task k's pattern ``separation * q_k``;
      content_basis: ``float32 [d, 49]``, the rows ``q_{K}, ..., q_{K+d-1}`` that carry a patch's
        content (``q`` an orthonormal basis of the 49 pixels, so signatures and content never mix);
      w1 ``[K, d, h]``, b1 ``[K, h]``, w2 ``[K, h]``: teacher k is
        ``f_k(z) = gelu(z @ w1[k] + b1[k]) @ w2[k]``;
      deciles: ``[K, 9]``, the deciles of ``f_k(z)`` for ``z ~ N(0, I_d)`` (from 200,000 draws),
        so that every value 0..9 is equally likely within each sub-task.
    """

    signatures: np.ndarray
    content_basis: np.ndarray
    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    deciles: np.ndarray

    def values(self, task: int, content: np.ndarray) -> np.ndarray:
        """The value (0..9) of contents ``[n, d]`` under sub-task ``task``: ``int64 [n]``."""
        f = _np_gelu(content @ self.w1[task] + self.b1[task]) @ self.w2[task]
        return np.searchsorted(self.deciles[task], f)

    def pixels(self, task: np.ndarray, content: np.ndarray) -> np.ndarray:
        """The 7x7 patches ``float32 [..., 7, 7]`` in [0, 1] of sub-tasks ``[...]`` and contents
        ``[..., d]``: ``clip(0.5 + (signature + content @ basis) / 8, 0, 1)``."""
        x = self.signatures[task] + content @ self.content_basis
        x = np.clip(0.5 + x / 8.0, 0.0, 1.0).astype(np.float32)
        return x.reshape(*task.shape, PATCH_VOTE_PATCH, PATCH_VOTE_PATCH)


def _np_gelu(x: np.ndarray) -> np.ndarray:
    """GELU, tanh form (``jax.nn.gelu``'s default)."""
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


@functools.lru_cache(maxsize=4)
def subtask_vote_teacher(content: int = SUBTASK_VOTE_CONTENT, teacher: int = SUBTASK_VOTE_TEACHER,
                         seed: int = 0, separation: float = SUBTASK_VOTE_SEPARATION) -> SubtaskVoteTeacher:
    """The signatures, content basis and teacher MLPs of :func:`subtask_vote`
    (:class:`SubtaskVoteTeacher`), the same for every call with these arguments. ``separation``
    scales the signatures only: the basis, the teachers and the contents do not depend on it."""
    tasks, pixels = SUBTASK_VOTE_TASKS, PATCH_VOTE_PATCH**2
    content = _check_option("content", content, 1)
    teacher = _check_option("teacher", teacher, 1)
    seed = _check_option("seed", seed, 0)
    separation = _check_separation(separation)
    if tasks + content > pixels:
        raise InputError(f"subtask_vote: content must be <= {pixels - tasks} (a 7x7 patch holds "
                         f"{tasks} signatures and the content), got {content}.")
    rng = np.random.default_rng((seed, 0, content, teacher))
    basis = np.linalg.qr(rng.standard_normal((pixels, pixels)))[0].T  # orthonormal rows
    w1 = rng.standard_normal((tasks, content, teacher)) * 2.0 / math.sqrt(content)
    b1 = rng.standard_normal((tasks, teacher)) * 0.5
    w2 = rng.standard_normal((tasks, teacher)) / math.sqrt(teacher)
    probe = rng.standard_normal((200_000, content))
    f = _np_gelu(probe @ w1 + b1[:, None]) @ w2[..., None]  # [K, n, 1]
    deciles = np.quantile(f[..., 0], np.arange(1, 10) / 10, axis=1).T  # [K, 9]
    return SubtaskVoteTeacher(signatures=separation * basis[:tasks],
                              content_basis=basis[tasks:tasks + content], w1=w1, b1=b1, w2=w2,
                              deciles=deciles)


def _check_separation(separation) -> float:
    if isinstance(separation, bool) or not isinstance(separation, (int, float, np.number)) or not separation > 0 \
            or not math.isfinite(separation):
        raise InputError(f"separation must be a finite number > 0 (the signatures' norm), got {separation!r}.")
    return float(separation)


def subtask_vote(split: str = "train", *, content: int = SUBTASK_VOTE_CONTENT,
                 teacher: int = SUBTASK_VOTE_TEACHER, num_train: int = 60000, num_test: int = 10000,
                 seed: int = 0, separation: float = SUBTASK_VOTE_SEPARATION) -> Dataset:
    """A synthetic 10-class image task whose right routing is known: chapter 9's sub-tasks
    in pixels.

    Each 28x28x1 image is a 4x4 grid of 7x7 patches, and each patch belongs to one of K = 8
    sub-tasks. A patch shows two things, on orthogonal directions of its 49 pixels
    (:class:`SubtaskVoteTeacher`): its sub-task's **signature**, a fixed random pattern
    (so a linear router can tell the sub-tasks apart), and a **content** ``z``, a fresh
    ``d``-dimensional Gaussian vector. Its **value** (0..9) is sub-task k's function of the
    content: the decile of ``f_k(z)``, where ``f_k`` is a random GELU MLP ``d -> h -> 1``, a
    different one per sub-task. The label is the value shared by exactly 6 of the 16 patches,
    as in :func:`patch_vote`: the 10 others have other values, none more than 3 times. Per
    image: the label uniform in 0..9, the values of the 16 patches as in :func:`patch_vote`,
    each patch's sub-task uniform in 0..K-1, and its content drawn from ``N(0, I_d)``
    conditioned on the patch's value under its sub-task.

    What it tests: the contents are new in every image (no table can be memorised), so a
    model must compute each patch's value from its content with the right one of K unrelated
    functions. One expert MLP can learn one ``f_k``; one MLP of the same width, the dense
    layer of equal activated FLOPs, has to hold all K. The **right routing** sends every patch
    of sub-task k to one expert, a different expert per sub-task; the signatures make it
    learnable. Whether a learned router finds more of it than a frozen or hashing one is not
    established: in the one pilot run with standardised inputs (one seed), the first MoE layer of
    a frozen Expert Choice router sent more patches home (0.62) than the learned one (0.54).
    :func:`subtask_vote_tasks` gives the
    sub-task of every patch, to measure routing against it
    (:func:`mini_moe.evaluate.routing_accuracy`).

    Deterministic: the teacher depends on ``(content, teacher, seed)``, each split on those
    and its own size; a split is generated once per process (``functools.lru_cache``) and held
    as read-only arrays.

    Args:
      split: ``"train"`` or ``"test"``.
      content: d >= 1 (at most 41), the content's dimension.
      teacher: h >= 1, the width of every teacher MLP (the pilot of issue 34 calibrates it
        against the experts' width).
      num_train, num_test: images per split (>= 1).
      seed: the seed of the teacher and of the images (>= 0).
      separation: the norm of every signature, in content standard deviations (> 0; default 4).
        Smaller values shrink the signatures relative to the content (the contents, values
        and labels stay the same), so a random projection of the pixels sorts fewer patches
        by sub-task; a learned linear map still reads the sub-task exactly at every value,
        the signatures being orthogonal to the content and noise-free (issue 51's pilot
        calibrates it; chapter 9 checks the exact read-out).

    Returns:
      A :class:`Dataset`: ``float32 [N, 28, 28, 1]`` images in ``[0, 1]`` and ``int32 [N]``
      labels; ``name="subtask_vote"``.
    """
    if split not in SPLITS:
        raise InputError(f"subtask_vote: unknown split {split!r}; expected 'train' or 'test'")
    counts = {"train": _check_option("num_train", num_train, 1), "test": _check_option("num_test", num_test, 1)}
    images, labels, _, _ = _subtask_vote_split(content, teacher, counts[split], seed, SPLITS.index(split) + 1,
                                               _check_separation(separation))
    return Dataset(images=images, labels=labels, num_classes=10, name="subtask_vote", split=split)


def subtask_vote_tasks(split: str = "train", *, content: int = SUBTASK_VOTE_CONTENT,
                       teacher: int = SUBTASK_VOTE_TEACHER, num_train: int = 60000, num_test: int = 10000,
                       seed: int = 0, separation: float = SUBTASK_VOTE_SEPARATION) -> tuple[np.ndarray, np.ndarray]:
    """The sub-task and the value of every patch of :func:`subtask_vote`'s split with the same
    arguments: ``(tasks int32 [N, 16], values int32 [N, 16])``, patches in row-major grid order."""
    if split not in SPLITS:
        raise InputError(f"subtask_vote: unknown split {split!r}; expected 'train' or 'test'")
    count = {"train": num_train, "test": num_test}[split]
    _check_option("num_" + split, count, 1)
    _, _, tasks, values = _subtask_vote_split(content, teacher, count, seed, SPLITS.index(split) + 1,
                                              _check_separation(separation))
    return tasks, values


@functools.lru_cache(maxsize=4)
def _subtask_vote_split(content: int, teacher: int, count: int, seed: int, stream: int,
                        separation: float = SUBTASK_VOTE_SEPARATION):
    """``(images, labels, tasks, values)`` of the random stream ``stream`` (1: train, 2: test)."""
    model = subtask_vote_teacher(content, teacher, seed, separation)
    rng = np.random.default_rng((seed, stream, content, teacher))
    labels, values = _vote_values(rng, count)
    tasks = rng.integers(0, SUBTASK_VOTE_TASKS, size=values.shape)
    z = np.empty(values.shape + (content,))
    for k in range(SUBTASK_VOTE_TASKS):  # contents by rejection: draw, keep those of a needed value
        mine = tasks == k
        wanted = values[mine]
        need = np.bincount(wanted, minlength=10)
        found = [np.empty((0, content)) for _ in range(10)]
        while any(len(f) < n for f, n in zip(found, need)):
            draw = rng.standard_normal((int(need.max()) * 12 + 100, content))
            drawn = model.values(k, draw)
            found = [np.concatenate([f, draw[drawn == v][: max(n - len(f), 0)]])
                     for v, (f, n) in enumerate(zip(found, need))]
        out = np.empty((wanted.size, content))
        for v in range(10):
            out[wanted == v] = found[v]
        z[mine] = out
    g, p = PATCH_VOTE_GRID, PATCH_VOTE_PATCH
    images = model.pixels(tasks, z).reshape(count, g, g, p, p).transpose(0, 1, 3, 2, 4)
    images = np.ascontiguousarray(images.reshape(count, g * p, g * p, 1))
    out = (images, labels.astype(np.int32), tasks.astype(np.int32), values.astype(np.int32))
    for array in out:
        array.flags.writeable = False
    return out


# --------------------------------------------------------------------------------------
# Normalisation and batches
# --------------------------------------------------------------------------------------


def validation_split(dataset: Dataset, num_validation: int, *, seed: int = 0) -> tuple[Dataset, Dataset]:
    """Carves ``num_validation`` images out of a training set: ``(train, validation)``, the
    validation images a random subset fixed by ``seed`` (not a run's seed, so every run of a
    study holds out the same images), both in their original order. Choices (a learning rate,
    a stopping step) are made on the validation split, so the test split stays unseen."""
    num_validation = _check_option("num_validation", num_validation, 1)
    if num_validation >= len(dataset):
        raise InputError(f"num_validation must be < {len(dataset)} (the training images), got {num_validation}.")
    held = np.zeros(len(dataset), bool)
    held[np.random.default_rng((seed, 7)).choice(len(dataset), num_validation, replace=False)] = True
    part = lambda mask, split: dataclasses.replace(dataset, images=dataset.images[mask], labels=dataset.labels[mask],
                                                   split=split)
    return part(~held, dataset.split), part(held, "validation")


def normalize(images: np.ndarray, mean: np.ndarray | None = None,
              std: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-channel standardisation ``(images - mean) / std``.

    Compute the statistics on the training images and reuse them for the test images::

        x_train, mean, std = normalize(train.images)
        x_test, _, _ = normalize(test.images, mean, std)

    Args:
      images: ``[..., C]`` (e.g. ``[N, H, W, C]``).
      mean, std: ``[C]``; both default to the statistics of ``images`` over all axes but
        the last (a channel with zero spread gets ``std = 1``).

    Returns:
      ``(normalized float32 [..., C], mean float32 [C], std float32 [C])``.
    """
    images = np.asarray(images, np.float32)
    axes = tuple(range(images.ndim - 1))
    if (mean is None) != (std is None):
        raise InputError("pass both mean and std, or neither")
    if mean is None:
        mean = images.mean(axis=axes, dtype=np.float64)
        std = images.std(axis=axes, dtype=np.float64)
        std = np.where(std > 1e-12, std, 1.0)
    mean = np.asarray(mean, np.float32)
    std = np.asarray(std, np.float32)
    if mean.shape != (images.shape[-1],) or std.shape != (images.shape[-1],):
        raise InputError(f"mean and std must have shape [C] = ({images.shape[-1]},), got "
                         f"{mean.shape} and {std.shape}")
    return (images - mean) / std, mean, std


def num_batches(num_examples: int, batch_size: int, *, drop_remainder: bool = True) -> int:
    """How many batches :func:`batches` yields per epoch."""
    if drop_remainder:
        return num_examples // batch_size
    return -(-num_examples // batch_size)


def batches(data: Dataset | Sequence[np.ndarray], batch_size: int, *, seed: int,
            epoch: int = 0, shuffle: bool = True, drop_remainder: bool = True,
            start: int = 0) -> Iterator[tuple[np.ndarray, ...]]:
    """Iterates over one epoch in batches.

    The permutation of an epoch depends only on ``(seed, epoch)``. To resume a run at
    global step ``s`` (counting from 0), with ``k = num_batches(N, batch_size)`` batches
    per epoch, call ``batches(..., epoch=s // k, start=s % k)`` and then continue with
    the following epochs as usual: the batches are exactly those of an uninterrupted run.

    Args:
      data: a :class:`Dataset` (yields ``(images, labels)``), or a tuple of arrays with a
        common leading axis N (yields a tuple of the same length).
      batch_size: B.
      seed, epoch: select the permutation (``np.random.default_rng((seed, epoch))``).
      shuffle: if False, the batches follow the stored order.
      drop_remainder: drop the last batch if it has fewer than B examples.
      start: index of the first batch to yield within this epoch.

    Yields:
      Tuples of arrays ``[B, ...]`` (the last one may be shorter if not
      ``drop_remainder``).
    """
    arrays = (data.images, data.labels) if isinstance(data, Dataset) else tuple(data)
    if not arrays:
        raise InputError("data must be a Dataset or a non-empty tuple of arrays")
    n = len(arrays[0])
    if any(len(a) != n for a in arrays):
        raise InputError(f"arrays must share their leading axis, got {[len(a) for a in arrays]}")
    if batch_size < 1:
        raise InputError(f"batch_size must be positive, got {batch_size}")
    if drop_remainder and batch_size > n:
        raise InputError(f"batch_size={batch_size} > {n} examples: with drop_remainder=True "
                         "an epoch would be empty")
    if seed < 0 or epoch < 0 or start < 0:
        raise InputError(f"seed, epoch and start must be >= 0, got {seed}, {epoch}, {start}")
    order = np.random.default_rng((seed, epoch)).permutation(n) if shuffle else np.arange(n)
    count = num_batches(n, batch_size, drop_remainder=drop_remainder)

    def generate():
        for b in range(start, count):
            index = order[b * batch_size:(b + 1) * batch_size]
            yield tuple(a[index] for a in arrays)

    return generate()
