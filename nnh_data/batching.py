"""Samples as columns: the form of the batches ``ShardedStreamingDataset(batch_size=...)`` yields.

A ``Columns`` is a dict of equally long columns: numpy arrays for numeric and boolean data,
lists of Python values for everything else, or nested ``Columns`` (``__aug__``). Building
batches this way costs a few pointer copies per value instead of a dict per sample, which is
what lets columnar sources (Parquet) stream at close to the speed of pyarrow itself.

>>> cols = columns_of([{"a": 1, "b": b"x"}, {"a": 2}])
>>> cols
{'a': [1, 2], 'b': [b'x', None]}
>>> concat([take(cols, np.array([1, 0])), cols])["a"]
[2, 1, 1, 2]
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

Column = list | np.ndarray | dict
Columns = dict[str, Column]

__all__ = ["Columns", "columns_of", "concat", "cut", "num_rows", "take"]


def num_rows(columns: Columns) -> int:
    """Rows of ``columns`` (which holds at least one column)."""
    first = next(iter(columns.values()))
    return num_rows(first) if isinstance(first, dict) else len(first)


def columns_of(samples: Sequence[dict]) -> Columns:
    """Columns of sample dicts: one per key (in first-seen order), ``None`` where it is missing."""
    names = dict.fromkeys(chain.from_iterable(samples))
    return {name: [s.get(name) for s in samples] for name in names}


def take(columns: Columns, indices: np.ndarray) -> Columns:
    """Rows ``indices`` (integers) of every column, in that order."""
    positions = indices.tolist()
    out: Columns = {}
    for name, col in columns.items():
        if isinstance(col, dict):
            out[name] = take(col, indices)
        elif isinstance(col, np.ndarray):
            out[name] = col[indices]
        else:
            out[name] = list(map(col.__getitem__, positions))
    return out


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
        merged: list = []
        for col, size in zip(cols, sizes):
            if col is None:
                merged += [None] * size
            else:
                merged += col.tolist() if isinstance(col, np.ndarray) else col
        out[name] = merged
    return out
