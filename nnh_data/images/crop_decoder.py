"""Decode only what a crop needs: one sample's crop, resized and flipped, from its image bytes.

:func:`decode_crop` gives the pixels of :func:`decode_crop_reference` (decode the whole image
with Pillow, crop :func:`~nnh_data.augment.params.crop_box`, resize to ``size x size`` with
Pillow's BILINEAR filter, flip) for less work, since the parameters are known before the bytes
are read. A plain JPEG (8-bit, one or three components, ending with its EOI marker) goes to the
cheapest of the installed backends of :mod:`~nnh_data.images.jpeg_backends` for its crop, by a
measured cost model: the rows down to the crop's bottom at the largest DCT scale the output
allows (simplejpeg, else Pillow's ``draft``), or the crop's box alone at full scale
(nvImageCodec's CPU decoder). Everything else (PNG, WebP, CMYK and YCCK JPEGs, truncated files,
and a JPEG a backend calls damaged) is decoded whole, at a DCT scale for JPEGs, so what decodes
and what raises is the reference's. Damage inside the entropy-coded data of a complete file
decodes to wrong blocks, as in Pillow, which passes libjpeg's warnings; only where Pillow raises
on a marker inside a scan, the backends' lenient decode of the rows does not. An unscaled crop
is resized from its exact pixel box by torch's antialiased bilinear uint8 kernel (Pillow's
filter, 2-5x its speed); a scaled one from its box divided by the scale (libjpeg's scaled pixel
``j`` covers source pixels ``[s j, s (j + 1))``) by Pillow. The same inputs give the same bytes
for a given set of installed backends.

Quality against the reference on ``tools/bench/images.py``'s corpora: mean PSNR 75 dB
(ImageNet-sized) and 60 dB (1,500-3,000 px), at least 37.9 dB on every image. The floor of the
speed: the Huffman pass over the rows that must be read, which no decoder skips (measured per
image by that script's ``floor``). EXIF orientation is ignored, as by the reference, Pillow's
``Image.open``, webdataset and torchvision's decoders: boxes refer to the stored pixels.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from nnh_data.augment.params import crop_box
from nnh_data.checks import check_int
from nnh_data.images.jpeg_backends import SCALES, cheapest, crop_job, installed_backends

__all__ = ["decode_crop", "decode_crop_reference", "is_jpeg", "jpeg_backend_names"]

_JPEG_MAGIC = b"\xff\xd8\xff"
_SIMPLEJPEG_SPACES = ("YCbCr", "Gray", "RGB")  # simplejpeg converts these to RGB itself


def is_jpeg(data: bytes) -> bool:
    """Whether ``data`` starts like a JPEG file (SOI then a marker)."""
    return bytes(data[:3]) == _JPEG_MAGIC


def jpeg_backend_names() -> tuple[str, ...]:
    """The JPEG backends :func:`decode_crop` chooses among here (``pillow`` always)."""
    return tuple(backend.name for backend in installed_backends())


def decode_crop(data: bytes, params: Mapping[str, Any], size: int) -> np.ndarray:
    """The ``size x size`` RGB crop of one sample: an ``(size, size, 3)`` uint8 array.

    Args:
        data: the encoded image (JPEG, PNG, WebP, PPM, or any format Pillow reads).
        params: the sample's parameters (its ``__aug__``), with ``crop_x``, ``crop_y``,
            ``crop_w``, ``crop_h`` and ``flip`` (as the ``imagenet`` preset makes them); without
            them, the whole image, unflipped.
        size: the output side in pixels.

    Raises ``ValueError`` (or Pillow's ``OSError``) for bytes that are not a readable image.

    Example:
        >>> from nnh_data.augment.params import gen_augmentation_params, get_preset
        >>> params = gen_augmentation_params(7, get_preset("imagenet"))
        >>> decode_crop(jpeg_bytes, params, 224).shape  # doctest: +SKIP
        (224, 224, 3)
    """
    size = check_int("size", size, low=1)
    job = crop_job(data, params, size) if is_jpeg(data) else None
    if job is not None:
        backend = cheapest(job, installed_backends())
        pixels = backend.decode(data, job)
        if pixels is not None:
            left, top, right, bottom = job.box
            if backend.region:
                box = (0, 0, right - left, bottom - top)
                return _flipped(_resize_exact(pixels, box, size), params)
            return _flipped(_resize_scaled(pixels, job.box, job.scale, size), params)
    array, (width, height), scale = _decode_whole(data, params, size)
    return _flipped(_resize_scaled(array, crop_box(params, width, height), scale, size), params)


def decode_crop_reference(data: bytes, params: Mapping[str, Any], size: int) -> np.ndarray:
    """What :func:`decode_crop` computes, the plain way: Pillow decodes the whole image, then
    crops the box, resizes to ``size x size`` with BILINEAR and flips."""
    size = check_int("size", size, low=1)
    with Image.open(io.BytesIO(data)) as image:
        image = image.convert("RGB")
    image = image.crop(crop_box(params, *image.size)).resize((size, size), Image.BILINEAR)
    if params.get("flip", 0):
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(image)


def _flipped(pixels: np.ndarray, params: Mapping[str, Any]) -> np.ndarray:
    """The (size, size, 3) crop, mirrored when the parameters flip it (torch's flip: numpy's
    negative-stride copy of 3-byte pixels is 15x slower)."""
    if not params.get("flip", 0):
        return pixels
    return _tensor(pixels).flip(1).numpy()


def _tensor(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only array (Pillow's) is only read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _scale(params: Mapping[str, Any], width: int, height: int, size: int) -> int:
    """The largest of 8, 4, 2 (else 1) that leaves the crop at least ``size`` pixels each way."""
    left, top, right, bottom = crop_box(params, width, height)
    fits = min(right - left, bottom - top) // size
    return next((s for s in SCALES if s <= fits), 1)


def _decode_whole(
    data: bytes, params: Mapping[str, Any], size: int
) -> tuple[np.ndarray, tuple[int, int], int]:
    """The whole image as an RGB array, its full ``(width, height)`` and the DCT scale it was
    decoded at: simplejpeg (strict) when installed, and Pillow for everything it declines."""
    if is_jpeg(data) and "simplejpeg" in jpeg_backend_names():
        import simplejpeg

        try:
            height, width, space, _ = simplejpeg.decode_jpeg_header(data)
            if space in _SIMPLEJPEG_SPACES:  # CMYK, YCCK: Pillow's conversion, as the reference's
                scale = _scale(params, width, height, size)
                array = simplejpeg.decode_jpeg(
                    data, "RGB", min_height=-(-height // scale), min_width=-(-width // scale)
                )
                return array, (width, height), scale
        except ValueError:
            # Damaged for libjpeg-turbo (even only extraneous bytes, which Pillow passes over
            # with a warning): Pillow decides. A truncated file raises there; never filled in.
            pass
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        scale = _scale(params, width, height, size) if image.format == "JPEG" else 1
        if scale > 1:
            image.draft("RGB", (width // scale, height // scale))
        array = np.asarray(image.convert("RGB"))
    return array, (width, height), -(-width // array.shape[1])


def _resize_scaled(
    array: np.ndarray, box: tuple[int, int, int, int], scale: int, size: int
) -> np.ndarray:
    """The crop ``box`` (full-size pixels) of an array decoded at ``1 / scale``, resized."""
    if scale == 1:
        return _resize_exact(array, box, size)
    return _resize_fractional(array, tuple(v / scale for v in box), size)


def _resize_exact(array: np.ndarray, box: tuple[int, int, int, int], size: int) -> np.ndarray:
    """The pixel box of an (H, W, 3) uint8 array resized to ``size x size`` by torch's
    antialiased bilinear kernel (Pillow's BILINEAR filter), as an (size, size, 3) array."""
    left, top, right, bottom = box
    crop = _tensor(array)[None, top:bottom, left:right].permute(0, 3, 1, 2)
    # channels-last takes torch's vectorised uint8 kernel (2.6x the strided input's speed); a
    # decoded box already is (no copy), a box of a larger array is copied
    crop = crop.contiguous(memory_format=torch.channels_last)
    out = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True)
    return out[0].permute(1, 2, 0).numpy()


def _resize_fractional(
    array: np.ndarray, box: tuple[float, ...], size: int
) -> np.ndarray:
    """The fractional box of an (H, W, 3) uint8 array resized by Pillow's BILINEAR filter."""
    image = Image.fromarray(array)
    return np.asarray(image.resize((size, size), Image.BILINEAR, box=box))
