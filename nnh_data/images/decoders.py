"""Built-in sample decoders: ``decode="pil" | "rgb8" | "torchrgb8" | "torchrgb" | "bytes"``.

The names and what they make are webdataset's (``webdataset.autodecode.ImageHandler``): a field
whose extension (the last dot-separated part of its name, "seg.png" -> "png") is an image
format is decoded by Pillow and converted to RGB, as a PIL image (``pil``), an (H, W, 3) uint8
numpy array (``rgb8``), a (3, H, W) uint8 tensor (``torchrgb8``) or a (3, H, W) float32 tensor
in [0, 1] (``torchrgb``); ``bytes`` leaves images encoded. Other fields are decoded as
webdataset's basic handlers do: ``txt``/``text``/``transcript`` to str, ``cls``/``cls2``/
``index``/``inx``/``id`` to int, ``json``/``jsn`` to JSON, ``npy``/``npz`` to arrays, and
``.gz`` fields unzipped first; other fields stay bytes, pickles and torch files included
(unpickling data runs code: decode those in your own callable if you trust the data). Values
that are not bytes (Parquet columns, ``__key__`` and the other labels) are left as they are.

With ``crop_size``, image fields are decoded by :func:`nnh_data.decode_crop` with the sample's
own ``__aug__`` parameters (the ``imagenet`` preset's crop and flip) into ``crop_size x
crop_size`` pixels of the same kinds. A decoder takes a sample dict or, with
``ShardedStreamingDataset(batch_size=...)``, a batch of columns (each value of a column decoded
alike; in crop mode, array and tensor images stacked into one array or tensor).
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from nnh_data.augment.params import GEOMETRY_NAMES
from nnh_data.checks import check_choice, check_int
from nnh_data.images.crop_decoder import decode_crop

__all__ = ["DECODER_NAMES", "IMAGE_EXTENSIONS", "SampleDecoder"]

DECODER_NAMES = ("pil", "rgb8", "torchrgb8", "torchrgb", "bytes")
# the image formats among webdataset's IMAGE_EXTENSIONS (those Pillow opens)
IMAGE_EXTENSIONS = frozenset(
    "jpg jpeg jpe jfif png apng ppm pgm pbm pnm webp bmp dib gif tif tiff tga ico".split()
)
_BASIC: dict[str, Callable[[bytes], Any]] = {
    **dict.fromkeys(("txt", "text", "transcript"), lambda data: data.decode("utf-8")),
    **dict.fromkeys(("cls", "cls2", "index", "inx", "id"), int),
    **dict.fromkeys(("json", "jsn"), json.loads),
    "npy": lambda data: np.lib.format.read_array(io.BytesIO(data)),
    "npz": lambda data: dict(np.load(io.BytesIO(data))),
}


@dataclass(frozen=True)
class SampleDecoder:
    """Decode a sample's (or a batch's) fields by extension; ``images`` is one of
    ``DECODER_NAMES``, ``crop_size`` turns on :func:`~nnh_data.decode_crop` for images.

    ``ShardedStreamingDataset(decode="rgb8")`` is ``decode=SampleDecoder("rgb8")``.

    Example:
        >>> from nnh_data import ShardedStreamingDataset, get_preset
        >>> ds = ShardedStreamingDataset(  # doctest: +SKIP
        ...     "train-{000..099}.tar", aug_config=get_preset("imagenet"),
        ...     decode=SampleDecoder("torchrgb8", crop_size=224))
        >>> SampleDecoder("bytes")({"__key__": "a", "cls": b"7", "jpg": b"..."})
        {'__key__': 'a', 'cls': 7, 'jpg': b'...'}
    """

    images: str = "rgb8"
    crop_size: int | None = None

    def __post_init__(self) -> None:
        check_choice("images", self.images, DECODER_NAMES)
        if self.crop_size is not None:
            object.__setattr__(self, "crop_size", check_int("crop_size", self.crop_size, low=1))
            if self.images == "bytes":
                raise ValueError("crop_size decodes images: pass images other than 'bytes'")

    def __call__(self, item: Mapping[str, Any]) -> dict[str, Any]:
        """The sample (or batch of columns) with its fields decoded."""
        if isinstance(item.get("__index__", 0), (int, np.integer)):  # a sample, not a batch
            return {name: self._value(name, v, item) for name, v in item.items()}
        params = None
        if self.crop_size:
            params = geometry_rows(item["__aug__"], len(item["__aug__"]["sample_id"]))
        out = {}
        for name, column in item.items():
            if name.startswith("__") or not isinstance(column, list):
                out[name] = column
                continue
            values = [self._value(name, v, p) for v, p in zip(column, params or [{}] * len(column))]
            stack = self.crop_size and _extension(name) in IMAGE_EXTENSIONS
            out[name] = self._stacked(values) if stack else values
        return out

    def _value(self, name: str, value: Any, sample: Mapping[str, Any]) -> Any:
        """One field's value decoded (``sample``: its sample, or its parameters in a batch)."""
        if name.startswith("__") or not isinstance(value, (bytes, bytearray, memoryview)):
            return value
        extension = _extension(name)
        if extension == "gz":
            return self._value(name[:-3], gzip.decompress(value), sample)
        if extension in IMAGE_EXTENSIONS:
            return value if self.images == "bytes" else self._image(bytes(value), sample)
        decode = _BASIC.get(extension)
        return value if decode is None else decode(bytes(value))

    def _image(self, data: bytes, sample: Mapping[str, Any]) -> Any:
        if self.crop_size is None:
            with Image.open(io.BytesIO(data)) as image:
                rgb = image.convert("RGB")
            return rgb if self.images == "pil" else _converted(np.asarray(rgb), self.images)
        params = sample.get("__aug__", sample)
        if GEOMETRY_NAMES[0] not in params:
            raise ValueError(
                f"crop_size={self.crop_size} needs the crop parameters {list(GEOMETRY_NAMES)} in "
                "__aug__: pass aug_config=get_preset('imagenet') (or crop=True) to the dataset"
            )
        pixels = decode_crop(data, params, self.crop_size)
        return Image.fromarray(pixels) if self.images == "pil" else _converted(pixels, self.images)

    def _stacked(self, images: list[Any]) -> Any:
        if self.images == "rgb8":
            return np.stack(images)
        return torch.stack(images) if self.images.startswith("torch") else images


def _converted(pixels: np.ndarray, kind: str) -> np.ndarray | torch.Tensor:
    """An (H, W, 3) uint8 array as ``kind`` (``rgb8``, ``torchrgb8`` or ``torchrgb``)."""
    if kind == "rgb8":
        return pixels
    tensor = torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))
    return tensor if kind == "torchrgb8" else tensor.float().div_(255)


def _extension(name: str) -> str:
    """A field's extension, as webdataset finds it: "seg.PNG" -> "png"."""
    return name.rsplit(".", 1)[-1].lower()


def geometry_rows(columns: Mapping[str, Any], count: int) -> list[dict[str, Any]]:
    """Per-row parameter dicts of a batch's ``__aug__`` columns (the geometry ones; ``count``
    empty dicts without them)."""
    names = [name for name in GEOMETRY_NAMES if name in columns]
    if not names:
        return [{}] * count
    values = [np.asarray(columns[name]).tolist() for name in names]
    return [dict(zip(names, row)) for row in zip(*values)]
