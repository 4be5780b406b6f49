"""Write samples as WebDataset tar shards, with their index.

Members are plain ustar (mtime 0, a PAX header only where a long or non-ASCII name or a huge
size needs one), so readers parse half the bytes of ``webdataset.ShardWriter``'s default
output (a PAX header per member). The layout is webdataset's: ``key.field`` members, fields in
sorted order, samples one after another. Each shard is written under a temporary name and
renamed when complete; the index sidecar is written at the end.

Keys become member paths, and tar tools extract members to those paths, so a key that would
leave the folder it is extracted into (an absolute path, a ``..`` part) or that a tar name cannot
hold (a NUL) is refused, never rewritten: a renamed key would silently be another sample's id.
Folders given to convert are read without following symbolic links unless asked
(``follow_symlinks=True``): a link inside the folder may point anywhere on the machine. Only
regular files are read: a FIFO would block the reader forever and a device such as /dev/zero
never ends, so special files (and links to them) are skipped and counted in a warning.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import stat
import tarfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from webdataset.writer import make_encoder

from nnh_data.atomic import temporary_name
from nnh_data.checks import check_int
from nnh_data.shards.arrow import open_ipc
from nnh_data.shards.index import (
    INDEX_NAME,
    ShardIndex,
    ShardInfo,
    default_index_path,
    file_version,
    load_entries,
    save_entries,
    updated_entries,
)
from nnh_data.shards.sources import detect_format, expand_sources
from nnh_data.shards.tar_members import BLOCK, split_name

__all__ = [
    "count_directory_samples",
    "count_parquet_samples",
    "count_table_samples",
    "directory_samples",
    "parquet_samples",
    "table_samples",
    "write_shards",
]

_END = bytes(2 * BLOCK)


def write_shards(
    samples: Iterable[dict],
    pattern: str,
    *,
    max_count: int = 100_000,
    max_bytes: int = 3_000_000_000,
    start_shard: int = 0,
    encoder: bool | dict | Callable = True,
    storage_options: dict[str, Any] | None = None,
    index_path: str | None = None,
) -> ShardIndex:
    """Write ``samples`` to tar shards named ``pattern % shard_number`` and index them.

    Each sample is a dict with ``__key__`` and one value per field; values are encoded like
    ``webdataset.TarWriter`` does (``encoder``: True for its default, by extension: bytes and
    str as they are, "cls" ints as text, "json" as JSON, ...; False for none; a dict or a
    callable). Keys starting with "_" are metadata and are not written. A shard holds at most
    ``max_count`` samples and ``max_bytes`` bytes (unless one sample alone is larger).

    >>> samples = ({"__key__": f"{i:06d}", "txt": f"sample {i}"} for i in range(10))
    >>> index = write_shards(samples, "out/train-%06d.tar", max_count=4)  # doctest: +SKIP
    >>> [info.num_samples for info in index.shards]  # doctest: +SKIP
    [4, 4, 2]
    """
    check_int("max_count", max_count, low=1)
    check_int("max_bytes", max_bytes, low=BLOCK)
    check_int("start_shard", start_shard, low=0)
    _check_pattern(pattern)
    encode = make_encoder(encoder)
    fs, _ = url_to_fs(pattern % start_shard, **(storage_options or {}))
    infos: list[ShardInfo] = []
    shard: _ShardFile | None = None
    previous_key = None
    try:
        for sample in samples:
            key, data = _encode_sample(encode(sample), previous_key)
            previous_key = key
            if shard is not None and (
                shard.count == max_count or shard.size + len(data) + len(_END) > max_bytes
            ):
                infos.append(shard.close())
                shard = None
            if shard is None:
                shard = _ShardFile(fs, pattern % (start_shard + len(infos)))
            shard.add(data)
    except BaseException:
        if shard is not None:
            shard.abort()  # leave no partial shard behind
        raise
    if shard is not None:
        infos.append(shard.close())
    if not infos:
        return ShardIndex(())
    index_path = index_path or default_index_path([info.url for info in infos])
    entries = updated_entries(load_entries(index_path, storage_options), infos, index_path)
    save_entries(index_path, entries, storage_options)
    return ShardIndex(tuple(infos), index_path)


def _check_pattern(pattern: str) -> None:
    try:
        numbered = pattern % 0 != pattern % 1
    except TypeError:
        numbered = False
    if not numbered:
        raise ValueError(f"pattern must hold one shard number field like %06d, got {pattern!r}")


def _encode_sample(sample: dict, previous_key: str | None) -> tuple[str, bytes]:
    """One sample's members as tar bytes; checks that a reader will see the same sample."""
    key = sample.get("__key__")
    if not isinstance(key, str) or not key:
        raise ValueError(f"each sample needs a non-empty str __key__, got {key!r}")
    _check_key(key)
    if key == previous_key:
        raise ValueError(f"consecutive samples share __key__ {key!r}: readers would merge them")
    parts = []
    for field in sorted(k for k in sample if not k.startswith("_")):
        name = f"{key}.{field}"
        if split_name(name) != (key, field):
            raise ValueError(
                f"sample {key!r}: member name {name!r} would read back as key and field "
                f"{split_name(name)}; use no '.' in the key's last part and lower-case fields"
            )
        parts.extend(_member(name, sample[field]))
    if not parts:
        raise ValueError(f"sample {key!r} has no field to write: a tar holds only its members")
    return key, b"".join(parts)


def _check_key(key: str) -> None:
    """Refuse a key that, as a member path, would be written outside the folder a tar tool
    extracts into, or that a tar name cannot hold (see the module docstring)."""
    parts = key.split("/")
    if key.startswith("/") or ".." in parts or "\0" in key:
        raise ValueError(
            f"sample key {key!r} is not a safe relative path (it starts with '/', has a '..' "
            "part or a NUL): tar tools would extract it outside their folder, so it is refused "
            "rather than renamed; give the sample a relative key"
        )


def _member(name: str, value: Any) -> list[bytes]:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ValueError(f"{name}: the encoder gave {type(value).__name__}, expected bytes")
    info = tarfile.TarInfo(name)
    info.size = len(value)
    info.mode = 0o444
    header = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    return [header, bytes(value), bytes(-len(value) % BLOCK)]


class _ShardFile:
    """One shard being written under a temporary name; ``close`` renames it into place."""

    def __init__(self, fs: AbstractFileSystem, url: str) -> None:
        self.fs = fs
        self.url = url
        self.path = fs._strip_protocol(url)
        self.temporary = temporary_name(self.path)
        fs.makedirs(posixpath.dirname(self.path), exist_ok=True)
        self.file = fs.open(self.temporary, "wb")
        self.offsets = [0]
        self.count = 0

    @property
    def size(self) -> int:
        return self.offsets[-1]

    def add(self, data: bytes) -> None:
        self.file.write(data)
        self.offsets.append(self.size + len(data))
        self.count += 1

    def abort(self) -> None:
        self.file.close()
        self.fs.rm(self.temporary)

    def close(self) -> ShardInfo:
        self.file.write(_END)
        self.file.close()
        self.fs.mv(self.temporary, self.path)
        size = self.size + len(_END)
        version = file_version(self.fs.info(self.path))  # as the index's listing will see it
        return ShardInfo.from_offsets(self.url, "tar", self.offsets, size, version)


def directory_samples(
    url: str,
    storage_options: dict[str, Any] | None = None,
    exclude: str | None = None,
    start: int = 0,
    stop: int | None = None,
    *,
    follow_symlinks: bool = False,
) -> Iterator[dict]:
    """Samples from a folder of files, grouped by key like a tar shard: ``a/1.jpg`` and
    ``a/1.cls`` become ``{"__key__": "a/1", "jpg": ..., "cls": ...}``, keys in sorted order;
    only samples ``[start, stop)`` of that order are read.

    Index sidecars, temporary files and files matching ``exclude`` (the output shard pattern
    of a convert, ``%``-style) are never inputs, so a convert that writes inside its source
    can run again. Symbolic links (to files or folders) are skipped with a warning unless
    ``follow_symlinks``: a link may lead out of the folder, to files nobody meant to pack."""
    fs, grouped = _grouped_files(url, storage_options, exclude, follow_symlinks)
    for key in sorted(grouped)[start:stop]:
        fields = grouped[key]
        yield {"__key__": key, **{field: fs.cat_file(path) for field, path in fields.items()}}


def count_directory_samples(
    url: str,
    storage_options: dict[str, Any] | None = None,
    exclude: str | None = None,
    *,
    follow_symlinks: bool = False,
) -> int:
    """How many samples :func:`directory_samples` yields (from one listing, no reads)."""
    return len(_grouped_files(url, storage_options, exclude, follow_symlinks)[1])


def _grouped_files(
    url: str, storage_options: dict[str, Any] | None, exclude: str | None, follow: bool
) -> tuple[AbstractFileSystem, dict[str, dict[str, str]]]:
    fs, root = url_to_fs(url, **(storage_options or {}))
    root = root.rstrip("/")
    skipped = _output_pattern(fs, exclude)
    grouped: dict[str, dict[str, str]] = {}
    for path in _files(fs, root, url, follow):
        name = path.rsplit("/", 1)[-1]
        if name == INDEX_NAME or name.startswith(".") or skipped and skipped.fullmatch(path):
            continue
        key, field = split_name(path[len(root) + 1 :])
        if key is not None:
            grouped.setdefault(key, {})[field] = path
    if not grouped:
        raise FileNotFoundError(f"no files named like key.field under {url!r}")
    return fs, grouped


def _files(fs: AbstractFileSystem, root: str, url: str, follow: bool) -> list[str]:
    """The regular files under ``root``, sorted; on a local disk symbolic links (unless
    ``follow``) and special files are skipped, with a warning that counts them."""
    if not isinstance(fs, LocalFileSystem):
        return sorted(fs.find(root))
    files, links, special = [], [], []
    for folder, dirs, names in os.walk(root, followlinks=follow):
        for name in [*dirs, *names]:
            path = posixpath.join(folder, name)
            if not follow and os.path.islink(path):
                links.append(path)
            elif name in names:
                (files if stat.S_ISREG(os.stat(path).st_mode) else special).append(path)
    if links:
        warnings.warn(
            f"skipped {len(links)} symbolic link(s) in {url!r}, e.g. {links[0]!r}: a link may "
            "lead out of the folder; pass follow_symlinks=True (nnh-data convert "
            "--follow-symlinks) to read what they point to",
            stacklevel=4,
        )
    if special:
        warnings.warn(
            f"skipped {len(special)} special file(s) in {url!r} (a FIFO, socket or device, or a "
            f"link to one), e.g. {special[0]!r}: only regular files are read",
            stacklevel=4,
        )
    return sorted(files)


def _output_pattern(fs: AbstractFileSystem, pattern: str | None) -> re.Pattern | None:
    """The paths ``pattern % n`` names, as a regular expression."""
    if pattern is None:
        return None
    path = fs._strip_protocol(pattern)
    parts = re.split(r"%0?\d*d", path)
    return re.compile(r"\d+".join(map(re.escape, parts)))


def table_samples(
    source: str | Sequence[str],
    storage_options: dict[str, Any] | None = None,
    start: int = 0,
    stop: int | None = None,
) -> Iterator[dict]:
    """Samples from the rows ``[start, stop)`` (counted over the files in order) of Parquet or
    Arrow IPC files (a ``datasets`` ``save_to_disk`` folder included), one field per column,
    named so that the value keeps its type when read back (as webdataset decodes by
    extension): binary as it is (the column name is the field), strings as ``.txt``, integers
    as ``.cls``, a Hugging Face ``Image()`` value as its image file (``image.jpg``: the
    extension of its path, else of its format; the path read relative to the file when its
    bytes are null), everything else (floats, booleans, lists, structs) as ``.json``; a null
    leaves the field out of that sample, and a row with only nulls is left out (with a warning:
    a tar sample needs a member). The key is the ``__key__`` column, else the file's stem and
    the row number."""
    first = 0
    for url in expand_sources(source, storage_options):
        fs, path = url_to_fs(url, **(storage_options or {}))
        table = _TableFile(fs, path, detect_format(url))
        high = table.rows if stop is None else min(stop - first, table.rows)
        low, first = max(start - first, 0), first + table.rows
        if low < high:
            yield from _table_rows(url, table, low, high)


def count_table_samples(
    source: str | Sequence[str], storage_options: dict[str, Any] | None = None
) -> int:
    """The rows of the Parquet or Arrow IPC files of ``source`` (from their metadata)."""
    total = 0
    for url in expand_sources(source, storage_options):
        fs, path = url_to_fs(url, **(storage_options or {}))
        total += _TableFile(fs, path, detect_format(url)).rows
    return total


parquet_samples = table_samples  # the names of Parquet-only days
count_parquet_samples = count_table_samples


class _TableFile:
    """A Parquet or Arrow IPC file: its schema, row count and record batches."""

    def __init__(self, fs: AbstractFileSystem, path: str, format: str) -> None:
        if format == "arrow":
            self._table = open_ipc(fs, path)
            self.schema, self.rows = self._table.schema, self._table.num_rows
        else:
            self._parquet = pq.ParquetFile(path, filesystem=fs)
            self.schema, self.rows = self._parquet.schema_arrow, self._parquet.metadata.num_rows
        self.fs = fs

    def batches(self) -> Iterator[pa.RecordBatch]:
        if hasattr(self, "_table"):
            return iter(self._table.to_batches())
        return self._parquet.iter_batches()


def _table_rows(url: str, table: _TableFile, low: int, high: int) -> Iterator[dict]:
    stem = url.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    fields = {f.name: _field_name(f) for f in table.schema if f.name != "__key__"}
    folder = url.rsplit("/", 1)[0] if "/" in url else "."
    row = 0
    for batch in table.batches():
        if row + batch.num_rows <= low:
            row += batch.num_rows
            continue
        for record in batch.to_pylist():
            if low <= row < high:
                key = record.pop("__key__", None)
                values = dict(_member_of(k, fields[k], v, folder, table.fs)
                              for k, v in record.items() if v is not None)  # fmt: skip
                values.pop(None, None)  # an Image() value with neither bytes nor path
                key = f"{stem}/{row}" if key is None else str(key)
                if values:
                    yield {"__key__": key, **values}
                else:
                    warnings.warn(f"{url}: row {key!r} holds only nulls; left out", stacklevel=2)
            row += 1
        if row >= high:
            return


def _field_name(field: pa.Field) -> str | None:
    """The tar field of a column (None for a Hugging Face ``Image()`` column: named per value,
    by :func:`_member_of`)."""
    kind = field.type
    if pa.types.is_struct(kind) and {kind.field(i).name for i in range(kind.num_fields)} == {
        "bytes", "path"
    }:  # fmt: skip
        return None
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return field.name
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        suffix = "txt"
    elif pa.types.is_integer(kind):
        suffix = "cls"
    else:
        suffix = "json"
    name = field.name
    return name if name == suffix or name.endswith("." + suffix) else f"{name}.{suffix}"


def _member_of(
    column: str, field: str | None, value: Any, folder: str, fs: AbstractFileSystem
) -> tuple[str | None, bytes]:
    """A column's value as a tar member: its field name (None to leave it out) and bytes; an
    ``Image()`` value (``field`` None) as its image file."""
    if field is not None:
        return field, _as_bytes(value)
    data, path = value["bytes"], value["path"]
    if data is None and path is None:
        return None, b""
    if data is None:
        local = "://" in path or path.startswith("/")
        with fs.open(path if local else f"{folder}/{path}", "rb") as file:
            data = file.read()
    extension = path.rsplit(".", 1)[-1].lower() if path and "." in path.rsplit("/", 1)[-1] else \
        next((ext for magic, ext in _IMAGE_MAGIC if data.startswith(magic)), "bin")  # fmt: skip
    return f"{column}.{extension}", data


_IMAGE_MAGIC = ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG", "png"), (b"GIF8", "gif"), (b"BM", "bmp"),
                (b"RIFF", "webp"), (b"II*\x00", "tif"), (b"MM\x00*", "tif"))  # fmt: skip


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return json.dumps(value).encode()
