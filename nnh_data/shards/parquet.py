"""Reading row ranges of Parquet shards as columns, through a reader the caller owns.

A :class:`ParquetReader` keeps the last file it opened (and its parsed footer), so reading a
shard block after block opens it once. The reader belongs to one pass of one worker: a new
pass makes a new reader, so a file rewritten between passes is read afresh, and nothing is
shared between threads or across a fork. Rows become columns as :mod:`.columnar` says (numpy
for numeric columns without nulls; Python values or, for batches, Arrow arrays for the rest);
for batches (``arrow=True``) the row groups are decoded ``_ARROW_BATCH`` rows at a time and
joined into one array per column.

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

from nnh_data.columns import Columns
from nnh_data.errors import ShardError, StaleIndexError
from nnh_data.shards.columnar import BATCH_ROWS, arrow_columns, value_columns, with_keys
from nnh_data.shards.index import ShardInfo, row_group_rows
from nnh_data.shards.retries import remote_fs

__all__ = ["ParquetReader"]

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
        first = _group_of(info, start)
        groups = range(first, max(first, int(np.searchsorted(info.offsets, stop))))
        nullable = frozenset(info.nullable) if self.nullable is None else self.nullable
        skip = start - int(info.offsets[first])
        try:
            parquet = self._file(info, file)
            if self.arrow:
                table = _row_groups(parquet, groups)
                columns = arrow_columns(info, table, skip, stop - start, nullable)
            else:
                batches = parquet.iter_batches(BATCH_ROWS, row_groups=groups, use_threads=False)
                columns = value_columns(info, batches, skip, stop - start, nullable)
        except (pa.ArrowException, OSError, StopIteration) as exc:
            position = f"row group {first} (sample {start})"
            raise ShardError(info.url, position, f"unreadable Parquet file ({exc!r})") from exc
        return with_keys(info, columns, start, stop)

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
