"""A worker's pass of global batches: its lanes read in the order it needs them, cut into its
loader batches.

The plan (:class:`GlobalPlan`) is the pure arithmetic of :mod:`nnh_data.order.global_batches`:
the loader batches worker ``w`` yields, as runs of lane items, and what it reads for them (each
lane window it enters, in the order it first needs it, and each pad). The reads go through the
source's :class:`~nnh_data.streaming.source_reader.SourceReader` as one stream of pieces (one
read-ahead thread, one cache session, the next epoch's pieces planned in the cache); each lane
window comes out as one part with its parameters (one call per window, as in a plain pass), is
held while the lane's items are taken from it, and a loader batch is the join of the runs it
takes. What that costs: one window held per lane the worker reads, and a join per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from nnh_data.columns import Columns, concat, cut
from nnh_data.order.epoch import EpochOrder, coalesce
from nnh_data.order.global_batches import (
    Batch,
    GlobalBatches,
    RankShare,
    read_pieces,
    worker_batches,
    worker_length,
)
from nnh_data.order.lanes import LaneOrder
from nnh_data.streaming.source_reader import Piece, SourceReader
from nnh_data.streaming.stages import Part, Rows
from nnh_data.streaming.stats import Meter

__all__ = ["GlobalPlan", "global_labels", "global_parts", "lane_orders"]

_UNSHUFFLED = 1024  # lane items read together without shuffle
_LABEL_CHUNK = 1 << 20  # planned labels computed at a time


@dataclass(frozen=True)
class GlobalPlan:
    """What worker ``worker`` of ``num_workers`` hands out in a pass of global batches that
    starts at the rank's item ``start``, after its first ``skip`` items."""

    share: RankShare
    start: int
    num_workers: int
    worker: int
    skip: int = 0

    @property
    def length(self) -> int:
        """Items this worker hands out in the pass."""
        return worker_length(self.share, self.start, self.num_workers, self.worker) - self.skip

    def batches(self) -> Iterator[Batch]:
        """The worker's loader batches, as runs of lane items."""
        return worker_batches(self.share, self.start, self.num_workers, self.worker, self.skip)


def lane_orders(order: EpochOrder, batches: GlobalBatches) -> list[LaneOrder]:
    """The order of every lane of ``batches`` over the epoch's shard ``order``."""
    starts = batches.lane_starts.tolist()
    return [LaneOrder(order, lane, a, b - a) for lane, (a, b) in enumerate(zip(starts, starts[1:]))]


def global_parts(
    reader: SourceReader,
    epoch: int,
    plan: GlobalPlan,
    upcoming: GlobalPlan | None,
    rows: Rows,
    params: Callable[[np.ndarray], Columns],
    meter: Meter,
) -> Iterator[Part]:
    """One part per loader batch of ``plan``, with its parameters (``params`` of a part's
    keys); ``upcoming``: the worker's plan of the next epoch, for the cache."""
    pieces = _pieces(reader, epoch, plan)
    following = [] if upcoming is None else _pieces(reader, epoch + 1, upcoming)
    read = reader.read(pieces, following, rows, num_workers=plan.num_workers, meter=meter)
    stream = _located(read, params)
    held: dict[int, tuple[Part, int]] = {}  # per lane: the part in use and its first item
    for batch in plan.batches():
        spans = []
        for lane, lo, hi, pad in zip(batch.lane.tolist(), batch.lo.tolist(), batch.hi.tolist(),
                                     batch.pad.tolist()):  # fmt: skip
            while lo < hi:
                part, first = held.get(lane, (None, 0))
                if pad or part is None or lo >= first + part.keys.size:
                    got, part, first = next(stream)
                    assert got == (-1 if pad else lane), "lane parts must come in need order"
                    if not pad:
                        held[lane] = (part, first)
                stop = min(hi, first + part.keys.size)
                spans.append((part, lo - first, stop - first))
                lo = stop
        yield _joined(spans, rows)


def _pieces(reader: SourceReader, epoch: int, plan: GlobalPlan) -> list[Piece]:
    """What ``plan`` reads, as pieces of the lanes' orders, in the order it needs them."""
    gb = plan.share.batches
    orders = lane_orders(reader.draws.order(epoch), gb)
    window = reader.draws.window or _UNSHUFFLED
    return [Piece(orders[r.lane], [(r.lo, r.hi)], r.pad, epoch)
            for r in read_pieces(plan.batches(), gb, window)]  # fmt: skip


def _located(
    read: Iterator[tuple[Piece, Part]], params: Callable[[np.ndarray], Columns]
) -> Iterator[tuple[int, Part, int]]:
    """``(lane, part, first item)`` of each part read, with its parameters; lane -1 for a
    pad. A piece read as several parts gives them in turn."""
    previous, end = None, 0
    for piece, part in read:
        part.params = params(part.keys)
        first = end if piece is previous else piece.positions[0][0]
        previous, end = piece, first + part.keys.size
        yield (-1 if piece.pad else piece.order.lane), part, first


def _joined(spans: list[tuple[Part, int, int]], rows: Rows) -> Part:
    """The rows ``[a, b)`` of each ``(part, a, b)`` of ``spans``, in order, as one part."""
    if len(spans) == 1 and spans[0][1] == 0 and spans[0][2] == spans[0][0].keys.size:
        return spans[0][0]
    taken = [rows.cut(part.rows, a, b) for part, a, b in spans]
    return Part(
        taken[0] if len(taken) == 1 else rows.join(taken),
        concat([cut(part.labels, a, b) for part, a, b in spans]),
        np.concatenate([part.keys[a:b] for part, a, b in spans]),
        concat([cut(part.params, a, b) for part, a, b in spans]),
    )


def global_labels(order: EpochOrder, plan: GlobalPlan) -> Iterator[dict[str, np.ndarray]]:
    """The labels (``__index__``, ``__pad__``) of what ``plan`` hands out, computed without
    reading a shard, in chunks, in no particular order; ``order``: the epoch's shard order."""
    orders = lane_orders(order, plan.share.batches)
    runs: dict[int, list[tuple[int, int]]] = {}
    pads: list[int] = []
    for batch in plan.batches():
        for lane, lo, hi, pad in zip(batch.lane.tolist(), batch.lo.tolist(), batch.hi.tolist(),
                                     batch.pad.tolist()):  # fmt: skip
            if pad:
                pads.append(int(orders[lane].sample_ids(np.array([lo]))[0]))
            else:
                runs.setdefault(lane, []).append((lo, hi))
    for lane, intervals in runs.items():
        for lo, hi in coalesce(intervals):
            for a in range(lo, hi, _LABEL_CHUNK):
                ids = orders[lane].sample_ids(np.arange(a, min(hi, a + _LABEL_CHUNK)))
                yield {"__index__": ids, "__pad__": np.zeros(ids.size, bool)}
    if pads:
        yield {"__index__": np.array(pads, np.int64), "__pad__": np.ones(len(pads), bool)}
