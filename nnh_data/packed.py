"""``PackedField``: the bytes or text values of one field of a batch, in one uint8 tensor.

A batch of 256 samples holds 256 ``bytes`` objects per binary field; sent from a DataLoader
worker to the main process as a list, each is pickled, copied and rebuilt as an object. Packed,
the values lie back to back in one ``uint8`` tensor (``data``) with ``offsets`` (int64, one more
than the values: value ``i`` is ``data[offsets[i]:offsets[i + 1]]``), so a batch's field crosses
the worker queue as one buffer, and the main process builds nothing per sample until a value is
asked for. Text is stored as UTF-8, a lone surrogate as ``"surrogatepass"`` writes it, so every
``str`` comes back as it went in (a tar member name that is not UTF-8 gives a key with
surrogates, as in Python's ``tarfile``, and pickle sends such keys the same way). A missing
value (``None``) is an empty slot marked in ``valid``. The type reads like the list it
replaces: ``len``, indexing (an int gives the value, a slice a ``PackedField``), iteration,
``tolist()``, and ``==`` against a list.

>>> names = PackedField.pack(["cat", "dog", None])
>>> len(names), names[1], names.tolist()
(3, 'dog', ['cat', 'dog', None])
>>> names[:2] == ["cat", "dog"]
True
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from itertools import starmap
from typing import Any

import numpy as np
import pyarrow as pa
import torch

__all__ = ["KINDS", "PackedField", "arrow_kind", "arrow_values", "as_views", "is_view"]

KINDS = ("bytes", "str")
_ARROW_KINDS = {pa.binary(): "bytes", pa.large_binary(): "bytes", pa.binary_view(): "bytes",
                pa.string(): "str", pa.large_string(): "str", pa.string_view(): "str"}  # fmt: skip
_VIEWS = {pa.binary(): pa.binary_view(), pa.large_binary(): pa.binary_view(),
          pa.string(): pa.string_view(), pa.large_string(): pa.string_view()}  # fmt: skip
_PACKED = {"bytes": pa.large_binary(), "str": pa.large_string()}  # what views are packed as
_TEXT_ERRORS = "surrogatepass"  # lone surrogates (keys of names that are not UTF-8) round-trip


class PackedField:
    """Bytes (``kind="bytes"``) or text (``kind="str"``) values packed in one uint8 tensor.

    ``data``: the values' bytes back to back; ``offsets``: where value ``i`` starts and ends
    (``offsets[i]``, ``offsets[i + 1]``); ``valid``: a bool tensor, False where the value is
    ``None``, or None when no value is. Build one with :meth:`pack` or :meth:`from_arrow`. For
    zero-copy access, a value's bytes are ``data[offsets[i]:offsets[i + 1]]`` (for instance for
    a GPU decoder). A field packed from values it can keep (``bytes`` or ``str`` objects, an
    Arrow array) keeps them and builds ``data`` and ``offsets`` when they are first asked for
    or when it crosses a process boundary, so a batch read where it was made copies nothing.
    """

    __slots__ = ("kind", "valid", "_data", "_offsets", "_values", "_bounds")

    def __init__(
        self, data: torch.Tensor, offsets: torch.Tensor, kind: str, valid: torch.Tensor | None
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self._data, self._offsets, self.kind, self.valid = data, offsets, kind, valid
        self._values: list | pa.Array | pa.ChunkedArray | None = None
        self._bounds: list[int] | None = None

    @classmethod
    def _kept(cls, values: Any, kind: str, valid: torch.Tensor | None) -> PackedField:
        """A field over ``values`` (a list with ``None`` where missing, or an Arrow array
        without nulls), packed when needed."""
        field = cls.__new__(cls)
        field.kind, field.valid, field._values = kind, valid, values
        field._data = field._offsets = field._bounds = None
        return field

    @classmethod
    def pack(cls, values: Sequence[bytes | str | None]) -> PackedField:
        """Pack ``values``: all ``bytes`` (``bytearray``, ``memoryview``) or all ``str``,
        ``None`` allowed (all ``None`` packs as bytes). Raises ``TypeError`` otherwise."""
        values = list(values)
        types = set(map(type, values))
        valid = None
        if type(None) in types:
            types.discard(type(None))
            valid = torch.from_numpy(np.fromiter(map(_is_not_none, values), bool, len(values)))
        if types <= {bytes} or types == {str}:
            return cls._kept(values, "str" if types == {str} else "bytes", valid)
        return cls._packed(values, valid)

    @classmethod
    def _packed(cls, values: list, valid: torch.Tensor | None) -> PackedField:
        """``values`` (``None`` where ``valid`` is False) packed now."""
        first = next((v for v in values if v is not None), b"")
        kind = "str" if isinstance(first, str) else "bytes"
        empty = "" if kind == "str" else b""
        values = [empty if v is None else v for v in values] if valid is not None else values
        buffer, lengths = _joined_text(values) if kind == "str" else _joined_bytes(values)
        offsets = np.zeros(len(values) + 1, np.int64)
        np.cumsum(np.fromiter(lengths, np.int64, len(values)), out=offsets[1:])
        return cls(_uint8_tensor(buffer), torch.from_numpy(offsets), kind, valid)

    @classmethod
    def from_arrow(cls, array: pa.Array | pa.ChunkedArray) -> PackedField:
        """A field of an Arrow binary or string array (chunked, ``large_`` and view ones,
        dictionaries of them too), packed from its buffers when needed, with no Python object
        per value: the same field :meth:`pack` makes of its values. Raises ``TypeError`` for
        other types."""
        kind = arrow_kind(array.type)
        if kind is None:
            raise TypeError(f"PackedField.from_arrow: a binary or string array, got {array.type}")
        if _has_nulls(array):  # null slots may hold bytes; pack gives them none
            return cls.pack(arrow_values(array).to_pylist())
        return cls._kept(array, kind, None)

    # ------------------------------------------------------------------ packed form

    @property
    def data(self) -> torch.Tensor:
        """The values' bytes back to back (uint8)."""
        if self._data is None:
            self._pack()
        return self._data

    @property
    def offsets(self) -> torch.Tensor:
        """Where each value starts, then where the last one ends (int64)."""
        if self._offsets is None:
            self._pack()
        return self._offsets

    def _pack(self) -> None:
        values = self._values
        if isinstance(values, list):
            packed = PackedField._packed(values, self.valid)
            self._data, self._offsets = packed._data, packed._offsets
        else:
            self._data, self._offsets = _arrow_packed(values)
        self._values = None

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return len(self._values) if self._values is not None else self._offsets.numel() - 1

    def __getitem__(self, index: int | slice) -> Any:
        values = self._values
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError(f"a PackedField slice must have step 1, got {index.step}")
            stop = max(start, stop)
            valid = None if self.valid is None else self.valid[start:stop]
            if values is None:
                return PackedField(self._data, self._offsets[start : stop + 1], self.kind, valid)
            kept = values[start:stop]
            if not isinstance(kept, list) and is_view(kept.type):  # its own bytes, not the
                return PackedField(*_arrow_packed(kept), self.kind, valid)  # blocks viewed
            return PackedField._kept(kept, self.kind, valid)
        n = len(self)
        i = operator.index(index)
        i = i + n if i < 0 else i
        if not 0 <= i < n:
            raise IndexError(f"PackedField index {index} out of range for {n} values")
        if isinstance(values, list):
            return values[i]
        if values is not None:
            if pa.types.is_dictionary(values.type):  # decoded once: a value of it is 2x slower
                self._values = values = arrow_values(values)
            return values[i].as_py()
        if self.valid is not None and not self.valid[i]:
            return None
        bounds = self._offsets_list()
        value = self._bytes()[bounds[i] : bounds[i + 1]].tobytes()
        return value.decode("utf-8", _TEXT_ERRORS) if self.kind == "str" else value

    def __iter__(self) -> Iterator[Any]:
        return iter(self.tolist())

    def tolist(self) -> list:
        """The values as a list of ``bytes`` or ``str`` (``None`` where missing)."""
        if isinstance(self._values, list):
            return list(self._values)
        if self._values is not None:
            return arrow_values(self._values).to_pylist()
        bounds = self._offsets_list()
        base = bounds[0] if bounds else 0
        raw = self._bytes()[base : bounds[-1] if bounds else 0].tobytes()
        shifted = [b - base for b in bounds]
        cuts = list(starmap(slice, zip(shifted, shifted[1:])))
        if self.kind == "str" and raw.isascii():  # one decode, then str slices
            values = list(map(raw.decode("ascii").__getitem__, cuts))
        else:
            values = list(map(raw.__getitem__, cuts))
            if self.kind == "str":
                values = [v.decode("utf-8", _TEXT_ERRORS) for v in values]
        if self.valid is not None:
            for i in np.flatnonzero(~self.valid.numpy()).tolist():
                values[i] = None
        return values

    def lengths(self) -> torch.Tensor:
        """The byte length of each value (0 where it is missing)."""
        return self.offsets[1:] - self.offsets[:-1]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedField):
            return self.kind == other.kind and self.tolist() == other.tolist()
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # mutable content, like a list

    def __repr__(self) -> str:
        shown = self[:4].tolist()
        more = ", ..." if len(self) > 4 else ""
        return f"PackedField({self.kind}, {len(self)} values: {str(shown)[1:-1]}{more})"

    # ------------------------------------------------------------------ moving

    def pin_memory(self) -> PackedField:
        """This field with its tensors in pinned memory (what ``DataLoader(pin_memory=True)``
        calls)."""
        valid = None if self.valid is None else self.valid.pin_memory()
        return PackedField(self.data.pin_memory(), self.offsets.pin_memory(), self.kind, valid)

    def __reduce__(self) -> tuple:
        """Pickled by value: the values' bytes, their offsets from 0, the null mask."""
        bounds = self.offsets.numpy()
        raw = self.data.numpy()[bounds[0] : bounds[-1]]
        valid = None if self.valid is None else self.valid.numpy()
        return _unpickle, (self.kind, raw, bounds - bounds[0], valid)

    # ------------------------------------------------------------------ internals

    def _offsets_list(self) -> list[int]:
        if self._bounds is None:
            self._bounds = self.offsets.tolist()
        return self._bounds

    def _bytes(self) -> np.ndarray:
        return self.data.numpy()


def _unpickle(kind: str, raw: np.ndarray, offsets: np.ndarray, valid: np.ndarray | None):
    data = torch.from_numpy(_writable(raw))
    mask = None if valid is None else torch.from_numpy(_writable(valid))
    return PackedField(data, torch.from_numpy(_writable(offsets)), kind, mask)


def _writable(array: np.ndarray) -> np.ndarray:
    return array if array.flags.writeable else array.copy()


def _is_not_none(value: Any) -> bool:
    return value is not None


def _joined_bytes(values: list) -> tuple[bytearray, Iterator[int]]:
    try:
        return bytearray().join(values), map(len, values)
    except TypeError:
        raise TypeError(_mixed(values, (bytes, bytearray, memoryview))) from None


def _joined_text(values: list) -> tuple[bytearray, Iterator[int]]:
    """The UTF-8 of ``values`` back to back and each one's length in bytes."""
    try:
        text = "".join(values)
    except TypeError:
        raise TypeError(_mixed(values, str)) from None
    if text.isascii():  # one encode for the whole batch
        return bytearray(text, "ascii"), map(len, values)
    pieces = [v.encode("utf-8", _TEXT_ERRORS) for v in values]
    return bytearray().join(pieces), map(len, pieces)


def _mixed(values: list, kind: type | tuple[type, ...]) -> str:
    bad = next(v for v in values if not isinstance(v, kind))
    return f"PackedField.pack: values must be all bytes or all str (or None), got {bad!r}"


def arrow_kind(kind: pa.DataType) -> str | None:
    """The kind of field (``"bytes"`` or ``"str"``) :meth:`PackedField.from_arrow` makes of
    Arrow arrays of type ``kind`` (binary, string, their ``large_`` and view forms and
    dictionaries of them); None for any other type."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return _ARROW_KINDS.get(kind)


def arrow_values(array: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """``array`` with dictionaries decoded: their values in a new array, taken by Arrow (whose
    ``to_pylist`` of a dictionary array boxes each value as a scalar: 5-20x slower than
    decoding first); any other array as it is."""
    if not pa.types.is_dictionary(array.type):
        return array
    if isinstance(array, pa.Array):
        return array.dictionary_decode()
    chunks = [chunk.dictionary_decode() for chunk in array.chunks]
    return pa.chunked_array(chunks, array.type.value_type)


def is_view(kind: pa.DataType) -> bool:
    """Whether ``kind`` is ``binary_view`` or ``string_view``."""
    return kind in (pa.binary_view(), pa.string_view())


def as_views(array: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """A binary or string ``array`` (``large_`` too) as views of its bytes (``binary_view``,
    ``string_view``: 16 bytes per value pointing into the same buffers, no byte copied), so
    that joining arrays or taking rows moves 16 bytes per value, not the value; any other
    array as it is."""
    view = _VIEWS.get(array.type)
    return array if view is None else array.cast(view)


def _has_nulls(array: pa.Array | pa.ChunkedArray) -> bool:
    """Whether ``array`` holds a null (in a dictionary array: a null key or a null value)."""
    if array.null_count:
        return True
    if not pa.types.is_dictionary(array.type):
        return False
    if isinstance(array, pa.Array):  # a batch's rows of a column taken as a dictionary
        return bool(array.dictionary.null_count)
    return any(chunk.dictionary.null_count for chunk in array.chunks)


def _arrow_packed(array: pa.Array | pa.ChunkedArray) -> tuple[torch.Tensor, torch.Tensor]:
    """The data and offsets of a binary or string array without nulls, from its buffers. A
    dictionary array's values, or views' bytes, are gathered by Arrow into a new array, whose
    data is then used as it is (one copy of the bytes, not two)."""
    chunks = array.chunks if isinstance(array, pa.ChunkedArray) else [array]
    values = None
    if chunks and is_view(chunks[0].type):  # views joined (16 bytes each), then one copy
        values = pa.concat_arrays(chunks).cast(_PACKED[arrow_kind(chunks[0].type)])
    elif len(chunks) == 1 and pa.types.is_dictionary(chunks[0].type):
        values = chunks[0].dictionary_decode()
    if values is not None:  # new buffers, held by nothing else
        data = values.buffers()[2]
        if data is not None and not data.is_mutable:
            data = bytearray(data)
        return _uint8_tensor(data), torch.from_numpy(_arrow_offsets(values))
    chunks = [arrow_values(chunk) for chunk in chunks]
    pieces, bounds, base = [], [np.zeros(1, np.int64)], 0
    for chunk in chunks:
        offsets = _arrow_offsets(chunk)
        low, high = int(offsets[0]), int(offsets[-1])
        if high > low:
            pieces.append(memoryview(chunk.buffers()[2])[low:high])
        bounds.append(offsets[1:] - low + base)
        base += high - low
    return _uint8_tensor(bytearray().join(pieces)), torch.from_numpy(np.concatenate(bounds))


def _arrow_offsets(chunk: pa.Array) -> np.ndarray:
    """The value offsets of a binary or string array (int64), its slice offset applied."""
    wide = chunk.type in (pa.large_binary(), pa.large_string())
    dtype = np.int64 if wide else np.int32
    buffer = chunk.buffers()[1]
    if buffer is None:  # an empty array may have no buffers
        return np.zeros(1, np.int64)
    itemsize = np.dtype(dtype).itemsize
    return np.frombuffer(buffer, dtype, len(chunk) + 1, chunk.offset * itemsize).astype(np.int64)


def _uint8_tensor(buffer: bytearray | pa.Buffer | None) -> torch.Tensor:
    """``buffer`` (writable) as a uint8 tensor that takes it over (no copy)."""
    if not buffer:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8)
