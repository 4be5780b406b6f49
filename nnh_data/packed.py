"""``PackedField``: the bytes or text values of one field of a batch, in one uint8 tensor.

A batch of 256 samples holds 256 ``bytes`` objects per binary field; sent from a DataLoader
worker to the main process as a list, each is pickled, copied and rebuilt as an object. Packed,
the values lie back to back in one ``uint8`` tensor (``data``) with ``offsets`` (int64, one more
than the values: value ``i`` is ``data[offsets[i]:offsets[i + 1]]``), so a batch's field crosses
the worker queue as one buffer, and the main process builds nothing per sample until a value is
asked for. Text is stored as UTF-8. A missing value (``None``) is an empty slot marked in
``valid``. The type reads like the list it replaces: ``len``, indexing (an int gives the value,
a slice a ``PackedField``), iteration, ``tolist()``, and ``==`` against a list.

>>> names = PackedField.pack(["cat", "dog", None])
>>> len(names), names[1], names.tolist()
(3, 'dog', ['cat', 'dog', None])
>>> names[:2] == ["cat", "dog"]
True
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from itertools import compress, starmap
from typing import Any

import numpy as np
import pyarrow as pa
import torch

__all__ = ["KINDS", "PackedField"]

KINDS = ("bytes", "str")
_ARROW_KINDS = {pa.binary(): "bytes", pa.large_binary(): "bytes", pa.string(): "str",
                pa.large_string(): "str"}  # fmt: skip


class PackedField:
    """Bytes (``kind="bytes"``) or text (``kind="str"``) values packed in one uint8 tensor.

    ``data``: the values' bytes back to back; ``offsets``: where value ``i`` starts and ends
    (``offsets[i]``, ``offsets[i + 1]``); ``valid``: a bool tensor, False where the value is
    ``None``, or None when no value is. Build one with :meth:`pack`. For zero-copy access, a
    value's bytes are ``data[offsets[i]:offsets[i + 1]]`` (for instance for a GPU decoder).
    """

    __slots__ = ("data", "offsets", "kind", "valid", "_bounds")

    def __init__(
        self, data: torch.Tensor, offsets: torch.Tensor, kind: str, valid: torch.Tensor | None
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.data, self.offsets, self.kind, self.valid = data, offsets, kind, valid
        self._bounds: list[int] | None = None

    @classmethod
    def pack(cls, values: Sequence[bytes | str | None]) -> PackedField:
        """Pack ``values``: all ``bytes`` (``bytearray``, ``memoryview``) or all ``str``,
        ``None`` allowed (all ``None`` packs as bytes). Raises ``TypeError`` otherwise."""
        values = list(values)
        valid = None
        if None in values:
            valid = np.fromiter(map(_is_not_none, values), bool, len(values))
            first = next(compress(values, valid), b"")
            empty = "" if isinstance(first, str) else b""
            values = [empty if v is None else v for v in values]
        kind = "str" if values and isinstance(values[0], str) else "bytes"
        buffer, lengths = _joined_text(values) if kind == "str" else _joined_bytes(values)
        offsets = np.zeros(len(values) + 1, np.int64)
        np.cumsum(np.fromiter(lengths, np.int64, len(values)), out=offsets[1:])
        mask = None if valid is None else torch.from_numpy(valid)
        return cls(_uint8_tensor(buffer), torch.from_numpy(offsets), kind, mask)

    @classmethod
    def from_arrow(cls, array: pa.Array) -> PackedField:
        """Pack an Arrow binary or string array (``large_`` ones too) from its buffers, with
        no Python object per value: the same field :meth:`pack` makes of its values. Raises
        ``TypeError`` for other types."""
        kind = _ARROW_KINDS.get(array.type)
        if kind is None:
            raise TypeError(f"PackedField.from_arrow: a binary or string array, got {array.type}")
        if array.null_count:  # null slots may hold bytes; pack gives them none
            return cls.pack(array.to_pylist())
        wide = array.type in (pa.large_binary(), pa.large_string())
        _, offsets, data = array.buffers()
        bounds = np.frombuffer(offsets, np.int64 if wide else np.int32, len(array) + 1,
                               array.offset * (8 if wide else 4)).astype(np.int64)  # fmt: skip
        low, high = int(bounds[0]), int(bounds[-1])
        raw = bytearray(memoryview(data)[low:high]) if high > low else bytearray()
        return cls(_uint8_tensor(raw), torch.from_numpy(bounds - low), kind, None)

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError(f"a PackedField slice must have step 1, got {index.step}")
            stop = max(start, stop)
            valid = None if self.valid is None else self.valid[start:stop]
            return PackedField(self.data, self.offsets[start : stop + 1], self.kind, valid)
        n = len(self)
        i = operator.index(index)
        i = i + n if i < 0 else i
        if not 0 <= i < n:
            raise IndexError(f"PackedField index {index} out of range for {n} values")
        if self.valid is not None and not self.valid[i]:
            return None
        bounds = self._offsets_list()
        value = self._bytes()[bounds[i] : bounds[i + 1]].tobytes()
        return value.decode() if self.kind == "str" else value

    def __iter__(self) -> Iterator[Any]:
        return iter(self.tolist())

    def tolist(self) -> list:
        """The values as a list of ``bytes`` or ``str`` (``None`` where missing)."""
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
                values = [v.decode() for v in values]
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
        shown = self.tolist()[:4] if len(self) <= 64 else self[:4].tolist()
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
    pieces = [v.encode() for v in values]
    return bytearray().join(pieces), map(len, pieces)


def _mixed(values: list, kind: type | tuple[type, ...]) -> str:
    bad = next(v for v in values if not isinstance(v, kind))
    return f"PackedField.pack: values must be all bytes or all str (or None), got {bad!r}"


def _uint8_tensor(buffer: bytearray) -> torch.Tensor:
    """``buffer`` as a uint8 tensor that takes it over (no copy)."""
    if not buffer:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8)
