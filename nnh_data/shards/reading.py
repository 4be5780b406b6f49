"""Reading shards: any sample range of a tar, Parquet or Arrow IPC shard, through its index.

The dataset layer works on sample ranges ``[start, stop)`` of a shard: a :class:`ShardReader`
(one per pass; :func:`fetch_shard_range` for a single read) does the I/O, one ranged read for
tar and, for Parquet and Arrow, the rows as columns (:mod:`nnh_data.shards.parquet`,
:mod:`nnh_data.shards.arrow`);
:func:`decode_shard_range` turns the payload into sample dicts and :func:`decode_shard_columns`
into columns. The index that makes ranges seekable, and :class:`ShardError`, live in
:mod:`nnh_data.shards.index` (re-exported here); tar parsing lives in :mod:`nnh_data.shards.tar`.

>>> index = build_shard_index("data/train-{000000..000003}.tar")
>>> info = index.shards[0]
>>> [s["__key__"] for s in iter_shard_samples(info, 0, 2)]
['000000', '000001']
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from nnh_data.checks import check_int
from nnh_data.columns import Columns, as_list, columns_of, rows_of
from nnh_data.errors import ShardError, StaleIndexError, TarFormatError
from nnh_data.shards.arrow import ArrowReader
from nnh_data.shards.index import ShardIndex, ShardInfo, build_shard_index
from nnh_data.shards.parquet import ParquetReader
from nnh_data.shards.retries import is_transient, remote_fs, retrying
from nnh_data.shards.sources import expand_sources, is_local
from nnh_data.shards.tar import parse_samples
from nnh_data.shards.tar_members import BLOCK, ZERO_BLOCK, Parsed

__all__ = [
    "ShardIndex",
    "ShardInfo",
    "ShardReader",
    "build_shard_index",
    "decode_shard_columns",
    "decode_shard_range",
    "decode_tar_each",
    "expand_sources",
    "fetch_shard_range",
    "iter_shard_samples",
    "split_shard_range",
]

_BUFFER_STEP = 64 << 10  # read buffers are made in multiples of this
# a larger block (one large sample) is read into memory of its own, let go of once decoded: a
# reused buffer keeps its size for the whole pass
_REUSED_BYTES = 4 << 20
# buffers a reader keeps for reuse: blocks whose values are held as views (batches of a shuffle
# window, kept by the caller) keep theirs; past this many, a block gets memory of its own
_KEPT_BUFFERS = 16
_CHUNK_BYTES = 16 << 20  # a decoded piece holds its bytes twice (payload and samples)


def split_shard_range(
    info: ShardInfo, start: int = 0, stop: int | None = None, *, max_bytes: int = _CHUNK_BYTES
) -> list[tuple[int, int]]:
    """Cut ``[start, stop)`` into consecutive sub-ranges small enough to hold in memory.

    Tar pieces stay under ``max_bytes`` (or hold one sample); Parquet and Arrow pieces are
    whole row groups or record batches (cut at ``start`` and ``stop``), as many as fit in
    ``max_bytes`` at the file's average bytes per row once decoded (what a Parquet footer
    declares, or the size when larger), and a row group or batch larger than that is cut into
    pieces of that many rows (at least one): a Parquet reader decodes a row group in batches,
    continuing from one piece to the next.
    """
    stop = info.num_samples if stop is None else stop
    offsets = info.offsets
    if info.format != "tar":
        rows = max(1, max_bytes * info.num_samples // max(1, info.size, info.data_bytes))
    pieces = []
    while start < stop:
        if info.format == "tar":
            end = max(start + 1, _piece(offsets, offsets[start] + max_bytes))
        elif start + rows >= stop:
            end = stop
        else:  # the last row group boundary within the rows that fit, else cut the group
            end = int(offsets[_piece(offsets, start + rows)])
            end = end if end > start else start + rows
        pieces.append((start, min(stop, end)))
        start = min(stop, end)
    return pieces


def _piece(offsets: np.ndarray, position: int) -> int:
    """The index of the piece (tar sample, Parquet row group) that holds ``position``."""
    return int(np.searchsorted(offsets, position, "right")) - 1


class ShardReader:
    """Reads what sample ranges of shards need, for one pass of one worker (one thread at a
    time): tar byte ranges in one read each, Parquet rows through a :class:`ParquetReader`
    that keeps the shard being read open. ``nullable``: the Parquet columns to give as lists
    (default: each shard's own ``info.nullable``; a dataset passes the union over its shards,
    so a column has one type in every batch); ``arrow``: Parquet columns that are not numpy
    arrays stay Arrow arrays (for batches)."""

    def __init__(
        self,
        storage_options: dict[str, Any] | None = None,
        nullable: Sequence[str] | None = None,
        arrow: bool = False,
    ) -> None:
        self.storage_options, self.nullable, self.arrow = storage_options, nullable, arrow
        self._parquet = ParquetReader(storage_options, nullable, arrow)
        self._arrow = ArrowReader(storage_options, nullable, arrow)
        self._failed: dict[str, ShardError] = {}  # remote shards whose reads gave up
        self._local: tuple[str, BinaryIO | None] | None = None  # the tar shard being read
        self._buffers: list[bytearray] = []  # read buffers of fetch_block, reused when free

    def fetch(
        self, info: ShardInfo, start: int, stop: int, file: BinaryIO | None = None
    ) -> bytes | Columns:
        """See :func:`fetch_shard_range`; ``file``: a local copy of the shard (a node-local
        cache's, opened by the caller) to read instead of its URL. A remote read is tried
        again on transient errors (:mod:`nnh_data.shards.retries`); once a shard's read gave up, its
        later reads in this pass raise the same error at once."""
        check_int("start", start, low=0, high=info.num_samples)
        check_int("stop", stop, low=start, high=info.num_samples)
        if file is not None or is_local(info.url):
            return self._read(info, start, stop, file)
        if info.url in self._failed:
            raise self._failed[info.url]
        try:
            read = functools.partial(self._read, info, start, stop, None)
            return retrying(read, info.url, f"sample {start}")
        except ShardError as exc:
            if is_transient(exc):
                self._failed[info.url] = exc
            raise

    def fetch_block(self, info: ShardInfo, start: int, stop: int) -> bytes | memoryview | Columns:
        """:meth:`fetch` for a pass that is done with each block before it reads the next: a
        local tar range comes as a view of one of this reader's read buffers, reused once
        nothing holds its last view, instead of new memory per block, which the kernel maps and
        zero-fills page by page (20,000 page faults and 12-15% of the CPU of a pass over 100,000
        samples of 3 KiB). A view is valid while it is held: a buffer with a view alive (a
        read-ahead thread's blocks in flight, a block kept, values decoded as Arrow views of
        it) is never read into. A block of more than 4 MiB (a large sample), or one read while
        16 buffers are held, comes in memory of its own."""
        check_int("start", start, low=0, high=info.num_samples)
        check_int("stop", stop, low=start, high=info.num_samples)
        if info.format != "tar" or not is_local(info.url):
            return self.fetch(info, start, stop)
        return self._read(info, start, stop, None, reuse=True)

    def _read(
        self, info: ShardInfo, start: int, stop: int, file: BinaryIO | None, reuse: bool = False
    ) -> bytes | memoryview | Columns:
        if info.format == "parquet":
            return self._parquet.read(info, start, stop, file)
        if info.format == "arrow":
            return self._arrow.read(info, start, stop, file)
        low, high = int(info.offsets[start]), int(info.offsets[stop])
        # The shard's last range also reads the block after it: the end-of-archive marker there
        # proves the index saw every sample (a rewritten shard often keeps its size).
        end = high + BLOCK if stop == info.num_samples and high + BLOCK <= info.size else high
        if low == end:
            return b""
        try:
            file = file or self._local_file(info.url)
            if file is not None and reuse and end - low <= _REUSED_BYTES:
                data = self._read_into_buffer(file.fileno(), end - low, low)
            elif file is not None:
                data = os.pread(file.fileno(), end - low, low)
            else:
                fs, path = remote_fs(info.url, self.storage_options)
                data = fs.cat_file(path, start=low, end=end)
        except OSError as exc:
            raise ShardError(info.url, _tar_position(info, low), f"unreadable ({exc})") from exc
        if len(data) < end - low:
            position = _tar_position(info, low + len(data))
            raise ShardError(info.url, position, "truncated tar (unexpected end of file)")
        return data

    def _read_into_buffer(self, fd: int, size: int, offset: int) -> memoryview:
        """Up to ``size`` bytes at ``offset`` read into a free buffer (one no view holds: its
        only references are this reader's list and the argument of ``getrefcount``), a view of
        them."""
        buffers = self._buffers
        free = (i for i in range(len(buffers)) if sys.getrefcount(buffers[i]) <= 2)
        number = next(free, len(buffers))
        if number == len(buffers) == _KEPT_BUFFERS:
            buffer = bytearray(size)
        elif number == len(buffers) or len(buffers[number]) < size:
            buffer = bytearray(-(-size // _BUFFER_STEP) * _BUFFER_STEP)  # a shard's last block
            buffers[number : number + 1] = [buffer]  # reads the end marker too: a little more
        else:
            buffer = buffers[number]
        view = memoryview(buffer)[:size]
        return view[: os.preadv(fd, [view], offset)]

    def _local_file(self, url: str) -> BinaryIO | None:
        """The tar shard at ``url`` opened, when it is a file on the local disk (kept open
        while its blocks are read: no fsspec filesystem, open, seek and close per block; a
        plain path is opened as it is); else None."""
        if self._local is None or self._local[0] != url:
            self._let_go_of_local()
            if "://" in url or url.startswith("~"):  # a protocol, or a home for fsspec to expand
                fs, path = remote_fs(url, self.storage_options)
                path = path if isinstance(fs, LocalFileSystem) else None
            else:
                path = url
            self._local = url, None if path is None else open(path, "rb", buffering=0)
        return self._local[1]

    def _let_go_of_local(self) -> None:
        local, self._local = self._local, None
        if local is not None and local[1] is not None:
            local[1].close()

    def close(self) -> None:
        """Let go of open files."""
        self._parquet.close()
        self._arrow.close()
        self._let_go_of_local()

    def __del__(self) -> None:  # a pass's reader is dropped, not closed: its shard goes with it
        if getattr(self, "_local", None) is not None:
            self._let_go_of_local()


def fetch_shard_range(
    info: ShardInfo,
    start: int,
    stop: int,
    *,
    storage_options: dict[str, Any] | None = None,
    nullable: Sequence[str] | None = None,
) -> bytes | Columns:
    """Read what samples ``[start, stop)`` of the shard need.

    Tar: their byte range in one read (``bytes``). Parquet: their rows as columns, ``__key__``
    added (the file's stem and row number unless the file has a ``__key__`` column); numeric
    and boolean columns as numpy arrays except those named in ``nullable`` (default: the
    shard's own ``info.nullable``), which come, like every other type, as Arrow arrays
    (``to_pylist()`` gives their Python values, ``None`` for nulls). Raises
    :class:`ShardError` when the shard cannot be read and :class:`StaleIndexError` when it does
    not match its index. To read many ranges, keep one :class:`ShardReader` (it keeps a
    Parquet file open between reads).
    """
    reader = ShardReader(storage_options, nullable)
    try:
        return reader.fetch(info, start, stop)
    finally:
        reader.close()


def decode_shard_range(
    info: ShardInfo, payload: bytes | Columns, start: int, stop: int
) -> Iterator[dict]:
    """Samples ``[start, stop)`` from the payload of :func:`fetch_shard_range`, in shard order.

    Tar samples hold ``__key__`` and one ``bytes`` value per member, named by its extension as
    webdataset names it ("jpg", "seg.png"); Parquet and Arrow samples hold one Python value per
    column and ``__key__`` (the ``__key__`` column, else the row number in the shard).
    """
    if info.format != "tar":
        return iter(rows_of(list(payload), list(map(as_list, payload.values()))))
    return iter(_decode_tar(info, payload, start, stop))


def _decode_tar(info: ShardInfo, buf: bytes, start: int, stop: int) -> list[dict]:
    return _parsed_tar(info, buf, start, stop, as_columns=False).samples


def _parsed_tar(
    info: ShardInfo,
    buf: bytes | memoryview,
    start: int,
    stop: int,
    as_columns: bool,
    views: bool = False,
) -> Parsed:
    """Samples ``[start, stop)`` parsed (:func:`parse_samples`), checked against the index."""
    base = int(info.offsets[start])
    buf, size, offsets = _tar_payload(info, buf, start, stop)
    try:
        parsed = parse_samples(buf, 0, size, as_columns=as_columns, views=views)
    except TarFormatError as exc:
        position = _position(info, start, offsets, exc.offset)
        raise ShardError(info.url, position, exc.reason) from exc
    if parsed.columns is None:
        keys = [sample["__key__"] for sample in parsed.samples]
    else:
        keys = parsed.columns["__key__"]
    if parsed.stop != size or len(keys) != stop - start:
        found = f"{len(keys)} samples ending at byte {base + parsed.stop}"
        expected = f"{stop - start} ending at byte {base + size}"
        raise StaleIndexError(info.url, _tar_position(info, base), f"found {found}, the index "
                              f"says {expected}")  # fmt: skip
    _warn_if_split(info, keys)
    return parsed


def _tar_payload(
    info: ShardInfo, buf: bytes | memoryview, start: int, stop: int
) -> tuple[bytes | memoryview, int, np.ndarray]:
    """Samples ``[start, stop)`` as read (:meth:`ShardReader.fetch`): the bytes without the
    index's gaps (damaged spans of a salvaged shard), how many of them hold the samples (the
    block read after the shard's last sample must be the end-of-archive marker), and the
    samples' offsets, moved by the gap bytes before each (``offsets - offsets[0]`` are their
    starts in the bytes)."""
    offsets = info.offsets[start : stop + 1]
    if info.gaps:
        buf, offsets = _without_gaps(info, buf, offsets)
    size = int(offsets[-1] - offsets[0])
    if len(buf) != size and buf[size:] != ZERO_BLOCK:
        position = _tar_position(info, int(info.offsets[stop]))
        raise StaleIndexError(info.url, position, "more data after the last indexed sample")
    return buf, size, offsets


def _without_gaps(
    info: ShardInfo, buf: bytes | memoryview, offsets: np.ndarray
) -> tuple[bytes, np.ndarray]:
    """``buf`` (read from ``offsets[0]``) with the gaps inside it cut out, and ``offsets``
    moved by the gap bytes before each."""
    low, high = int(offsets[0]), int(offsets[-1])
    inside = [(a, b) for a, b in info.gaps if low <= a and b <= high]
    pieces, pos = [], low
    moved = offsets.copy()
    for a, b in inside:
        pieces.append(buf[pos - low : a - low])
        moved[offsets >= b] -= b - a
        pos = b
    pieces.append(buf[pos - low :])
    return b"".join(pieces), moved


def _position(info: ShardInfo, start: int, offsets: np.ndarray, offset: int) -> str:
    """Where byte ``offset`` of a payload of :func:`_tar_payload` lies in the shard."""
    starts = offsets - offsets[0]
    i = max(0, int(np.searchsorted(starts, offset, "right")) - 1)
    return _tar_position(info, int(info.offsets[start + i]) + offset - int(starts[i]))


def _warn_if_split(info: ShardInfo, keys: list[str]) -> None:
    """Warn when one key names several samples: its members were not stored together (as
    `tar -C dir .` stores files in directory order), so each part is read as a sample."""
    if len(set(keys)) < len(keys):
        seen: set[str] = set()
        key = next(k for k in keys if k in seen or seen.add(k))
        warnings.warn(
            f"{info.url}: the members of sample {key!r} are not contiguous, so each run of them "
            "is read as a separate sample; write shards with write_shards() or `tar --sort=name`",
            stacklevel=3,
        )


def decode_tar_each(info: ShardInfo, buf: bytes, start: int, stop: int) -> list[dict | ShardError]:
    """Samples ``[start, stop)`` from a tar payload one at a time: each sample, or the
    :class:`ShardError` that makes it unreadable. Where a block holds a bad header, this keeps
    every other sample of it (the index knows where each one starts)."""
    buf, _, offsets = _tar_payload(info, buf, start, stop)
    starts = offsets - offsets[0]
    out: list[dict | ShardError] = []
    for i in range(stop - start):
        low, high = int(starts[i]), int(starts[i + 1])
        try:
            parsed = parse_samples(buf, low, high)
            if parsed.stop != high or len(parsed.samples) != 1:
                raise TarFormatError(parsed.stop, "the sample does not end where indexed")
            out.append(parsed.samples[0])
        except TarFormatError as exc:
            position = _position(info, start, offsets, exc.offset)
            out.append(ShardError(info.url, position, exc.reason))
    return out


def _tar_position(info: ShardInfo, offset: int) -> str:
    sample = max(0, _piece(info.offsets, offset))
    return f"sample {min(sample, info.num_samples)}, byte {offset}"


def decode_shard_columns(
    info: ShardInfo,
    payload: bytes | memoryview | Columns,
    start: int,
    stop: int,
    from_samples: Callable[[list[dict]], Columns] = columns_of,
    views: bool = False,
) -> Columns:
    """Samples ``[start, stop)`` as columns (:mod:`nnh_data.columns`), in shard order.

    Values are those of :func:`decode_shard_range`, except that Parquet and Arrow columns come
    as read (numeric and boolean columns without nulls as numpy arrays, the others as Arrow
    arrays).
    Tar samples that do not all have the first one's fields are made columns by
    ``from_samples`` (by default ``None`` where a sample lacks a field). With ``views``, the
    values of plain tar blocks come as Arrow ``binary_view`` arrays into ``payload``
    (:func:`~nnh_data.shards.tar.parse_samples`).
    """
    if info.format != "tar":
        return dict(payload)
    parsed = _parsed_tar(info, payload, start, stop, as_columns=True, views=views)
    return from_samples(parsed.samples) if parsed.columns is None else parsed.columns


def iter_shard_samples(
    info: ShardInfo,
    start: int = 0,
    stop: int | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
) -> Iterator[dict]:
    """Samples ``[start, stop)`` of a shard (all by default), read in memory-bounded pieces.

    >>> for sample in iter_shard_samples(index.shards[0], 10, 20):  # doctest: +SKIP
    ...     print(sample["__key__"], len(sample["jpg"]))
    """
    reader = ShardReader(storage_options)  # one for all pieces: a Parquet row group's
    try:  # batches are decoded once, the next piece continuing where the last stopped
        for low, high in split_shard_range(info, start, stop):
            payload = reader.fetch(info, low, high)
            yield from decode_shard_range(info, payload, low, high)
    finally:
        reader.close()
