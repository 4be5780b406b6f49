"""A worker's pass, from the source readers to the items handed to the loader.

The dataset decides which epoch positions a worker hands out (a :class:`~nnh_data.order.epoch.
WorkerPlan`); a :class:`Pipeline` turns that plan into items with the generator stages of
:mod:`nnh_data.streaming.stages`: each source's reader yields its parts in epoch order
(:mod:`nnh_data.streaming.source_reader`), several sources are interleaved in the mixed order
(:class:`~nnh_data.order.mixing.MixedOrder`), each part gets its parameters in one call
(:class:`Parameters`: generated, or looked up in a precomputed table), and the items are handed
out as samples, rows of columns or batches, ``decode`` applied under the error policy. It also
gives a plan's labels without reading a shard (what :class:`~nnh_data.audit.EpochAudit`
compares with). Pure plumbing: it holds no epoch and no resume state (the dataset does).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nnh_data.augment.params import AugmentationConfig, gen_augmentation_params_batch
from nnh_data.cache.store import ShardCache
from nnh_data.columns import Columns, num_rows, without_arrow
from nnh_data.order.epoch import Intervals, WorkerPlan
from nnh_data.order.mixing import MixedOrder, SourceDraws, source_seed
from nnh_data.precompute.read import PrecomputedParams
from nnh_data.streaming import stages
from nnh_data.streaming.arguments import Data
from nnh_data.streaming.error_policy import ErrorPolicy
from nnh_data.streaming.global_reader import GlobalPlan, global_labels, global_parts
from nnh_data.streaming.source_reader import SourceReader
from nnh_data.streaming.stages import LEFT_OUT, Progress
from nnh_data.streaming.stats import PARAMS_NS, Meter
from nnh_data.workers.handoff import handed_out, tensor_columns

__all__ = ["Parameters", "Pass", "Pipeline"]

_MIX_CHUNK = 4096  # mixed positions interleaved per part
_LABEL_CHUNK = 1 << 20  # planned labels computed at a time


@dataclass
class Pass:
    """The layout of the iteration a worker is running, and its progress."""

    epoch: int
    base: Intervals
    world_size: int
    num_workers: int
    worker: int
    progress: Progress = field(default_factory=Progress)
    meter: Meter = field(default_factory=Meter.alone)  # counts for ds.stats()


@dataclass(frozen=True)
class Parameters:
    """How a dataset's parameters are made: generated, or looked up in a precomputed table."""

    config: AugmentationConfig | None
    seed: int
    rank: int | None  # set for rank-aware parameters
    world_size: int
    precomputed: PrecomputedParams | None

    def columns(self, keys: np.ndarray, epoch: int) -> dict[str, np.ndarray]:
        """The parameters keyed by ``keys`` as columns, ``seed`` as int64 (its 64 bits,
        signed: what tensors hold and ``apply_augmentation`` takes)."""
        if self.precomputed is not None:
            cols = self.precomputed.batch(keys, epoch, self.rank)
        elif self.rank is None:
            cols = gen_augmentation_params_batch(
                keys, config=self.config, base_seed=self.seed, epoch=epoch, rank_aware=False
            )
        else:
            cols = gen_augmentation_params_batch(
                keys, self.rank, self.world_size, self.config, self.seed, epoch
            )
        cols["seed"] = cols["seed"].view(np.int64)
        return cols

    def check(self, epoch: int, total: int) -> None:
        """Raise when the precomputed table does not cover ``epoch`` of ``total`` samples."""
        if self.precomputed is not None:
            self.precomputed.check_covers(self.config, self.seed, epoch, total,
                                          self.rank is not None, self.world_size)  # fmt: skip


@dataclass
class Pipeline:
    """The readers of a dataset's sources and how their parts become the items handed out."""

    readers: list[SourceReader]
    counts: tuple[int, ...]  # draws per epoch, per source
    seed: int
    params: Parameters
    errors: ErrorPolicy
    decode: Callable[[Any], Any] | None
    batch_size: int | None

    @classmethod
    def create(cls, data: Data, *, window: int, storage_options: dict[str, Any] | None,
               readahead: int, cache: ShardCache | None, cache_prefetch: int,
               **settings: Any) -> Pipeline:  # fmt: skip
        """One reader per source, drawing ``data.counts[s]`` per epoch; parameters keyed by
        source (``key_offset``) and repeat (``key_stride``). ``settings``: the other fields."""
        infos = [info for index in data.indexes for info in index.shards]
        nullable = sorted({name for info in infos for name in info.nullable})
        readers, first_shard, key_offset = [], 0, 0
        for s, (source, index) in enumerate(zip(data.sources, data.indexes)):
            shard_counts = tuple(i.num_samples for i in index.shards)
            draws = SourceDraws(shard_counts, source_seed(settings["seed"], s), data.counts[s],
                                window)  # fmt: skip
            name = s if source.name is None else source.name
            readers.append(SourceReader(
                index, draws, errors=settings["errors"], first_shard=first_shard,
                key_offset=key_offset, key_stride=sum(i.total_samples for i in data.indexes),
                labels={"__source__": name} if data.mixed else None, repeats=data.mixed,
                storage_options=source.storage_options or storage_options,
                nullable=nullable, readahead=readahead, cache=cache, cache_prefetch=cache_prefetch,
            ))  # fmt: skip
            first_shard += len(index.shards)
            key_offset += index.total_samples
        pipeline = cls(readers, tuple(data.counts), **settings)
        if data.mixed and pipeline.batch_size is not None:
            pipeline.check_same_fields()
        return pipeline

    def items(
        self, run: Pass, plan: WorkerPlan | GlobalPlan, upcoming: Any, rows: bool
    ) -> Iterator[Any]:
        """The items of ``plan``: samples (or batches, with ``batch_size``); with ``rows``, the
        samples as rows of columns (:func:`stages.hand_out_rows`). ``upcoming``: the worker's
        plan of the next epoch, for the cache. A plan of global batches reads its lanes
        (:mod:`nnh_data.streaming.global_reader`), one part per loader batch."""
        # batches and rows taken as columns; samples built from columns at hand-out
        kind = stages.COLUMNS if self.batch_size is not None or rows else stages.VALUE_COLUMNS
        params = functools.partial(self._columns, run)
        if isinstance(plan, GlobalPlan):
            parts = global_parts(self.readers[0], run.epoch, plan, upcoming, kind, params,
                                 run.meter)  # fmt: skip
        else:
            mixed = MixedOrder(self.counts, self.seed, run.epoch)
            parts = stages.with_parameters(_worker_parts(
                self.readers, mixed, plan, upcoming, kind, run.num_workers, run.meter), params)
        if rows:
            return stages.hand_out_rows(parts, run.progress, self.skipped)
        if self.batch_size is None:
            return stages.hand_out_samples(parts, run.progress, self._decoding(run), self.skipped)
        finish = functools.partial(self._finish, run)
        return stages.hand_out_batches(parts, self.batch_size, run.progress, finish)

    def labels(self, epoch: int, plan: WorkerPlan | GlobalPlan) -> Iterator[dict[str, np.ndarray]]:
        """The labels of ``plan``'s rows (``__index__``, ``__pad__``, ``__source__``,
        ``__repeat__``), by source, in chunks, computed without reading a shard."""
        if isinstance(plan, GlobalPlan):
            yield from global_labels(self.readers[0].draws.order(epoch), plan)
            return
        mixed = MixedOrder(self.counts, self.seed, epoch)
        draws = [(plan.positions, list(plan.pads))] if len(self.readers) == 1 else \
            _source_draws(mixed, plan)  # fmt: skip
        for s, (intervals, pads) in enumerate(draws):
            source = self.readers[s].draws
            spans = [(a, min(a + _LABEL_CHUNK, hi)) for lo, hi in intervals
                     for a in range(lo, hi, _LABEL_CHUNK)]  # fmt: skip
            for a, b in spans:
                yield _labels(s, *source.sample_ids(epoch, a, b), pad=False)
            for j in range(0, len(pads), _LABEL_CHUNK):
                got = [source.sample_ids(epoch, p, p + 1) for p in pads[j : j + _LABEL_CHUNK]]
                yield _labels(s, *(np.concatenate(c) for c in zip(*got)), pad=True)

    def skipped(self, label: dict) -> None:
        """Count an unreadable sample as it comes to be handed out."""
        source = label.get("__source__", 0)
        reader = next(r for r in self.readers if r.labels.get("__source__", 0) == source)
        self.errors.count(reader.shard_of(label["__index__"]))

    def check_same_fields(self) -> None:
        """Batch mode: mixed sources must have the same fields (one sample of each is read)."""
        fields = {s: r.field_names() for s, r in enumerate(self.readers) if r.index.total_samples}
        first = next(iter(fields.values()), None)
        differ = {s: f for s, f in fields.items() if f != first}
        if differ:
            raise ValueError(
                "with batch_size, mixed sources must have the same fields; source 0 has "
                f"{first}, but " + ", ".join(f"source {s} has {f}" for s, f in differ.items())
            )

    def _columns(self, run: Pass, keys: np.ndarray) -> dict[str, np.ndarray]:
        """A part's parameters (see :class:`Parameters`), timed; the part is counted."""
        run.meter.part(keys.size)
        began = time.perf_counter_ns()
        columns = self.params.columns(keys, run.epoch)
        run.meter.add(PARAMS_NS, time.perf_counter_ns() - began)
        return columns

    def _decoding(self, run: Pass) -> stages.Decoding | None:
        """How a per-sample pass applies ``decode``: as it is (no wrapper per sample), timed in
        the parts the pass's meter samples, its errors under the error policy."""
        if self.decode is None:
            return None
        timed = functools.partial(self._timed, run, self.decode)
        return stages.Decoding(self.decode, self.errors.decode_failed, timed,
                               lambda: run.meter.timing)  # fmt: skip

    def _finish(self, run: Pass, item: Columns) -> Any:
        """A batch as handed out: rows skipped as unreadable dropped, ``decode`` applied under
        the error policy (a batch without it as tensors and packed fields,
        :mod:`nnh_data.workers.handoff`); ``LEFT_OUT`` when nothing is left."""
        if (item := self.errors.readable(item)) is LEFT_OUT:
            return LEFT_OUT
        if self.decode is None:
            return tensor_columns(item)
        decode = functools.partial(self.errors.decoded, self.decode)
        item, rows = without_arrow(item), num_rows(item)
        return handed_out(self._timed(run, decode, item, rows) if run.meter.timing else
                          decode(item))  # fmt: skip

    def _timed(self, run: Pass, decode: Callable[[Any], Any], item: Any, items: int = 1) -> Any:
        """``decode(item)``, its time added to the pass's meter (``item`` holds ``items``)."""
        began = time.perf_counter_ns()
        item = decode(item)
        run.meter.decoded(time.perf_counter_ns() - began, items)
        return item


def _worker_parts(
    readers: list[SourceReader],
    mixed: MixedOrder,
    plan: WorkerPlan,
    upcoming: WorkerPlan | None,
    rows: stages.Rows,
    num_workers: int,
    meter: Meter,
) -> Iterator[stages.Part]:
    """The parts of ``plan``'s positions: one source's, or each source's draws of the mixed
    epoch read in its own order and interleaved by :func:`stages.mix`. ``upcoming``: the
    worker's plan of the next epoch, for the cache; ``meter`` counts the reads."""
    epoch = mixed.epoch
    if len(readers) == 1:
        following = None if upcoming is None else (upcoming.positions, upcoming.pads)
        return readers[0].parts(epoch, plan.positions, plan.pads, rows, following=following,
                                num_workers=num_workers, meter=meter)  # fmt: skip
    draws = _source_draws(mixed, plan)
    following = [None] * len(readers) if upcoming is None else _source_draws(
        MixedOrder(mixed.counts, mixed.seed, epoch + 1), upcoming)  # fmt: skip
    deferred = stages.deferred(rows)  # each row gathered once, by the mix
    streams = [r.parts(epoch, *draws[s], deferred, following=following[s], num_workers=num_workers,
                       meter=meter) for s, r in enumerate(readers)]  # fmt: skip
    chunks = [mixed.assign(a, min(a + _MIX_CHUNK, hi))[0]
              for lo, hi in plan.positions for a in range(lo, hi, _MIX_CHUNK)]  # fmt: skip
    chunks += [mixed.assign(p, p + 1)[0] for p in plan.pads]
    return stages.mix(streams, chunks, rows)


def _labels(source: int, ids: np.ndarray, occurrences: np.ndarray, pad: bool) -> dict:
    return {"__index__": ids, "__pad__": np.full(ids.size, pad),
            "__source__": np.full(ids.size, source), "__repeat__": occurrences > 0}  # fmt: skip


def _source_draws(mixed: MixedOrder, plan: WorkerPlan) -> list[tuple[Intervals, list[int]]]:
    """Per source, the draws (intervals) and the pad draws that ``plan``'s positions hold."""
    out: list[tuple[Intervals, list[int]]] = [([], []) for _ in mixed.counts]
    for lo, hi in plan.positions:
        for s, (a, b) in enumerate(mixed.draw_range(lo, hi)):
            out[s][0].extend([(a, b)] if b > a else [])
    for p in plan.pads:
        source, draw = mixed.assign(p, p + 1)
        out[int(source[0])][1].append(int(draw[0]))
    return out
