"""Handing batches out: columns as tensors, bytes and text packed, one message per worker batch.

What a training loop receives from :func:`~nnh_data.streaming_loader.streaming_loader` (or a
``DataLoader`` over a dataset with ``batch_size``): a dict of columns in which numbers are
tensors, bytes and text fields are :class:`~nnh_data.packed.PackedField` (one uint8 tensor and
offsets instead of a list of objects), nested dicts (``__aug__``) the same, and anything else
as ``default_collate`` makes it. :func:`collate_samples` builds it from sample dicts (the
loader's ``collate_fn`` in per-sample mode), :func:`tensor_columns` from the dataset's own
columns (batch mode).

Why the transport matters. A batch leaves a DataLoader worker pickled through a pipe, and torch
pickles every tensor by moving it to a new shared-memory segment whose file descriptor the main
process fetches over a socket, with an authentication handshake, one tensor at a time: for the
dozen small columns of a batch (ids, pad flags, the parameters) that costs far more than their
bytes. :func:`handed_out` wraps a worker's batch so that tensors up to :data:`BY_VALUE_BYTES`
and packed fields travel inside the one pickled message (the main process rebuilds them as
tensors), while larger tensors (decoded images) keep torch's shared-memory path, where one
segment per tensor is cheap relative to its size. In the main process the batch is a plain
dict; outside a worker, nothing is wrapped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain, groupby
from operator import itemgetter
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info

from nnh_data import batching
from nnh_data.packed import PackedField

__all__ = [
    "BY_VALUE_BYTES",
    "collate_decoded",
    "collate_rows",
    "collate_samples",
    "handed_out",
    "tensor_columns",
]

BY_VALUE_BYTES = 1 << 20  # tensors and packed fields up to this size travel in the message
_NUMPY_KIND = {bool: np.bool_, int: np.int64, float: np.float64}  # what default_collate makes


def collate_samples(samples: Sequence[Any]) -> Any:
    """Collate sample dicts into a dict of columns: ``int``/``float``/``bool`` values as
    tensors (the dtypes of ``default_collate``), ``bytes`` or ``str`` values (``None`` allowed)
    as a :class:`PackedField`, dicts recursively, anything else by ``default_collate``. A field
    missing from some samples is ``None`` there. In a DataLoader worker the batch is wrapped
    for the hand-off (:func:`handed_out`).

    Example:
        >>> batch = collate_samples([{"x": 1, "t": "a"}, {"x": 2, "t": "b"}])
        >>> batch["x"], batch["t"].tolist()
        (tensor([1, 2]), ['a', 'b'])
    """
    return handed_out(_collated(samples))


def collate_decoded(samples: Sequence[Any]) -> Any:
    """``default_collate`` (what decoding users get), wrapped for the hand-off in a worker."""
    return handed_out(default_collate(samples))


def _collated(samples: Sequence[Any]) -> Any:
    if not samples or type(samples[0]) is not dict:
        return default_collate(samples)
    names = dict.fromkeys(chain.from_iterable(samples))
    return {name: _column(_values(samples, name)) for name in names}


def _values(samples: Sequence[dict], name: str) -> list:
    try:
        return list(map(itemgetter(name), samples))
    except KeyError:
        return [sample.get(name) for sample in samples]


def _column(values: list) -> Any:
    """One collated column (see :func:`collate_samples`)."""
    first = next((v for v in values if v is not None), None)
    kind = type(first)
    if kind in (bytes, str):
        try:
            return PackedField.pack(values)
        except TypeError:
            return default_collate(values)
    if kind is dict and None not in values:
        return _collated(values)
    if kind in _NUMPY_KIND and first is values[0]:
        array = np.array(values)
        if array.dtype == _NUMPY_KIND[kind]:
            return torch.from_numpy(array)
    return default_collate(values)


def collate_rows(rows: Sequence[tuple[dict[str, Any], int]]) -> dict[str, Any]:
    """Collate the ``(columns, i)`` rows of :func:`nnh_data.stages.hand_out_rows`: the batch
    :func:`collate_samples` makes of the same samples as dicts, taken from their columns."""
    pieces = []
    for columns, group in groupby(rows, key=itemgetter(0)):
        at = [i for _, i in group]
        if at[-1] - at[0] == len(at) - 1:
            pieces.append(batching.cut(columns, at[0], at[-1] + 1))
        else:
            pieces.append(batching.take(columns, np.array(at, dtype=np.int64)))
    return handed_out(_as_collated(batching.concat(pieces)))


def _as_collated(columns: dict[str, Any]) -> dict[str, Any]:
    """Columns as :func:`collate_samples` collates the Python values of their rows."""
    out = {}
    for name, column in columns.items():
        if isinstance(column, dict):
            out[name] = _as_collated(column)
        elif isinstance(column, np.ndarray) and (dtype := _collated_dtype(column.dtype)):
            out[name] = torch.from_numpy(column.astype(dtype))
        else:
            out[name] = _column(column.tolist() if isinstance(column, np.ndarray) else column)
    return out


def _collated_dtype(dtype: np.dtype) -> type | None:
    """The dtype :func:`collate_samples` gives the Python values of a numpy column of
    ``dtype`` (bool, int64 or float64); None where it must look at the values (uint64, whose
    values may not fit int64; other kinds)."""
    if dtype.kind in "iu" and (dtype.kind == "i" or dtype.itemsize < 8):
        return np.int64
    return {"b": np.bool_, "f": np.float64}.get(dtype.kind)


def tensor_columns(columns: dict[str, Any]) -> dict[str, Any]:
    """Batch-mode columns (:mod:`nnh_data.batching`) as handed out: numpy arrays as tensors,
    lists of bytes or text (``None`` allowed, not all ``None``) as :class:`PackedField`,
    nested columns recursively, other lists unchanged; wrapped in a worker."""
    return handed_out(_tensors(columns))


def _tensors(columns: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, column in columns.items():
        if isinstance(column, dict):
            out[name] = _tensors(column)
        elif isinstance(column, np.ndarray):
            out[name] = torch.from_numpy(column if column.flags.writeable else column.copy())
        else:
            out[name] = _packed_or_list(column)
    return out


def _packed_or_list(values: list) -> Any:
    first = next((v for v in values if v is not None), None)
    if isinstance(first, (bytes, str)):
        try:
            return PackedField.pack(values)
        except TypeError:
            pass
    return values


# ---------------------------------------------------------------- the worker queue


def handed_out(batch: Any) -> Any:
    """``batch`` ready for the worker queue: in a DataLoader worker a dict is wrapped so that
    pickling sends its small tensors and packed fields by value (see the module docstring); the
    main process receives a plain dict of the same values. Outside a worker, ``batch``."""
    if get_worker_info() is None or type(batch) is not dict:
        return batch
    return _HandOff(batch)


class _HandOff(dict):
    """A dict that pickles as a plain dict of its values encoded for the worker queue."""

    __slots__ = ()

    def __reduce__(self) -> tuple:
        return dict, (), None, None, ((k, _encoded(v)) for k, v in self.items())


class _ByValue:
    """A small tensor pickled as its numpy array, rebuilt as a tensor."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce__(self) -> tuple[Callable, tuple]:
        return _tensor_of, (self.array,)


class _SharedPacked:
    """A large packed field pickled with its data as a tensor (torch's shared memory)."""

    __slots__ = ("field",)

    def __init__(self, field: PackedField) -> None:
        self.field = field

    def __reduce__(self) -> tuple[Callable, tuple]:
        f = self.field
        return PackedField, (f.data, _ByValue(f.offsets.numpy()), f.kind,
                             None if f.valid is None else _ByValue(f.valid.numpy()))  # fmt: skip


def _encoded(value: Any) -> Any:
    if type(value) is dict:
        return _HandOff(value)
    if isinstance(value, torch.Tensor):
        small = value.nbytes <= BY_VALUE_BYTES and value.device.type == "cpu"
        return _ByValue(_numpy(value)) if small and not value.requires_grad else value
    if isinstance(value, PackedField) and value.data.nbytes > BY_VALUE_BYTES:
        return _SharedPacked(value)
    return value


def _numpy(tensor: torch.Tensor) -> np.ndarray | torch.Tensor:
    """The tensor's numpy view, or the tensor itself for dtypes numpy lacks (bfloat16)."""
    try:
        return tensor.numpy()
    except TypeError:
        return tensor


def _tensor_of(array: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array
    return torch.from_numpy(array if array.flags.writeable else array.copy())
