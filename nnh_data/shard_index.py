"""The shard index (sample counts and seek positions) and its JSON sidecar.

The sidecar (``nnh-index.json`` next to the first shard, or any ``index_path``) maps each shard,
by its path relative to the sidecar's folder (or its full URL), to its format, byte size,
sample count and seek positions. An entry is reused while the shard's size is unchanged, so a
sidecar serves several shard sets in one folder and a rebuild re-scans only what changed.
Seek positions are stored delta-encoded (sample sizes in 512-byte tar blocks, rows per Parquet
row group) as base64 text of the narrowest integers that fit: about 1.4 bytes per small tar
sample, so the sidecar of 10,000 shards loads in milliseconds and is decoded per shard on use.
"""

from __future__ import annotations

import base64
import json
import posixpath
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs

from nnh_data.sources import FORMATS

INDEX_NAME = "nnh-index.json"
INDEX_VERSION = 2
_UNITS = {"tar": 512, "parquet": 1}  # tar offsets are whole 512-byte blocks


@dataclass(frozen=True)
class ShardInfo:
    """One shard: its URL, format, sample count and where its samples start.

    ``seek`` is the compact, JSON-safe form of :attr:`offsets` (see :func:`encode_offsets`);
    build a ShardInfo from offsets with :meth:`from_offsets`. ``size`` is the file size in
    bytes when indexed; ``error`` is set (and ``num_samples`` is 0) for a shard skipped as
    unreadable.
    """

    url: str
    format: str
    num_samples: int
    seek: str = ""
    size: int = -1
    error: str | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")

    @classmethod
    def from_offsets(cls, url: str, format: str, offsets: Sequence[int], size: int) -> ShardInfo:
        """A ShardInfo for a shard whose pieces start at ``offsets`` (see :attr:`offsets`)."""
        num_samples = len(offsets) - 1 if format == "tar" else int(offsets[-1])
        return cls(url, format, num_samples, encode_offsets(offsets, format), size)

    @cached_property
    def offsets(self) -> np.ndarray:
        """Where the pieces of the shard start, then where the last one ends (int64).

        Tar: the byte offset of each sample's first header (extended headers included), then
        the end of the last sample. Parquet: the first row of each row group, then
        ``num_samples``. Decoded from ``seek`` on first use, so opening an index of many
        shards costs nothing per sample.
        """
        offsets = decode_offsets(self.seek, self.format)
        expected = len(offsets) - 1 if self.format == "tar" else offsets[-1]
        if expected != self.num_samples:
            raise ValueError(f"offsets of {self.url!r} do not match {self.num_samples} samples")
        offsets.flags.writeable = False
        return offsets


def encode_offsets(offsets: Sequence[int], format: str) -> str:
    """Increasing ``offsets`` as short text: their differences (in 512-byte blocks for tar),
    as little-endian unsigned integers of the smallest width that fits, in base64, after one
    digit giving that width: ``[0, 7680, 15360]`` -> ``"1AA8P"``."""
    deltas = np.diff(np.asarray(offsets, np.int64), prepend=0) // _UNITS[format]
    width = next((w for w in (1, 2, 4) if int(deltas.max(initial=0)) < 256**w), 8)
    return f"{width}{base64.b64encode(deltas.astype(f'<u{width}').tobytes()).decode()}"


def decode_offsets(seek: str, format: str) -> np.ndarray:
    """The offsets encoded by :func:`encode_offsets` (``""`` is ``[0]``)."""
    if not seek:
        return np.zeros(1, np.int64)
    deltas = np.frombuffer(base64.b64decode(seek[1:]), f"<u{seek[0]}")
    return np.cumsum(deltas, dtype=np.int64) * _UNITS[format]


@dataclass(frozen=True)
class ShardIndex:
    """The shards of a source, in order; ``path`` is where the sidecar was read or saved."""

    shards: tuple[ShardInfo, ...]
    path: str | None = None

    @property
    def total_samples(self) -> int:
        """The number of samples in all shards."""
        return sum(info.num_samples for info in self.shards)

    def offsets(self) -> np.ndarray:
        """Cumulative sample counts (int64, ``len(shards) + 1``): shard i holds global ids
        ``offsets()[i]`` to ``offsets()[i + 1] - 1``."""
        counts = np.fromiter((info.num_samples for info in self.shards), np.int64)
        return np.concatenate(([0], np.cumsum(counts)))


def default_index_path(urls: Sequence[str]) -> str:
    """The sidecar next to the first shard."""
    folder = urls[0].rpartition("/")[0]
    return f"{folder}/{INDEX_NAME}" if folder else INDEX_NAME


def _entry_key(url: str, index_path: str) -> str:
    folder = index_path.rpartition("/")[0]
    return url[len(folder) + 1 :] if folder and url.startswith(folder + "/") else url


def cached_infos(
    urls: Sequence[str],
    formats: Sequence[str],
    sizes: Sequence[int],
    entries: dict[str, Any],
    index_path: str,
) -> list[ShardInfo | None]:
    """The ShardInfo of each URL whose sidecar entry still matches (format and size), else None."""
    infos: list[ShardInfo | None] = []
    for url, format, size in zip(urls, formats, sizes):
        entry = entries.get(_entry_key(url, index_path))
        if entry is None or entry["format"] != format or entry["size"] != size:
            infos.append(None)
            continue
        infos.append(ShardInfo(url, format, entry["num_samples"], entry["seek"], size))
    return infos


def updated_entries(
    entries: dict[str, Any], infos: Sequence[ShardInfo], index_path: str
) -> dict[str, Any]:
    """``entries`` plus those of ``infos`` (unreadable shards are left out)."""
    merged = dict(entries)
    for info in infos:
        if info.error is None:
            merged[_entry_key(info.url, index_path)] = {
                "format": info.format,
                "size": info.size,
                "num_samples": info.num_samples,
                "seek": info.seek,
            }
    return merged


def load_entries(index_path: str, storage_options: dict[str, Any] | None = None) -> dict:
    """The entries of the sidecar at ``index_path``; empty when it is missing or unusable."""
    fs, path = url_to_fs(index_path, **(storage_options or {}))
    if not fs.exists(path):
        return {}
    try:
        saved = json.loads(fs.cat_file(path))
    except ValueError as exc:
        warnings.warn(f"ignoring unreadable shard index {index_path!r}: {exc}", stacklevel=3)
        return {}
    if not isinstance(saved, dict) or saved.get("version") != INDEX_VERSION:
        warnings.warn(f"ignoring shard index {index_path!r} of another version", stacklevel=3)
        return {}
    return saved["shards"]


def save_entries(
    index_path: str, entries: dict[str, Any], storage_options: dict[str, Any] | None = None
) -> None:
    """Write the sidecar atomically: to a temporary name first, then renamed."""
    fs, path = url_to_fs(index_path, **(storage_options or {}))
    text = json.dumps({"version": INDEX_VERSION, "shards": entries}, separators=(",", ":"))
    write_atomic(fs, path, text.encode())


def write_atomic(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary name, so readers never see a partial file."""
    temporary = temporary_path(path)
    fs.pipe_file(temporary, data)
    fs.mv(temporary, path)


def temporary_path(path: str) -> str:
    """A unique hidden name next to ``path``, to write to before renaming."""
    folder, _, name = path.rpartition("/")
    return posixpath.join(folder, f".{name}.{uuid.uuid4().hex}.tmp")


def file_sizes(fs: AbstractFileSystem, paths: Sequence[str]) -> list[int]:
    """The size of each file, from one listing per folder (a stat or request per file is slow)."""
    listed: dict[str, int] = {}
    for folder in dict.fromkeys(posixpath.dirname(p) for p in paths):
        for item in fs.ls(folder, detail=True):
            listed[fs._strip_protocol(item["name"])] = item["size"]
    missing = [p for p in paths if p not in listed]
    if missing:
        raise FileNotFoundError(f"shard not found: {missing[0]!r} ({len(missing)} missing)")
    return [listed[p] for p in paths]
