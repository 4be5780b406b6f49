"""Decode only what a crop needs: one sample's crop, resized and flipped, from its image bytes.

:func:`decode_crop` gives the pixels of :func:`decode_crop_reference` (decode the whole image
with Pillow, crop :func:`~nnh_data.augment.params.crop_box`, resize to ``size x size`` with Pillow's
BILINEAR filter, flip) for less work, since the parameters are known before the bytes are read:

- JPEG (YCbCr, grayscale or RGB) is decoded at the smallest DCT scale of 1/2, 1/4 or 1/8 that
  leaves the crop at least ``size`` pixels wide and high (libjpeg-turbo's scaled IDCT: the
  IDCT, upsampling and colour conversion of 1/4 to 1/64 of the pixels), and resized from the
  crop's box scaled alike (fractional, so Pillow resizes it). libjpeg-turbo's other scales (7/8
  to 3/8) were measured slower than a full decode. The decoder is simplejpeg when installed
  (the ``images`` extra, libjpeg-turbo in its wheel; measured 1.4-1.6x Pillow's speed on
  ImageNet-sized files, 1.1x on large ones, as it decodes straight into an array), else
  Pillow's ``draft``; a JPEG simplejpeg calls damaged is left to Pillow. Region decode: neither
  exposes libjpeg-turbo's partial decode (``jpeg_skip_scanlines``, TurboJPEG 3's cropping
  region), and pyvips' demand-driven crop was measured no faster, so the whole image is decoded
  at that scale.
- Everything else, CMYK and YCCK JPEGs included, and JPEGs whose crop is too small to scale,
  is decoded whole by Pillow (or simplejpeg) and resized from the exact pixel box by torch's
  antialiased bilinear uint8 kernel (Pillow's filter, about 2.4x its speed).

Quality against the reference: identical boxes; mean PSNR 75 dB on the ImageNet-like and 40 dB
on the large images of ``tools/bench/images.py`` (at least 30.6 dB on every one). The floor of
the speed: the Huffman decoding of the whole file, which no scale skips (a 1/8-scale decode of
the large images costs about half of a full one). EXIF orientation is ignored, as by the
reference, Pillow's ``Image.open``, webdataset and torchvision's decoders: boxes refer to the
stored pixels (rotate images when writing the shards if they carry an orientation).
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

try:
    import simplejpeg
except ImportError:  # the optional ``images`` extra
    simplejpeg = None

__all__ = ["JPEG_BACKEND", "decode_crop", "decode_crop_reference", "is_jpeg"]

JPEG_BACKEND = "pillow" if simplejpeg is None else "simplejpeg"  # what decode_crop uses
_JPEG_MAGIC = b"\xff\xd8\xff"
_SCALES = (8, 4, 2)  # libjpeg-turbo's fast scaled IDCTs: 1/8, 1/4, 1/2
_SIMPLEJPEG_SPACES = ("YCbCr", "Gray", "RGB")  # simplejpeg converts these to RGB itself


def is_jpeg(data: bytes) -> bool:
    """Whether ``data`` starts like a JPEG file (SOI then a marker)."""
    return bytes(data[:3]) == _JPEG_MAGIC


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
    array, (width, height) = _decode(data, params, size)
    box = crop_box(params, width, height)
    scale_x, scale_y = array.shape[1] / width, array.shape[0] / height
    if (scale_x, scale_y) == (1, 1):
        out = _resize_exact(array, box, size)
    else:
        scaled = (box[0] * scale_x, box[1] * scale_y, box[2] * scale_x, box[3] * scale_y)
        out = _resize_fractional(array, scaled, size)
    return np.ascontiguousarray(out[:, ::-1]) if _flips(params) else out


def decode_crop_reference(data: bytes, params: Mapping[str, Any], size: int) -> np.ndarray:
    """What :func:`decode_crop` computes, the plain way: Pillow decodes the whole image, then
    crops the box, resizes to ``size x size`` with BILINEAR and flips."""
    size = check_int("size", size, low=1)
    with Image.open(io.BytesIO(data)) as image:
        image = image.convert("RGB")
    image = image.crop(crop_box(params, *image.size)).resize((size, size), Image.BILINEAR)
    if _flips(params):
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(image)


def _decode(
    data: bytes, params: Mapping[str, Any], size: int
) -> tuple[np.ndarray, tuple[int, int]]:
    """The image as an RGB array at the chosen scale, and its full ``(width, height)``."""
    if is_jpeg(data) and simplejpeg is not None:
        try:
            return _simplejpeg_decode(data, params, size)
        except ValueError:
            # Damaged for libjpeg-turbo (even only extraneous bytes, which Pillow passes over
            # with a warning): Pillow decides, so what decodes and what raises is the
            # reference's. A truncated file raises there; it is never filled in.
            pass
    return _pillow_decode(data, params, size)


def _flips(params: Mapping[str, Any]) -> bool:
    return bool(params.get("flip", 0))


def _scale(params: Mapping[str, Any], width: int, height: int, size: int) -> int:
    """The largest of 8, 4, 2 (else 1) that leaves the crop at least ``size`` pixels each way."""
    left, top, right, bottom = crop_box(params, width, height)
    fits = min(right - left, bottom - top) // size
    return next((s for s in _SCALES if s <= fits), 1)


def _simplejpeg_decode(
    data: bytes, params: Mapping[str, Any], size: int
) -> tuple[np.ndarray, tuple[int, int]]:
    """The JPEG as an RGB array at the chosen scale, and its full ``(width, height)``."""
    height, width, space, _ = simplejpeg.decode_jpeg_header(data)
    if space not in _SIMPLEJPEG_SPACES:  # CMYK, YCCK: Pillow's conversion, as the reference's
        return _pillow_decode(data, params, size)
    scale = _scale(params, width, height, size)
    array = simplejpeg.decode_jpeg(
        data, "RGB", min_height=-(-height // scale), min_width=-(-width // scale)
    )
    return array, (width, height)


def _pillow_decode(
    data: bytes, params: Mapping[str, Any], size: int
) -> tuple[np.ndarray, tuple[int, int]]:
    """The image as an RGB array (a JPEG at the chosen scale, by ``draft``), and its full
    ``(width, height)``."""
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        scale = _scale(params, width, height, size) if image.format == "JPEG" else 1
        if scale > 1:  # draft picks the largest scale that keeps the size asked for
            image.draft("RGB", (width // scale, height // scale))
        return np.asarray(image.convert("RGB")), (width, height)


def _resize_exact(array: np.ndarray, box: tuple[int, int, int, int], size: int) -> np.ndarray:
    """The pixel box of an (H, W, 3) uint8 array resized to ``size x size`` by torch's
    antialiased bilinear kernel (Pillow's BILINEAR filter), as an (size, size, 3) array."""
    left, top, right, bottom = box
    with warnings.catch_warnings():  # a read-only array (Pillow's) is only read here
        warnings.simplefilter("ignore", UserWarning)
        pixels = torch.from_numpy(array)
    crop = pixels[top:bottom, left:right].permute(2, 0, 1).unsqueeze(0)
    # a channels-last copy takes torch's vectorised uint8 kernel (2.6x the strided input's speed)
    crop = crop.contiguous(memory_format=torch.channels_last)
    out = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True)
    return out[0].permute(1, 2, 0).numpy()


def _resize_fractional(
    array: np.ndarray, box: tuple[float, float, float, float], size: int
) -> np.ndarray:
    """The fractional box of an (H, W, 3) uint8 array resized by Pillow's BILINEAR filter."""
    image = Image.fromarray(array)
    return np.asarray(image.resize((size, size), Image.BILINEAR, box=box))
