"""Tests of mini_moe.data: datasets, batches, augmentation geometry, patch correspondence."""

import dataclasses
import gzip
import struct
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds  # in the "test" extra; needs no TensorFlow

from mini_moe import data


# ---------------------------------------------------------------------------- digits


def test_digits_shapes_range_and_classes():
    train, test = data.load("digits"), data.load("digits", "test")
    assert train.images.shape == (1497, 8, 8, 1) and test.images.shape == (300, 8, 8, 1)
    for ds in (train, test):
        assert ds.images.dtype == np.float32 and ds.labels.dtype == np.int32
        assert ds.images.min() == 0.0 and ds.images.max() == 1.0
        assert ds.num_classes == 10 and ds.image_size == 8 and ds.channels == 1
        assert set(np.unique(ds.labels)) == set(range(10))  # every class in both splits
    assert (train.name, train.split, test.split) == ("digits", "train", "test")


def test_digits_split_is_disjoint_deterministic_and_stratified():
    from sklearn.datasets import load_digits

    train, test = data.load("digits"), data.load("digits", "test")

    def as_bytes(ds):
        return [(x.tobytes(), int(y)) for x, y in zip(ds.images, ds.labels)]

    # Disjoint and complete: together they are exactly the 1797 digits (with multiplicity).
    everything = load_digits()
    full = [((x / 16.0).astype(np.float32)[..., None].tobytes(), int(y))
            for x, y in zip(everything.images, everything.target)]
    assert sorted(as_bytes(train) + as_bytes(test)) == sorted(full)
    train_set = {b for b, _ in as_bytes(train)}
    test_set = {b for b, _ in as_bytes(test)}
    duplicates = len(full) - len({b for b, _ in full})  # identical images in load_digits
    assert len(train_set & test_set) <= duplicates
    # The same on every load.
    again = data.load("digits", "test")
    np.testing.assert_array_equal(again.images, test.images)
    np.testing.assert_array_equal(again.labels, test.labels)
    # Stratified: each class gets its proportional share of the 300, within one.
    share = np.bincount(everything.target, minlength=10) * 300 / 1797
    assert np.all(np.abs(np.bincount(test.labels, minlength=10) - share) <= 1)


def test_unknown_name_or_split_is_a_value_error():
    with pytest.raises(ValueError, match="cifar100"):  # the message lists DATASETS
        data.load("imagenet")
    with pytest.raises(ValueError, match="'train' or 'test'"):
        data.load("digits", "validation")


# ---------------------------------------------------------------------- fashion_mnist


def _write_idx(path, array, gz):
    codes = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C,
             np.float32: 0x0D, np.float64: 0x0E}
    header = bytes([0, 0, codes[array.dtype.type], array.ndim])
    header += struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        payload = gzip.compress(payload)
    path.write_bytes(payload)


def _write_fashion(folder, gz, rng):
    arrays = {}
    for prefix, n in (("train", 7), ("t10k", 5)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        _write_idx(folder / f"{prefix}-images-idx3-ubyte", images, gz)
        _write_idx(folder / f"{prefix}-labels-idx1-ubyte", labels, gz)
        arrays[prefix] = images, labels
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_fashion_mnist_reads_idx_files_exactly(tmp_path, gz):
    arrays = _write_fashion(tmp_path, gz, np.random.default_rng(int(gz)))
    for split, prefix in (("train", "train"), ("test", "t10k")):
        ds = data.load("fashion_mnist", split, data_dir=tmp_path)
        images, labels = arrays[prefix]
        assert ds.images.shape == (len(labels), 28, 28, 1) and ds.images.dtype == np.float32
        np.testing.assert_array_equal(ds.images[..., 0], images.astype(np.float32) / 255)
        np.testing.assert_array_equal(ds.labels, labels.astype(np.int32))
        assert ds.num_classes == 10 and ds.split == split


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.float32, np.float64, np.int8])
def test_read_idx_types_and_bad_files(tmp_path, dtype):
    array = (np.arange(24).reshape(2, 3, 4) - 7).astype(dtype)
    _write_idx(tmp_path / "x-idx3", array, gz=False)
    out = data.read_idx(tmp_path / "x-idx3")
    assert out.dtype == np.dtype(dtype) and out.dtype.isnative
    np.testing.assert_array_equal(out, array)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01" + b"\0" * 8)
    with pytest.raises(ValueError, match="not an IDX file"):
        data.read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes((tmp_path / "x-idx3").read_bytes()[:-1])
    with pytest.raises(ValueError, match="header says shape"):
        data.read_idx(tmp_path / "short")


def test_fashion_mnist_from_the_debian_package():
    if data._find_idx_files(data.FASHION_MNIST_DIR, "test") is None:
        pytest.skip(f"no Fashion-MNIST in {data.FASHION_MNIST_DIR} "
                    "(apt-get install dataset-fashion-mnist)")
    train, test = data.load("fashion_mnist"), data.load("fashion_mnist", "test")
    assert train.images.shape == (60000, 28, 28, 1) and test.images.shape == (10000, 28, 28, 1)
    assert train.num_classes == 10
    np.testing.assert_array_equal(np.bincount(test.labels), np.full(10, 1000))
    assert 0.0 <= test.images.min() and test.images.max() <= 1.0


# ------------------------------------------------- tensorflow-datasets, offline (mocked)


def _mock_tfds(num_examples):
    # USE_CODE: random examples generated from the builder's feature spec, no files.
    return tfds.testing.mock_data(num_examples=num_examples,
                                  policy=tfds.testing.MockPolicy.USE_CODE)


@pytest.mark.parametrize("name,classes", [("cifar10", 10), ("cifar100", 100)])
def test_cifar_through_tfds_data_source_without_tensorflow(tmp_path, name, classes):
    tf_loaded_before = "tensorflow" in sys.modules  # (TensorFlow is not even installed
    with _mock_tfds(12):                              # in the project's test venv)
        ds = data.load(name, "test", data_dir=tmp_path)
    assert tf_loaded_before or "tensorflow" not in sys.modules  # the path never imports TF
    assert ds.images.shape == (12, 32, 32, 3) and ds.images.dtype == np.float32
    assert ds.image_size == 32 and ds.channels == 3 and ds.num_classes == classes
    assert 0.0 <= ds.images.min() and ds.images.max() <= 1.0 and ds.images.std() > 0
    assert ds.labels.dtype == np.int32 and np.all((0 <= ds.labels) & (ds.labels < classes))


def test_fashion_mnist_falls_back_to_tfds(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "FASHION_MNIST_DIR", tmp_path / "missing")
    with _mock_tfds(9):
        ds = data.load("fashion_mnist", "train")  # no IDX folder anywhere -> tfds
        ds2 = data.load("fashion_mnist", "test", data_dir=tmp_path / "empty")
    assert ds.images.shape == (9, 28, 28, 1) and ds2.images.shape == (9, 28, 28, 1)
    assert np.all((0 <= ds.labels) & (ds.labels < 10))


def test_missing_fashion_mnist_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "FASHION_MNIST_DIR", tmp_path / "missing")
    hints = ["apt-get install dataset-fashion-mnist", "tensorflow-datasets", "data_dir="]
    # 1. tensorflow-datasets is not installed.
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(FileNotFoundError) as info:
        data.load("fashion_mnist")
    assert all(h in str(info.value) for h in hints), str(info.value)
    # 2. It is installed, but the download fails (offline).
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", tfds)

    def offline(*args, **kwargs):
        raise ConnectionError("Failed to resolve 'storage.googleapis.com'")

    monkeypatch.setattr(tfds, "data_source", offline)
    with pytest.raises(FileNotFoundError) as info:
        data.load("fashion_mnist", "test")
    assert all(h in str(info.value) for h in hints) and "resolve" in str(info.value)


def test_cifar_without_tfds_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(ImportError, match=r'pip install "mini_moe\[tfds\]"'):
        data.load("cifar10")


# ---------------------------------------------------------------------- patch_vote


def _vote_rule_holds(values, labels):
    """Per image: the label's value appears exactly 6 times, every other value at most 3."""
    counts = (values[..., None] == np.arange(10)).sum(axis=1)  # [N, 10]
    label_count = counts[np.arange(len(labels)), labels]
    counts[np.arange(len(labels)), labels] = 0
    return (label_count == 6) & (counts.max(axis=1) <= 3)


def test_patch_vote_label_rule_holds_for_every_image():
    for split, n in (("train", 60000), ("test", 10000)):
        ds = data.load("patch_vote", split)
        values = data.patch_vote_patch_values(ds.images)  # each patch looked up in the vocabulary
        assert values.shape == (n, 16) and values.min() >= 0  # every patch is a vocabulary patch
        assert _vote_rule_holds(values, ds.labels).all()
        assert set(np.unique(ds.labels)) == set(range(10))
    # The check itself can fail: a label moved to another value breaks the rule.
    assert not _vote_rule_holds(values[:100], (ds.labels[:100] + 1) % 10).any()


def test_patch_vote_shapes_dtypes_and_range():
    train, test = data.load("patch_vote"), data.load("patch_vote", "test")
    assert train.images.shape == (60000, 28, 28, 1) and test.images.shape == (10000, 28, 28, 1)
    for ds in (train, test):
        assert ds.images.dtype == np.float32 and ds.labels.dtype == np.int32
        assert 0.0 <= ds.images.min() and ds.images.max() <= 1.0
        assert ds.num_classes == 10 and ds.image_size == 28 and ds.channels == 1
        assert not ds.images.flags.writeable and not ds.labels.flags.writeable  # a shared cache
    patches, values = data.patch_vote_vocabulary()
    assert patches.shape == (4096, 7, 7) and patches.dtype == np.float32
    assert np.array_equal(np.bincount(values), np.full(10, 4096 // 10) + (np.arange(10) < 4096 % 10))
    z = (patches - 0.5) * 8  # the documented transform of standard Gaussian pixels
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01


def test_patch_vote_is_deterministic_and_splits_share_the_vocabulary():
    a = data.patch_vote("test", vocab_size=64, num_test=500, seed=3)
    data._patch_vote_split.cache_clear()
    data.patch_vote_vocabulary.cache_clear()
    b = data.patch_vote("test", vocab_size=64, num_test=500, seed=3)
    assert a.images is not b.images  # generated again, not the cached arrays
    np.testing.assert_array_equal(a.images, b.images)
    np.testing.assert_array_equal(a.labels, b.labels)
    other = data.patch_vote("test", vocab_size=64, num_test=500, seed=4)
    assert not np.array_equal(other.images, a.images)
    # Train and test images are different draws from the one vocabulary.
    train = data.patch_vote("train", vocab_size=64, num_train=2000, seed=3)
    assert data.patch_vote_patch_values(train.images, 64, 3).min() >= 0
    assert data.patch_vote_patch_values(a.images, 64, 3).min() >= 0
    assert data.patch_vote_patch_values(a.images, 64, 4).max() == -1  # not another seed's vocabulary
    assert not np.array_equal(train.images[:500], a.images)
    # The number of training images does not change the test images, nor the vocabulary.
    np.testing.assert_array_equal(data.patch_vote("test", vocab_size=64, num_train=7, num_test=500, seed=3).images,
                                  a.images)


def test_patch_vote_names_select_the_vocabulary():
    assert data.patch_vote_options("patch_vote") == {"vocab_size": 4096}
    assert data.patch_vote_options("patch_vote_v512") == {"vocab_size": 512}
    assert data.patch_vote_options("patch_vote_512") is None and data.patch_vote_options("digits") is None
    ds = data.load("patch_vote_v100", "test")  # any V, not only the names in DATASETS
    assert ds.name == "patch_vote_v100" and len(ds) == 10000
    values = data.patch_vote_patch_values(ds.images, 100)
    assert values.min() >= 0 and _vote_rule_holds(values, ds.labels).all()
    assert len(np.unique(ds.images.reshape(-1, 4, 7, 4, 7).transpose(0, 1, 3, 2, 4).reshape(-1, 49), axis=0)) == 100
    for name in data.DATASETS:
        if name.startswith("patch_vote"):
            assert data.patch_vote_options(name) is not None


@pytest.mark.parametrize("kwargs, argument", [
    (dict(vocab_size=9), "vocab_size"), (dict(vocab_size=64.0), "vocab_size"), (dict(vocab_size=True), "vocab_size"),
    (dict(num_train=0), "num_train"), (dict(num_test=-5), "num_test"), (dict(seed=-1), "seed"),
    (dict(seed="a"), "seed"),
])
def test_patch_vote_bad_options_name_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        data.patch_vote("train", **kwargs)


def test_patch_vote_bad_names_and_splits():
    with pytest.raises(ValueError, match="vocab_size"):
        data.load("patch_vote_v5")
    with pytest.raises(ValueError, match="patch_vote_v<V>"):
        data.load("patch_vote_x")
    with pytest.raises(ValueError, match="'train' or 'test'"):
        data.patch_vote("validation")


def test_patch_vote_has_its_own_configuration():
    from mini_moe import config

    cfg = config.get_config("quick", dataset="patch_vote", router=None)
    m = cfg.model
    assert (m.image_size, m.channels, m.num_classes, m.patch_size) == (28, 1, 10, 7)  # one patch per token
    assert (m.dim, m.mlp_dim, cfg.steps) == (64, 64, 2000)
    assert config.get_config("quick", dataset="patch_vote_v512", router=None) == dataclasses.replace(
        cfg, dataset="patch_vote_v512")
    # The other datasets keep their quick model.
    fm = config.get_config("quick", dataset="fashion_mnist", router=None)
    assert (fm.model.dim, fm.model.mlp_dim, fm.model.patch_size, fm.steps) == (128, 256, 7, 1500)
    with pytest.raises(ValueError, match="patch_vote_v<V>"):
        config.get_config("quick", dataset="imagenet")


# -------------------------------------------------------------- subtask_vote


def _recover(images, teacher):
    """Sub-task and content of every patch, read back from the pixels through the documented
    map ``pixels = 0.5 + (signature_k + z @ basis) / 8`` (the signatures and the content basis
    are orthonormal directions, so projections separate them)."""
    x = (np.asarray(images, np.float64).reshape(-1, 4, 7, 4, 7).transpose(0, 1, 3, 2, 4).reshape(-1, 16, 49)
         - 0.5) * 8
    return np.argmax(x @ teacher.signatures.T, -1), x @ teacher.content_basis.T


def test_subtask_vote_label_rule_and_right_routing_hold():
    ds = data.subtask_vote("test", content=4, teacher=8, num_test=2000, seed=1)
    tasks, values = data.subtask_vote_tasks("test", content=4, teacher=8, num_test=2000, seed=1)
    assert ds.images.shape == (2000, 28, 28, 1) and ds.images.dtype == np.float32 and ds.labels.dtype == np.int32
    assert 0 <= ds.images.min() and ds.images.max() <= 1 and not ds.images.flags.writeable
    assert _vote_rule_holds(values, ds.labels).all()
    assert not _vote_rule_holds(values[:100], (ds.labels[:100] + 1) % 10).any()
    teacher = data.subtask_vote_teacher(4, 8, 1)
    # The sub-task is what the signature shows, and the value is that sub-task's teacher applied to
    # the content the pixels carry (float32 pixels move a content by ~1e-7: a value may flip only
    # for a content that close to a decile, far fewer than 1 in 1,000).
    seen, content = _recover(ds.images, teacher)
    np.testing.assert_array_equal(seen, tasks)
    recomputed = np.empty_like(values)
    for k in range(8):
        recomputed[tasks == k] = teacher.values(k, content[tasks == k])
    assert np.mean(recomputed == values) > 0.999
    # Each sub-task is 1/8 of the patches; within a sub-task every value 1/10 (5 binomial SDs).
    n = tasks.size
    assert np.all(np.abs(np.bincount(tasks.ravel(), minlength=8) - n / 8) < 5 * np.sqrt(n / 8 * 7 / 8))
    # The signatures and the content basis are orthonormal rows, the signatures of norm 4.
    rows = np.concatenate([teacher.signatures / data.SUBTASK_VOTE_SEPARATION, teacher.content_basis])
    np.testing.assert_allclose(rows @ rows.T, np.eye(12), atol=1e-12)
    # The deciles split a fresh Gaussian sample into ten equal parts, for every teacher.
    z = np.random.default_rng(5).standard_normal((50_000, 4))
    for k in range(8):
        share = np.bincount(teacher.values(k, z), minlength=10) / len(z)
        assert np.all(np.abs(share - 0.1) < 5 * np.sqrt(0.1 * 0.9 / len(z))), (k, share)


def test_subtask_vote_teachers_differ_so_one_function_cannot_serve_every_sub_task():
    teacher = data.subtask_vote_teacher(4, 16, 0)
    z = np.random.default_rng(0).standard_normal((20_000, 4))
    values = np.stack([teacher.values(k, z) for k in range(8)])  # [K, n]: the same contents, each teacher
    agree = (values[:, None] == values[None]).mean(-1)
    off = agree[~np.eye(8, dtype=bool)]
    assert off.max() < 0.5, agree  # two sub-tasks' values of one content mostly differ (chance is 0.1)


def test_subtask_vote_is_deterministic_and_names_select_the_teacher():
    a = data.subtask_vote("test", num_test=300, seed=2, content=3, teacher=5)
    data._subtask_vote_split.cache_clear()
    data.subtask_vote_teacher.cache_clear()
    b = data.subtask_vote("test", num_test=300, seed=2, content=3, teacher=5)
    assert a.images is not b.images
    np.testing.assert_array_equal(a.images, b.images)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert not np.array_equal(data.subtask_vote("test", num_test=300, seed=3, content=3, teacher=5).images, a.images)
    assert not np.array_equal(data.subtask_vote("train", num_train=300, seed=2, content=3, teacher=5).images, a.images)
    assert data.subtask_vote_options("subtask_vote") == {}
    assert data.subtask_vote_options("subtask_vote_d4_h16") == {"content": 4, "teacher": 16}
    assert data.subtask_vote_options("subtask_vote_h8") == {"teacher": 8}
    assert data.subtask_vote_options("subtask_vote_x") is None
    ds = data.load("subtask_vote_d3_h5", "test")
    assert ds.name == "subtask_vote_d3_h5" and len(ds) == 10000
    with pytest.raises(ValueError, match="content must be <= 41"):
        data.subtask_vote_teacher(content=42)
    with pytest.raises(ValueError, match="teacher must be an integer >= 1"):
        data.subtask_vote("test", teacher=0)
    with pytest.raises(ValueError, match="subtask_vote_d<d>_h<h>"):
        data.load("subtask_votes")


def test_subtask_vote_separation_shrinks_only_the_signatures():
    """``separation`` (issue 51) scales the signatures and nothing else: the same contents,
    values, sub-tasks and labels, and every patch's projection on the signature directions
    scaled by the ratio of separations."""
    kw = dict(content=3, teacher=5, num_test=200, seed=4)
    a, b = data.subtask_vote("test", **kw), data.subtask_vote("test", separation=1.5, **kw)
    assert np.array_equal(a.labels, b.labels)
    for left, right in zip(data.subtask_vote_tasks("test", **kw), data.subtask_vote_tasks("test", separation=1.5, **kw)):
        assert np.array_equal(left, right)
    wide, narrow = data.subtask_vote_teacher(3, 5, 4), data.subtask_vote_teacher(3, 5, 4, 1.5)
    np.testing.assert_allclose(narrow.signatures * 4.0 / 1.5, wide.signatures, atol=1e-12)
    assert np.array_equal(narrow.content_basis, wide.content_basis) and np.array_equal(narrow.w1, wide.w1)
    directions = wide.signatures / data.SUBTASK_VOTE_SEPARATION  # orthonormal rows
    tasks, _ = data.subtask_vote_tasks("test", **kw)
    grid = lambda ds: ds.images[..., 0].reshape(-1, 4, 7, 4, 7).transpose(0, 1, 3, 2, 4).reshape(len(ds), 16, 49)
    # unclipped pixels are 0.5 + x / 8: the signature part is 8 * (pixels - 0.5) projected
    for ds, sep in ((a, 4.0), (b, 1.5)):
        x = 8 * (grid(ds).astype(np.float64) - 0.5)
        on_own = np.take_along_axis(x @ directions.T, tasks[..., None], axis=-1)[..., 0]
        unclipped = (np.abs(grid(ds) - 0.5) < 0.49).all(-1)
        np.testing.assert_allclose(on_own[unclipped], sep, atol=1e-5)
    assert data.subtask_vote_options("subtask_vote_d4_h16_s1.5") == {"content": 4, "teacher": 16, "separation": 1.5}
    assert data.subtask_vote_options("subtask_vote_s2") == {"separation": 2.0}
    assert data.subtask_vote_options("subtask_vote_s-1") is None
    with pytest.raises(ValueError, match="separation must be a finite number > 0"):
        data.subtask_vote("test", separation=0.0)


def test_subtask_vote_has_patch_votes_configuration():
    from mini_moe import config

    cfg = config.get_config("quick", dataset="subtask_vote_d4_h16", router=None)
    vote = config.get_config("quick", dataset="patch_vote", router=None)
    assert cfg == dataclasses.replace(vote, dataset="subtask_vote_d4_h16")


def test_validation_split_is_disjoint_fixed_and_checked():
    train = data.patch_vote("train", vocab_size=64, num_train=1000)
    part, held = data.validation_split(train, 200)
    assert len(part) == 800 and len(held) == 200 and held.split == "validation" and part.split == "train"
    keys = lambda d: {x.tobytes() for x in d.images}  # every image is distinct, so bytes identify it
    assert keys(part).isdisjoint(keys(held)) and keys(part) | keys(held) == keys(train)
    again, held_again = data.validation_split(train, 200)
    np.testing.assert_array_equal(held.images, held_again.images)
    assert not np.array_equal(data.validation_split(train, 200, seed=1)[1].images, held.images)
    with pytest.raises(ValueError, match="num_validation must be < 1000"):
        data.validation_split(train, 1000)


# -------------------------------------------------------------- normalize and batches


def test_normalize_uses_train_statistics_for_test():
    rng = np.random.default_rng(0)
    train = rng.uniform(size=(50, 4, 4, 3)).astype(np.float32) * [1, 2, 3] + [0, 1, 5]
    test = rng.uniform(size=(20, 4, 4, 3)).astype(np.float32)
    x, mean, std = data.normalize(train)
    assert mean.shape == std.shape == (3,) and x.dtype == np.float32
    np.testing.assert_allclose(x.mean(axis=(0, 1, 2)), 0, atol=1e-5)
    np.testing.assert_allclose(x.std(axis=(0, 1, 2)), 1, atol=1e-5)
    y, mean2, std2 = data.normalize(test, mean, std)
    np.testing.assert_allclose(y, (test - mean) / std, rtol=1e-6)
    assert np.array_equal(mean2, mean) and np.array_equal(std2, std)
    constant, _, std_c = data.normalize(np.ones((3, 2, 2, 1), np.float32))
    assert std_c[0] == 1 and np.all(constant == 0)  # no division by zero


@pytest.mark.parametrize("n,batch_size", [(10, 3), (12, 4), (7, 7), (5, 8)])
def test_batches_cover_every_example_once_per_epoch(n, batch_size):
    images, labels = np.arange(n)[:, None] * 10, np.arange(n)
    got = list(data.batches((images, labels), batch_size, seed=3, drop_remainder=False))
    assert len(got) == data.num_batches(n, batch_size, drop_remainder=False)
    assert all(len(b[1]) == batch_size for b in got[:-1])
    seen = np.concatenate([b[1] for b in got])
    assert sorted(seen) == list(range(n))
    np.testing.assert_array_equal(np.concatenate([b[0] for b in got])[:, 0], seen * 10)


def test_batches_order_depends_only_on_seed_and_epoch():
    ds = data.load("digits", "test")

    def order(**kw):
        return np.concatenate(
            [lab for _, lab in data.batches((np.arange(300), np.arange(300)), 32, **kw)])

    assert np.array_equal(order(seed=0, epoch=1), order(seed=0, epoch=1))
    assert not np.array_equal(order(seed=0, epoch=1), order(seed=0, epoch=2))
    assert not np.array_equal(order(seed=0, epoch=1), order(seed=1, epoch=1))
    assert np.array_equal(order(seed=0, shuffle=False), np.arange(9 * 32))
    # drop_remainder: 300 // 32 = 9 full batches; a Dataset yields (images, labels).
    got = list(data.batches(ds, 32, seed=0))
    assert len(got) == 9 and all(x.shape == (32, 8, 8, 1) and y.shape == (32,) for x, y in got)
    # Resuming at batch 4 of the epoch gives the rest of the uninterrupted epoch.
    rest = list(data.batches(ds, 32, seed=0, start=4))
    assert len(rest) == 5 and all(np.array_equal(a[1], b[1]) for a, b in zip(rest, got[4:]))
    with pytest.raises(ValueError, match="batch_size"):
        data.batches(ds, 301, seed=0)
