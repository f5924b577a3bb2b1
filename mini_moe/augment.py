"""Augmentation with known geometry (paper 004, Section III.C).

:func:`random_resized_crop` returns each view together with its geometry, a
:class:`CropTransform`, so that Pairwise Router Consistency can match the patches of two views
of one image (:func:`patch_correspondence`). Plain NumPy, like :mod:`mini_moe.data`.

Coordinates. Image coordinates are continuous ``(y, x)`` pairs in pixel units: pixel
``(i, j)`` covers ``[i, i + 1) x [j, j + 1)`` and its centre is ``(i + 0.5, j + 0.5)``
(the "half-pixel" convention of ``jax.image.resize`` and torchvision). A crop box
``(top, left, height, width)`` is given in the source image's coordinates, and the view of
size ``S x S`` is the box stretched onto ``[0, S) x [0, S)`` (then mirrored left-right if
``flip``), so every coordinate map here is an exact affine map of the plane.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from mini_moe.validate import InputError

__all__ = ["CropTransform", "random_resized_crop", "resample", "to_source", "from_source", "view_resolution",
           "patch_correspondence"]



class CropTransform(NamedTuple):
    """Where each view came from: a crop box of the source image and a flip flag.

    All fields are arrays of shape ``[B]``. The box ``(top, left, height, width)`` is in
    the source image's continuous pixel coordinates (see the module docstring); the view
    of size ``S x S`` shows the box stretched to ``[0, S) x [0, S)``, mirrored left-right
    when ``flip``. :func:`to_source` and :func:`from_source` apply the map.
    """

    top: np.ndarray     # float64 [B]
    left: np.ndarray    # float64 [B]
    height: np.ndarray  # float64 [B]
    width: np.ndarray   # float64 [B]
    flip: np.ndarray    # bool [B]

    @classmethod
    def full(cls, batch: int, height: float, width: float, *, flip: Any = False
             ) -> "CropTransform":
        """The whole ``height x width`` image, optionally flipped (bool or bool ``[B]``)."""
        return cls(np.zeros(batch), np.zeros(batch), np.full(batch, float(height)),
                   np.full(batch, float(width)), np.broadcast_to(np.asarray(flip, bool), (batch,)))


def to_source(transforms: CropTransform, yx: np.ndarray, *, out_size: int) -> np.ndarray:
    """Maps view coordinates to source-image coordinates.

    Args:
      transforms: the views' :class:`CropTransform` (fields ``[B]``).
      yx: ``[B, K, 2]`` or ``[K, 2]`` (the same points for every view): continuous
        ``(y, x)`` coordinates in the ``out_size x out_size`` view; the centre of view
        pixel ``(i, j)`` is ``(i + 0.5, j + 0.5)``.
      out_size: S, the side of the views.

    Returns:
      ``float64 [B, K, 2]``: the same points in source-image coordinates.
    """
    t = _fields(transforms)
    yx = np.asarray(yx, np.float64)
    y, x = yx[..., 0], yx[..., 1]
    x = np.where(t.flip[:, None], out_size - x, x)
    return np.stack([t.top[:, None] + y * (t.height[:, None] / out_size),
                     t.left[:, None] + x * (t.width[:, None] / out_size)], axis=-1)


def from_source(transforms: CropTransform, yx: np.ndarray, *, out_size: int) -> np.ndarray:
    """The inverse of :func:`to_source`: source coordinates ``[B, K, 2]`` (or ``[K, 2]``)
    to view coordinates ``float64 [B, K, 2]`` (outside ``[0, out_size)`` = not in view)."""
    t = _fields(transforms)
    yx = np.asarray(yx, np.float64)
    y = (yx[..., 0] - t.top[:, None]) * (out_size / t.height[:, None])
    x = (yx[..., 1] - t.left[:, None]) * (out_size / t.width[:, None])
    x = np.where(t.flip[:, None], out_size - x, x)
    return np.stack([y, x], axis=-1)


def _fields(transforms: CropTransform) -> CropTransform:
    return CropTransform(*(np.asarray(f, np.float64) for f in transforms[:4]),
                         np.asarray(transforms.flip, bool))


def resample(images: np.ndarray, transforms: CropTransform, *, out_size: int) -> np.ndarray:
    """Renders each view: its crop box resized to ``out_size x out_size`` (then flipped).

    Bilinear interpolation at the source point of every view pixel centre (half-pixel
    convention, edges replicated), vectorised over the batch. The crop is axis-aligned,
    so interpolation is separable: rows first, then columns.

    Args:
      images: ``[B, H, W, C]`` (any real dtype).
      transforms: :class:`CropTransform` with fields ``[B]``.
      out_size: S.

    Returns:
      ``float32 [B, S, S, C]``.
    """
    images = np.asarray(images, np.float32)
    if images.ndim != 4:
        raise InputError(f"images must be [B, H, W, C], got shape {images.shape}")
    b, h, w, _ = images.shape
    centres = np.arange(out_size) + 0.5
    grid = np.stack([centres, centres], axis=-1)          # [S, 2]: (y_i, x_i) for i < S
    src = to_source(transforms, grid, out_size=out_size)  # [B, S, 2]
    if src.shape[0] != b:
        raise InputError(f"transforms describe {src.shape[0]} views, images has {b}")
    y0, y1, wy = _bilinear_taps(src[..., 0], h)           # [B, S] each
    x0, x1, wx = _bilinear_taps(src[..., 1], w)
    bi = np.arange(b)[:, None]
    rows = (images[bi, y0] * (1 - wy)[..., None, None]
            + images[bi, y1] * wy[..., None, None])       # [B, S, W, C]
    bi, si = bi[:, :, None], np.arange(out_size)[None, :, None]
    return (rows[bi, si, x0[:, None, :]] * (1 - wx)[:, None, :, None]
            + rows[bi, si, x1[:, None, :]] * wx[:, None, :, None])  # [B, S, S, C]


def _bilinear_taps(coord: np.ndarray, size: int):
    """Neighbouring pixel indices and the weight of the second one, edges replicated."""
    f = np.clip(coord - 0.5, 0.0, size - 1)  # continuous index: pixel i has centre i + 0.5
    i0 = np.floor(f).astype(np.int64)
    i1 = np.minimum(i0 + 1, size - 1)
    return i0, i1, (f - i0).astype(np.float32)


def random_resized_crop(rng: np.random.Generator, images: np.ndarray, *, out_size: int,
                        scale: tuple[float, float] = (0.35, 1.0),
                        ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = True
                        ) -> tuple[np.ndarray, CropTransform]:
    """Inception-style random crop, resized to ``out_size``, with a random horizontal flip.

    The box is drawn as in torchvision's ``RandomResizedCrop``: area ``~ U(scale) * H * W``,
    aspect ``w / h ~ logU(ratio)``, integer sides and position, 10 attempts per image, then
    a centre crop (of the whole image clipped to ``ratio``) for images where all failed.
    With ``flip``, each view is mirrored with probability 1/2.

    Args:
      rng: a ``np.random.Generator`` (all randomness comes from it).
      images: ``[B, H, W, C]``.
      out_size: S, the side of the square views.
      scale, ratio: ranges of the box's area fraction and of its aspect ratio w / h.
      flip: whether to flip at random.

    Returns:
      ``(views float32 [B, S, S, C], transforms)``: a :class:`CropTransform` with one box
      and flip flag per image; ``to_source(transforms, yx, out_size=S)`` maps view
      coordinates back to the source image.
    """
    images = np.asarray(images)
    if images.ndim != 4:
        raise InputError(f"images must be [B, H, W, C], got shape {images.shape}")
    if not (0 < scale[0] <= scale[1] <= 1) or not (0 < ratio[0] <= ratio[1]):
        raise InputError(f"need 0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= ratio[1], "
                         f"got scale={scale}, ratio={ratio}")
    b, h, w, _ = images.shape
    attempts = 10
    area = h * w * rng.uniform(scale[0], scale[1], size=(b, attempts))
    aspect = np.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1]), size=(b, attempts)))
    ws = np.round(np.sqrt(area * aspect))
    hs = np.round(np.sqrt(area / aspect))
    ok = (ws >= 1) & (ws <= w) & (hs >= 1) & (hs <= h)
    first = np.argmax(ok, axis=1)
    crop_h = hs[np.arange(b), first]
    crop_w = ws[np.arange(b), first]
    # Fallback (as torchvision): the largest centred box of the image with aspect in ratio.
    aspect_img = w / h
    if aspect_img < ratio[0]:
        fb_w, fb_h = w, round(w / ratio[0])
    elif aspect_img > ratio[1]:
        fb_w, fb_h = round(h * ratio[1]), h
    else:
        fb_w, fb_h = w, h
    failed = ~ok.any(axis=1)
    crop_h = np.where(failed, fb_h, crop_h)
    crop_w = np.where(failed, fb_w, crop_w)
    top = rng.integers(0, h - crop_h.astype(np.int64) + 1).astype(np.float64)
    left = rng.integers(0, w - crop_w.astype(np.int64) + 1).astype(np.float64)
    top = np.where(failed, (h - fb_h) // 2, top)
    left = np.where(failed, (w - fb_w) // 2, left)
    flips = rng.random(b) < 0.5 if flip else np.zeros(b, bool)
    transforms = CropTransform(top, left, crop_h, crop_w, flips)
    return resample(images, transforms, out_size=out_size), transforms


def view_resolution(transforms: CropTransform, *, out_size: int) -> np.ndarray:
    """``float64 [B]``: view pixels per source pixel (geometric mean over y and x).

    Paper 004 makes the higher-resolution view of each pair "image 1" of
    :func:`patch_correspondence`, which keeps the most corresponding patches.
    """
    t = _fields(transforms)
    return out_size / np.sqrt(t.height * t.width)


def patch_correspondence(transforms1: CropTransform, transforms2: CropTransform, *,
                         out_size1: int, out_size2: int, patch_size: int
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Matches every patch of view 1 with the nearest patch of view 2 (paper 004, III.C).

    Each view-1 patch centre is mapped to the source image (``transforms1``), then into
    view 2's pixel grid (``transforms2``); its partner is the view-2 patch whose centre is
    nearest there, i.e. the patch containing the point (clipped to the grid). The map is
    asymmetric: paper 004 calls the higher-resolution view of a pair "image 1" (see
    :func:`view_resolution`); ordering the two views is the caller's job.

    Args:
      transforms1, transforms2: :class:`CropTransform` of the two views (fields ``[B]``).
      out_size1, out_size2: sides S1, S2 of the views; multiples of ``patch_size``.
      patch_size: side of the (ViT) patches, the same in both views.

    Returns:
      ``(index int32 [B, P1], valid bool [B, P1])`` with ``P1 = (S1 // patch_size) ** 2``,
      patches numbered row-major: ``index[b, p1]`` is the row-major index of view 2's
      patch matched to view 1's patch ``p1``; ``valid[b, p1]`` says whether the point
      lies inside view 2 (the pair ``(p1, index)`` belongs to U_x of eq. 3).
    """
    for name, size in (("out_size1", out_size1), ("out_size2", out_size2)):
        if size % patch_size:
            raise InputError(f"{name}={size} must be a multiple of patch_size={patch_size}")
    n1, n2 = out_size1 // patch_size, out_size2 // patch_size
    c = (np.arange(n1) + 0.5) * patch_size
    yx1 = np.stack(np.meshgrid(c, c, indexing="ij"), axis=-1).reshape(-1, 2)  # [P1, 2]
    yx2 = from_source(transforms2, to_source(transforms1, yx1, out_size=out_size1),
                      out_size=out_size2)                                     # [B, P1, 2]
    valid = np.all((yx2 >= 0) & (yx2 < out_size2), axis=-1)
    ij = np.clip(np.floor(yx2 / patch_size), 0, n2 - 1).astype(np.int32)
    return ij[..., 0] * n2 + ij[..., 1], valid
