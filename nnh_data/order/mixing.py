"""Mixing several sources into one epoch: pure functions of integers.

Counts. :func:`plan_counts` turns each :class:`Source`'s setting into integer draws per epoch
(``choose``, ``repeat`` x size, or a ``weight`` share of what is left), rounded by largest
remainder so they sum exactly to the epoch size.

Draws. Source ``s`` drawn ``c`` times per epoch from its ``N`` samples reads an endless stream of
cycles, cycle ``k`` being one whole shuffled pass: the :class:`~nnh_data.order.epoch.EpochOrder` of
epoch ``k`` under the source's seed. Epoch ``e`` takes stream positions ``[e*c, (e+1)*c)``, so a
source drawn below its size sees another part each epoch and meets every sample before any
repeats; one drawn above its size is read in whole passes plus a part; a lone source drawn ``N``
times reads exactly the single-source order (cycle ``e`` is epoch ``e``). A sample met in several
cycles of one epoch is a repeat: its occurrence number counts the earlier cycles of the epoch that
drew it, which needs the inverse of the epoch's first cycle in one window only (O(window)).

Interleave. :class:`MixedOrder` gives source ``s`` a phase ``u_s`` hashed from (seed, epoch,
``s``) and its draw ``j`` the time ``(j + u_s) / c_s``; mixed positions take the draws by
increasing time, ties by source. Each source is thus spread evenly: ``L`` consecutive positions
hold ``L * c_s / E`` of source ``s`` within ``1 + w_s * (S - 2)`` (``w_s = c_s / E``, ``S``
sources with draws), so within 2 for up to three sources. Any position range is located in
O(S log S) exact integer steps and merged with numpy in O(range), whatever the epoch size. The
trade-off: the interleave is stratified, not random, within an epoch (each source's draws are
evenly spaced with a random offset), which is what makes every window proportional; only the
phases change between epochs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from nnh_data.checks import check_int
from nnh_data.order.epoch import EpochOrder
from nnh_data.seeding import MASK64, fold_key

__all__ = [
    "MixedOrder",
    "Source",
    "SourceDraws",
    "draw_segments",
    "epoch_positions",
    "plan_counts",
    "source_seed",
]

_MIXING_DOMAIN = 0x4D4958494E47  # "MIXING": keeps mixing keys apart from order and augmentation
_SOURCE_SEED, _PHASE = 1, 2
_PHASE_BITS = 53
_NEAR = 2.0**-48  # float times closer than this are ordered exactly (float error is < 2**-51)
_SETTINGS = ("weight", "repeat", "choose")
_KEPT_ORDERS = 4  # cycle orders a SourceDraws keeps


# ---------------------------------------------------------------- sources and counts


@dataclass(frozen=True)
class Source:
    """One dataset of shards in a mix, with at most one of ``weight``, ``repeat``, ``choose``.

    ``source``, ``format``, ``storage_options`` and ``index_path`` are what the dataset takes for
    one source; ``name`` labels its samples (default: its index).

    Example:
        >>> Source("data/wiki-*.tar", weight=0.7, name="wiki").weight
        0.7
    """

    source: Any
    _: KW_ONLY
    weight: float | None = None
    repeat: float | None = None
    choose: int | None = None
    name: str | None = None
    format: str | None = None
    storage_options: dict | None = None
    index_path: str | None = None

    def __post_init__(self) -> None:
        if self.source is None:
            raise ValueError("source must be shards (URLs, a glob, a ShardIndex), got None")
        given = {k: getattr(self, k) for k in _SETTINGS if getattr(self, k) is not None}
        if len(given) > 1:
            shown = ", ".join(f"{k}={v!r}" for k, v in given.items())
            raise ValueError(f"at most one of weight, repeat, choose may be given, got {shown}")
        for key in ("weight", "repeat"):
            if key in given:
                object.__setattr__(self, key, _positive(key, given[key]))
        if "choose" in given:
            object.__setattr__(self, "choose", check_int("choose", self.choose, low=0))
        if self.name is not None and not isinstance(self.name, str):
            raise ValueError(f"name must be a str or None, got {self.name!r}")


def _positive(name: str, value: Any) -> float:
    """``value`` as a finite float > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _exact(value: float) -> Fraction:
    """The number the user wrote: 0.3 is 3/10, not the nearest binary fraction."""
    return Fraction(repr(float(value)))


def plan_counts(
    sizes: Sequence[int], sources: Sequence[Source], epoch_size: int | None = None
) -> list[int]:
    """Draws per epoch of each source (sizes ``sizes``), summing exactly to the epoch size.

    Rules, in order:

    - ``choose`` is a fixed count, ``repeat`` a fixed ``repeat * size``; the fixed counts are
      rounded together to the nearest whole total (halves up).
    - ``epoch_size`` defaults to the fixed counts plus the sizes of the other sources.
    - What the fixed counts leave goes to the other sources: by ``weight`` (normalised over the
      weighted sources), or, when no source has a weight, in proportion to the sources' sizes
      (so without ``epoch_size`` a source with no setting is read once per epoch, and
      ``[Source(a)]`` with ``epoch_size=n`` draws ``n`` from ``a``). Mixing weighted sources with
      sources of no setting is ambiguous and refused.
    - Shares are rounded by largest remainder, ties to the earlier source.

    Raises ``ValueError`` naming the sources and numbers when the fixed counts exceed
    ``epoch_size``, leave draws no source may take, leave nothing for a source that should share
    the rest, or when a source of 0 samples would be drawn.

    Example:
        >>> weights = [Source("a", weight=0.5), Source("b", weight=0.3), Source("c", weight=0.2)]
        >>> plan_counts([1000, 500, 300], weights, epoch_size=2000)
        [1000, 600, 400]
    """
    sizes = _check_sizes(sizes, sources)
    quotas = [_fixed_quota(source, size) for source, size in zip(sources, sizes)]
    fixed = {s: q for s, q in enumerate(quotas) if q is not None}
    pool = [s for s in range(len(sources)) if s not in fixed]
    _check_pool(sources, pool)
    fixed_total = math.floor(sum(fixed.values(), Fraction(0)) + Fraction(1, 2))
    counts = dict(zip(fixed, _largest_remainder(list(fixed.values()), fixed_total)))
    if epoch_size is None:
        left = sum(sizes[s] for s in pool)
    else:
        epoch_size = check_int("epoch_size", epoch_size, low=0)
        left = epoch_size - fixed_total
        _check_left(sources, fixed, counts, pool, epoch_size, left)
    shares = [_pool_weight(sources[s], sizes[s]) for s in pool]
    counts.update(zip(pool, _share(left, shares)))
    plan = [counts[s] for s in range(len(sources))]
    _check_empty(sources, sizes, plan)
    return plan


def _check_sizes(sizes: Sequence[int], sources: Sequence[Source]) -> list[int]:
    if not sources:
        raise ValueError("sources must hold at least one Source, got none")
    if len(sizes) != len(sources):
        raise ValueError(f"sizes must hold one size per source ({len(sources)}), got {sizes!r}")
    return [check_int(f"sizes[{s}]", n, low=0) for s, n in enumerate(sizes)]


def _fixed_quota(source: Source, size: int) -> Fraction | None:
    if source.choose is not None:
        return Fraction(source.choose)
    if source.repeat is not None:
        return _exact(source.repeat) * size
    return None


def _pool_weight(source: Source, size: int) -> Fraction:
    return _exact(source.weight) if source.weight is not None else Fraction(size)


def _label(sources: Sequence[Source], indices: Sequence[int]) -> str:
    """``source 0 ('wiki'), 2``: the sources by index, with their names."""
    named = [f"{s} ({sources[s].name!r})" if sources[s].name else str(s) for s in indices]
    return ("source " if len(named) == 1 else "sources ") + ", ".join(named)


def _check_pool(sources: Sequence[Source], pool: Sequence[int]) -> None:
    weighted = [s for s in pool if sources[s].weight is not None]
    unset = [s for s in pool if sources[s].weight is None]
    if weighted and unset:
        raise ValueError(
            "weights on some sources and no setting on others is ambiguous: weighted "
            f"{_label(sources, weighted)}; no weight, repeat or choose: {_label(sources, unset)}; "
            "give each a weight, or repeat=1 to read it once per epoch"
        )


def _check_left(
    sources: Sequence[Source],
    fixed: dict[int, Fraction],
    counts: dict[int, int],
    pool: Sequence[int],
    epoch_size: int,
    left: int,
) -> None:
    """The draws the fixed counts leave must be >= 0, and > 0 exactly when a source shares them
    (or the epoch is empty)."""
    taken = ", ".join(f"{_label(sources, [s])}: {counts[s]}" for s in fixed)
    if left < 0:
        raise ValueError(
            f"epoch_size is {epoch_size} but choose/repeat fix {epoch_size - left} draws ({taken})"
        )
    if left and not pool:
        raise ValueError(
            f"epoch_size is {epoch_size} but choose/repeat fix {epoch_size - left} draws "
            f"({taken}) and no other source takes the {left} left; leave epoch_size unset, "
            "or add a source with a weight"
        )
    if pool and not left and epoch_size:
        raise ValueError(
            f"epoch_size is {epoch_size} and choose/repeat fix all of it ({taken}): "
            f"nothing is left for {_label(sources, pool)}"
        )


def _share(total: int, weights: Sequence[Fraction]) -> list[int]:
    """``total`` split in proportion to ``weights`` (evenly when they are all 0)."""
    weight_sum = sum(weights, Fraction(0))
    if not weight_sum:
        weights, weight_sum = [Fraction(1)] * len(weights), Fraction(len(weights))
    return _largest_remainder([total * w / weight_sum for w in weights], total)


def _largest_remainder(quotas: Sequence[Fraction], total: int) -> list[int]:
    """Integers summing to ``total`` (within ``len(quotas)`` of the quotas' sum): the floors,
    plus one for each of the largest remainders, ties to the earlier quota."""
    floors = [math.floor(q) for q in quotas]
    extra = total - sum(floors)
    assert 0 <= extra <= len(quotas), (quotas, total)
    by_remainder = sorted(range(len(quotas)), key=lambda i: (floors[i] - quotas[i], i))
    for i in by_remainder[:extra]:
        floors[i] += 1
    return floors


def _check_empty(sources: Sequence[Source], sizes: Sequence[int], counts: Sequence[int]) -> None:
    empty = [s for s, (n, c) in enumerate(zip(sizes, counts)) if c and not n]
    if empty:
        asked = ", ".join(f"{_label(sources, [s])} asked for {counts[s]}" for s in empty)
        raise ValueError(f"sources of 0 samples cannot be drawn: {asked}")


# ---------------------------------------------------------------- one source's draws


def source_seed(seed: int, index: int) -> int:
    """The order seed of source ``index`` of a mix seeded ``seed``: ``seed`` itself for source 0
    (a lone source keeps today's order), a key folded from (seed, index) for the others."""
    seed = check_int("seed", seed, low=0, high=MASK64)
    index = check_int("index", index, low=0)
    return seed if index == 0 else fold_key(seed, (_MIXING_DOMAIN, _SOURCE_SEED, index))


def draw_segments(
    count: int, size: int, epoch: int, lo: int, hi: int
) -> list[tuple[int, int, int]]:
    """Draws ``[lo, hi)`` of epoch ``epoch`` of a source of ``size`` samples drawn ``count`` per
    epoch, as ``(cycle, a, b)``: positions ``[a, b)`` of cycle ``cycle``'s order, in draw order.

    Example:
        >>> draw_segments(count=4, size=6, epoch=1, lo=0, hi=4)
        [(0, 4, 6), (1, 0, 2)]
    """
    count = check_int("count", count, low=0)
    size = check_int("size", size, low=0)
    epoch = check_int("epoch", epoch, low=0)
    hi = check_int("hi", hi, low=0, high=count)
    lo = check_int("lo", lo, low=0, high=hi)
    if count and not size:
        raise ValueError(f"size must be > 0 to draw count={count} samples per epoch, got 0")
    out: list[tuple[int, int, int]] = []
    start, end = epoch * count + lo, epoch * count + hi
    while start < end:
        cycle, a = divmod(start, size)
        b = min(size, a + end - start)
        out.append((cycle, a, b))
        start += b - a
    return out


def _concat_of(order: EpochOrder, ids: np.ndarray) -> np.ndarray:
    """Concat positions in ``order`` of global sample ids ``ids`` (the shard order's inverse)."""
    counts = np.asarray(order.counts, dtype=np.int64).reshape(-1)
    starts = np.concatenate(([0], np.cumsum(counts)))
    shard = np.searchsorted(starts, ids, side="right") - 1  # skips empty shards
    rank = np.empty_like(order.shard_perm)
    rank[order.shard_perm] = np.arange(order.shard_perm.size)
    concat_starts = np.concatenate(([0], np.cumsum(counts[order.shard_perm])))
    return concat_starts[rank[shard]] + (ids - starts[shard])


def _positions_of_concat(order: EpochOrder, concat: np.ndarray) -> np.ndarray:
    """Epoch positions of concat positions (the windows' inverse): O(window) per window."""
    if not order.window or concat.size == 0:
        return concat
    out = np.empty_like(concat)
    wins = concat // order.window
    by_window = np.argsort(wins, kind="stable")
    cuts = np.flatnonzero(np.diff(wins[by_window])) + 1
    for group in np.split(by_window, cuts):
        w = int(wins[group[0]])
        inverse = np.argsort(order.window_permutation(w))
        out[group] = w * order.window + inverse[concat[group] - w * order.window]
    return out


def epoch_positions(order: EpochOrder, ids: np.ndarray) -> np.ndarray:
    """Epoch positions of global sample ids: the inverse of ``order.sample_ids``.

    O(shards + len(ids)) plus O(window) per window the ids fall in.

    Example:
        >>> order = EpochOrder(counts=(3, 0, 2), seed=1, epoch=0, window=4)
        >>> epoch_positions(order, order.sample_ids(np.arange(5))).tolist()
        [0, 1, 2, 3, 4]
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= order.total):
        bad = ids[(ids < 0) | (ids >= order.total)][0]
        raise ValueError(f"ids must be in [0, {order.total}), got {bad}")
    return _positions_of_concat(order, _concat_of(order, ids))


def _at_or_after(order: EpochOrder, ids: np.ndarray, start: int) -> np.ndarray:
    """Whether each id's epoch position in ``order`` is ``>= start``: only the window holding
    ``start`` is inverted, the others are decided by their window number."""
    concat = _concat_of(order, ids)
    if not order.window:
        return concat >= start
    wins, edge = concat // order.window, start // order.window
    out = wins > edge
    at_edge = wins == edge
    out[at_edge] = _positions_of_concat(order, concat[at_edge]) >= start
    return out


@dataclass(frozen=True)
class SourceDraws:
    """The draws of one source: ``draws`` per epoch over shards of ``counts`` samples, shuffled
    with seed ``seed`` (from :func:`source_seed`) and window ``window`` (0: no shuffle).

    Example:
        >>> src = SourceDraws(counts=(4, 6), seed=3, draws=4)
        >>> ids, occurrences = src.sample_ids(epoch=1, lo=0, hi=4)
        >>> occurrences.tolist()
        [0, 0, 0, 0]
    """

    counts: tuple[int, ...]
    seed: int
    draws: int
    window: int = 1024
    _orders: dict[int, EpochOrder] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts", tuple(self.counts))
        check_int("seed", self.seed, low=0, high=MASK64)
        check_int("draws", self.draws, low=0)
        check_int("window", self.window, low=0)
        if self.draws and not self.size:
            raise ValueError(f"draws must be 0 for a source of 0 samples, got {self.draws}")

    @property
    def size(self) -> int:
        """Samples in the source."""
        return sum(self.counts)

    def order(self, cycle: int) -> EpochOrder:
        """The order of cycle ``cycle`` (one whole pass of the source); the last few are kept,
        since an epoch's windows ask for the same one or two cycles again and again."""
        if cycle not in self._orders:
            if len(self._orders) >= _KEPT_ORDERS:
                self._orders.clear()
            self._orders[cycle] = EpochOrder(self.counts, self.seed, cycle, self.window)
        return self._orders[cycle]

    def segments(self, epoch: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Draws ``[lo, hi)`` of ``epoch`` as ``(cycle, a, b)`` (see :func:`draw_segments`)."""
        return draw_segments(self.draws, self.size, epoch, lo, hi)

    def occurrence(self, epoch: int, cycle: int, ids: np.ndarray) -> np.ndarray:
        """For ids drawn in cycle ``cycle`` during ``epoch``: how many earlier cycles of this
        epoch's draws hold each (0 for a first occurrence). O(shards + len(ids) + window)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        epoch = check_int("epoch", epoch, low=0)
        first, start = divmod(epoch * self.draws, self.size or 1)
        last = first if not self.draws else ((epoch + 1) * self.draws - 1) // self.size
        cycle = check_int("cycle", cycle, low=first, high=last)
        out = np.full(ids.size, max(cycle - first - 1, 0), dtype=np.int64)
        if cycle > first:  # the full cycles between, then the first cycle's tail [start, size)
            out += _at_or_after(self.order(first), ids, start) if start else 1
        return out

    def sample_ids(self, epoch: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample ids of draws ``[lo, hi)`` of ``epoch`` and their occurrence numbers."""
        ids, occurrences = [np.empty(0, dtype=np.int64)], [np.empty(0, dtype=np.int64)]
        for cycle, a, b in self.segments(epoch, lo, hi):
            got = self.order(cycle).sample_ids(np.arange(a, b, dtype=np.int64))
            ids.append(got)
            occurrences.append(self.occurrence(epoch, cycle, got))
        return np.concatenate(ids), np.concatenate(occurrences)


# ---------------------------------------------------------------- the interleave


def _phase(seed: int, epoch: int, source: int) -> int:
    """Source ``source``'s phase in epoch ``epoch``, as a 53-bit integer (``u = phase / 2**53``)."""
    return fold_key(seed, (_MIXING_DOMAIN, _PHASE, epoch, source)) >> (64 - _PHASE_BITS)


def _time(phase: int, j: int, count: int) -> Fraction:
    """The exact time ``(j + u) / count`` of a draw."""
    return Fraction((j << _PHASE_BITS) + phase, count)


def _draws_before(counts: Sequence[int], phases: Sequence[int], p: int) -> list[int]:
    """Draws of each source in mixed positions ``[0, p)``.

    Start from the draws with time below ``(p - S) / E``, which are fewer than ``p`` and at
    least ``p - 2 S`` (``S`` sources with draws), then take the next draws one at a time.
    """
    live = [s for s, c in enumerate(counts) if c]
    total, q = sum(counts), max(p - len(live), 0)
    before = [0] * len(counts)
    for s in live:  # #{j : (j + u) / c < q / E} = ceil(q c / E - u), exactly in integers
        ceil = -((phases[s] * total - (q * counts[s] << _PHASE_BITS)) // (total << _PHASE_BITS))
        before[s] = min(max(ceil, 0), counts[s])
    heap = [(_time(phases[s], before[s], counts[s]), s) for s in live if before[s] < counts[s]]
    heapq.heapify(heap)
    for _ in range(p - sum(before)):
        _, s = heapq.heappop(heap)
        before[s] += 1
        if before[s] < counts[s]:
            heapq.heappush(heap, (_time(phases[s], before[s], counts[s]), s))
    return before


def _merge(
    counts: Sequence[int], phases: Sequence[int], starts: Sequence[int], stops: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Sources and draw indices of draws ``[starts[s], stops[s])`` of each source, by time.

    Sorted on float times, then every run of times closer than ``_NEAR`` (float error is far
    below it) is sorted again on exact times: the result is the exact order.
    """
    sizes = np.subtract(stops, starts)
    source = np.repeat(np.arange(len(counts), dtype=np.int64), sizes)
    draw = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in zip(starts, stops)])
    scale = np.asarray([c or 1 for c in counts], dtype=np.float64)[source]
    offset = np.asarray(phases, dtype=np.float64)[source] * 2.0**-_PHASE_BITS
    times = (draw + offset) / scale
    order = np.argsort(times, kind="stable")  # ties to the earlier source: sources are in order
    near = np.flatnonzero(np.diff(times[order]) <= _NEAR)
    for run in np.split(near, np.flatnonzero(np.diff(near) > 1) + 1) if near.size else []:
        block = order[run[0] : run[-1] + 2].tolist()
        block.sort(key=lambda i: (_time(phases[source[i]], int(draw[i]), counts[source[i]]), i))
        order[run[0] : run[-1] + 2] = block
    return source[order], draw[order]


@dataclass(frozen=True)
class MixedOrder:
    """The interleave of sources drawn ``counts`` times in epoch ``epoch``: mixed position ``p``
    in ``[0, total)`` holds draw ``j`` of source ``s``.

    Example:
        >>> mix = MixedOrder(counts=(2, 1), seed=0, epoch=0)
        >>> sorted(zip(*(a.tolist() for a in mix.assign(0, 3))))
        [(0, 0), (0, 1), (1, 0)]
    """

    counts: tuple[int, ...]
    seed: int = 0
    epoch: int = 0
    phases: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        counts = tuple(check_int(f"counts[{s}]", c, low=0) for s, c in enumerate(self.counts))
        if not counts:
            raise ValueError("counts must hold one count per source, got ()")
        check_int("seed", self.seed, low=0, high=MASK64)
        check_int("epoch", self.epoch, low=0, high=MASK64)
        object.__setattr__(self, "counts", counts)
        phases = tuple(_phase(self.seed, self.epoch, s) for s in range(len(counts)))
        object.__setattr__(self, "phases", phases)

    @property
    def total(self) -> int:
        """Positions in the epoch."""
        return sum(self.counts)

    def draws_before(self, p: int) -> list[int]:
        """Draws of each source in positions ``[0, p)``. O(S log S) big-integer steps."""
        p = check_int("p", p, low=0, high=self.total)
        return _draws_before(self.counts, self.phases, p)

    def draw_range(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Per source, the draws ``[j_lo, j_hi)`` that positions ``[lo, hi)`` hold.

        Example:
            >>> MixedOrder(counts=(3,)).draw_range(1, 3)
            [(1, 3)]
        """
        hi = check_int("hi", hi, low=0, high=self.total)
        lo = check_int("lo", lo, low=0, high=hi)
        return list(zip(self.draws_before(lo), self.draws_before(hi)))

    def assign(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Source and draw index (both int64) of each position in ``[lo, hi)``, in order."""
        starts, stops = zip(*self.draw_range(lo, hi))
        return _merge(self.counts, self.phases, starts, stops)
