"""A sketch of sample ids that names the ids two multisets differ by: sums that cancel.

Design. An :class:`IdSketch` holds sums over the elements added to it, so adding one multiset
(what the training loop consumed) and subtracting another (what the plan holds) leaves a
sketch of their difference alone, in any order, on any rank: sketches of several ranks are
summed by one ``all_reduce``. Each element goes to ``LEVELS`` strata by the trailing zeros of a
hash (stratum ``l`` holds a ``2**-(l+1)`` share) and, in its stratum, to one cell of each of
three sub-tables of ``CELLS`` cells (an invertible Bloom lookup table). A cell holds the count,
the sum of the elements and the sum of a check hash of the elements, all mod ``2**64``.

Reading a difference peels each stratum: a cell whose count ``c`` and sums are those of ``c``
copies of one element names that element (``c > 0``: consumed more than planned, ``c < 0``:
fewer); removing it from its three cells frees others. A stratum of up to about 150
differences peels completely, so up to about 300 differences are named exactly. Beyond that,
the lowest strata do not peel, and the counts are estimated from the strata above the first
that failed (Eppstein et al., "What's the difference?", SIGCOMM 2011): ``2**(l+1)`` times what
they hold, within about 10% once a few hundred differ. The trade-off: ~110 KB of cells per
sketch and about 10 ns of numpy work per element, against exact names for small differences
and a count for large ones, where a set of ids would take 8 bytes per sample.

An element is a sample id (below ``2**45``) and the number of its source (below ``2**16``),
packed by :func:`encode`; an element added several times is counted that many times.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nnh_data.seeding import MASK64, mix64, mix64_int

__all__ = [
    "CELLS",
    "ID_BITS",
    "LEVELS",
    "SOURCE_BITS",
    "IdSketch",
    "SketchDifference",
    "decode",
    "encode",
]

LEVELS = 20
CELLS = 64  # per sub-table, a power of two
ID_BITS = 45
SOURCE_BITS = 16
_TABLES = 4
_LEVEL_SIZE = _TABLES * CELLS
_CELL_SHIFT = 36  # the cell bits are bits 36.. of the hash; the stratum is its trailing zeros
_SALT_CELL = 0x494453_4B45544348  # "IDSKETCH"
_SALT_CHECK = 0x434845434B  # "CHECK"
_MAX_ELEMENT = 1 << (ID_BITS + SOURCE_BITS)


def encode(ids: np.ndarray, sources: np.ndarray | None = None) -> np.ndarray:
    """The elements (uint64) of sample ``ids`` of ``sources`` (default 0).

    Example:
        >>> decode(int(encode(np.array([7]), np.array([2]))[0]))
        (7, 2)
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= 1 << ID_BITS):
        raise ValueError(f"sample ids must be in [0, 2**{ID_BITS}), got {ids.min()}..{ids.max()}")
    out = ids.astype(np.uint64)
    if sources is not None:
        sources = np.asarray(sources, dtype=np.int64).reshape(-1)
        if sources.size and (sources.min() < 0 or sources.max() >= 1 << SOURCE_BITS):
            raise ValueError(f"sources must be in [0, 2**{SOURCE_BITS}), got {sources.max()}")
        out |= sources.astype(np.uint64) << np.uint64(ID_BITS)
    return out


def decode(element: int) -> tuple[int, int]:
    """``(sample id, source)`` of an element made by :func:`encode`."""
    return element & ((1 << ID_BITS) - 1), element >> ID_BITS


@dataclass(frozen=True)
class SketchDifference:
    """What a difference sketch holds: elements consumed more often than planned (``extra``)
    and less often (``missing``), as ``{element: times}``, and their totals. ``exact``: every
    difference was named; otherwise the totals are estimates (``None`` when even the highest
    stratum did not peel) and the dicts hold the named part."""

    extra: dict[int, int]
    missing: dict[int, int]
    extra_count: int | None
    missing_count: int | None
    exact: bool


class IdSketch:
    """Count, element sum and check sum per cell, ``LEVELS`` strata of three sub-tables.

    Example:
        >>> sketch = IdSketch()
        >>> sketch.add(encode(np.array([1, 2, 3, 3])))
        >>> sketch.add(encode(np.array([1, 2, 3, 4])), sign=-1)
        >>> diff = sketch.difference()
        >>> [decode(e)[0] for e in diff.extra], [decode(e)[0] for e in diff.missing]
        ([3], [4])
    """

    def __init__(self, cells: np.ndarray | None = None) -> None:
        shape = (3, LEVELS * _LEVEL_SIZE)
        self.cells = np.zeros(shape, np.int64) if cells is None else cells.reshape(shape)

    @staticmethod
    def size() -> int:
        """int64 values in a sketch (what an ``all_reduce`` of it carries)."""
        return 3 * LEVELS * _LEVEL_SIZE

    def add(self, elements: np.ndarray, sign: int = 1) -> None:
        """Add each element once (``sign=1``) or remove it (``sign=-1``)."""
        elements = np.asarray(elements, dtype=np.uint64).reshape(-1)
        if elements.size == 0:
            return
        cells = _cells(elements).reshape(-1)
        values = np.repeat(elements.view(np.int64), _TABLES)
        checks = np.repeat(_check(elements).view(np.int64), _TABLES)
        if sign < 0:
            values, checks = -values, -checks  # wraps mod 2**64, as the sums do
        np.add.at(self.cells[0], cells, sign)
        np.add.at(self.cells[1], cells, values)
        np.add.at(self.cells[2], cells, checks)

    def difference(self) -> SketchDifference:
        """Peel the strata from the highest down (see the module's docstring)."""
        extra: dict[int, int] = {}
        missing: dict[int, int] = {}
        for level in range(LEVELS - 1, -1, -1):
            found = _peel(level, self.cells[:, level * _LEVEL_SIZE : (level + 1) * _LEVEL_SIZE])
            if found is None:
                return _estimate(extra, missing, level)
            for element, times in found.items():
                (extra if times > 0 else missing)[element] = abs(times)
        return SketchDifference(extra, missing, sum(extra.values()), sum(missing.values()), True)


def _estimate(extra: dict[int, int], missing: dict[int, int], level: int) -> SketchDifference:
    """Totals when stratum ``level`` did not peel: the strata above hold a ``2**-(level+1)``
    share of all elements."""
    if level == LEVELS - 1:
        return SketchDifference(extra, missing, None, None, False)
    scale = 2 ** (level + 1)
    return SketchDifference(extra, missing, scale * sum(extra.values()),
                            scale * sum(missing.values()), False)  # fmt: skip


def _cells(elements: np.ndarray) -> np.ndarray:
    """(n, 4) flat cell numbers: the stratum from the hash's trailing zeros, one cell per
    sub-table from its high bits."""
    h = mix64(elements ^ np.uint64(_SALT_CELL))
    zeros = np.bitwise_count((h & (~h + np.uint64(1))) - np.uint64(1))  # 64 for h == 0
    base = np.minimum(zeros, LEVELS - 1).astype(np.int64) * _LEVEL_SIZE
    out = np.empty((elements.size, _TABLES), np.int64)
    for t in range(_TABLES):
        bits = (h >> np.uint64(_CELL_SHIFT + 6 * t)) & np.uint64(CELLS - 1)
        np.add(base, bits.view(np.int64), out=out[:, t])
        out[:, t] += t * CELLS
    return out


def _check(elements: np.ndarray) -> np.ndarray:
    return mix64(elements ^ np.uint64(_SALT_CHECK))


def _cells_of(element: int) -> tuple[int, list[int]]:
    """The stratum of one element and its cells there (offsets 0 .. 3 * CELLS - 1)."""
    h = mix64_int(element ^ _SALT_CELL)
    level = min((h & -h).bit_length() - 1, LEVELS - 1) if h else LEVELS - 1
    return level, [t * CELLS + ((h >> (_CELL_SHIFT + 6 * t)) & (CELLS - 1)) for t in range(_TABLES)]


def _pure(count: int, total: int, check: int) -> int | None:
    """The element of a cell holding ``count`` copies of one element, else None."""
    if count == 0:
        return None
    zeros = (count & -count).bit_length() - 1
    if total & ((1 << zeros) - 1):
        return None
    modulus = 1 << (64 - zeros)
    odd = (count >> zeros) % modulus
    element = ((total >> zeros) * pow(odd, -1, modulus)) % modulus
    if element >= _MAX_ELEMENT or (count * mix64_int(element ^ _SALT_CHECK)) & MASK64 != check:
        return None
    return element


def _peel(level: int, cells: np.ndarray) -> dict[int, int] | None:
    """``{element: count}`` of stratum ``level`` (its ``cells``), or None when it does not
    peel."""
    count, total, check = ([int(v) for v in row] for row in cells)
    total = [v & MASK64 for v in total]
    check = [v & MASK64 for v in check]
    found: dict[int, int] = {}
    queue = [c for c in range(len(count)) if count[c]]
    while queue:
        c = queue.pop()
        element = _pure(count[c], total[c], check[c])
        if element is None:
            continue
        at, offsets = _cells_of(element)
        if at != level or c not in offsets:
            continue
        times, checked = count[c], mix64_int(element ^ _SALT_CHECK)
        found[element] = found.get(element, 0) + times
        for cell in offsets:
            count[cell] -= times
            total[cell] = (total[cell] - times * element) & MASK64
            check[cell] = (check[cell] - times * checked) & MASK64
            queue.append(cell)
    if any(count) or any(total) or any(check):
        return None
    return {e: t for e, t in found.items() if t}
