"""Arrow record batches as the columns a pass reads: shared by Parquet and Arrow IPC shards.

Both formats give Arrow data (Parquet decoded from its pages, Arrow IPC as it lies in the file),
cut into pieces the index knows (row groups, record batches). Numeric and boolean columns come
as numpy arrays, except those the dataset lists as nullable (a column then has one type in
every batch): those, and every other type, come as lists of Python values with ``None`` for
nulls, or, for batches (``arrow=True``), as Arrow arrays: the shuffle then gathers them in
Arrow, and text and bytes reach a batch as one buffer (:class:`~nnh_data.packed.PackedField`)
without a Python object per value. Python values are made ``BATCH_ROWS`` rows at a time, while
the rows are in cache; long text and bytes are kept as views of the decoded chunks (no value
copied: a shuffle then gathers 16-byte views, and a batch's values are copied once, when it is
packed).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from nnh_data.columns import Column, Columns, one_array
from nnh_data.errors import StaleIndexError
from nnh_data.packed import as_views

if TYPE_CHECKING:  # the index imports the Arrow reader, which imports this
    from nnh_data.shards.index import ShardInfo

__all__ = [
    "BATCH_ROWS",
    "VIEW_BYTES",
    "arrow_columns",
    "is_long",
    "preload_conversions",
    "value_columns",
    "with_keys",
]

BATCH_ROWS = 256  # rows converted to Python values at a time: they stay in cache
# bytes per value above which text and bytes are kept as views (joining the decoded chunks
# and a shuffle's take then copy 16 bytes per value, not the value); shorter values are
# joined by copying (cheaper than Arrow's cast to views, and than packing views back)
VIEW_BYTES = 64


def preload_conversions() -> None:
    """Make pyarrow load what its first conversion loads: where pandas is installed, pyarrow
    imports it then (1-2 s of CPU). Called by the process that forks the DataLoader workers,
    they inherit it instead of importing it each (with 2 workers and 100,000 Parquet rows of
    3 KiB, 14.6 -> 8.8 us of worker CPU per row in an epoch at load 13)."""
    pa.array([0]).to_numpy()


def arrow_columns(
    info: ShardInfo,
    table: pa.Table,
    skip: int,
    rows: int,
    nullable: frozenset,
    long: Collection[str] | None = None,
) -> Columns:
    """``rows`` rows of ``table`` after the first ``skip``, for batches: numpy for numeric
    columns not in ``nullable``, one Arrow array for each other column; text and bytes kept
    as views where ``long`` names them (default: where ``table``'s chunks hold over
    ``VIEW_BYTES`` a value, which slices of larger chunks cannot tell)."""
    if long is None:
        long = {name for name, column in zip(table.column_names, table.columns)
                if is_long(column)}  # fmt: skip
    table = table.slice(skip, rows)
    return {name: _values(info, name, column, name in nullable, True, name in long)
            for name, column in zip(table.column_names, table.columns)}  # fmt: skip


def value_columns(
    info: ShardInfo,
    batches: Iterable[pa.RecordBatch],
    skip: int,
    rows: int,
    nullable: frozenset,
) -> Columns:
    """``rows`` rows after the first ``skip`` of ``batches``, converted to Python values batch
    by batch (while each is in cache): numpy for numeric columns not in ``nullable``."""
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
    return _joined(parts)


def with_keys(info: ShardInfo, columns: Columns, start: int, stop: int) -> Columns:
    """``columns`` of rows ``[start, stop)`` with ``__key__``: the file's stem and row number,
    unless the file has a ``__key__`` column."""
    if "__key__" not in columns:
        stem = info.url.rsplit("/", 1)[-1].rsplit(".", 1)[0]
        columns["__key__"] = list(map(f"{stem}/".__add__, map(str, range(start, stop))))
    return columns


def is_long(column: pa.Array | pa.ChunkedArray) -> bool:
    """Whether the decoded ``column`` (not sliced) holds over ``VIEW_BYTES`` per value, told by
    its buffers' sizes, not by ``nbytes``, which finds the bytes each chunk references (~20 us a
    column, as much as joining it)."""
    return column.get_total_buffer_size() > VIEW_BYTES * len(column)


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
