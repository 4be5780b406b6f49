"""Reading row ranges of Parquet shards as columns, through a reader the caller owns.

A :class:`ParquetReader` keeps the last file it opened (and its parsed footer), so reading a
shard block after block opens it once. The reader belongs to one pass of one worker: a new
pass makes a new reader, so a file rewritten between passes is read afresh, and nothing is
shared between threads or across a fork. Numeric and boolean columns come as numpy arrays,
except those the dataset lists as nullable (a column then has one type in every batch): those,
and every other type, come as lists of Python values with ``None`` for nulls, or, for batches
(``arrow=True``), as Arrow arrays: the shuffle then gathers them in Arrow, and text and bytes
reach a batch as one buffer (:class:`~nnh_data.packed.PackedField`) without a Python object
per value. Python values are made ``_BATCH`` rows at a time, while the decompressed rows are in
cache; Arrow columns are decoded ``_ARROW_BATCH`` rows at a time and joined into one array per
column, long text and bytes as views of the decoded chunks (no value copied: a shuffle then
gathers 16-byte views, and a batch's values are copied once, when it is packed).

>>> reader = ParquetReader()  # doctest: +SKIP
>>> reader.read(index.shards[0], 0, 10)["__key__"][:2]  # doctest: +SKIP
['part-000000/0', 'part-000000/1']
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from nnh_data.columns import Column, Columns, one_array
from nnh_data.errors import ShardError, StaleIndexError
from nnh_data.packed import as_views
from nnh_data.shards.index import ShardInfo, row_group_rows
from nnh_data.shards.retries import remote_fs

__all__ = ["ParquetReader"]

_BATCH = 256  # rows decompressed then converted at a time: they stay in cache
_ARROW_BATCH = 1024  # rows decoded at a time for Arrow columns (the best of 256-4,096)
# bytes per value above which text and bytes are kept as views (joining the decoded chunks
# and a shuffle's take then copy 16 bytes per value, not the value); shorter values are
# joined by copying (cheaper than Arrow's cast to views, and than packing views back)
_VIEW_BYTES = 64

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
        first = _group_of(info, start)
        groups = range(first, max(first, int(np.searchsorted(info.offsets, stop))))
        nullable = frozenset(info.nullable) if self.nullable is None else self.nullable
        skip = start - int(info.offsets[first])
        try:
            parquet = self._file(info, file)
            if self.arrow:
                table = _row_groups(parquet, groups)
                long = {name for name, column in zip(table.column_names, table.columns)
                        if _is_long(column)}  # fmt: skip
                table = table.slice(skip, stop - start)
                columns = {name: _values(info, name, column, name in nullable, True, name in long)
                           for name, column in zip(table.column_names, table.columns)}  # fmt: skip
            else:
                batches = parquet.iter_batches(_BATCH, row_groups=groups, use_threads=False)
                columns = _joined(_converted(info, batches, skip, stop - start, nullable))
        except (pa.ArrowException, OSError, StopIteration) as exc:
            position = f"row group {first} (sample {start})"
            raise ShardError(info.url, position, f"unreadable Parquet file ({exc!r})") from exc
        if "__key__" not in columns:
            stem = info.url.rsplit("/", 1)[-1].rsplit(".", 1)[0]
            columns["__key__"] = list(map(f"{stem}/".__add__, map(str, range(start, stop))))
        return columns

    def _file(self, info: ShardInfo, file: BinaryIO | None) -> pq.ParquetFile:
        """The open file of ``info`` (the last one is kept), its footer checked against the
        index. A local file is opened by pyarrow itself (closed when let go of) and read without
        pre-buffering: the read-ahead of column ranges, which a remote file needs, only costs
        I/O threads there (5-8% of the CPU of reading a local shard)."""
        if self._open is None or self._open[0] != (info.url, file):
            self._open = None
            if file is not None:
                parquet = pq.ParquetFile(file, pre_buffer=False)
            elif "://" in info.url or info.url.startswith("~"):  # fsspec: ranges read ahead
                fs, path = remote_fs(info.url, self.storage_options)
                parquet = pq.ParquetFile(path, filesystem=fs)
            else:  # a local path: pyarrow's own file (no filesystem lookup), read when asked
                parquet = pq.ParquetFile(pa.OSFile(info.url), pre_buffer=False)
            rows = [0, *itertools.accumulate(row_group_rows(parquet.metadata))]
            if not np.array_equal(rows, info.offsets):
                found = f"{rows[-1]} rows in {len(rows) - 1} row groups"
                indexed = f"{info.num_samples} rows in {len(info.offsets) - 1}"
                raise StaleIndexError(info.url, "footer", f"the file has {found}, the index "
                                      f"{indexed}")  # fmt: skip
            self._open = ((info.url, file), parquet)
        return self._open[1]

    def close(self) -> None:
        """Let go of the open file."""
        self._open = None


def _group_of(info: ShardInfo, row: int) -> int:
    return int(np.searchsorted(info.offsets, row, "right")) - 1


def _row_groups(parquet: pq.ParquetFile, groups: range) -> pa.Table:
    """Row groups ``groups`` of ``parquet`` in batches of ``_ARROW_BATCH`` rows, as chunks of
    one table: decoding several row groups in one call grows Arrow's builders by copying (in
    a shuffled pass, 5-10% more CPU than this)."""
    batches = list(parquet.iter_batches(_ARROW_BATCH, row_groups=groups, use_threads=False))
    return pa.Table.from_batches(batches) if batches else parquet.schema_arrow.empty_table()


def _converted(
    info: ShardInfo, batches: Iterable[pa.RecordBatch], skip: int, rows: int, nullable: frozenset
) -> list[Columns]:
    """``rows`` rows after the first ``skip`` of ``batches``, converted to Python values batch
    by batch (while each is in cache)."""
    parts = []
    batches = iter(batches)
    while rows:
        batch = next(batches)
        if skip < batch.num_rows:
            part = batch.slice(skip, rows)
            parts.append({name: _values(info, name, column, name in nullable, False)
                          for name, column in zip(part.schema.names, part)})  # fmt: skip
            rows -= part.num_rows
        skip = max(0, skip - batch.num_rows)
    return parts


def _is_long(column: pa.ChunkedArray) -> bool:
    """Whether the decoded ``column`` (not sliced) holds over ``_VIEW_BYTES`` per value, told by
    its buffers' sizes, not by ``nbytes``, which finds the bytes each chunk references (~20 us a
    column, as much as joining it)."""
    return column.get_total_buffer_size() > _VIEW_BYTES * len(column)


def _values(
    info: ShardInfo,
    name: str,
    column: pa.Array | pa.ChunkedArray,
    nullable: bool,
    arrow: bool,
    long: bool = False,
) -> Column:
    """Numeric and boolean columns as numpy, unless ``nullable`` in the dataset (a column then
    has one type in every batch): then, like every other type, an Arrow array (``arrow``; text
    and bytes as views when ``long``) or a list of Python values (``None`` for nulls)."""
    kind = column.type
    numeric = pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
    if numeric and not nullable:
        if column.null_count:
            raise StaleIndexError(info.url, f"column {name!r}", "a null the index did not list")
        return column.to_numpy(zero_copy_only=False)
    if not arrow:
        return column.to_pylist()
    if long:  # joined and taken as views
        column = as_views(column)
    return one_array(column)


def _joined(parts: list[Columns]) -> Columns:
    """The parts' rows one after the other."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return {}
    out = {}
    for name, first in parts[0].items():
        pieces = [part[name] for part in parts]
        if isinstance(first, np.ndarray):
            out[name] = np.concatenate(pieces)
        else:
            out[name] = list(itertools.chain.from_iterable(pieces))
    return out
