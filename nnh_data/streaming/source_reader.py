"""One source of a streaming dataset, read as parts: the plan, read and assemble stages.

A source's draws of an epoch are runs of its cycles (:class:`~nnh_data.order.mixing.SourceDraws`:
cycle ``k`` is one shuffled pass; a source drawn once per epoch reads cycle ``epoch``). For the
draws a worker hands out, :meth:`SourceReader.parts` plans the read blocks of each cycle's
positions, reads them in one read-ahead thread (a :class:`~nnh_data.shards.reading.ShardReader`
owned by the pass), decodes them into rows and assembles them in draw order, labelled with the
source's ids. Parameters are keyed by ``key_offset + id`` (plus ``key_stride`` times the
occurrence of a sample drawn again in the same epoch), so every source and every repeat gets
its own.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, groupby
from typing import Any

import numpy as np

from nnh_data.cache.cached_pass import CachedPass
from nnh_data.cache.store import ShardCache
from nnh_data.errors import ShardError
from nnh_data.order.blocks import Block, pad_plan, read_plan
from nnh_data.order.epoch import EpochOrder, Intervals, coalesce
from nnh_data.order.lanes import LaneOrder
from nnh_data.order.mixing import SourceDraws
from nnh_data.shards.index import ShardIndex, ShardInfo
from nnh_data.shards.reading import (
    ShardReader,
    decode_shard_columns,
    decode_shard_range,
    split_shard_range,
)
from nnh_data.shards.sources import is_local
from nnh_data.streaming import stages
from nnh_data.streaming.duplicate_keys import DuplicateKeys
from nnh_data.streaming.error_policy import ErrorPolicy
from nnh_data.streaming.readahead import read_ahead
from nnh_data.streaming.stats import DECODE_NS, DUPLICATE_KEYS, RETRIES, Meter

__all__ = ["Piece", "SourceReader"]

_READ_BYTES = 8 << 20
# local tar shards are read in smaller pieces: a read costs no request there, and each worker
# holds a piece twice while it is parsed (its bytes and their values): 2 MiB instead of 8 MiB
# took 30-70 MiB off the peak PSS of 2 workers reading 3 KiB samples, at the same CPU per sample
_LOCAL_TAR_READ_BYTES = 2 << 20
# what a part holds at most without shuffle (of the 1,024 samples it holds else): a part is
# assembled before its first sample is handed out (1,024 Parquet rows of 1 MiB: 1 GiB)
_PART_BYTES = 32 << 20


@dataclass(frozen=True)
class Piece:
    """Positions of one order read together: sorted ``positions`` (the blocks of the windows
    they touch, in order), or one position repeated as a pad (``pad``); ``cycle``: the
    source's cycle the order belongs to."""

    order: EpochOrder | LaneOrder
    positions: Intervals
    pad: bool = False
    cycle: int = 0


class SourceReader:
    """Reads one source's draws as :class:`~nnh_data.streaming.stages.Part` streams.

    ``labels``: constant labels of every row (``__source__`` when mixing); ``repeats``: add
    ``__repeat__``; ``first_shard``: the number of the source's first shard in ``errors``;
    ``cache``: a node-local cache remote shards are read through
    (:mod:`nnh_data.cache.cached_pass`).
    """

    def __init__(
        self,
        index: ShardIndex,
        draws: SourceDraws,
        *,
        errors: ErrorPolicy,
        first_shard: int = 0,
        key_offset: int = 0,
        key_stride: int = 0,
        labels: dict[str, Any] | None = None,
        repeats: bool = False,
        storage_options: dict[str, Any] | None = None,
        nullable: Sequence[str] = (),
        readahead: int = 0,
        cache: ShardCache | None = None,
        cache_prefetch: int = 1,
    ) -> None:
        self.index, self.draws, self.errors = index, draws, errors
        self.first_shard, self.key_offset, self.key_stride = first_shard, key_offset, key_stride
        self.labels, self.repeats = labels or {}, repeats
        self.storage_options, self.nullable = storage_options, nullable
        self.readahead, self.cache, self.cache_prefetch = readahead, cache, cache_prefetch
        self._starts = np.concatenate(([0], np.cumsum([i.num_samples for i in index.shards])))
        self._keys = DuplicateKeys()

    def parts(
        self,
        epoch: int,
        draws: Intervals,
        pads: Sequence[int],
        rows: stages.Rows,
        *,
        following: tuple[Intervals, Sequence[int]] | None = None,
        num_workers: int = 1,
        meter: Meter | None = None,
    ) -> Iterator[stages.Part]:
        """The rows of draws ``draws`` (intervals of this epoch's draws, in order) then of the
        single draws ``pads`` (marked ``__pad__``), in that order, as parts. With a cache:
        ``following`` holds the draws and pads this worker reads next epoch (planned in the
        cache), ``num_workers`` the DataLoader workers taking turns with it. ``meter`` counts
        the reads and their decoding (:mod:`nnh_data.streaming.stats`)."""
        pieces = self._pieces(epoch, draws, pads)
        upcoming = self._pieces(epoch + 1, *following) if following else []
        for piece, part in self.read(pieces, upcoming, rows, num_workers=num_workers, meter=meter):
            yield self._labelled(part, epoch, piece.cycle)

    def read(
        self,
        pieces: Sequence[Piece],
        upcoming: Sequence[Piece],
        rows: stages.Rows,
        *,
        num_workers: int = 1,
        meter: Meter | None = None,
    ) -> Iterator[tuple[Piece, stages.Part]]:
        """The parts of ``pieces``, read in that order, each with its piece (one part per
        window a piece's positions touch), unlabelled; ``upcoming``: what this worker reads
        next epoch, for the cache (see :meth:`parts`)."""
        meter = Meter.alone() if meter is None else meter
        blocks = self._blocks(pieces)
        reader = ShardReader(self.storage_options, self.nullable, arrow=rows.arrow)
        # blocks come in the reader's reused buffers (each decoded before the next is asked
        # for); a salvage reads its pieces anew with ``fetch``, in this thread: with a
        # read-ahead thread on ``reader``, through a reader of its own
        read_block, cached = reader.fetch_block, None
        fetch = reader.fetch if not self.readahead else ShardReader(
            self.storage_options, self.nullable, arrow=rows.arrow).fetch  # fmt: skip
        if self.cache is not None and not is_local(self.index.shards[0].url):
            cached = CachedPass(self.cache, reader, self.index.shards, list(blocks),
                                self._blocks(upcoming), prefetch=self.cache_prefetch,
                                num_workers=num_workers)  # fmt: skip
            blocks, fetch = cached.blocks(), cached.fetch
            read_block = fetch
        remote = not is_local(self.index.shards[0].url)
        read = functools.partial(self._fetch, read_block, meter.reads(), remote, cached)
        fetched = read_ahead(read, blocks, self.readahead)
        decoded = self._decoded(fetched, rows, fetch, cached, meter)
        window, group = self.draws.window, _part_samples(self.index)
        for piece in pieces:
            positions, pads = ([], 1) if piece.pad else (piece.positions, 0)
            for part in stages.assemble(decoded, piece.order, positions, window, pads, rows,
                                        group):  # fmt: skip
                yield piece, part

    def _decoded(
        self,
        fetched: Iterator[tuple[Block, object]],
        rows: stages.Rows,
        fetch: Callable[..., Any],
        cached: CachedPass | None,
        meter: Meter,
    ) -> Iterator[tuple[int, Any]]:
        """``(concat start, rows)`` of each fetched block; its payload let go of before the
        rows are handed on, so the reused buffer it lies in is free for the next block."""
        for block, payload in fetched:
            out = self._rows_of(block, payload, rows, fetch, cached, meter)
            del payload
            yield block[3], out

    def _runs(
        self, epoch: int, draws: Intervals, pads: Sequence[int]
    ) -> tuple[list[tuple[int, Intervals]], list[tuple[int, int]]]:
        """The cycles of ``draws`` with their positions, and each pad's cycle and position."""
        runs = [(c, coalesce([(a, b) for _, a, b in g])) for c, g in groupby(
            (s for lo, hi in draws for s in self.draws.segments(epoch, lo, hi)),
            key=lambda s: s[0])]  # fmt: skip
        singles = [self.draws.segments(epoch, j, j + 1)[0][:2] for j in pads]
        return runs, singles

    def _pieces(self, epoch: int, draws: Intervals, pads: Sequence[int]) -> list[Piece]:
        """The pieces of ``draws`` (one per cycle) then of the pads ``pads``, in read order."""
        runs, singles = self._runs(epoch, draws, pads)
        order = self.draws.order
        return [Piece(order(c), positions, cycle=c) for c, positions in runs] + [
            Piece(order(c), [(a, a + 1)], pad=True, cycle=c) for c, a in singles]  # fmt: skip

    def _blocks(self, pieces: Sequence[Piece]) -> Iterator[Block]:
        """The read blocks of ``pieces``, in read order."""
        window = self.draws.window
        return chain.from_iterable(
            pad_plan(p.order, [p.positions[0][0]]) if p.pad
            else read_plan(p.order, p.positions, window, self._split)
            for p in pieces
        )  # fmt: skip

    def field_names(self) -> list[str]:
        """The sorted field names of the source's first sample (one sample is read)."""
        info = next(info for info in self.index.shards if info.num_samples)
        payload = ShardReader(self.storage_options, self.nullable).fetch(info, 0, 1)
        return sorted(next(decode_shard_range(info, payload, 0, 1)))

    def shard_of(self, sample_id: int) -> int:
        """The number (in ``errors``) of the shard that holds ``sample_id``."""
        return self.first_shard + int(np.searchsorted(self._starts, sample_id, "right")) - 1

    def _labelled(self, part: stages.Part, epoch: int, cycle: int) -> stages.Part:
        n = part.keys.size
        for name, value in self.labels.items():
            part.labels[name] = [value] * n
        part.keys = part.keys + self.key_offset
        if self.repeats:
            occurrence = self.draws.occurrence(epoch, cycle, part.labels["__index__"])
            part.labels["__repeat__"] = occurrence > 0
            part.keys += occurrence * self.key_stride
        return part

    def _split(self, shard: int, start: int, stop: int) -> list[tuple[int, int]]:
        info = self.index.shards[shard]
        small = info.format == "tar" and is_local(info.url)
        size = _LOCAL_TAR_READ_BYTES if small else _READ_BYTES
        return split_shard_range(info, start, stop, max_bytes=size)

    def _fetch(
        self, fetch: Callable[..., Any], reads: list[int], remote: bool,
        cached: CachedPass | None, block: Block,
    ) -> object:  # fmt: skip
        """Read one block, counted in ``reads`` (this thread's); a ``ShardError`` is returned,
        to be handled where it is decoded."""
        shard, start, stop, _ = block
        info = self.index.shards[shard]
        began = time.perf_counter_ns()
        try:
            payload = fetch(info, start, stop)
        except ShardError as exc:
            return exc
        got = remote and (cached is None or not cached.local)  # not from a cached copy
        Meter.read(reads, stop - start, _nbytes(info, payload, start, stop),
                   time.perf_counter_ns() - began, got)  # fmt: skip
        return payload

    def _rows_of(
        self,
        block: Block,
        payload: object,
        rows: stages.Rows,
        fetch: Callable[..., Any],
        cached: CachedPass | None,
        meter: Meter,
    ) -> Any:
        """The rows of a block (unreadable samples as ``None`` rows), ``__shard__`` set; a
        block read from a cached copy that fails to decode is read again from the remote;
        what fails to decode as a whole is salvaged in smaller pieces (``fetch`` reads them)."""
        shard, start, stop, _ = block
        info = self.index.shards[shard]
        began = time.perf_counter_ns()
        try:
            if isinstance(payload, ShardError):
                raise payload
            out = decode_shard_columns(
                info, payload, start, stop, rows.from_samples, views=rows.arrow
            )
        except ShardError as exc:
            if cached is not None and cached.copy_failed(info):
                meter.add(RETRIES, 1)
                remote = cached.fetch_remote
                again = self._fetch(remote, meter.reads(), True, None, block)
                return self._rows_of(block, again, rows, remote, None, meter)
            if isinstance(payload, memoryview):  # a reused buffer: salvaged values are bytes
                payload = payload.tobytes()
            out = self.errors.salvaged(info, payload, start, stop, exc, rows, fetch)
            # a read error raised above has this frame in its traceback: let go of it, or the
            # cycle keeps it, and the read buffers its frames view, until a collection
            del payload
        meter.add(DECODE_NS, time.perf_counter_ns() - began)
        rows_read, keys = _keys(out, start, stop)
        meter.add(DUPLICATE_KEYS, self._keys.count(info.url, info.num_samples, rows_read, keys))
        return rows.label(out, "__shard__", info.url)


def _keys(rows: stages.Columns, start: int, stop: int) -> tuple[slice | np.ndarray, list[str]]:
    """The samples in the shard (a slice, or their numbers where some were unreadable) and
    the keys (a list, an Arrow column's too) of the decoded rows of samples ``[start, stop)``."""
    keys = rows.get("__key__", [])
    keys = keys if isinstance(keys, list) else keys.to_pylist()
    if stages.SKIPPED not in rows:
        return slice(start, stop), keys
    readable = ~np.asarray(rows[stages.SKIPPED], bool)
    numbers = np.arange(start, stop)[readable]
    return numbers, [key for key, ok in zip(keys, readable) if ok] if numbers.size else []


def _part_samples(index: ShardIndex) -> int:
    """Samples per part without shuffle: about ``_PART_BYTES`` of them at the source's
    average bytes per sample (decoded, for Parquet), 1 to 1,024."""
    size = sum(max(info.size, info.data_bytes) for info in index.shards)
    return int(min(stages.GROUP, max(1, _PART_BYTES * index.total_samples // max(1, size))))


def _nbytes(info: ShardInfo, payload: object, start: int, stop: int) -> int:
    """Bytes a block read: a tar block's own; a Parquet block's share of its file."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return len(payload)
    return info.size * (stop - start) // max(info.num_samples, 1)
