"""The epoch's sample order and its split over ranks and workers: pure functions of integers.

Order. The shards (in index order, sample counts ``counts``) are permuted; their samples are
laid end to end in that order ("concat positions"); the concat positions are cut into windows
of ``window`` samples and each window is permuted. Epoch position ``p`` of window ``w`` holds the
concat position ``w * window + perm_w[p - w * window]``. Both permutations sort the counter-based
hashes of :mod:`nnh_data.seeding` under keys derived from (seed, epoch), so the order is a pure
function of (seed, epoch, shard counts, window): any process computes any part of it, in
O(window) work per window and O(shards) for the shard order. A window spans at most a few
shards, so a reader that walks a range of positions reads its shards nearly sequentially.
``window=0`` means no shuffle: position ``p`` is global sample ``p``.

Split. A pass iterates a ``base``: a sorted list of disjoint epoch-position intervals (the whole
epoch ``[(0, total)]``, or what a resumed epoch has left). Their concatenation ("virtual
positions", ``R`` of them) is cut into contiguous rank ranges by ``DistributedRangeSplitter``;
every rank yields ``length`` items: ``ceil(R / world)`` with ``uneven="pad"`` (a short rank
repeats its own first samples, marked as pads) or ``R // world`` with ``"drop"`` (a long rank's
last sample is left out). A rank's ``length`` items are then cut into contiguous worker ranges.

Resume. Each worker walks its range in order, so what a rank's loader handed out is a prefix
of every worker range, ``consumed[k]`` items for worker ``k``; under DDP all ranks run the same
number of steps over identical layouts, so the same ``consumed`` list holds on every rank. The
samples left in the epoch are therefore ``remaining(base, world, workers, uneven, consumed)``: a
new base of at most ``world * workers`` intervals that any new world size splits again.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from nnh_data.checks import check_choice, check_int
from nnh_data.order.ranges import DistributedRangeSplitter
from nnh_data.seeding import fold_key, keyed_seeds, premixed_ids, stream_key

__all__ = [
    "UNEVEN",
    "EpochOrder",
    "Intervals",
    "RankSpan",
    "WorkerPlan",
    "base_size",
    "coalesce",
    "hashed_permutation",
    "rank_span",
    "remaining",
    "virtual_to_positions",
    "windowed",
    "worker_plan",
    "worker_range",
]

Intervals = list[tuple[int, int]]
UNEVEN = ("pad", "drop")
_ORDER_DOMAIN = 0x4F52444552  # "ORDER": keeps order keys apart from augmentation keys
_SHARDS, _WINDOW = 1, 2


def _order_key(seed: int, epoch: int, *fields: int) -> int:
    """A 64-bit key folded from (seed, epoch) and ``fields``, distinct from augmentation keys."""
    return fold_key(stream_key(seed, epoch, 1), (_ORDER_DOMAIN, *fields))


def hashed_permutation(size: int, key: int) -> np.ndarray:
    """A uniformly random permutation of ``range(size)`` that is a pure function of ``key``.

    Example:
        >>> sorted(hashed_permutation(5, key=7).tolist())
        [0, 1, 2, 3, 4]
    """
    # sample_seeds is a bijection of the ids, so the hashes are distinct and the sort is unique:
    # any sort gives it; numpy's stable one is 1.5-2x faster from 1,024 to 4,096 keys (windows),
    # its default from about 16,000 (the shard order of many shards)
    kind = "stable" if 512 <= size <= 8192 else "quicksort"
    return np.argsort(keyed_seeds(key, _premixed_range(size)), kind=kind)


@functools.lru_cache(maxsize=4)
def _premixed_range(size: int) -> np.ndarray:
    """:func:`~nnh_data.seeding.premixed_ids` of ``range(size)``, read-only: the windows of a
    pass (all but the last of one size) hash the same ids, each under its own key."""
    premixed = premixed_ids(np.arange(size, dtype=np.int64))
    premixed.flags.writeable = False
    return premixed


def windowed(
    positions: np.ndarray, window: int, permutation: Callable[[int], np.ndarray]
) -> np.ndarray:
    """Sorted ``positions`` (int64) through the permutation of the window of ``window``
    positions each falls in (``permutation(w)`` for window ``w``); unchanged when ``window``
    is 0 (no shuffle).

    Example:
        >>> windowed(np.array([0, 1, 2]), 2, lambda w: np.array([1, 0])).tolist()
        [1, 0, 3]
    """
    positions = np.asarray(positions, dtype=np.int64)
    if not window or positions.size == 0:
        return positions
    w = int(positions[0]) // window
    if int(positions[-1]) // window == w:  # one window (the assemble stage's groups)
        start = w * window
        return start + permutation(w)[positions - start]
    out = np.empty_like(positions)
    wins = positions // window
    cuts = np.flatnonzero(np.diff(wins)) + 1
    for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, positions.size]):
        w = int(wins[lo])
        start = w * window
        out[lo:hi] = start + permutation(w)[positions[lo:hi] - start]
    return out


@dataclass(frozen=True)
class EpochOrder:
    """The sample order of one epoch over shards of ``counts`` samples each.

    Example:
        >>> order = EpochOrder(counts=(3, 0, 2), seed=1, epoch=0, window=4)
        >>> sorted(order.sample_ids(np.arange(5)).tolist())
        [0, 1, 2, 3, 4]
    """

    counts: tuple[int, ...]
    seed: int = 0
    epoch: int = 0
    window: int = 1024
    shard_perm: np.ndarray = field(init=False, repr=False, compare=False)
    _shard_starts: np.ndarray = field(init=False, repr=False, compare=False)
    _concat_starts: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts, dtype=np.int64).reshape(-1)
        if counts.size and counts.min() < 0:
            raise ValueError(f"counts must be non-negative, got {self.counts!r}")
        check_int("window", self.window, low=0)
        if self.window:
            perm = hashed_permutation(counts.size, _order_key(self.seed, self.epoch, _SHARDS))
        else:
            perm = np.arange(counts.size)
        starts = np.concatenate(([0], np.cumsum(counts)))
        object.__setattr__(self, "shard_perm", perm)
        object.__setattr__(self, "_shard_starts", starts)
        object.__setattr__(self, "_concat_starts", np.concatenate(([0], np.cumsum(counts[perm]))))

    @property
    def total(self) -> int:
        """Samples in the epoch."""
        return int(self._shard_starts[-1])

    def window_permutation(self, w: int) -> np.ndarray:
        """The permutation of window ``w`` (identity without shuffle)."""
        size = min(self.window, self.total - w * self.window) if self.window else 0
        return hashed_permutation(size, _order_key(self.seed, self.epoch, _WINDOW, w))

    def concat_positions(self, positions: np.ndarray) -> np.ndarray:
        """Concat positions of sorted epoch ``positions`` (int64); one window permutation each."""
        return windowed(positions, self.window, self.window_permutation)

    def shard_of(self, concat: np.ndarray) -> np.ndarray:
        """Position in ``shard_perm`` of the shard that holds each concat position."""
        return np.searchsorted(self._concat_starts, concat, side="right") - 1

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        """Global sample ids at sorted epoch ``positions``."""
        return self.ids_at_concat(self.concat_positions(positions))

    def ids_at_concat(self, concat: np.ndarray) -> np.ndarray:
        """Global sample ids at concat positions ``concat``."""
        k = self.shard_of(concat)
        return self._shard_starts[self.shard_perm[k]] + (concat - self._concat_starts[k])

    def pieces(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """``(shard, start, stop)`` local sample ranges, in order, that hold concat ``[lo, hi)``."""
        k = int(self.shard_of(np.int64(lo))) if lo < hi else 0
        while lo < hi:
            shard_lo, shard_hi = int(self._concat_starts[k]), int(self._concat_starts[k + 1])
            stop = min(hi, shard_hi)
            if stop > lo:
                yield int(self.shard_perm[k]), lo - shard_lo, stop - shard_lo
            lo = stop
            k += 1


# ---------------------------------------------------------------- split over ranks and workers


@dataclass(frozen=True)
class RankSpan:
    """Rank ``rank``'s part of ``total`` virtual positions: ``[start, start + real)`` then pads.

    ``length`` items in all; items ``real..length-1`` are pads, repeating virtual positions
    ``(start + j) % total``.
    """

    start: int
    real: int
    length: int
    total: int

    def pad_position(self, j: int) -> int:
        """Virtual position repeated by pad ``j``."""
        return (self.start + j) % self.total


def rank_span(total: int, world_size: int, rank: int, uneven: str) -> RankSpan:
    """Split ``total`` virtual positions over ``world_size`` ranks; the span of ``rank``.

    Example:
        >>> rank_span(10, 3, 2, "pad")
        RankSpan(start=7, real=3, length=4, total=10)
    """
    check_choice("uneven", uneven, UNEVEN)
    start, end = DistributedRangeSplitter(total, world_size).get_rank_range(rank)
    length = -(-total // world_size) if uneven == "pad" else total // world_size
    return RankSpan(start, min(end - start, length), length, total)


def worker_range(length: int, num_workers: int, worker: int, unit: int = 1) -> tuple[int, int]:
    """Items ``[a, b)`` of a rank's ``length`` items that worker ``worker`` yields.

    The items are split in whole units of ``unit`` (a batch), so every worker range but the
    last non-empty one holds whole batches and the rank yields ``ceil(length / unit)`` batches
    whatever the number of workers.

    Example:
        >>> [worker_range(10, 2, k, unit=4) for k in range(2)]
        [(0, 8), (8, 10)]
    """
    units = -(-length // unit)
    a, b = DistributedRangeSplitter(units, num_workers).get_rank_range(worker)
    return min(a * unit, length), min(b * unit, length)


def base_size(base: Sequence[tuple[int, int]]) -> int:
    """Number of positions in ``base``."""
    return sum(b - a for a, b in base)


def virtual_to_positions(base: Sequence[tuple[int, int]], lo: int, hi: int) -> Intervals:
    """Epoch-position intervals of virtual positions ``[lo, hi)`` of ``base``, in order."""
    ends = np.cumsum([b - a for a, b in base]).tolist()
    out: Intervals = []
    i = bisect.bisect_right(ends, lo)
    while lo < hi:
        first = ends[i - 1] if i else 0
        a = base[i][0] + lo - first
        b = base[i][0] + min(hi, ends[i]) - first
        out.append((a, b))
        lo = min(hi, ends[i])
        i += 1
    return out


def coalesce(intervals: Sequence[tuple[int, int]]) -> Intervals:
    """Sort, drop empty and merge touching intervals."""
    out: Intervals = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


@dataclass(frozen=True)
class WorkerPlan:
    """What one worker of one rank yields: the real ``positions`` in order, then ``pads``.

    ``length`` counts the worker's whole range (what it yields in a full pass, pads included);
    ``consumed`` items of it were handed out before this pass.
    """

    positions: Intervals
    pads: list[int]
    length: int
    consumed: int


def worker_plan(
    base: Sequence[tuple[int, int]],
    world_size: int,
    rank: int,
    num_workers: int,
    worker: int,
    uneven: str,
    consumed: int = 0,
    unit: int = 1,
) -> WorkerPlan:
    """The epoch positions worker ``worker`` of ``rank`` yields after its first ``consumed``;
    worker ranges are cut in units of ``unit`` items (see :func:`worker_range`).

    Example:
        >>> worker_plan([(0, 10)], world_size=3, rank=2, num_workers=2, worker=1, uneven="pad")
        WorkerPlan(positions=[(9, 10)], pads=[7], length=2, consumed=0)
    """
    span = rank_span(base_size(base), world_size, rank, uneven)
    a, b = worker_range(span.length, num_workers, worker, unit)
    consumed = check_int("consumed", consumed, low=0, high=b - a)
    lo, hi = a + consumed, min(b, span.real)
    positions = virtual_to_positions(base, span.start + lo, span.start + hi) if lo < hi else []
    pad_numbers = range(max(lo, span.real) - span.real, b - span.real)
    pads = [virtual_to_positions(base, v, v + 1)[0][0] for v in map(span.pad_position, pad_numbers)]
    return WorkerPlan(positions, pads, b - a, consumed)


def remaining(
    base: Sequence[tuple[int, int]],
    world_size: int,
    num_workers: int,
    uneven: str,
    consumed: Sequence[int],
    unit: int = 1,
) -> Intervals:
    """Positions of ``base`` no rank has handed out after worker ``k`` yielded ``consumed[k]``
    (worker ranges cut in units of ``unit``).

    Pads and, with ``"drop"``, the dropped positions are not left over.

    Example:
        >>> remaining([(0, 10)], world_size=2, num_workers=1, uneven="pad", consumed=[3])
        [(3, 5), (8, 10)]
    """
    if len(consumed) != num_workers:
        raise ValueError(f"consumed must hold {num_workers} counts, got {list(consumed)!r}")
    out: Intervals = []
    for rank in range(world_size):
        for k, count in enumerate(consumed):
            plan = worker_plan(base, world_size, rank, num_workers, k, uneven, count, unit)
            out += plan.positions
    return coalesce(out)
