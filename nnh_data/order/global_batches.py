"""Global batches that do not depend on the world size: pure arithmetic on integers.

Steps. Global batch ``k`` of an epoch of ``total`` samples is stream positions
``[k * G, (k + 1) * G)`` (``G`` = ``global_batch_size``). A step draws ``g = G / D``
consecutive items from each of ``D = gcd(P, G)`` partitions (``P`` = ``partitions``): offset
``o`` of a step belongs to partition ``o // g``. Each partition is read as :data:`LANES` lanes
that take turns step by step: step ``k`` takes items ``[(k // LANES) * g, ... + g)`` of lane
``(partition, k % LANES)``. The lanes are laid end to end over the epoch's shard order
(partition-major, each a contiguous range), so the stream positions map one to one onto the
epoch's samples; the lane lengths follow from (total, G, P) alone. With ``uneven="pad"`` the
last, short step is filled with pads, each repeating a sample of the epoch's first steps
(stream position ``(t - total) % total``); with ``"drop"`` the lanes hold the whole steps only
and the rest of the shard order is not read. Nothing here depends on the world size.

Split. Rank ``r`` of ``W`` takes offsets ``[r * G / W, (r + 1) * G / W)`` of every step. When
``W`` divides ``D`` that is ``D / W`` whole partitions, one contiguous range of the shard
order, as a rank reads today; when ``P`` divides ``W`` (so ``D = P``), ``W / P`` ranks share a
partition and each reads its windows (``W / P`` times the bytes). Other world sizes would read
every partition and are refused (:func:`check_world_size`). A rank's items are cut into loader
batches of ``unit`` items and DataLoader worker ``w`` of ``K`` yields batches ``j = w, w + K,
...`` of its pass, which is the order in which a DataLoader takes them: the rank's batches are
the same at any worker count. With ``K`` dividing ``LANES`` (and a loader batch of whole
partition items) a lane is read by one worker only.

Trade-off. A process holds one shuffle window per lane it reads, ``D * LANES / (W * K)`` lanes
per worker (a run that replays 64 ranks on one process holds 256 windows), where the plain
split holds one. In exchange the windows of a lane are its own (:mod:`nnh_data.order.lanes`),
so no window is read twice, at any world size that divides ``D``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from nnh_data.checks import check_choice, check_int
from nnh_data.order.epoch import UNEVEN

__all__ = [
    "LANES",
    "PARTITIONS",
    "Batch",
    "GlobalBatches",
    "RankShare",
    "Read",
    "check_world_size",
    "fitting_world_sizes",
    "read_pieces",
    "worker_batches",
    "worker_length",
]

LANES = 4  # lanes per partition, taking turns step by step: 1, 2 or 4 workers read apart
PARTITIONS = 64  # the default: 1, 2, 4, ..., 64 ranks (and multiples of 64) fit
_CHUNK_ITEMS = 1 << 16  # items planned at a time


def fitting_world_sizes(global_batch_size: int, partitions: int) -> list[int]:
    """The world sizes at which the global batches are kept: divisors of
    ``global_batch_size`` that divide ``partitions`` or are multiples of it.

    Example:
        >>> fitting_world_sizes(96, 64)
        [1, 2, 4, 8, 16, 32]
    """
    g = check_int("global_batch_size", global_batch_size, low=1)
    p = check_int("partitions", partitions, low=1)
    small = [d for d in range(1, math.isqrt(g) + 1) if g % d == 0]
    divisors = sorted(set(small + [g // d for d in small]))
    return [w for w in divisors if p % w == 0 or w % p == 0]


def check_world_size(world_size: int, global_batch_size: int, partitions: int) -> int:
    """``world_size`` when the global batches are kept at it, else a ``ValueError`` naming the
    world sizes that fit."""
    fits = fitting_world_sizes(global_batch_size, partitions)
    if world_size not in fits:
        raise ValueError(
            f"world_size={world_size} does not fit global_batch_size={global_batch_size} and "
            f"partitions={partitions}: the global batches are the same at world sizes that "
            f"divide {global_batch_size} and divide {partitions} or are multiples of it: "
            f"{', '.join(map(str, fits))}"
        )
    return world_size


@dataclass(frozen=True)
class GlobalBatches:
    """The global batches of an epoch of ``total`` samples: which lane item each stream
    position is (see the module).

    Example:
        >>> gb = GlobalBatches(total=10, global_batch_size=4, partitions=2)
        >>> gb.steps, gb.lanes
        (3, 8)
        >>> [int(n) for n in np.diff(gb.lane_starts)]
        [2, 2, 2, 0, 2, 2, 0, 0]
    """

    total: int
    global_batch_size: int
    partitions: int = PARTITIONS
    uneven: str = "pad"
    groups: int = field(init=False)  # partitions a step draws from: gcd(partitions, G)
    per_group: int = field(init=False)  # items a step draws from each
    steps: int = field(init=False)
    kept: int = field(init=False)  # samples the lanes hold
    lane_starts: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        total = check_int("total", self.total, low=0)
        size = check_int("global_batch_size", self.global_batch_size, low=1)
        check_int("partitions", self.partitions, low=1)
        pad = check_choice("uneven", self.uneven, UNEVEN) == "pad"
        groups = math.gcd(self.partitions, size)
        per_group = size // groups
        full, rest = divmod(total, size)
        phase = np.arange(LANES)
        uses = full // LANES + (phase < full % LANES)  # whole steps each lane takes part in
        lengths = np.tile(per_group * uses, (groups, 1))
        if pad and rest:
            lengths[:, full % LANES] += np.clip(rest - per_group * np.arange(groups), 0, per_group)
        for name, value in (("groups", groups), ("per_group", per_group),
                            ("steps", full + bool(pad and rest)),
                            ("kept", total if pad else full * size),
                            ("lane_starts", np.concatenate(([0], np.cumsum(lengths))))):
            object.__setattr__(self, name, value)  # fmt: skip

    @property
    def lanes(self) -> int:
        """Lanes in the epoch."""
        return self.groups * LANES

    def lane_length(self, lane: int) -> int:
        """Samples in lane ``lane``."""
        return int(self.lane_starts[lane + 1] - self.lane_starts[lane])

    def real(self, step: int) -> int:
        """Samples of step ``step`` that are not pads (a trainer averages its loss over them).

        Example:
            >>> [GlobalBatches(10, 4, 2).real(k) for k in range(3)]
            [4, 4, 2]
        """
        check_int("step", step, low=0, high=self.steps - 1)
        return min(self.global_batch_size, self.kept - step * self.global_batch_size)

    def locate(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(lane, item, pad)`` of stream positions ``t`` (int64): a pad is the lane item of
        the sample it repeats."""
        t = np.asarray(t, dtype=np.int64)
        pad = t >= self.kept
        t = np.where(pad, (t - self.kept) % max(self.kept, 1), t)
        step, offset = np.divmod(t, self.global_batch_size)
        group, within = np.divmod(offset, self.per_group)
        lane = group * LANES + step % LANES
        return lane, (step // LANES) * self.per_group + within, pad


@dataclass(frozen=True)
class RankShare:
    """Rank ``rank``'s share of every global batch at ``world_size`` ranks, in loader batches
    of ``unit`` items: ``share`` items per step, ``length`` per epoch."""

    batches: GlobalBatches
    world_size: int
    rank: int
    unit: int

    def __post_init__(self) -> None:
        gb = self.batches
        check_world_size(self.world_size, gb.global_batch_size, gb.partitions)
        check_int("rank", self.rank, low=0, high=self.world_size - 1)
        share = self.share
        if check_int("batch_size", self.unit, low=1) > share or share % self.unit:
            units = [d for d in range(1, share + 1) if share % d == 0]
            raise ValueError(
                f"batch_size={self.unit} must divide a rank's share of a global batch "
                f"(global_batch_size={gb.global_batch_size} / world_size={self.world_size} = "
                f"{share}): one of {', '.join(map(str, units))}"
            )

    @property
    def share(self) -> int:
        """Items of each step this rank takes."""
        return self.batches.global_batch_size // self.world_size

    @property
    def length(self) -> int:
        """Items this rank yields in an epoch (pads included)."""
        return self.batches.steps * self.share

    def stream(self, x: np.ndarray) -> np.ndarray:
        """Stream positions of the rank's items ``x``."""
        step, within = np.divmod(np.asarray(x, dtype=np.int64), self.share)
        return step * self.batches.global_batch_size + self.rank * self.share + within


@dataclass(frozen=True)
class Batch:
    """One loader batch as runs of consecutive lane items, in order: run ``i`` is items
    ``[lo[i], hi[i])`` of lane ``lane[i]``, a pad when ``pad[i]`` (then one item)."""

    lane: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    pad: np.ndarray

    @property
    def size(self) -> int:
        """Items in the batch."""
        return int((self.hi - self.lo).sum())


def worker_length(share: RankShare, start: int, num_workers: int, worker: int) -> int:
    """Items worker ``worker`` of ``num_workers`` yields in a pass from the rank's item
    ``start`` to the epoch's end.

    Example:
        >>> share = RankShare(GlobalBatches(10, 4, 2), world_size=2, rank=0, unit=1)
        >>> [worker_length(share, 1, 2, w) for w in range(2)]
        [3, 2]
    """
    items = share.length - start
    batches = -(-items // share.unit)
    own = len(range(worker, batches, num_workers))
    short = batches * share.unit - items if batches and (batches - 1) % num_workers == worker else 0
    return own * share.unit - short


def worker_batches(
    share: RankShare, start: int, num_workers: int, worker: int, skip: int = 0
) -> Iterator[Batch]:
    """The loader batches worker ``worker`` of ``num_workers`` yields in a pass from the
    rank's item ``start``: batches ``j = worker, worker + num_workers, ...`` of ``unit`` items
    from there, after its first ``skip`` items (a worker resumed inside its pass).

    Example:
        >>> share = RankShare(GlobalBatches(8, 4, 2), world_size=1, rank=0, unit=2)
        >>> [(b.lane.tolist(), b.lo.tolist()) for b in worker_batches(share, 0, 2, 1)]
        [([4], [0]), ([5], [0])]
    """
    unit = share.unit
    batches = -(-(share.length - start) // unit)
    numbers = np.arange(worker, batches, num_workers, dtype=np.int64)[skip // unit :]
    per_chunk = max(1, _CHUNK_ITEMS // unit)
    for first in range(0, numbers.size, per_chunk):
        x = start + numbers[first : first + per_chunk, None] * unit + np.arange(unit)
        which = np.repeat(np.arange(x.shape[0]), unit)
        x = x.reshape(-1)
        keep = x < share.length
        if first == 0:
            keep[: skip % unit] = False
        yield from _runs(share, x[keep], which[keep])


def _runs(share: RankShare, x: np.ndarray, which: np.ndarray) -> Iterator[Batch]:
    """The batches of the rank's items ``x`` (in order; ``which`` numbers their batches)."""
    lane, item, pad = share.batches.locate(share.stream(x))
    new = np.ones(x.size, bool)
    new[1:] = (which[1:] != which[:-1]) | pad[1:] | pad[:-1] | (lane[1:] != lane[:-1]) | (
        item[1:] != item[:-1] + 1)  # fmt: skip
    starts = np.flatnonzero(new)
    ends = np.r_[starts[1:], x.size]
    lo, hi = item[starts], item[ends - 1] + 1
    cuts = np.flatnonzero(which[starts][1:] != which[starts][:-1]) + 1
    for a, b in zip(np.r_[0, cuts], np.r_[cuts, starts.size]):
        yield Batch(lane[starts[a:b]], lo[a:b], hi[a:b], pad[starts[a:b]])


@dataclass(frozen=True)
class Read:
    """Items ``[lo, hi)`` of lane ``lane`` read together: a window's, or one ``pad``."""

    lane: int
    lo: int
    hi: int
    pad: bool = False


def read_pieces(batches: Iterator[Batch], gb: GlobalBatches, window: int) -> Iterator[Read]:
    """What a worker reads for ``batches``, in the order it first needs it: for each lane
    window (``window`` items; a lane's windows start at its start) that a run enters, the
    window's items from the first one needed to its end; for each pad, its one sample.

    Example:
        >>> gb = GlobalBatches(8, 4, 2)
        >>> share = RankShare(gb, world_size=1, rank=0, unit=4)
        >>> [(r.lane, r.lo, r.hi) for r in read_pieces(worker_batches(share, 0, 1, 0), gb, 2)]
        [(0, 0, 2), (4, 0, 2), (1, 0, 2), (5, 0, 2)]
    """
    entered = np.full(gb.lanes, -1, dtype=np.int64)  # the last window entered, per lane
    lengths = np.diff(gb.lane_starts).tolist()
    for batch in batches:
        # most batches enter no window: their runs are only looked at one by one when one does
        marked = np.flatnonzero(batch.pad | ((batch.hi - 1) // window > entered[batch.lane]))
        for i in marked.tolist():
            lane, lo, hi = int(batch.lane[i]), int(batch.lo[i]), int(batch.hi[i])
            if batch.pad[i]:
                yield Read(lane, lo, hi, True)
                continue
            for w in range(max(lo // window, int(entered[lane]) + 1), (hi - 1) // window + 1):
                yield Read(lane, max(lo, w * window), min((w + 1) * window, lengths[lane]))
                entered[lane] = w
