"""Built-in sample decoders: ``decode="pil" | "rgb8" | "torchrgb8" | "torchrgb" | "bytes"``, or
a decoder per field: ``decode={"image": "rgb8", "label": "cls"}``.

The names and what they make are webdataset's (``webdataset.autodecode.ImageHandler``): a field
whose extension (the last dot-separated part of its name, "seg.png" -> "png") is an image
format is decoded by Pillow and converted to RGB, as a PIL image (``pil``), an (H, W, 3) uint8
numpy array (``rgb8``), a (3, H, W) uint8 tensor (``torchrgb8``) or a (3, H, W) float32 tensor
in [0, 1] (``torchrgb``); ``bytes`` leaves images encoded. Other fields are decoded as
webdataset's basic handlers do: ``txt``/``text``/``transcript`` to str, ``cls``/``cls2``/
``index``/``inx``/``id`` to int, ``json``/``jsn`` to JSON, ``npy``/``npz`` to arrays, and
``.gz`` fields unzipped first; other fields stay bytes, pickles and torch files included
(unpickling data runs code: decode those in your own callable if you trust the data). Values
that are not bytes (Parquet columns, ``__key__`` and the other labels) are left as they are,
except a Hugging Face ``Image()`` value (a dict of ``bytes`` and ``path``), which is an image
(unless its path names another format): its bytes, or when they are null the file at ``path``,
read relative to the shard's folder (where ``datasets`` writes the Parquet file).

Columns rarely carry extensions (Hugging Face names its image column ``image``), so a decoder
can also be a mapping from field name to a decoder name: an image name above, or a basic one
(``"cls"``, ``"txt"``, ``"json"``, ...) for that field whatever its name; the fields it does not
name are left as they are. A named field that its decoder cannot decode (a label given to
``rgb8``, bytes that are no image, a field the sample lacks) raises :class:`ShardError` naming
the shard, the sample's key and the field; a ``None`` (a null) stays ``None``.

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
import posixpath
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import torch
from PIL import Image

from nnh_data.augment.params import GEOMETRY_NAMES
from nnh_data.checks import check_choice, check_int
from nnh_data.errors import ShardError
from nnh_data.images.crop_decoder import decode_crop

__all__ = ["DECODER_NAMES", "FIELD_DECODERS", "IMAGE_EXTENSIONS", "SampleDecoder"]

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
FIELD_DECODERS = (*DECODER_NAMES, *_BASIC)
"""The decoder names a field may be given in a mapping: the image kinds, then the basic ones."""
_IMAGE_KINDS = frozenset(DECODER_NAMES) - {"bytes"}
_HF_IMAGE_KEYS = frozenset(("bytes", "path"))  # a Hugging Face Image() value
# first bytes of the image formats Pillow opens most (for an Image() value with no path)
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"BM", b"II*\x00", b"MM\x00*", b"P6", b"P5")
_WEBP = (b"RIFF", b"WEBP")


@dataclass(frozen=True)
class SampleDecoder:
    """Decode a sample's (or a batch's) fields: by extension with ``images`` one of
    ``DECODER_NAMES``, or the fields a mapping names, each with its decoder (one of
    ``FIELD_DECODERS``); ``crop_size`` turns on :func:`~nnh_data.decode_crop` for images.

    ``ShardedStreamingDataset(decode="rgb8")`` is ``decode=SampleDecoder("rgb8")``, and
    ``decode={"image": "rgb8"}`` is ``decode=SampleDecoder({"image": "rgb8"})``.

    Example:
        >>> from nnh_data import ShardedStreamingDataset, get_preset
        >>> ds = ShardedStreamingDataset(  # doctest: +SKIP
        ...     "train-{000..099}.tar", aug_config=get_preset("imagenet"),
        ...     decode=SampleDecoder("torchrgb8", crop_size=224))
        >>> SampleDecoder("bytes")({"__key__": "a", "cls": b"7", "jpg": b"..."})
        {'__key__': 'a', 'cls': 7, 'jpg': b'...'}
        >>> SampleDecoder({"label": "cls"})({"__key__": "a", "label": b"7", "jpg": b"..."})
        {'__key__': 'a', 'label': 7, 'jpg': b'...'}
    """

    images: str | Mapping[str, str] = "rgb8"
    crop_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.images, Mapping):
            object.__setattr__(self, "images", _checked_fields(self.images))
            kinds = set(self.images.values())
        else:
            check_choice("images", self.images, DECODER_NAMES)
            kinds = {self.images}
        if self.crop_size is not None:
            object.__setattr__(self, "crop_size", check_int("crop_size", self.crop_size, low=1))
            if not kinds & _IMAGE_KINDS:
                raise ValueError(
                    f"crop_size decodes images: pass images other than 'bytes', got "
                    f"{self.images!r}"
                )

    def __call__(self, item: Mapping[str, Any]) -> dict[str, Any]:
        """The sample (or batch of columns) with its fields decoded."""
        if isinstance(item.get("__index__", 0), (int, np.integer)):  # a sample, not a batch
            return self._sample(item)
        self._check_named(item, 0)
        rows = None
        if self.crop_size:
            rows = geometry_rows(item["__aug__"], len(item["__aug__"]["sample_id"]))
        out = dict(item)
        for name, column in item.items():
            decoder = self._decoder_of(name)
            if name.startswith("__") or decoder is None or self._as_is(column, decoder):
                continue
            params = rows or [{}] * len(column)
            values = [self._field(name, v, item, i, params[i]) for i, v in enumerate(column)]
            stack = self._stacks(name, decoder, column)
            out[name] = _stacked(values, decoder) if stack else values
        return out

    def _sample(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        self._check_named(sample, None)
        return {name: value if name.startswith("__") or self._decoder_of(name) is None
                else self._field(name, value, sample, None, sample)
                for name, value in sample.items()}  # fmt: skip

    def _decoder_of(self, name: str) -> str | None:
        """The decoder of field ``name``: from the mapping (None where it names none), else
        ``images`` (which decodes by extension)."""
        if isinstance(self.images, dict):
            return self.images.get(name)
        return self.images

    def _as_is(self, column: Any, decoder: str) -> bool:
        """Whether a batch's column stays as it is: anything but a list (numpy numbers, nested
        columns), except a numpy column a mapping names, which is decoded value by value
        unless it holds integers and its decoder makes integers."""
        if isinstance(column, list):
            return False
        if not isinstance(self.images, dict) or not isinstance(column, np.ndarray):
            return True
        return _BASIC.get(decoder) is int and column.dtype.kind in "iu"

    def _check_named(self, item: Mapping[str, Any], row: int | None) -> None:
        """A ``ShardError`` when the mapping names a field the sample (or batch: named by its
        ``row``) lacks."""
        if isinstance(self.images, dict) and not self.images.keys() <= item.keys():
            name = next(n for n in self.images if n not in item)
            fields = sorted(n for n in item if not n.startswith("__"))
            raise _error(item, row, name, f"no such field (the fields: {fields})")

    def _field(
        self, name: str, value: Any, item: Mapping[str, Any], row: int | None, params: Any
    ) -> Any:
        """One field's value decoded (``params``: its sample, or its parameters in a batch);
        a named decoder's failure as a ``ShardError`` naming shard, key and field."""
        if not isinstance(self.images, dict):
            return self._by_extension(name, value, item, row, params)
        if value is None:
            return None
        try:
            return self._named(self.images[name], value, item, row, params)
        except ShardError:
            raise
        except Exception as exc:
            raise _error(item, row, name, f"{self.images[name]!r} cannot decode it: {exc!r}") \
                from exc  # fmt: skip

    def _named(
        self, decoder: str, value: Any, item: Mapping[str, Any], row: int | None, params: Any
    ) -> Any:
        if decoder in DECODER_NAMES:
            data = _image_bytes(value, _shard_of(item, row))
            if data is None:
                raise TypeError(f"a {type(value).__name__}, not image bytes")
            return data if decoder == "bytes" else self._image(data, params, decoder)
        if isinstance(value, (bytes, bytearray, memoryview)):
            return _BASIC[decoder](bytes(value))
        if isinstance(value, str) and decoder in _TEXT:
            return value
        if isinstance(value, (str, int, np.integer)) and _BASIC[decoder] in (int, json.loads):
            return _BASIC[decoder](value)
        raise TypeError(f"a {type(value).__name__}, which {decoder!r} does not decode")

    def _by_extension(
        self, name: str, value: Any, item: Mapping[str, Any], row: int | None, params: Any
    ) -> Any:
        """A field decoded by its extension (an ``Image()`` value as an image)."""
        if type(value) is dict and value.keys() == _HF_IMAGE_KEYS:
            return self._hf_image(name, value, item, row, params)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            return value
        extension = _extension(name)
        if extension == "gz":
            return self._by_extension(name[:-3], gzip.decompress(value), item, row, params)
        if extension in IMAGE_EXTENSIONS:
            return value if self.images == "bytes" else self._image(bytes(value), params)
        decode = _BASIC.get(extension)
        if decode is None and self.images != "bytes" and _looks_like_image(value):
            _warn_unnamed_image(name, self.images)
        return value if decode is None else decode(bytes(value))

    def _hf_image(
        self, name: str, value: dict, item: Mapping[str, Any], row: int | None, params: Any
    ) -> Any:
        """An ``Image()`` value decoded as an image, unless its path names another format
        (a Hugging Face ``Audio()`` value has the same fields)."""
        path = value["path"]
        if value["bytes"] is None and path is None:
            return None
        if path and "." in path.rsplit("/", 1)[-1] and _extension(path) not in IMAGE_EXTENSIONS:
            return value
        if not path and not _looks_like_image(value["bytes"]):
            return value
        try:
            data = _image_bytes(value, _shard_of(item, row))
            return data if self.images == "bytes" else self._image(data, params)
        except Exception as exc:
            raise _error(item, row, name, f"an unreadable Image() value: {exc!r}") from exc

    def _image(self, data: bytes, sample: Mapping[str, Any], kind: str | None = None) -> Any:
        kind = kind or self.images
        if self.crop_size is None:
            with Image.open(io.BytesIO(data)) as image:
                rgb = image.convert("RGB")
            return rgb if kind == "pil" else _converted(np.asarray(rgb), kind)
        params = sample.get("__aug__", sample)
        if GEOMETRY_NAMES[0] not in params:
            raise ValueError(
                f"crop_size={self.crop_size} needs the crop parameters {list(GEOMETRY_NAMES)} in "
                "__aug__: pass aug_config=get_preset('imagenet') (or crop=True) to the dataset"
            )
        pixels = decode_crop(data, params, self.crop_size)
        return Image.fromarray(pixels) if kind == "pil" else _converted(pixels, kind)

    def _stacks(self, name: str, decoder: str, column: list) -> bool:
        """Whether a batch's column of images is stacked (crop mode: one size)."""
        if not self.crop_size or decoder not in _IMAGE_KINDS:
            return False
        if isinstance(self.images, dict) or _extension(name) in IMAGE_EXTENSIONS:
            return True
        return any(type(value) is dict for value in column)  # Image() values


_TEXT = frozenset(("txt", "text", "transcript"))


def _stacked(images: list[Any], kind: str) -> Any:
    """A batch's cropped images of decoder ``kind`` as one array or tensor (a list for PIL
    images, and where a null left a ``None``)."""
    if any(image is None for image in images):
        return images
    if kind == "rgb8":
        return np.stack(images)
    return torch.stack(images) if kind.startswith("torch") else images


def _checked_fields(fields: Mapping[str, str]) -> dict[str, str]:
    """A mapping of field names to decoder names, checked."""
    for name, decoder in fields.items():
        if not isinstance(name, str) or decoder not in FIELD_DECODERS:
            raise ValueError(
                f"images must map field names to one of {', '.join(map(repr, FIELD_DECODERS))}, "
                f"got {name!r}: {decoder!r}"
            )
    if not fields:
        raise ValueError("images must name at least one field, got an empty mapping")
    return dict(fields)


def _image_bytes(value: Any, shard: str | None) -> bytes | None:
    """The encoded image of ``value``: bytes as they are, an ``Image()`` value's bytes or the
    file at its path (relative to the shard's folder); None for anything else."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if type(value) is not dict or value.keys() != _HF_IMAGE_KEYS:
        return None
    if value["bytes"] is not None:
        return bytes(value["bytes"])
    path = value["path"]
    if shard and "://" not in path and not posixpath.isabs(path):
        path = posixpath.join(posixpath.dirname(shard), path)
    with fsspec.open(path, "rb") as file:
        return file.read()


def _looks_like_image(data: Any) -> bool:
    head = bytes(data[:12]) if data is not None else b""
    return head.startswith(_IMAGE_MAGIC) or (head[:4], head[8:12]) == _WEBP


def _warn_unnamed_image(name: str, images: str) -> None:
    warnings.warn(
        f"field {name!r} holds image bytes, but its name has no image extension, so "
        f"decode={images!r} leaves it encoded; name it: decode={{{name!r}: {images!r}}}",
        stacklevel=4,
    )


def _shard_of(item: Mapping[str, Any], row: int | None) -> str | None:
    shard = item.get("__shard__")
    return shard if row is None or shard is None else shard[row]


def _error(item: Mapping[str, Any], row: int | None, name: str, reason: str) -> ShardError:
    """A ``ShardError`` naming the sample's shard and key, and the field."""
    key = item.get("__key__")
    key = key if row is None or key is None else key[row]
    return ShardError(str(_shard_of(item, row)), f"sample {key!r}, field {name!r}", reason)


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
