"""A worker's pass of global batches: its lanes read in the order it needs them, cut into its
loader batches.

The plan (:class:`GlobalPlan`) is the pure arithmetic of :mod:`nnh_data.order.global_batches`:
the loader batches worker ``w`` yields, as runs of lane items, and what it reads for them (each
lane window it enters, in the order it first needs it, and each pad). The reads go through the
source's :class:`~nnh_data.streaming.source_reader.SourceReader` as one stream of pieces (one
read-ahead thread, one cache session, the next epoch's pieces planned in the cache); each lane
window comes out as one part, its rows as read and the indices that order them, and is held
while the lane's items are taken from it. The held parts are joined once (until a lane moves
on), and a chunk of loader batches is one take per field from the join: each row is gathered
once, as in a plain pass. The chunk's runs are looked up per lane in arrays, and it is handed
out in parts of up to 1,024 rows, each with its parameters (one call per part, as in a plain
pass). What that costs: one window held per lane the worker reads (its values copied out of
the read buffers), the join, and a gather that reads each row back from memory (a window is
read when its lane first needs it and gathered from until the lane moves on).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa

from nnh_data.columns import ARROW, Columns, concat, cut, one_array, take
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
from nnh_data.packed import is_view
from nnh_data.streaming.source_reader import Piece, SourceReader
from nnh_data.streaming.stages import Part, Rows
from nnh_data.streaming.stats import Meter

__all__ = ["GlobalPlan", "global_labels", "global_parts", "lane_orders"]

_UNSHUFFLED = 1024  # lane items read together without shuffle
_CHUNK_ROWS = 8192  # rows of loader batches taken at once
_HANDED_ROWS = 1024  # rows per part handed out (see :func:`_handed`)
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
    """The rows of ``plan``'s loader batches, in order, with their parameters (``params`` of
    a part's keys), in parts of whole batches; ``upcoming``: the worker's plan of the next
    epoch, for the cache."""
    pieces = _pieces(reader, epoch, plan)
    following = [] if upcoming is None else _pieces(reader, epoch + 1, upcoming)
    read = reader.read(pieces, following, replace(rows, take=_Later),
                       num_workers=plan.num_workers, meter=meter)  # fmt: skip
    lanes, pools = _Lanes(_located(read), plan.share.batches.lanes), _Pools(rows)
    batches = plan.batches()
    while chunk := _chunk(batches):
        taken = pools.taken(lanes.spans(chunk), lanes.parts, lanes.held)
        yield from _handed(taken, rows, params)
        for number in lanes.released():
            pools.release(number)


def _chunk(batches: Iterator[Batch]) -> list[Batch]:
    """The next loader batches, up to :data:`_CHUNK_ROWS` rows (one at least): handed out as
    one part, in order (the loader cuts its batches from the rows it is handed)."""
    chunk, size = [], 0
    for batch in batches:
        chunk.append(batch)
        size += batch.size
        if size >= _CHUNK_ROWS:
            break
    return chunk


def _handed(part: Part, rows: Rows, params: Callable[[np.ndarray], Columns]) -> Iterator[Part]:
    """``part`` in parts of up to :data:`_HANDED_ROWS` rows (views, nothing copied), each with
    ``params`` of its keys, as a plain pass computes them: where a lane's parameters, held and
    joined with its window, cost a third of the gather (read back from memory). A part is
    handed out as a tuple per row (:func:`~nnh_data.streaming.stages.hand_out_rows`), which
    CPython takes from its free list of 2,000 small tuples as long as a part has no more: with
    8,192 rows a part it made new ones, and their count set off a collection every 700 (a
    full one, which walks the windows held, each few chunks: a fifth of a worker's CPU)."""
    size = part.keys.size
    for a in range(0, size, _HANDED_ROWS):
        b = min(size, a + _HANDED_ROWS)
        keys = part.keys[a:b]
        yield Part(rows.cut(part.rows, a, b), cut(part.labels, a, b), keys, params(keys))


class _Lanes:
    """The part each lane holds, the next one pulled from ``stream`` (in need order) when a run
    goes past it. Parts are numbered as pulled; :meth:`spans` gives the runs of a chunk as
    arrays (part number, first row, end row), looked up per lane in arrays: only a run that
    goes past its lane's part (or a pad) is followed in Python."""

    def __init__(self, stream: Iterator[tuple[int, Part, int]], lanes: int) -> None:
        self.stream = stream
        self.parts: dict[int, Part] = {}  # by number: the parts held, and those of the chunk
        self.held: set[int] = set()  # the numbers of the parts held
        self._number = np.full(lanes, -1, np.int64)  # per lane: the number of its part,
        self._first = np.zeros(lanes, np.int64)  # the lane item of its first row
        self._end = np.zeros(lanes, np.int64)  # and of the row after its last
        self._released: list[int] = []
        self._pulled = -1

    def spans(self, chunk: list[Batch]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The runs of ``chunk``'s batches as ``(number, a, b)``: rows ``[a, b)`` of part
        ``number``, in order. A run at or past its lane's part is at or past it in every later
        run of the lane (items go forward), so all but those are taken from the parts held
        when the chunk starts."""
        lane, lo, hi, pad = (np.concatenate([getattr(b, k) for b in chunk])
                             for k in ("lane", "lo", "hi", "pad"))  # fmt: skip
        first = self._first[lane]
        number, a, b = self._number[lane], lo - first, hi - first
        marked = np.flatnonzero(pad | (hi > self._end[lane])).tolist()
        if not marked:
            return number, a, b
        pieces, at = [], 0
        for i in marked:
            run = int(lane[i]), int(lo[i]), int(hi[i]), bool(pad[i])
            pieces += [(number[at:i], a[at:i], b[at:i]), self._followed(*run)]
            at = i + 1
        pieces.append((number[at:], a[at:], b[at:]))
        return tuple(np.concatenate(column) for column in zip(*pieces))  # type: ignore[return-value]

    def _followed(self, lane: int, lo: int, hi: int, pad: bool) -> tuple[list, list, list]:
        """Run ``[lo, hi)`` of ``lane`` (a pad: one item) as spans of the parts it needs."""
        spans: tuple[list, list, list] = ([], [], [])
        while lo < hi:
            if pad:
                number, first, stop = *self._pull(-1), hi
            else:
                if lo >= self._end[lane]:
                    self._pull(lane)
                number, first = int(self._number[lane]), int(self._first[lane])
                stop = min(hi, int(self._end[lane]))
            for column, value in zip(spans, (number, lo - first, stop - first)):
                column.append(value)
            lo = stop
        return spans

    def released(self) -> list[int]:
        """The numbers of the parts let go of since last asked (after a chunk is taken)."""
        released, self._released = self._released, []
        self.parts = {n: part for n, part in self.parts.items() if n in self.held}
        return released

    def _pull(self, lane: int) -> tuple[int, int]:
        """The next part (``lane`` -1: a pad's), held by ``lane``: its number, first item."""
        got, part, first = next(self.stream)
        assert got == lane, "lane parts must come in need order"
        number = self._pulled = self._pulled + 1
        self.parts[number] = part
        if lane >= 0:
            if self._number[lane] >= 0:
                self._released.append(int(self._number[lane]))
                self.held.discard(self._released[-1])
            self.held.add(number)
            self._number[lane], self._first[lane] = number, first
            self._end[lane] = first + part.keys.size
        return number, first


def _pieces(reader: SourceReader, epoch: int, plan: GlobalPlan) -> list[Piece]:
    """What ``plan`` reads, as pieces of the lanes' orders, in the order it needs them."""
    gb = plan.share.batches
    orders = lane_orders(reader.draws.order(epoch), gb)
    window = reader.draws.window or _UNSHUFFLED
    return [Piece(orders[r.lane], [(r.lo, r.hi)], r.pad, epoch)
            for r in read_pieces(plan.batches(), gb, window)]  # fmt: skip


def _located(read: Iterator[tuple[Piece, Part]]) -> Iterator[tuple[int, Part, int]]:
    """``(lane, part, first item)`` of each part read, its rows held; lane -1 for a pad. A
    piece read as several parts gives them in turn."""
    previous, end = None, 0
    for piece, part in read:
        if isinstance(part.rows, _Later):
            part.rows = _Later(_held(part.rows.rows, own=True), part.rows.indices)
        first = end if piece is previous else piece.positions[0][0]
        previous, end = piece, first + part.keys.size
        yield (-1 if piece.pad else piece.order.lane), part, first


@dataclass(frozen=True)
class _Later:
    """A part's rows as read and the indices that put them in its order: taken once, when a
    loader batch gathers them (:class:`_Pools`), not first into the lane's order."""

    rows: Any
    indices: np.ndarray


class _Pools:
    """The parts a worker's loader batches take rows from, joined once, so that a chunk of
    batches is one take per field: a batch takes a run from each of its lanes' held parts, and
    the next batches of the same lanes take from the same parts until a lane moves to its next
    window. A join is kept while all its parts are held (one per set of parts); one with a part
    that is not held (a pad, a lane's previous window at a window's edge) serves one chunk. The
    rows are joined as read and taken once, through the parts' indices (:class:`_Later`)."""

    def __init__(self, rows: Rows) -> None:
        self.rows = rows
        self._joins: dict[frozenset[int], tuple[Part, np.ndarray, dict[int, int]]] = {}

    def taken(
        self, spans: tuple[np.ndarray, np.ndarray, np.ndarray], parts: dict[int, Part],
        held: set[int],
    ) -> Part:  # fmt: skip
        """The rows ``[a, b)`` of part ``number`` for each ``(number, a, b)`` of ``spans``, in
        order, as one part; ``parts``: the parts by number; ``held``: the numbers of the parts
        that the lanes hold."""
        number, a, b = spans
        numbers = np.unique(number)
        key = frozenset(numbers.tolist())
        known = self._joins.get(key)
        joined, read, starts = known or self._join([parts[n] for n in numbers.tolist()])
        if key <= held:
            self._joins[key] = joined, read, starts
        sizes = b - a
        first = starts[np.searchsorted(numbers, number)] + a
        indices = np.repeat(first - np.cumsum(sizes) + sizes, sizes) + np.arange(sizes.sum())
        return Part(self.rows.take(joined.rows, read[indices]), take(joined.labels, indices),
                    joined.keys[indices])  # fmt: skip

    def release(self, number: int) -> None:
        """Part ``number`` is no longer held: the joins with it go."""
        gone = [key for key in self._joins if number in key]
        for key in gone:
            del self._joins[key]

    def _join(self, parts: list[Part]) -> tuple[Part, np.ndarray, np.ndarray]:
        """``parts`` as one part (its rows as read, Arrow columns as one array each, which a
        take needs), the rows as read of each of its rows, and where each part starts."""
        reads, at, read = [], 0, []
        for part in parts:
            rows = part.rows if isinstance(part.rows, _Later) else \
                _Later(part.rows, np.arange(part.keys.size))  # fmt: skip
            reads.append(rows.rows)
            read.append(rows.indices + at)
            at += self.rows.size(rows.rows)
        joined = Part(
            _held(reads[0] if len(reads) == 1 else self.rows.join(reads)),
            concat([part.labels for part in parts]),
            np.concatenate([part.keys for part in parts]),
        )
        starts = np.cumsum([0] + [part.keys.size for part in parts[:-1]])
        return joined, np.concatenate(read), starts


def _held(columns: Columns, own: bool = False) -> Columns:
    """``columns`` to hold for a while: every Arrow column as one array (a take needs it:
    :func:`nnh_data.columns.one_array`), with ``own`` its values copied out of the read buffers
    (:func:`_own_values`), lists of values as tuples. A worker holds a window per lane, and the
    cyclic collector walks every list it holds at each full collection (several times an
    epoch), where it stops tracking a tuple of untracked values (bytes, text, numbers) the first
    time it meets it: with 128 lanes held, the lists cost a third more CPU."""
    return {name: _held(col, own) if isinstance(col, dict) else
            _own_values(one_array(col), own) if isinstance(col, ARROW) else
            tuple(col) if isinstance(col, list) else col
            for name, col in columns.items()}  # fmt: skip


def _own_values(column: pa.Array, own: bool) -> pa.Array:
    """``column``; with ``own``, views of bytes or text (:func:`~nnh_data.packed.is_view`)
    with their values copied into buffers of their own (Arrow's, which its pool keeps from
    epoch to epoch), so that the read buffers they were decoded from go back to the reader,
    which reuses a few: a window held per lane would otherwise keep its read buffers, and each
    epoch's be new memory, zeroed page by page (133,000 page faults an epoch for the 256 lanes
    of one rank of 2 workers reading 512 MB)."""
    if not own or not is_view(column.type) or len(column.buffers()) == 2:
        return column  # (a view array without data buffers holds its values in its views)
    plain = pa.string() if pa.types.is_string_view(column.type) else pa.binary()
    return column.cast(plain).cast(column.type)


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
