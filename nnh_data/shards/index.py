"""The shard index (sample counts and seek positions), how it is built, and its JSON sidecar.

The sidecar (``nnh-index.json`` next to the first shard, or any ``index_path``) maps each shard,
by its path relative to the sidecar's folder (or its full URL), to its format, byte size,
version, sample count and seek positions. The version is what the filesystem's listing says
identifies this content of the file (an object store's ETag or version id, else the
modification time): an entry is reused only while size and version are unchanged, because a
rewritten tar keeps its size more often than not (tar pads to 10 KiB records). So a sidecar
serves several shard sets in one folder and a rebuild re-scans only what changed. An entry is
checked as strictly as a resume state before it is used (types, ranges, its count against its
seek positions; one of no sample by a scan, which costs nothing for a shard that is empty): one
that is no valid index of its shard (a hand-edited sidecar) is indexed again, with a warning
naming the sidecar and the entry. A Parquet entry keeps a digest of its columns and types, so
that shards holding one column under two types are named when indexed (:func:`check_schemas`),
not found out as a batch of mixed types.
Seek positions are stored delta-encoded (sample sizes in 512-byte tar blocks, rows per Parquet
row group) as base64 text of the narrowest integers that fit: about 1.4 bytes per small tar
sample, so the sidecar of 10,000 shards loads in milliseconds and is decoded per shard on use.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import itertools
import json
import logging
import os
import posixpath
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import MISSING, dataclass, fields, replace
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from tqdm.auto import tqdm

from nnh_data.atomic import replace_file
from nnh_data.checks import check_choice
from nnh_data.errors import ShardError, TarFormatError
from nnh_data.shards.arrow import arrow_offsets, null_columns, open_ipc
from nnh_data.shards.sources import (
    FORMATS,
    content_format,
    detect_format,
    listed_sources,
    shard_filesystem,
)
from nnh_data.shards.tar import parse_samples
from nnh_data.shards.tar_members import BLOCK
from nnh_data.shards.tar_salvage import AFTER_END, data_after_end, salvage_tar
from nnh_data.topology import dist_info

logger = logging.getLogger(__name__)

__all__ = [
    "INDEX_NAME",
    "build_shard_index",
    "row_group_rows",
    "salvage_shard",
    "scan_shard",
    "ShardIndex",
    "ShardInfo",
    "cached_infos",
    "check_schemas",
    "decode_offsets",
    "default_index_path",
    "encode_offsets",
    "file_stats",
    "file_version",
    "load_entries",
    "save_entries",
    "schema_digest",
    "updated_entries",
]

INDEX_NAME = "nnh-index.json"
INDEX_VERSION = 3
# listing fields that identify a file's content, most specific first (S3, GCS, Azure, local, ...)
_VERSION_FIELDS = ("VersionId", "ETag", "generation", "etag", "mtime", "LastModified",
                   "last_modified", "updated", "created")  # fmt: skip
# kept since version 3 was first written: entries without them are indexed again
_COLUMNAR_KEYS = {"parquet": {"schema", "data_bytes"}, "arrow": {"schema"}, "tar": set()}
_UNITS = {"tar": 512, "parquet": 1, "arrow": 1}  # tar offsets are whole 512-byte blocks


@dataclass(frozen=True)
class ShardInfo:
    """One shard: its URL, format, sample count and where its samples start.

    ``seek`` is the compact, JSON-safe form of :attr:`offsets` (see :func:`encode_offsets`);
    build a ShardInfo from offsets with :meth:`from_offsets`. ``size`` is the file size in
    bytes when indexed and ``version`` what identified its content then (:func:`file_version`);
    ``nullable`` names the Parquet and Arrow columns that hold nulls (or lack statistics to
    tell), ``schema`` is a digest of a Parquet or Arrow shard's column names and types
    (:func:`schema_digest`) and ``data_bytes`` the bytes its footer declares its rows hold once
    decompressed (-1: unknown), which bound the rows read at once.
    A shard indexed with ``on_error="skip"`` despite damage has ``error`` set (what was wrong),
    ``lost`` samples that could not be indexed (a lower bound unless ``lost_exact``) and, for
    tar, ``gaps``: byte spans inside its samples' pieces that hold no readable sample, cut out
    by readers (:mod:`nnh_data.shards.tar_salvage`).
    """

    url: str
    format: str
    num_samples: int
    seek: str = ""
    size: int = -1
    error: str | None = None
    version: str = ""
    nullable: tuple[str, ...] = ()
    lost: int = 0
    lost_exact: bool = True
    gaps: tuple[tuple[int, int], ...] = ()
    schema: str = ""
    data_bytes: int = -1

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")

    @classmethod
    def from_offsets(
        cls,
        url: str,
        format: str,
        offsets: Sequence[int],
        size: int,
        version: str = "",
        nullable: Sequence[str] = (),
        schema: str = "",
        data_bytes: int = -1,
    ) -> ShardInfo:
        """A ShardInfo for a shard whose pieces start at ``offsets`` (see :attr:`offsets`)."""
        num_samples = len(offsets) - 1 if format == "tar" else int(offsets[-1])
        seek = encode_offsets(offsets, format)
        return cls(url, format, num_samples, seek, size, None, version, tuple(nullable),
                   schema=schema, data_bytes=data_bytes)  # fmt: skip

    @property
    def loss(self) -> str:
        """The samples lost at indexing, in words: "1 sample", "at least 3 samples", "an
        unknown number of samples"."""
        if self.lost_exact:
            return f"{self.lost} sample{'' if self.lost == 1 else 's'}"
        return f"at least {self.lost} samples" if self.lost else "an unknown number of samples"

    @cached_property
    def offsets(self) -> np.ndarray:
        """Where the pieces of the shard start, then where the last one ends (int64).

        Tar: the byte offset of each sample's first header (extended headers included), then
        the end of the last sample. Parquet: the first row of each row group, then
        ``num_samples``; Arrow: the same of each record batch. Decoded from ``seek`` on first
        use, so opening an index of many shards costs nothing per sample.
        """
        offsets = decode_offsets(self.seek, self.format)
        expected = len(offsets) - 1 if self.format == "tar" else offsets[-1]
        if expected != self.num_samples:
            raise ValueError(f"offsets of {self.url!r} do not match {self.num_samples} samples")
        offsets.flags.writeable = False
        return offsets


_INFO_DEFAULTS = {f.name: f.default for f in fields(ShardInfo) if f.default is not MISSING}


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

    @cached_property
    def total_samples(self) -> int:
        """The number of samples in all shards."""
        return sum(info.num_samples for info in self.shards)

    def fingerprint(self) -> str:
        """A short hash of what defines the sample order and ids: each shard's file name and
        sample count, in order (not the folder, so a copied data set keeps it)."""
        names = [(i.url[i.url.rfind("/") + 1 :], i.num_samples) for i in self.shards]
        return hashlib.sha256(json.dumps(names).encode()).hexdigest()[:16]

    def offsets(self) -> np.ndarray:
        """Cumulative sample counts (int64, ``len(shards) + 1``): shard i holds global ids
        ``offsets()[i]`` to ``offsets()[i + 1] - 1``."""
        counts = np.fromiter((info.num_samples for info in self.shards), np.int64)
        return np.concatenate(([0], np.cumsum(counts)))


def default_index_path(urls: Sequence[str]) -> str:
    """The sidecar next to the first shard."""
    folder = urls[0].rpartition("/")[0]
    return f"{folder}/{INDEX_NAME}" if folder else INDEX_NAME


def _entry_key(url: str, folder: str) -> str:
    """The sidecar's name of ``url``: its path from ``folder``, the sidecar's, if inside it."""
    return url[len(folder) + 1 :] if folder and url.startswith(folder + "/") else url


def cached_infos(
    urls: Sequence[str],
    formats: Sequence[str],
    stats: Sequence[tuple[int, str]],
    entries: dict[str, Any],
    index_path: str,
) -> tuple[list[ShardInfo | None], dict[str, str]]:
    """The ShardInfo of each URL whose sidecar entry still matches (format, size and version,
    from :func:`file_stats`) and is a valid index of the shard (:func:`entry_problem`), else
    None; and what is wrong with each entry that matched but is no valid index, by entry
    name."""
    folder = index_path.rpartition("/")[0]
    infos: list[ShardInfo | None] = []
    problems: dict[str, str] = {}
    for url, format, (size, version) in zip(urls, formats, stats):
        key = _entry_key(url, folder)
        entry = entries.get(key)
        if not isinstance(entry, dict) or (
            entry.get("format"), entry.get("size"), entry.get("version")
        ) != (format, size, version) or not _COLUMNAR_KEYS[format] <= entry.keys():
            infos.append(None)  # new, changed, or indexed before schemas and sizes were kept
            continue
        problem = entry_problem(entry, size)
        if problem is not None:
            problems[key] = problem
            infos.append(None)
            continue
        info = _matched_info(url=url, format=format, num_samples=entry["num_samples"],
                             seek=entry["seek"], size=size, version=version,
                             nullable=tuple(entry.get("nullable", ())),
                             schema=entry.get("schema", ""),
                             data_bytes=entry.get("data_bytes", -1))  # fmt: skip
        if "error" in entry:  # indexed with on_error="skip" despite damage
            gaps = tuple(tuple(gap) for gap in entry.get("gaps", ()))
            info = replace(info, error=entry["error"], lost=entry["lost"],
                           lost_exact=entry["lost_exact"], gaps=gaps)  # fmt: skip
        infos.append(info)
    return infos, problems


def entry_problem(entry: dict[str, Any], size: int) -> str | None:
    """What makes a sidecar entry that matched its shard's format, size and version no index
    of it, or None: each field's type and range, as strictly as a resume state, and its sample
    count against its seek positions (a hand-edited count would otherwise drop samples or
    promise more than the shard holds). Checked from the seek text's length for tar (about
    1 us an entry, where decoding it takes 10): positions that disagree with the bytes
    are a :class:`StaleIndexError` when the shard is read."""
    format, count, seek = entry["format"], entry.get("num_samples"), entry.get("seek")
    if not _is_count(count):
        return f"num_samples must be an integer >= 0, got {_clip(count)}"
    if not isinstance(seek, str):
        return f"seek must be a str, got {_clip(seek)}"
    try:
        width, deltas = (1, b"\0") if not seek else (int(seek[0]), _b64(seek[1:]))
        if width not in (1, 2, 4, 8) or not deltas or len(deltas) % width:
            raise ValueError(f"{len(deltas)} bytes of {width}-byte numbers")
    except (ValueError, TypeError) as exc:
        return f"seek {_clip(seek)} does not hold offsets ({exc})"
    if format == "tar":
        held = len(deltas) // width - 1
    else:
        held = sum(np.frombuffer(deltas, f"<u{width}").tolist())
    if held != count:
        return f"num_samples is {count}, its seek positions hold {held}"
    return _optional_problem(entry, size)


def _optional_problem(entry: dict[str, Any], size: int) -> str | None:
    """The optional fields: nullable columns, and what was lost of a damaged shard."""
    nullable = entry.get("nullable", [])
    if not isinstance(nullable, list) or not all(isinstance(n, str) for n in nullable):
        return f"nullable must be a list of column names, got {_clip(nullable)}"
    if not isinstance(entry.get("schema", ""), str):
        return f"schema must be a str, got {_clip(entry['schema'])}"
    data_bytes = entry.get("data_bytes", 0)
    if not (_is_count(data_bytes) or type(data_bytes) is int and data_bytes == -1):  # not known
        return f"data_bytes must be an integer >= -1, got {_clip(entry['data_bytes'])}"
    if "error" not in entry:
        return None
    if not isinstance(entry["error"], str) or not _is_count(entry.get("lost")):
        return f"error must be a str and lost an integer >= 0, got {_clip(entry)}"
    if not isinstance(entry.get("lost_exact"), bool):
        return f"lost_exact must be true or false, got {_clip(entry.get('lost_exact'))}"
    gaps = entry.get("gaps", [])
    if not isinstance(gaps, list) or not all(
        isinstance(g, list) and len(g) == 2 and all(map(_is_count, g)) and g[0] < g[1] <= size
        for g in gaps
    ):
        return f"gaps must be [start, end] byte spans inside the shard, got {_clip(gaps)}"
    return None


def _b64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _clip(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _matched_info(**values: Any) -> ShardInfo:
    """A ShardInfo of ``values`` (the other fields at their defaults) from a sidecar entry that
    matched its shard, built without the frozen dataclass's ``__setattr__`` per field: 0.5 us
    instead of 1.5 (a third of the sidecar's check for 10,000 shards)."""
    info = object.__new__(ShardInfo)
    info.__dict__.update(_INFO_DEFAULTS, **values)
    return info


def updated_entries(
    entries: dict[str, Any], infos: Sequence[ShardInfo], index_path: str
) -> dict[str, Any]:
    """``entries`` plus those of ``infos`` (a damaged shard's with what was lost, so that a
    later open reports the same)."""
    folder = index_path.rpartition("/")[0]
    merged = dict(entries)
    for info in infos:
        entry = {"format": info.format, "size": info.size, "version": info.version,
                 "num_samples": info.num_samples, "seek": info.seek}  # fmt: skip
        if info.nullable:
            entry["nullable"] = list(info.nullable)
        if info.format == "parquet":
            entry.update(schema=info.schema, data_bytes=info.data_bytes)
        elif info.format == "arrow":
            entry["schema"] = info.schema
        if info.error is not None:
            entry.update(error=info.error, lost=info.lost, lost_exact=info.lost_exact)
            entry.update({"gaps": [list(gap) for gap in info.gaps]} if info.gaps else {})
        merged[_entry_key(info.url, folder)] = entry
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
    if not isinstance(saved.get("shards"), dict):
        warnings.warn(f"ignoring shard index {index_path!r}: its 'shards' is no object of "
                      f"entries (got {_clip(saved.get('shards'))})", stacklevel=3)  # fmt: skip
        return {}
    return saved["shards"]


def save_entries(
    index_path: str, entries: dict[str, Any], storage_options: dict[str, Any] | None = None
) -> None:
    """Write the sidecar atomically: to a temporary name first, then renamed."""
    fs, path = url_to_fs(index_path, **(storage_options or {}))
    text = json.dumps({"version": INDEX_VERSION, "shards": entries}, separators=(",", ":"))
    replace_file(path, text.encode(), fs=fs)


def file_version(item: dict[str, Any]) -> str:
    """What identifies the content of a file in an fsspec listing or ``info()`` entry: its
    ETag or version id on object stores, else its modification time (``""`` if none)."""
    for field in _VERSION_FIELDS:
        if item.get(field) is not None:
            return f"{field}={item[field]}"
    return ""


def file_stats(
    fs: AbstractFileSystem,
    paths: Sequence[str],
    entries: Sequence[dict[str, Any] | None] | None = None,
) -> list[tuple[int, str]]:
    """``(size, version)`` of each file: from its listing entry in ``entries`` when given (what
    :func:`~nnh_data.shards.sources.listed_sources` found), else from one ``os.stat`` per local file
    or one listing per remote folder (a request per file is slow); ``FileNotFoundError``
    naming the first missing shard."""
    entries = entries or [None] * len(paths)
    listed = {p: (e["size"], file_version(e)) for p, e in zip(paths, entries) if e is not None}
    unlisted = [p for p in paths if p not in listed]
    local = isinstance(fs, LocalFileSystem)
    listed.update(_local_stats(unlisted) if local else _remote_stats(fs, unlisted))
    missing = [p for p in paths if p not in listed]
    if missing:
        raise FileNotFoundError(
            f"no such file or folder: {missing[0]!r} ({len(missing)} of {len(paths)} shards "
            "missing)"
        )
    return [listed[p] for p in paths]


def _remote_stats(fs: AbstractFileSystem, paths: Sequence[str]) -> dict[str, tuple[int, str]]:
    """``(size, version)`` of each file in the folders of ``paths``, by path: one listing per
    folder (``posixpath.dirname`` taken once per folder, not per path)."""
    heads = dict.fromkeys(path[: path.rfind("/") + 1] for path in paths)
    out = {}
    for folder in dict.fromkeys(map(posixpath.dirname, heads)):
        try:
            items = fs.ls(folder, detail=True)
        except FileNotFoundError:
            continue
        out.update({fs._strip_protocol(i["name"]): (i["size"], file_version(i)) for i in items})
    return out


def _local_stats(paths: Sequence[str]) -> dict[str, tuple[int, str]]:
    """``(size, version)`` of each local file that exists, by path: one ``os.stat`` each (links
    followed, as fsspec's ``info`` does; 10,000 shards: 25 ms, against 45 for ``os.scandir``
    and 0.3 s for fsspec's listing, which builds a dict per file). The version is
    :func:`file_version`'s ``mtime=``, what fsspec's listing gives."""
    out = {}
    for path in paths:
        try:
            stat = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):  # missing, or a dangling link
            continue
        out[path] = (stat.st_size, f"mtime={stat.st_mtime}")
    return out


_SCAN_BLOCK = 1 << 20
_SCAN_THREADS = 16


def build_shard_index(
    source: str | Sequence[str],
    *,
    format: str | None = None,
    storage_options: dict[str, Any] | None = None,
    index_path: str | None = None,
    rebuild: bool = False,
    on_error: str = "raise",
) -> ShardIndex:
    """Index the shards of ``source``: sample counts and seek positions, cached in a sidecar.

    Tar counts come from a header-only scan, Parquet counts from footers, Arrow IPC counts from
    the record batches' metadata (a local file memory-mapped, a remote one read). The sidecar
    (``nnh-index.json`` next to the first shard unless ``index_path`` is given) is reused for
    every shard whose size and version are unchanged and rewritten when something was scanned;
    creating it in a folder that had none says so once (a warning). Where the shards' folder
    is read-only or shared with others, pass ``index_path`` (any writable URL, e.g. a local
    file): a sidecar that cannot be saved is only kept in memory, with a warning, and every
    open then scans again.

    A damaged shard raises :class:`ShardError`; with ``on_error="skip"`` what can be read of it
    is indexed instead (tar: the samples before and after each damaged member, see
    :mod:`nnh_data.shards.tar_salvage`; Parquet: nothing when its footer is unreadable), its
    ``error`` and ``lost`` samples recorded in the sidecar, and a warning says how many were lost.

    >>> index = build_shard_index("data/train-{000000..000063}.tar")  # doctest: +SKIP
    >>> index.total_samples, index.offsets()[:3]  # doctest: +SKIP
    (64000, array([   0, 1000, 2000]))
    """
    check_choice("on_error", on_error, ("raise", "skip"))
    found = listed_sources(source, storage_options)
    urls = [url for url, _ in found]
    fs, paths = shard_filesystem(urls, storage_options)
    stats = file_stats(fs, paths, [entry for _, entry in found])  # first: a mistyped path
    formats = [detect_format(url, format) for url in urls]  # is missing, not of no format
    beside = index_path is None  # the sidecar goes into the shards' folder
    index_path = index_path or default_index_path(urls)
    entries = {} if rebuild else load_entries(index_path, storage_options)
    infos, problems = cached_infos(urls, formats, stats, entries, index_path)
    # A damaged shard from the sidecar is scanned again when it must raise; an entry of no
    # sample too (cheap: an empty shard holds nothing to scan): an edited count of 0 would
    # drop the shard's samples without a trace.
    empty = [i for i, info in enumerate(infos) if info and info.num_samples == 0 and not info.error]
    todo = [i for i, info in enumerate(infos)
            if info is None or info.error and on_error == "raise" or i in empty]  # fmt: skip

    def scan(i: int) -> ShardInfo:
        return _scan_or_salvage(fs, paths[i], urls[i], formats[i], stats[i], on_error)

    # Threads overlap remote requests; local scans are CPU-bound and run faster without them.
    threads = 1 if isinstance(fs, LocalFileSystem) else _SCAN_THREADS
    bar = tqdm(total=len(todo), desc="indexing shards", unit="shard", delay=1.0,
               disable=not todo or dist_info()[0] != 0)  # fmt: skip
    with bar, ThreadPoolExecutor(min(threads, max(1, len(todo)))) as pool:
        for i, info in zip(todo, pool.map(scan, todo)):
            infos[i] = info
            bar.update()
    for info in infos:
        if info.error is not None:
            warnings.warn(f"{info.url}: {info.loss} lost, {info.num_samples} indexed "
                          f"({info.error})", stacklevel=2)  # fmt: skip
    folder = index_path.rpartition("/")[0]
    problems.update({_entry_key(infos[i].url, folder): f"num_samples is 0, the shard holds "
                     f"{infos[i].num_samples}" for i in empty if infos[i].num_samples})  # fmt: skip
    _warn_invalid(index_path, problems)
    check_schemas(fs, paths, infos)
    updated = updated_entries(entries, infos, index_path) if todo else entries
    if updated != entries:
        _save_or_warn(index_path, updated, storage_options, note=beside)
    return ShardIndex(tuple(infos), index_path)


def _warn_invalid(index_path: str, problems: dict[str, str]) -> None:
    """Say which entries of the sidecar matched their shard but held no valid index of it
    (they were indexed again, and the sidecar is rewritten)."""
    if problems:
        (name, problem), more = next(iter(problems.items())), len(problems) - 1
        warnings.warn(
            f"shard index {index_path!r}: entry {name!r} is not a valid index of its shard "
            f"({problem})" + (f", nor are {more} other entries" if more else "")
            + "; indexed again (was the sidecar edited?)",
            stacklevel=3,
        )


def _save_or_warn(
    index_path: str, entries: dict, storage_options: dict | None, *, note: bool
) -> None:
    """Save the sidecar; with ``note``, say so when it is new; warn (keeping it in memory)
    when it cannot be saved."""
    fs, path = url_to_fs(index_path, **(storage_options or {}))
    try:
        new = note and not fs.exists(path)
        save_entries(index_path, entries, storage_options)
    except OSError as exc:  # a read-only dataset is still readable, only slower to open
        warnings.warn(
            f"could not save the shard index to {index_path!r} ({exc}); it is kept in memory "
            "for this process only, so every open scans the shards again: pass index_path= a "
            "writable file (e.g. on local disk) to keep it",
            stacklevel=3,
        )
        return
    if new:
        logger.info(
            "wrote the shard index %r beside the shards (their sample counts and seek "
            "positions, reused while they are unchanged); pass index_path= to keep it "
            "elsewhere, e.g. for a read-only or shared folder",
            index_path,
        )


def _scan_or_salvage(
    fs: AbstractFileSystem,
    path: str,
    url: str,
    format: str,
    stat: tuple[int, str],
    on_error: str,
) -> ShardInfo:
    try:
        return scan_shard(fs, path, url, format, stat)
    except ShardError as exc:
        if on_error == "raise":
            raise
        return salvage_shard(fs, path, url, format, stat, exc)


def scan_shard(
    fs: AbstractFileSystem, path: str, url: str, format: str, stat: tuple[int, str]
) -> ShardInfo:
    """Index one shard (``path`` on ``fs``; ``stat`` its size and version from
    :func:`file_stats`); raises :class:`ShardError`."""
    size, version = stat
    if format == "arrow":
        try:
            table = open_ipc(fs, path)
        except (pa.ArrowException, OSError) as exc:
            what = _content(fs, path, "Arrow IPC") or f"unreadable Arrow IPC file ({exc})"
            raise ShardError(url, "header", what) from exc
        nullable, schema = null_columns(table), schema_digest(table.schema)
        return ShardInfo.from_offsets(url, format, arrow_offsets(table), size, version, nullable,
                                      schema)  # fmt: skip
    if format == "parquet":
        try:
            metadata = pq.read_metadata(path, filesystem=fs)
        except (pa.ArrowException, OSError) as exc:
            what = _content(fs, path, "Parquet") or f"unreadable Parquet file ({exc})"
            raise ShardError(url, "footer", what) from exc
        offsets = [0, *itertools.accumulate(row_group_rows(metadata))]
        nullable = _nullable_columns(metadata)
        schema = schema_digest(metadata.schema.to_arrow_schema())
        data = sum(metadata.row_group(g).total_byte_size for g in range(metadata.num_row_groups))
        return ShardInfo.from_offsets(url, format, offsets, size, version, nullable, schema, data)
    try:
        offsets = _scan_tar(fs, path, size)
    except TarFormatError as exc:
        if (what := _content(fs, path, "tar")) is not None:  # gzip, Parquet, ... not a tar
            raise ShardError(url, "byte 0", what) from exc
        raise ShardError(url, f"byte {exc.offset}", exc.reason) from exc
    return ShardInfo.from_offsets(url, format, offsets, size, version)


def salvage_shard(
    fs: AbstractFileSystem,
    path: str,
    url: str,
    format: str,
    stat: tuple[int, str],
    error: ShardError,
) -> ShardInfo:
    """What can be indexed of a shard that :func:`scan_shard` found damaged (``error``): the
    readable tar samples (:func:`~nnh_data.shards.tar_salvage.salvage_tar`); nothing of a Parquet
    file without a readable footer, of an unreadable Arrow file or of a file that is not a
    tar."""
    size, version = stat
    what = f"{error.reason} (at {error.position})"
    empty = ShardInfo(url, format, 0, "", size, what, version, lost_exact=False)
    if format != "tar" or content_format(fs.cat_file(path, start=0, end=BLOCK)) not in (
        None, "a tar file"
    ):  # fmt: skip
        return empty
    found = salvage_tar(_reader(fs, path), size)
    info = ShardInfo.from_offsets(url, format, found.offsets, size, version)
    reasons = found.reasons or [what]
    more = f" and {len(reasons) - 1} more damaged spans" if len(reasons) > 1 else ""
    return replace(info, error=reasons[0] + more, lost=found.lost,
                   lost_exact=found.exact, gaps=tuple(found.gaps))  # fmt: skip


def _reader(fs: AbstractFileSystem, path: str) -> Callable[[int, int], bytes]:
    """``read(start, stop)``: those bytes of the file."""
    return functools.partial(_read, fs, path)


def _read(fs: AbstractFileSystem, path: str, start: int, stop: int) -> bytes:
    return fs.cat_file(path, start=start, end=stop)


def _content(fs: AbstractFileSystem, path: str, expected: str) -> str | None:
    """What a file that failed to read as ``expected`` is, by its first bytes, when that is
    not ``expected``: compressed, Parquet, Arrow, tar, zip (or, for tar, no tar header at all); None
    when they look right."""
    what = content_format(fs.cat_file(path, start=0, end=BLOCK))
    if what is not None and what.endswith(f" {expected} file"):
        return None
    if what is None:
        return "not a tar file: its first block is no tar header" if expected == "tar" else None
    if what in ("a tar file", "a Parquet file", "an Arrow IPC file"):
        return f"{what}, not {expected}: pass format={what.split()[1].lower()!r}"
    return what if "not supported" in what else f"{what}, not {expected}"


def schema_digest(schema: pa.Schema) -> str:
    """16 hex digits of a hash of the column names and types of ``schema`` (not their order,
    nullability or metadata, which do not change what a batch holds)."""
    columns = sorted([field.name, str(field.type)] for field in schema)
    return hashlib.sha256(json.dumps(columns).encode()).hexdigest()[:16]


def check_schemas(fs: AbstractFileSystem, paths: Sequence[str], infos: Sequence[ShardInfo]) -> None:
    """A column that several Parquet or Arrow shards hold has one type in all of them (a
    column all null in a shard, of type null there, fits any type): otherwise its samples
    would have several types and batches mix them (``large_string`` and ``string`` are one
    type here, and so are the two binaries). A shard may lack columns others have (its
    samples then lack them too). A ``ValueError`` names the column and two shards that differ.
    Only the first shard of each schema digest is read (its footer, or an Arrow file's schema),
    and only when digests differ."""
    firsts: dict[str, int] = {}
    for i, info in enumerate(infos):
        if info.schema:
            firsts.setdefault(info.schema, i)
    if len(firsts) < 2:
        return
    known: dict[str, tuple[pa.DataType, str]] = {}  # column: its type, and a shard holding it
    for i in firsts.values():
        url = infos[i].url
        for field in _schema(fs, paths[i], infos[i].format):
            have, other = known.get(field.name, (pa.null(), url))
            if pa.types.is_null(have):
                known[field.name] = field.type, url
            elif _plain(field.type) != _plain(have) and not pa.types.is_null(field.type):
                raise ValueError(f"shards differ in column {field.name!r}: {other} "
                                 f"holds {have}, {url} holds {field.type}; a column needs one "
                                 "type in every shard (cast it when writing them)")  # fmt: skip


def _plain(type_: pa.DataType) -> pa.DataType:
    """``type_`` with the 64-bit-offset text and bytes types as their plain ones: writers
    choose between them by size, and their values are the same."""
    if pa.types.is_large_string(type_):
        return pa.string()
    return pa.binary() if pa.types.is_large_binary(type_) else type_


def _schema(fs: AbstractFileSystem, path: str, format: str) -> pa.Schema:
    if format == "parquet":
        return pq.read_schema(path, filesystem=fs)
    return open_ipc(fs, path).schema


def row_group_rows(metadata: pq.FileMetaData) -> list[int]:
    return [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]


def _nullable_columns(metadata: pq.FileMetaData) -> list[str]:
    """Top-level columns with a null in some row group, or without statistics to tell."""
    found: dict[str, None] = {}
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        for c in range(group.num_columns):
            column = group.column(c)
            stats = column.statistics
            if stats is None or not stats.has_null_count or stats.null_count > 0:
                found[column.path_in_schema.split(".")[0]] = None
    return list(found)


def _scan_tar(fs: AbstractFileSystem, path: str, size: int) -> tuple[int, ...]:
    """Sample start offsets (then the end) from the headers alone: blocks are read around each
    header and member data is skipped unless it is a PAX or GNU long-name record."""
    starts: list[int] = []
    key = None
    pos = 0
    block = _SCAN_BLOCK
    while pos < size:
        buf = fs.cat_file(path, start=pos, end=min(pos + block, size))
        try:
            parsed = parse_samples(buf, 0, len(buf), need_data=False, key=key)
        except TarFormatError as exc:
            raise TarFormatError(pos + exc.offset, exc.reason) from None
        starts.extend(pos + start for start in parsed.starts)
        key = parsed.key
        if parsed.end:
            end = pos + parsed.stop
            tail = buf[parsed.stop :]  # usually the whole tail: zeros up to a 10 KiB record
            read = _reader(fs, path)
            if tail.count(0) != len(tail) or data_after_end(read, pos + len(buf), size):
                raise TarFormatError(end, AFTER_END.format(end))
            return (*starts, end)
        if pos + parsed.stop > size or pos + len(buf) == size and parsed.stop < len(buf):
            raise TarFormatError(size, "truncated tar (unexpected end of file)")
        block = block * 2 if parsed.stop == 0 else _SCAN_BLOCK
        pos += parsed.stop
    return (*starts, size)
