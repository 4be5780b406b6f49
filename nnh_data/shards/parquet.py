"""Reading row ranges of Parquet shards as columns, through a reader the caller owns.

A :class:`ParquetReader` keeps the last file it opened (and its parsed footer), so reading a
shard block after block opens it once. The reader belongs to one pass of one worker: a new
pass makes a new reader, so a file rewritten between passes is read afresh, and nothing is
shared between threads or across a fork. A row group is never decoded whole: rows are decoded
in batches of at most ``_DECODE_BYTES`` of what the footer declares (and at most ``BATCH_ROWS`` or
``_ARROW_BATCH`` rows), through a cursor that the next read of the shard continues from, so
the memory and the time to the first rows depend on the rows read, not on the row group (a
row group of 10^7 rows, or a small file that declares 512 MiB of strings). A value over
``MAX_VALUE_BYTES`` is a :class:`ShardError` naming the shard, row group and column, found
from the footer when the declared sizes prove it, else when its batch is decoded.

Rows become columns as :mod:`.columnar` says (numpy for numeric columns without nulls; Python
values or, for batches, Arrow arrays for the rest).

>>> reader = ParquetReader()  # doctest: +SKIP
>>> reader.read(index.shards[0], 0, 10)["__key__"][:2]  # doctest: +SKIP
['part-000000/0', 'part-000000/1']
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from nnh_data.columns import Columns
from nnh_data.errors import ShardError, StaleIndexError
from nnh_data.shards.columnar import (
    BATCH_ROWS,
    arrow_columns,
    is_long,
    value_columns,
    with_keys,
)
from nnh_data.shards.index import ShardInfo, row_group_rows
from nnh_data.shards.retries import remote_fs

__all__ = ["MAX_VALUE_BYTES", "ParquetReader"]

MAX_VALUE_BYTES = 256 << 20  # the most one value (a cell) of a Parquet shard may hold
_DECODE_BYTES = 8 << 20  # declared (uncompressed) bytes decoded at a time
# a local column chunk is read 1 MiB at a time, not whole (a row group of 10^7 rows: 7 MiB
# of Arrow memory instead of 91, and 40% less CPU to its first rows)
_LOCAL_BUFFER = 1 << 20

_ARROW_BATCH = 1024  # rows decoded at a time for Arrow columns (the best of 256-4,096)

class ParquetReader:
    """Reads rows ``[start, stop)`` of Parquet shards; see the module docstring.

    ``nullable`` names the numeric columns that may hold nulls (default: each shard's own
    ``info.nullable``); ``storage_options`` go to fsspec; ``arrow``: keep the non-numeric and
    nullable columns as Arrow arrays (for batches) instead of lists of Python values.
    """

    def __init__(
        self,
        storage_options: dict[str, Any] | None = None,
        nullable: Iterable[str] | None = None,
        arrow: bool = False,
    ) -> None:
        self.storage_options = storage_options
        self.nullable = None if nullable is None else frozenset(nullable)
        self.arrow = arrow
        self._open: tuple[tuple[str, BinaryIO | None], pq.ParquetFile] | None = None

    def read(self, info: ShardInfo, start: int, stop: int, file: BinaryIO | None = None) -> Columns:
        """Rows ``[start, stop)`` of ``info`` as columns, ``__key__`` added (the file's stem
        and row number unless the file has a ``__key__`` column). ``file``: an open copy of
        the shard to read instead of its URL (a local cache's). Raises :class:`ShardError`
        when the file cannot be read and :class:`StaleIndexError` when it does not match its
        index."""
        try:
            columns = self._columns(info, start, stop, file)
        except (pa.ArrowException, OSError, StopIteration) as exc:
            self._open = None  # its cursor stopped mid-read: opened afresh by the next read
            position = f"row group {_group_of(info, start)} (sample {start})"
            raise ShardError(info.url, position, f"unreadable Parquet file ({exc!r})") from exc
        except ShardError:
            self._open = None
            raise
        return with_keys(info, columns, start, stop)

    def _columns(
        self, info: ShardInfo, start: int, stop: int, file: BinaryIO | None
    ) -> Columns:
        nullable = frozenset(info.nullable) if self.nullable is None else self.nullable
        rows = self._rows(info, file)
        batches = rows.take(start, stop)
        if not self.arrow:
            return value_columns(info, batches, 0, stop - start, nullable)
        parquet = self._open[1]
        table = pa.Table.from_batches(batches) if batches else parquet.schema_arrow.empty_table()
        return arrow_columns(info, table, 0, stop - start, nullable, rows.long)

    def _rows(self, info: ShardInfo, file: BinaryIO | None) -> _Rows:
        """The row cursor of the open file of ``info`` (the last one is kept), its footer
        checked against the index and its declared sizes against the limits. A local file is
        opened by pyarrow itself (closed when let go of) and read without pre-buffering: the
        read-ahead of column ranges, which a remote file needs, only costs I/O threads there
        (5-8% of the CPU of reading a local shard). A remote file's row group is fetched
        whole (compressed), in as few requests as pyarrow can make."""
        if self._open is None or self._open[0] != (info.url, file):
            self._open = None
            if file is not None:
                parquet = pq.ParquetFile(file, pre_buffer=False, buffer_size=_LOCAL_BUFFER)
            elif "://" in info.url or info.url.startswith("~"):  # fsspec: ranges read ahead
                fs, path = remote_fs(info.url, self.storage_options)
                parquet = pq.ParquetFile(path, filesystem=fs)
            else:  # a local path: pyarrow's own file (no filesystem lookup), read when asked
                parquet = pq.ParquetFile(pa.OSFile(info.url), pre_buffer=False,
                                         buffer_size=_LOCAL_BUFFER)  # fmt: skip
            rows = [0, *itertools.accumulate(row_group_rows(parquet.metadata))]
            if not np.array_equal(rows, info.offsets):
                found = f"{rows[-1]} rows in {len(rows) - 1} row groups"
                indexed = f"{info.num_samples} rows in {len(info.offsets) - 1}"
                raise StaleIndexError(info.url, "footer", f"the file has {found}, the index "
                                      f"{indexed}")  # fmt: skip
            most = BATCH_ROWS if not self.arrow else _ARROW_BATCH
            rows = max(1, min(most, int(_DECODE_BYTES / _row_bytes(info, parquet.metadata))))
            self._open = ((info.url, file), parquet, _Rows(info, parquet, rows))
        return self._open[2]

    def close(self) -> None:
        """Let go of the open file."""
        self._open = None


class _Rows:
    """A forward cursor over the rows of one open Parquet file, decoded ``batch_rows`` at a
    time: a read continues from where the last one stopped (decoding the rows between, as a
    read from the row group's start would), a read behind it or past the row groups decoded so
    far starts again at its row group.
    Batches, not row groups, are what is decoded at once; one decoder runs over the row
    groups a read needs (one per row group cost 15% more CPU on small groups) and no further
    (a batch may span row groups: the next one may be unreadable)."""

    def __init__(self, info: ShardInfo, parquet: pq.ParquetFile, batch_rows: int) -> None:
        self.info, self.parquet, self.batch_rows = info, parquet, batch_rows
        self._batches: Iterator[pa.RecordBatch] | None = None
        self._next_group = 0  # the first row group no decoder has been started on
        self._last = 0  # the last row group the current read needs
        self._at = 0  # the first row of the held batch, or of the next one
        self._held: pa.RecordBatch | None = None  # a batch decoded but not read to its end
        self._started = False
        self.long: set[str] = set()  # the columns the last read keeps as views (is_long)

    def take(self, start: int, stop: int) -> list[pa.RecordBatch]:
        """Rows ``[start, stop)`` as slices of the decoded batches."""
        group = _group_of(self.info, start)
        if not self._started or start < self._at or group >= self._next_group:
            self._batches, self._held, self._started = None, None, True
            self._next_group, self._at = group, int(self.info.offsets[group])
        self._last = _group_of(self.info, max(start, stop - 1))
        out, self.long = [], set()
        while self._at < stop:
            batch = self._held if self._held is not None else self._decoded()
            self.long.update(name for name, column in zip(batch.schema.names, batch.columns)
                             if is_long(column))  # of whole batches: slices cannot tell
            end = self._at + batch.num_rows
            if end > start:
                low = max(start, self._at) - self._at
                out.append(batch.slice(low, min(end, stop) - self._at - low))
            if end > stop:
                self._held = batch
                break
            self._held, self._at = None, end
        return out

    def _decoded(self) -> pa.RecordBatch:
        """The next batch, checked against ``MAX_VALUE_BYTES``; StopIteration past the row
        groups the read needs."""
        batch = None if self._batches is None else next(self._batches, None)
        while batch is None:  # the decoder is done (or none was started): the next groups
            if self._next_group > self._last:
                raise StopIteration(f"no row {self._at} in row groups up to {self._last}")
            groups = range(self._next_group, self._last + 1)
            self._batches = self.parquet.iter_batches(self.batch_rows, row_groups=groups,
                                                      use_threads=False)  # fmt: skip
            self._next_group = self._last + 1
            batch = next(self._batches, None)
        for name, column in zip(batch.schema.names, batch.columns):
            if column.get_total_buffer_size() > MAX_VALUE_BYTES:  # else no value can be
                self._check_values(name, column)
        return batch

    def _check_values(self, name: str, column: pa.Array) -> None:
        """A :class:`ShardError` when a value of text or bytes ``column`` (of the batch at row
        ``_at``) is over ``MAX_VALUE_BYTES``, naming its row group."""
        if any(is_kind(column.type) for is_kind in _TEXT):
            lengths = pc.binary_length(column)
            row = pc.index(lengths, pc.max(lengths)).as_py()
            if lengths[row].as_py() > MAX_VALUE_BYTES:
                group = _group_of(self.info, self._at + row)
                raise _too_large(self.info, group, name, lengths[row].as_py())


def _row_bytes(info: ShardInfo, metadata: pq.FileMetaData) -> float:
    """The most bytes a row of any row group declares (uncompressed, over its columns); a
    :class:`ShardError` when a column declares more than ``MAX_VALUE_BYTES`` a row on
    average (so one value at least is over the limit), before anything is decoded."""
    most = 1.0
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        rows = max(1, group.num_rows)
        if group.total_byte_size / rows > MAX_VALUE_BYTES:  # else no column's can be
            for c in range(group.num_columns):
                size = group.column(c).total_uncompressed_size
                if size / rows > MAX_VALUE_BYTES:
                    name = group.column(c).path_in_schema
                    raise _too_large(info, g, name, size // rows, "on average")
        most = max(most, group.total_byte_size / rows)
    return most


_TEXT = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
         pa.types.is_large_binary)  # fmt: skip


def _too_large(info: ShardInfo, group: int, column: str, size: int, how: str = "") -> ShardError:
    return ShardError(info.url, f"row group {group}, column {column!r}",
                      f"a value of {size:,} bytes{' ' + how if how else ''}, over the "
                      f"limit of {MAX_VALUE_BYTES:,} (nnh_data.shards.parquet.MAX_VALUE_BYTES)")


def _group_of(info: ShardInfo, row: int) -> int:
    return int(np.searchsorted(info.offsets, row, "right")) - 1
