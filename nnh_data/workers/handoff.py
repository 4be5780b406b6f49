"""Handing batches out: columns as tensors, bytes and text packed, one message per worker batch.

What a training loop receives from :func:`~nnh_data.streaming.loader.streaming_loader` (or a
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
bytes, and pickling the bytes of a packed field through the pipe costs more than copying them.
:func:`handed_out` wraps a worker's batch so that the worker queue sends its tensors up to
:data:`BY_VALUE_BYTES` and its packed fields through the worker's shared-memory ring
(:mod:`nnh_data.workers.shm_ring`: one copy in, one copy out, a few bytes through the pipe), or
inside the message when no slot is free, and so do lists of bytes (what a ``decode`` function
keeps of a sample) from :data:`PACKED_LIST_BYTES` on, packed and rebuilt as the same lists,
while larger tensors (decoded images) are stacked by
:func:`collate_decoded` into one of the worker's reused shared-memory buffers
(:mod:`nnh_data.workers.batch_buffers`: no new segment to fault in per batch, no copy on either
side; a buffer is written again only once the receiving process has let go of the batch over it), or
else keep torch's shared-memory path. The receiving process gets a plain dict; outside a
worker, nothing is wrapped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import chain, groupby
from multiprocessing.reduction import ForkingPickler
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import (
    collate,
    collate_float_fn,
    collate_int_fn,
    collate_numpy_array_fn,
    collate_tensor_fn,
    default_collate_fn_map,
)

from nnh_data.columns import ARROW, as_list, concat, cut, take
from nnh_data.packed import PackedField, arrow_kind
from nnh_data.workers import batch_buffers, shm_ring

__all__ = [
    "BY_VALUE_BYTES",
    "PACKED_LIST_BYTES",
    "collate_decoded",
    "collate_rows",
    "collate_samples",
    "handed_out",
    "tensor_columns",
]

BY_VALUE_BYTES = 1 << 20  # tensors and packed fields up to this size travel in the message
PACKED_LIST_BYTES = 64 << 10  # lists of bytes of this size travel packed (a decode's bytes)
_NUMPY_KIND = {bool: np.bool_, int: np.int64, float: np.float64}  # what default_collate makes


def collate_samples(samples: Sequence[Any]) -> Any:
    """Collate sample dicts into a dict of columns: ``int``/``float``/``bool`` values as
    tensors (the dtypes of ``default_collate``), ``bytes`` or ``str`` values (``None`` allowed)
    as a :class:`PackedField`, dicts recursively, lists (Parquet list columns) and any other
    column holding a ``None`` (a nullable column) as the list of their values, anything else
    by ``default_collate``. A field missing from some samples is ``None`` there.
    In a DataLoader worker the batch is wrapped for the hand-off (:func:`handed_out`).

    Example:
        >>> batch = collate_samples([{"x": 1, "t": "a"}, {"x": 2, "t": "b"}])
        >>> batch["x"], batch["t"].tolist()
        (tensor([1, 2]), ['a', 'b'])
    """
    return handed_out(_collated(samples))


def collate_decoded(samples: Sequence[Any]) -> Any:
    """``default_collate`` (what decoding users get), wrapped for the hand-off in a worker;
    a field with ``None`` in some samples (a nullable column), or with lists of different
    lengths, stays the list of its values."""
    return handed_out(_default_collate(samples))


def _default_collate(batch: Sequence[Any]) -> Any:
    """``torch.utils.data.default_collate``, same output, made with fewer steps where numpy
    gives the same result: tensors and numpy arrays of one shape and dtype stacked by numpy
    in the calling thread, and Python numbers made into a tensor by numpy.

    Why: ``torch.stack`` copies through torch's thread pool: for a batch of decoded images
    (256 x 224x224x3) in a loaded main process that took 0.4-0.5 s of CPU against 0.03 s here,
    the pool's threads spinning while they wait for a core. Numpy arrays become one tensor
    each before torch stacks them (about 1 us a sample). And ``torch.tensor`` of 256 Python
    ints takes 5x numpy's time (0.3 us a sample for each int field: a label, an id, the
    parameters a decode function keeps)."""
    return collate(batch, collate_fn_map=_COLLATE_MAP)


def _stacked(batch: Sequence[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
    """``collate_tensor_fn``'s result (in shared memory in a DataLoader worker), copied by
    numpy where the tensors are CPU tensors of one shape and a dtype numpy knows."""
    elem = batch[0]
    if not all(_numpy_stackable(t, elem) for t in batch):
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    out = _batch_tensor((len(batch), *elem.shape), elem.dtype, elem)
    np.stack([t.numpy() for t in batch], out=out.numpy())
    return out


def _stacked_arrays(batch: Sequence[np.ndarray], *, collate_fn_map: Any = None) -> torch.Tensor:
    """``collate_numpy_array_fn``'s result: numpy arrays of one shape and a dtype torch has
    stacked by numpy into the batch's tensor, with no tensor made per array."""
    elem = batch[0]
    dtype = _TORCH_DTYPE.get(elem.dtype)
    if dtype is None or not all(_same_array(a, elem) for a in batch):
        return collate_numpy_array_fn(batch, collate_fn_map=collate_fn_map)
    out = _batch_tensor((len(batch), *elem.shape), dtype, None)
    np.stack(batch, out=out.numpy())
    return out


def _same_array(array: np.ndarray, first: np.ndarray) -> bool:
    return type(array) is np.ndarray and array.shape == first.shape and array.dtype == first.dtype


def _batch_tensor(shape: tuple[int, ...], dtype: torch.dtype, like: Any) -> torch.Tensor:
    """An uninitialised tensor for a batch: a reused buffer when one is free, else new memory
    (in a DataLoader worker shared memory, as ``collate_tensor_fn`` makes, so that the queue
    sends it as it is)."""
    out = batch_buffers.batch_tensor(shape, dtype)
    if out is not None:
        return out
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    like = torch.empty(0, dtype=dtype) if like is None else like
    storage = like._typed_storage()._new_shared(math.prod(shape), device="cpu")
    return like.new(storage).resize_(shape)


def _numbers(batch: Sequence[Any], *, collate_fn_map: Any = None) -> torch.Tensor:
    """``collate_int_fn``'s or ``collate_float_fn``'s tensor of Python numbers, made by numpy
    where numpy gives the dtype torch gives (int64 or bool for ints and bools, float64 for
    floats); torch's function for anything else (mixed kinds, numbers out of range)."""
    floats = isinstance(batch[0], float)
    try:
        array = np.array(batch)
    except (TypeError, ValueError, OverflowError):
        array = None
    if array is not None and array.ndim == 1 and array.dtype in _NUMBER_DTYPES[floats]:
        return torch.from_numpy(array)
    return (collate_float_fn if floats else collate_int_fn)(batch, collate_fn_map=collate_fn_map)


def _numpy_stackable(tensor: torch.Tensor, first: torch.Tensor) -> bool:
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_nested
        and not tensor.requires_grad
        and tensor.dtype == first.dtype
        and tensor.shape == first.shape
        and tensor.dtype in _NUMPY_DTYPES
    )


_NUMPY_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
                           torch.int64, torch.float16, torch.float32, torch.float64})  # fmt: skip


_NONE_TYPE = type(None)


def _nullable(collate_fn: Callable) -> Callable:
    """``collate_fn``, except that a column holding a ``None`` stays the list of its values
    (a nullable column: ``default_collate`` cannot make a tensor of it)."""

    def collate_column(batch: Sequence[Any], *, collate_fn_map: Any = None) -> Any:
        if _NONE_TYPE in map(type, batch):  # in C: ``value is None`` is a frame step a value
            return list(batch)
        return collate_fn(batch, collate_fn_map=collate_fn_map)

    return collate_column


def _lists(batch: Sequence[list], *, collate_fn_map: Any = None) -> Any:
    """``default_collate``'s lists (transposed); lists of different lengths (a Parquet list
    column) stay the list of their values."""
    if len(set(map(len, batch))) > 1:
        return list(batch)
    return collate(batch, collate_fn_map={k: f for k, f in collate_fn_map.items() if k is not list})


_TORCH_DTYPE = {torch.empty(0, dtype=d).numpy().dtype: d for d in _NUMPY_DTYPES}
_NUMBER_DTYPES = {False: (np.dtype(np.int64), np.dtype(np.bool_)), True: (np.dtype(np.float64),)}
_COLLATE_MAP = {**default_collate_fn_map, torch.Tensor: _stacked, np.ndarray: _stacked_arrays,
                bool: _numbers, int: _numbers, float: _numbers, list: _lists}  # fmt: skip
_COLLATE_MAP = {type(None): _nullable(list), **{k: _nullable(f) for k, f in _COLLATE_MAP.items()}}


def _collated(samples: Sequence[Any]) -> Any:
    if not samples or type(samples[0]) is not dict:
        return _default_collate(samples)
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
            return _default_collate(values)
    if kind is list or any(value is None for value in values):  # as batch mode gives them
        return values
    if kind is dict:
        return _collated(values)
    if kind in _NUMPY_KIND and first is values[0]:
        array = np.array(values)
        if array.dtype == _NUMPY_KIND[kind]:
            return torch.from_numpy(array)
    return _default_collate(values)


def collate_rows(rows: Sequence[tuple[dict[str, Any], int]]) -> dict[str, Any]:
    """Collate the ``(columns, i)`` rows of :func:`nnh_data.streaming.stages.hand_out_rows`: the
    batch :func:`collate_samples` makes of the same samples as dicts, taken from their columns."""
    pieces = []
    for _, group in groupby(rows, key=_part_of):  # by identity: parts may hold equal values
        rows_of_part = list(group)
        columns, at = rows_of_part[0][0], [i for _, i in rows_of_part]
        if at[-1] - at[0] == len(at) - 1:
            pieces.append(cut(columns, at[0], at[-1] + 1))
        else:
            pieces.append(take(columns, np.array(at, dtype=np.int64)))
    return handed_out(_as_collated(concat(pieces)))


def _part_of(row: tuple[dict[str, Any], int]) -> int:
    """The identity of a row's part (its columns dict)."""
    return id(row[0])


def _as_collated(columns: dict[str, Any]) -> dict[str, Any]:
    """Columns as :func:`collate_samples` collates the Python values of their rows; an Arrow
    column of numbers (a nullable column: those without nulls come as numpy) as their Python
    values in every batch, whether or not it holds a ``None``, as in batch mode."""
    out = {}
    for name, column in columns.items():
        if isinstance(column, dict):
            out[name] = _as_collated(column)
        elif isinstance(column, np.ndarray) and (dtype := _collated_dtype(column.dtype)):
            out[name] = torch.from_numpy(column.astype(dtype))
        elif (packed := _packed_arrow(column)) is not None:
            out[name] = packed
        elif isinstance(column, ARROW) and _numeric(column.type):
            out[name] = column.to_pylist()
        else:
            out[name] = _column(as_list(column))
    return out


def _packed_arrow(column: Any) -> PackedField | None:
    """An Arrow binary or string column packed from its buffers; None for anything else (and
    for a column of nulls only, which stays a list)."""
    if not isinstance(column, ARROW) or arrow_kind(column.type) is None:
        return None
    return PackedField.from_arrow(column) if column.null_count < len(column) else None


def _numeric(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)


def _collated_dtype(dtype: np.dtype) -> type | None:
    """The dtype :func:`collate_samples` gives the Python values of a numpy column of
    ``dtype`` (bool, int64 or float64); None where it must look at the values (uint64, whose
    values may not fit int64; other kinds)."""
    if dtype.kind in "iu" and (dtype.kind == "i" or dtype.itemsize < 8):
        return np.int64
    return {"b": np.bool_, "f": np.float64}.get(dtype.kind)


def tensor_columns(columns: dict[str, Any]) -> dict[str, Any]:
    """Batch-mode columns (:mod:`nnh_data.columns`) as handed out: numpy arrays as tensors,
    lists of bytes or text (``None`` allowed, not all ``None``) as :class:`PackedField`,
    nested columns recursively, other lists unchanged; wrapped in a worker."""
    return handed_out(_tensors(columns))


def _tensors(columns: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, column in columns.items():
        if isinstance(column, np.ndarray):  # most columns (labels, parameters)
            out[name] = _tensor(column)
        elif isinstance(column, dict):
            out[name] = _tensors(column)
        elif (packed := _packed_arrow(column)) is not None:
            out[name] = packed
        else:
            out[name] = _packed_or_list(as_list(column))
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
    multiprocessing's pickler sends its small tensors and packed fields through the worker's
    shared-memory ring (or inside the message); the receiving process gets a plain dict of the
    same values (see the module docstring). Outside a worker, ``batch``."""
    if get_worker_info() is None or type(batch) is not dict:
        return batch
    return _HandOff(batch)


class _HandOff(dict):
    """A worker's batch on its way to the queue (a plain dict to any other pickler)."""

    __slots__ = ()


def _reduce_hand_off(batch: _HandOff) -> tuple[Callable, tuple]:
    """How the worker queue pickles a batch: its arrays in the worker's ring (or by value
    when no slot is free), the rest of it as it is."""
    arrays: list[np.ndarray] = []
    skeleton = _skeleton(batch, arrays)
    ring = shm_ring.worker_ring(shm_ring.footprint(arrays)) if arrays else None
    placed = None if ring is None else ring.put(arrays)
    if placed is None:
        return _filled, (skeleton, arrays)
    return _from_ring, (skeleton, placed)


ForkingPickler.register(_HandOff, _reduce_hand_off)


class _Tensor(NamedTuple):
    """In a skeleton: the tensor of array ``index``."""

    index: int


class _Pooled(NamedTuple):
    """In a skeleton: a tensor in a worker's reused buffer (:func:`batch_buffers.rebuild`'s
    arguments)."""

    placed: tuple


class _Packed(NamedTuple):
    """In a skeleton: a packed field of arrays ``data``, ``offsets``, ``valid`` (or None)."""

    kind: str
    data: int
    offsets: int
    valid: int | None


class _PackedList(NamedTuple):
    """In a skeleton: a list of bytes sent as a packed field (its :class:`_Packed` marker, or
    a :class:`_SharedPacked`), rebuilt as the same list."""

    field: Any


class _SharedPacked:
    """A large packed field pickled with its data as a tensor (torch's shared memory)."""

    __slots__ = ("field",)

    def __init__(self, field: PackedField) -> None:
        self.field = field

    def __reduce__(self) -> tuple[Callable, tuple]:
        f = self.field
        valid = None if f.valid is None else f.valid.clone()
        return PackedField, (f.data, f.offsets.clone(), f.kind, valid)


def _skeleton(value: Any, arrays: list[np.ndarray]) -> Any:
    """``value`` with its small tensors and packed fields moved to ``arrays`` (as numpy),
    markers in their places; dicts as plain dicts."""
    if isinstance(value, dict) and type(value) in (dict, _HandOff):
        return {name: _skeleton(v, arrays) for name, v in value.items()}
    if isinstance(value, torch.Tensor):
        array = _small_array(value)
        if array is None:
            pooled = batch_buffers.placed(value)
            return value if pooled is None else _Pooled(pooled)
        arrays.append(array)
        return _Tensor(len(arrays) - 1)
    if isinstance(value, PackedField):
        if value.data.nbytes > BY_VALUE_BYTES:
            return _SharedPacked(value)
        bounds, first = value.offsets.numpy(), len(arrays)
        arrays += [value.data.numpy()[bounds[0] : bounds[-1]], bounds - bounds[0]]
        if value.valid is not None:
            arrays.append(value.valid.numpy())
        return _Packed(value.kind, first, first + 1, None if value.valid is None else first + 2)
    if type(value) is list and _packable(value):
        return _PackedList(_skeleton(PackedField.pack(value), arrays))
    return value


def _packable(values: list) -> bool:
    """Whether a list travels packed: only ``bytes``, :data:`PACKED_LIST_BYTES` or more of
    them (pickled, 256 values of 3 KiB cost 4x the copies into and out of the ring: the
    pipe's own copies, 64 KiB at a time, and a wake-up of each side per piece)."""
    return (bool(values) and type(values[0]) is bytes and set(map(type, values)) == {bytes}
            and sum(map(len, values)) >= PACKED_LIST_BYTES)  # fmt: skip


def _small_array(tensor: torch.Tensor) -> np.ndarray | None:
    """A small CPU tensor's numpy view; None for large ones (torch's shared memory suits
    them) and for those numpy cannot view (bfloat16, autograd)."""
    if tensor.nbytes > BY_VALUE_BYTES or tensor.device.type != "cpu" or tensor.requires_grad:
        return None
    try:
        return tensor.numpy()
    except TypeError:
        return None


def _from_ring(skeleton: Any, placed: tuple) -> Any:
    return _filled(skeleton, shm_ring.rebuild(*placed))


def _filled(skeleton: Any, arrays: list[np.ndarray]) -> Any:
    """The batch of ``skeleton`` with its markers replaced by tensors and packed fields."""
    if type(skeleton) is dict:
        return {name: _filled(v, arrays) for name, v in skeleton.items()}
    if type(skeleton) is _Tensor:
        return _tensor(arrays[skeleton.index])
    if type(skeleton) is _Pooled:
        return batch_buffers.rebuild(*skeleton.placed)
    if type(skeleton) is _PackedList:
        return _filled(skeleton.field, arrays).tolist()
    if type(skeleton) is _Packed:
        valid = None if skeleton.valid is None else _tensor(arrays[skeleton.valid])
        return PackedField(_tensor(arrays[skeleton.data]), _tensor(arrays[skeleton.offsets]),
                           skeleton.kind, valid)  # fmt: skip
    return skeleton


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array if array.flags.writeable else array.copy())
