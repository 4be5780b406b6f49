"""Arrow IPC shards (``.arrow``): the file and the stream format, as Hugging Face ``datasets``
writes them, read like Parquet.

Record batches play the part of Parquet's row groups: the index holds the first row of each
(:func:`arrow_offsets`), so a shard is split and read in row ranges exactly like a Parquet
one, and the columns are made as :mod:`.columnar` says. The two formats differ in where the
batches are found: a file (``ARROW1`` magic, what ``pyarrow.ipc.new_file`` writes) ends in a
footer listing them; a stream (what ``save_to_disk`` writes) is read message after message. A
local shard is memory-mapped, so reading either costs the parsing of each batch's metadata and
no copy: the columns are views of the mapped file until a batch packs them (zero-copy, which
Arrow's layout allows). A remote shard has no column ranges to fetch, as Parquet does, and a
stream can only be read in order, so it is read whole when a pass first opens it (for a remote
``save_to_disk`` folder, a node-local ``cache_dir`` keeps the copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import pyarrow as pa
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from nnh_data.columns import Columns
from nnh_data.errors import ShardError, StaleIndexError
from nnh_data.shards.columnar import BATCH_ROWS, arrow_columns, value_columns, with_keys
from nnh_data.shards.retries import remote_fs

if TYPE_CHECKING:
    from nnh_data.shards.index import ShardInfo

__all__ = ["FILE_MAGIC", "ArrowReader", "arrow_offsets", "ipc_table", "null_columns", "open_ipc"]

FILE_MAGIC = b"ARROW1"
"""The first bytes of the Arrow IPC file format (a stream starts with a message instead)."""


def ipc_table(source: pa.Buffer | pa.NativeFile) -> pa.Table:
    """An Arrow IPC file or stream (told by its first bytes) as a table whose chunks are its
    record batches, with no copy of a memory-mapped ``source``; ``pyarrow.ArrowInvalid`` when
    it is neither."""
    head = source[: len(FILE_MAGIC)] if isinstance(source, pa.Buffer) else source.read_at(6, 0)
    if bytes(head) == FILE_MAGIC:
        reader = pa.ipc.open_file(source)
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        return pa.Table.from_batches(batches, reader.schema)
    return pa.ipc.open_stream(source).read_all()


def arrow_offsets(table: pa.Table) -> list[int]:
    """The first row of each record batch (chunk of :func:`ipc_table`), then the row count:
    the index's offsets."""
    rows = [batch.num_rows for batch in table.to_batches()]
    return [0, *np.cumsum(rows, dtype=np.int64).tolist()]


def null_columns(table: pa.Table) -> list[str]:
    """The columns with a null in some row (from the batches' metadata: exact, no value read)."""
    return [name for name, column in zip(table.column_names, table.columns) if column.null_count]


def open_ipc(fs: AbstractFileSystem | None, path: str) -> pa.Table:
    """:func:`ipc_table` of the shard at ``path``: memory-mapped when ``fs`` is None or local,
    else read whole through ``fs``."""
    if fs is None or isinstance(fs, LocalFileSystem):
        return ipc_table(pa.memory_map(path))
    return ipc_table(pa.py_buffer(fs.cat_file(path)))


class ArrowReader:
    """Reads rows ``[start, stop)`` of Arrow IPC shards, keeping the last one open (its
    batches, views of the mapped file); the arguments are :class:`ParquetReader`'s."""

    def __init__(
        self,
        storage_options: dict[str, Any] | None = None,
        nullable: Sequence[str] | None = None,
        arrow: bool = False,
    ) -> None:
        self.storage_options = storage_options
        self.nullable = None if nullable is None else frozenset(nullable)
        self.arrow = arrow
        self._open: tuple[tuple[str, BinaryIO | None], pa.Table] | None = None

    def read(self, info: ShardInfo, start: int, stop: int, file: BinaryIO | None = None) -> Columns:
        """Rows ``[start, stop)`` of ``info`` as columns, ``__key__`` added (the file's stem
        and row number unless the file has a ``__key__`` column). ``file``: an open local copy
        of the shard to read instead of its URL (a cache's). Raises :class:`ShardError` when
        the file cannot be read and :class:`StaleIndexError` when it does not match its
        index."""
        nullable = frozenset(info.nullable) if self.nullable is None else self.nullable
        offsets = info.offsets
        first = int(np.searchsorted(offsets, start, "right")) - 1
        low, high = int(offsets[first]), int(offsets[max(first, np.searchsorted(offsets, stop))])
        try:
            table = self._table(info, file).slice(low, high - low)  # whole batches (views)
            if self.arrow:
                columns = arrow_columns(info, table, start - low, stop - start, nullable)
            else:
                pieces = table.to_batches(BATCH_ROWS)  # converted one piece at a time
                columns = value_columns(info, pieces, start - low, stop - start, nullable)
        except (pa.ArrowException, OSError) as exc:
            position = f"record batch {first} (sample {start})"
            raise ShardError(info.url, position, f"unreadable Arrow IPC file ({exc!r})") from exc
        return with_keys(info, columns, start, stop)

    def _table(self, info: ShardInfo, file: BinaryIO | None) -> pa.Table:
        """The shard of ``info`` (the last one is kept), checked against the index."""
        if self._open is None or self._open[0] != (info.url, file):
            self._open = None
            table = self._opened(info, file)
            rows = arrow_offsets(table)
            if not np.array_equal(rows, info.offsets):
                found = f"{rows[-1]} rows in {len(rows) - 1} record batches"
                indexed = f"{info.num_samples} rows in {len(info.offsets) - 1}"
                raise StaleIndexError(info.url, "record batches", f"the file has {found}, the "
                                      f"index {indexed}")  # fmt: skip
            self._open = ((info.url, file), table)
        return self._open[1]

    def _opened(self, info: ShardInfo, file: BinaryIO | None) -> pa.Table:
        if file is not None:  # a cache's local copy: mapped by its name
            return open_ipc(None, file.name)
        if "://" in info.url or info.url.startswith("~"):
            return open_ipc(*remote_fs(info.url, self.storage_options))
        return open_ipc(None, info.url)

    def close(self) -> None:
        """Let go of the open shard."""
        self._open = None

