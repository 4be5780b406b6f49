"""Samples as columns: the form batches take inside ``ShardedStreamingDataset`` before they are
handed out (:mod:`nnh_data.workers.handoff`).

A ``Columns`` is a dict of equally long columns: numpy arrays for numeric and boolean data,
Arrow arrays for the other Parquet columns, lists of Python values for everything else, or
nested ``Columns`` (``__aug__``). Building batches this way costs a few pointer copies per value
(none per value for Arrow columns, which Arrow gathers itself) instead of a dict per sample,
which is what lets columnar sources (Parquet) stream at the speed of pyarrow itself. Bytes and
text taken in a new order (the shuffle) are not even gathered: long values read from Parquet
are views (16 bytes per value, pointing into the decoded pages), the views are taken, and their
bytes are copied once, when a batch is packed (:class:`~nnh_data.packed.PackedField`).

>>> cols = columns_of([{"a": 1, "b": b"x"}, {"a": 2}])
>>> cols
{'a': [1, 2], 'b': [b'x', None]}
>>> concat([take(cols, np.array([1, 0])), cols])["a"]
[2, 1, 1, 2]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from nnh_data.packed import arrow_values, as_views, is_view

Column = list | np.ndarray | pa.Array | pa.ChunkedArray | dict
ARROW = (pa.Array, pa.ChunkedArray)
Columns = dict[str, Column]

__all__ = [
    "ARROW",
    "Columns",
    "as_list",
    "columns_of",
    "concat",
    "constant",
    "cut",
    "num_rows",
    "arrow_of",
    "one_array",
    "rows_of",
    "take",
    "without_arrow",
]


def num_rows(columns: Columns) -> int:
    """Rows of ``columns`` (which holds at least one column)."""
    first = next(iter(columns.values()))
    return num_rows(first) if isinstance(first, dict) else len(first)


def columns_of(samples: Sequence[dict]) -> Columns:
    """Columns of sample dicts: one per key (in first-seen order), ``None`` where it is missing."""
    if not samples:
        return {}
    first = samples[0]
    if len(first) > 1 and sum(map(len, samples)) == len(first) * len(samples):
        try:  # every sample has the first one's keys (and no others): C-level transpose
            return dict(zip(first, map(list, zip(*map(itemgetter(*first), samples)))))
        except KeyError:
            pass
    names = dict.fromkeys(chain.from_iterable(samples))
    return {name: [s.get(name) for s in samples] for name in names}


def rows_of(names: Sequence[str], columns: Sequence[Iterable]) -> list[dict]:
    """Row dicts from columns: row ``i`` maps ``names[j]`` to item ``i`` of ``columns[j]``.

    The rows are as many as the shortest column (so ``itertools.repeat`` fills a constant).

    >>> rows_of(["a", "b"], [[1, 2], "xy"])
    [{'a': 1, 'b': 'x'}, {'a': 2, 'b': 'y'}]
    """
    if not names:
        return []
    names = tuple(names)
    if all(type(name) is str for name in names):
        return _rows_builder(names)(columns)
    return _rows_builder(len(names))(*names, columns)


@functools.lru_cache(maxsize=64)
def _rows_builder(keys: tuple[str, ...] | int) -> Callable[..., list[dict]]:
    """``build(columns)`` for :func:`rows_of`: a comprehension with the dict display written
    out, about 3x faster per row than ``dict(zip(names, row))``. String ``keys`` are written
    in as literals (``repr``: a display of constant keys builds each dict in one step, ~20%
    faster than keys passed in); for a width (other keys) the builder is
    ``build(k0, ..., k{width-1}, columns)``, the keys passed in as arguments."""
    width = keys if isinstance(keys, int) else len(keys)
    values = [f"v{i}" for i in range(width)]
    params = [f"k{i}" for i in range(width)] if isinstance(keys, int) else []
    shown = params or list(map(repr, keys))
    display = ", ".join(f"{k}: {v}" for k, v in zip(shown, values))
    source = (
        f"def build({''.join(k + ', ' for k in params)}columns):\n"
        f"    return [{{{display}}} for {''.join(v + ', ' for v in values)} in zip(*columns)]\n"
    )
    namespace: dict[str, Any] = {}
    exec(source, namespace)  # noqa: S102 - names only as repr() literals
    return namespace["build"]


def constant(value: Any, rows: int) -> Column:
    """A column of ``rows`` times ``value``: for text, an Arrow dictionary array of the one
    value (taken, cut and packed without a Python object per row), else a list.

    >>> constant("a.tar", 3).to_pylist(), constant(7, 2)
    (['a.tar', 'a.tar', 'a.tar'], [7, 7])
    """
    if isinstance(value, str):
        keys = arrow_of(np.zeros(rows, np.int32))
        return pa.DictionaryArray.from_arrays(keys, _one_value(value), safe=False)
    return [value] * rows


@functools.lru_cache(maxsize=256)
def _one_value(text: str) -> pa.Array:
    """The dictionary of :func:`constant` (a shard's URL labels each of its blocks)."""
    data = text.encode()
    offsets = np.array([0, len(data)], np.int32)
    return pa.Array.from_buffers(pa.string(), 1, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def arrow_of(values: np.ndarray) -> pa.Array:
    """A 1-d numpy array of numbers as an Arrow array over its memory. Not ``pa.array``: its
    first call in a process imports pandas (0.2 s of CPU and tens of MB in every DataLoader
    worker; so does ``Array.to_numpy``)."""
    values = np.ascontiguousarray(values)
    assert values.dtype.kind in "iuf", values.dtype
    kind = pa.from_numpy_dtype(values.dtype)
    return pa.Array.from_buffers(kind, values.size, [None, pa.py_buffer(values)])


def take(columns: Columns, indices: np.ndarray) -> Columns:
    """Rows ``indices`` (integers) of every column, in that order."""
    positions = arrow_indices = None
    out: Columns = {}
    for name, col in columns.items():
        if isinstance(col, dict):
            out[name] = take(col, indices)
        elif isinstance(col, np.ndarray):
            out[name] = col[indices]
        elif isinstance(col, ARROW):  # the indices made an Arrow array once, for every column
            arrow_indices = arrow_of(indices) if arrow_indices is None else arrow_indices
            out[name] = _arrow_rows(col, indices, arrow_indices)
        else:
            positions = indices.tolist() if positions is None else positions
            out[name] = list(map(col.__getitem__, positions))
    return out


def _arrow_rows(
    column: pa.Array | pa.ChunkedArray, indices: np.ndarray, arrow_indices: pa.Array
) -> pa.Array:
    """Rows ``indices`` (``arrow_indices`` as an Arrow array) of an Arrow column. Of views (long
    bytes and text read from Parquet, :func:`~nnh_data.packed.as_views`), the 16-byte views are
    gathered, not the values, so the bytes of a shuffled batch are copied once, when it is
    packed (:class:`~nnh_data.packed.PackedField`). A dictionary array's keys are taken; other
    types are taken by Arrow's kernel, called directly (``Array.take`` of numpy indices costs
    about twice as much for a window of short text)."""
    column = one_array(column)
    kind = column.type
    if pa.types.is_dictionary(kind):  # its keys taken (by numpy unless one is null)
        keys = column.indices
        taken = keys.take(arrow_indices) if keys.null_count else arrow_of(_numpy_of(keys)[indices])
        return pa.DictionaryArray.from_arrays(taken, column.dictionary, safe=False)
    if is_view(kind):  # Arrow has no take for views
        return _view_rows(column, indices)
    return pc.call_function("take", [column, arrow_indices])


def _numpy_of(keys: pa.Array) -> np.ndarray:
    """An integer Arrow array without nulls as a numpy view (see :func:`arrow_of`)."""
    dtype = np.dtype(keys.type.to_pandas_dtype())
    return np.frombuffer(keys.buffers()[1], dtype, len(keys), keys.offset * dtype.itemsize)


_VIEW = np.dtype((np.void, 16))  # one value of a binary_view or string_view array


def _view_rows(column: pa.Array, indices: np.ndarray) -> pa.Array:
    """Rows ``indices`` of a view array: its views gathered by numpy, its byte buffers shared."""
    validity, views, *data = column.buffers()
    taken = np.frombuffer(views, _VIEW, len(column), column.offset * _VIEW.itemsize)[indices]
    nulls = 0
    if column.null_count:
        bits = np.unpackbits(np.frombuffer(validity, np.uint8), bitorder="little")
        valid = bits[column.offset : column.offset + len(column)][indices]
        nulls = valid.size - int(np.count_nonzero(valid))
        validity = pa.py_buffer(np.packbits(valid, bitorder="little"))
    buffers = [validity if nulls else None, pa.py_buffer(taken), *data]
    return pa.Array.from_buffers(column.type, taken.size, buffers, null_count=nulls)


def one_array(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """``column`` as one array: the array itself, the only chunk, or the chunks joined (a
    window read from two blocks: Arrow takes from one array 3-5x faster than from chunks;
    views are joined without copying their values). Dictionary chunks are joined as they are
    when their dictionaries hold fewer values than a quarter of the rows (joining unifies the
    dictionaries, hashing each of their values: a shard's URL, one value per block), else
    decoded first."""
    if isinstance(column, pa.Array):
        return column
    if column.num_chunks == 1:
        return column.chunk(0)
    if pa.types.is_dictionary(column.type):
        values = sum(len(chunk.dictionary) for chunk in column.chunks)
        if 4 * values < len(column):
            return pa.concat_arrays(column.chunks)
    return arrow_values(column).combine_chunks()


def as_list(column: Column) -> list:
    """A column's values as a list of Python values."""
    if isinstance(column, np.ndarray):
        return column.tolist()
    return arrow_values(column).to_pylist() if isinstance(column, ARROW) else column


def without_arrow(columns: Columns) -> Columns:
    """``columns`` with Arrow arrays as lists of Python values (what ``decode`` receives)."""
    return {
        name: without_arrow(col) if isinstance(col, dict) else
        as_list(col) if isinstance(col, ARROW) else col
        for name, col in columns.items()
    }  # fmt: skip


def cut(columns: Columns, start: int, stop: int) -> Columns:
    """Rows ``[start, stop)`` of every column."""
    return {
        name: cut(col, start, stop) if isinstance(col, dict) else col[start:stop]
        for name, col in columns.items()
    }


def concat(parts: Sequence[Columns]) -> Columns:
    """The rows of ``parts`` one after the other.

    A column missing from a part is ``None`` there; numpy columns stay numpy (dtypes promoted)
    when every part has them as numpy, else they become lists; nested columns are joined when
    every part has them.
    """
    if len(parts) == 1:
        return parts[0]
    sizes = [num_rows(part) for part in parts]
    out: Columns = {}
    for name in dict.fromkeys(chain.from_iterable(parts)):
        cols = [part.get(name) for part in parts]
        if all(isinstance(col, np.ndarray) for col in cols):
            out[name] = np.concatenate(cols)
            continue
        if all(isinstance(col, dict) for col in cols):
            out[name] = concat(cols)
            continue
        if all(isinstance(col, ARROW) for col in cols):
            if len({c.type for c in cols}) > 1:  # rows taken (views, dictionaries) and as read
                cols = [as_views(arrow_values(col)) for col in cols]
            if len({c.type for c in cols}) == 1:
                out[name] = pa.chunked_array(_chunks(cols), cols[0].type)
                continue
        merged: list = []
        for col, size in zip(cols, sizes):
            merged += [None] * size if col is None else as_list(col)
        out[name] = merged
    return out


def _chunks(columns: Sequence[pa.Array | pa.ChunkedArray]) -> list[pa.Array]:
    chunked = (col.chunks if isinstance(col, pa.ChunkedArray) else [col] for col in columns)
    return list(chain.from_iterable(chunked))
