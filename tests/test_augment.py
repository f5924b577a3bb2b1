"""mini_moe.augment: random resized crops with known geometry and paper 004's patch correspondences."""


import numpy as np
import pytest

from mini_moe import augment, data

def _ramp(batch, h, w):
    """Channel 0 = y and channel 1 = x coordinate of each pixel centre."""
    y, x = np.meshgrid(np.arange(h) + 0.5, np.arange(w) + 0.5, indexing="ij")
    return np.broadcast_to(np.stack([y, x], -1), (batch, h, w, 2)).astype(np.float32)


def test_random_resized_crop_identity_and_flip():
    rng = np.random.default_rng(0)
    images = rng.uniform(size=(16, 28, 28, 3)).astype(np.float32)
    views, t = augment.random_resized_crop(rng, images, out_size=28, scale=(1, 1),
                                        ratio=(1, 1), flip=False)
    np.testing.assert_array_equal(views, images)
    assert np.all(t.top == 0) and np.all(t.height == 28) and not t.flip.any()
    views, t = augment.random_resized_crop(rng, images, out_size=28, scale=(1, 1), ratio=(1, 1))
    assert 0 < t.flip.sum() < 16  # flip=True mirrors about half the views
    expected = np.where(t.flip[:, None, None, None], images[:, :, ::-1], images)
    np.testing.assert_array_equal(views, expected)
    forced = augment.resample(images, augment.CropTransform.full(16, 28, 28, flip=True), out_size=28)
    np.testing.assert_array_equal(forced, images[:, :, ::-1])


def test_random_resized_crop_boxes_follow_scale_and_ratio():
    rng = np.random.default_rng(1)
    _, t = augment.random_resized_crop(rng, np.zeros((500, 32, 24, 1)), out_size=16,
                                    scale=(0.35, 1.0), ratio=(3 / 4, 4 / 3))
    assert np.all(t.top >= 0) and np.all(t.left >= 0)
    assert np.all(t.top + t.height <= 32) and np.all(t.left + t.width <= 24)
    area = t.height * t.width / (32 * 24)
    assert area.min() >= 0.3 and area.max() <= 1.0  # integer rounding of the sides
    assert np.all((t.width / t.height > 0.7) & (t.width / t.height < 1.4))
    # Reproducible from the generator's seed.
    _, t2 = augment.random_resized_crop(np.random.default_rng(1), np.zeros((500, 32, 24, 1)),
                                     out_size=16)
    assert all(np.array_equal(a, b) for a, b in zip(t, t2))


def test_to_source_says_where_interpolated_values_came_from():
    rng = np.random.default_rng(2)
    for out_size in (12, 28, 40):  # downsampling and upsampling
        images = _ramp(64, 28, 20)
        views, t = augment.random_resized_crop(rng, images, out_size=out_size)
        centres = np.arange(out_size) + 0.5
        grid = np.stack(np.meshgrid(centres, centres, indexing="ij"), -1).reshape(-1, 2)
        src = augment.to_source(t, grid, out_size=out_size).reshape(64, out_size, out_size, 2)
        # A bilinear sample of a linear ramp is the coordinate itself (edges replicated).
        expected = np.clip(src, 0.5, np.array([28, 20]) - 0.5)
        np.testing.assert_allclose(views, expected, atol=1e-4)
        back = augment.from_source(t, src.reshape(64, -1, 2), out_size=out_size)
        np.testing.assert_allclose(back, np.broadcast_to(grid, back.shape), atol=1e-9)


def test_resample_matches_jax_image_resize_when_upsampling():
    import jax

    rng = np.random.default_rng(3)
    images = rng.uniform(size=(4, 8, 8, 2)).astype(np.float32)
    ours = augment.resample(images, augment.CropTransform.full(4, 8, 8), out_size=20)
    theirs = jax.image.resize(images, (4, 20, 20, 2), method="linear")
    np.testing.assert_allclose(ours, np.asarray(theirs), atol=1e-5)


# ------------------------------------------------------------- patch correspondence


def test_patch_correspondence_identity_and_mirror():
    b, s, ps = 3, 28, 4
    n = s // ps
    t = augment.CropTransform(np.array([0.0, 2, 5]), np.array([0.0, 3, 1]),
                           np.array([28.0, 20, 14]), np.array([28.0, 21, 16]),
                           np.array([False, True, False]))
    index, valid = augment.patch_correspondence(t, t, out_size1=s, out_size2=s, patch_size=ps)
    assert index.shape == valid.shape == (b, n * n) and index.dtype == np.int32
    np.testing.assert_array_equal(index, np.broadcast_to(np.arange(n * n), (b, n * n)))
    assert valid.all()
    mirrored = t._replace(flip=~t.flip)
    index, valid = augment.patch_correspondence(t, mirrored, out_size1=s, out_size2=s,
                                             patch_size=ps)
    i, j = np.divmod(np.arange(n * n), n)
    np.testing.assert_array_equal(index, np.broadcast_to(i * n + (n - 1 - j), (b, n * n)))
    assert valid.all()


def test_patch_correspondence_of_a_known_crop():
    # View 1 is the whole 16x16 image; view 2 its top-left quarter, upsampled to 16x16.
    s, ps, n = 16, 4, 4
    full = augment.CropTransform.full(1, 16, 16)
    quarter = augment.CropTransform(np.zeros(1), np.zeros(1), np.full(1, 8.0), np.full(1, 8.0),
                                 np.zeros(1, bool))
    index, valid = augment.patch_correspondence(full, quarter, out_size1=s, out_size2=s,
                                             patch_size=ps)
    i, j = np.divmod(np.arange(n * n), n)
    inside = (i < 2) & (j < 2)
    np.testing.assert_array_equal(valid[0], inside)
    # Patch (i, j) of view 1 has centre 4i + 2 -> 8i + 4 in view 2: view-2 patch 2i + 1.
    np.testing.assert_array_equal(index[0][inside], ((2 * i + 1) * n + 2 * j + 1)[inside])
    # The reverse direction: each view-2 patch lies inside view-1 patch (i // 2, j // 2).
    index, valid = augment.patch_correspondence(quarter, full, out_size1=s, out_size2=s,
                                             patch_size=ps)
    assert valid.all()
    np.testing.assert_array_equal(index[0], (i // 2) * n + j // 2)
    assert augment.view_resolution(quarter, out_size=s)[0] == 2 * augment.view_resolution(
        full, out_size=s)[0]


def test_patch_correspondence_picks_the_nearest_patch_centre():
    rng = np.random.default_rng(4)
    images = np.zeros((32, 32, 32, 3), np.float32)
    _, t1 = augment.random_resized_crop(rng, images, out_size=32)
    _, t2 = augment.random_resized_crop(rng, images, out_size=24)
    index, valid = augment.patch_correspondence(t1, t2, out_size1=32, out_size2=24, patch_size=8)
    c1 = (np.arange(4) + 0.5) * 8
    c2 = (np.arange(3) + 0.5) * 8
    yx1 = np.stack(np.meshgrid(c1, c1, indexing="ij"), -1).reshape(-1, 2)
    yx2 = np.stack(np.meshgrid(c2, c2, indexing="ij"), -1).reshape(-1, 2)
    point = augment.from_source(t2, augment.to_source(t1, yx1, out_size=32), out_size=24)  # [B,16,2]
    dist = np.linalg.norm(point[:, :, None] - yx2[None, None], axis=-1)             # [B,16,9]
    chosen = np.take_along_axis(dist, index[..., None].astype(np.int64), -1)[..., 0]
    np.testing.assert_allclose(chosen[valid], dist.min(-1)[valid], atol=1e-9)
    np.testing.assert_array_equal(valid, np.all((point >= 0) & (point < 24), -1))
    assert 0 < valid.mean() < 1
    with pytest.raises(ValueError, match="multiple of patch_size"):
        augment.patch_correspondence(t1, t2, out_size1=30, out_size2=24, patch_size=8)


def test_names_moved_in_0_2_are_gone_from_data_since_0_4():
    for name in ("CropTransform", "random_resized_crop", "patch_correspondence"):
        assert hasattr(augment, name) and not hasattr(data, name)
