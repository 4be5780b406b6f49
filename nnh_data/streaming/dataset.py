"""``ShardedStreamingDataset``: every sample once per epoch, equal counts per rank, exact resume.

Design. The epoch order and its split are the pure functions of :mod:`nnh_data.order.epoch`: shards
are shuffled, then samples within windows of ``shuffle_window``; the order is cut into one
contiguous range per rank, padded (``uneven="pad"``) or truncated (``"drop"``) to one length,
then into one contiguous range per DataLoader worker (in whole loader batches). A pass of a
worker is the chain of generator stages of :mod:`nnh_data.streaming.stages`: plan the read blocks
behind its positions, read them (one block fetched ahead in a thread while the current one is
decoded), assemble each window's rows in the window's permuted order (per source,
:mod:`nnh_data.streaming.source_reader`), interleave the sources (:mod:`nnh_data.order.mixing`),
add the parameters of ``gen_augmentation_params_batch`` once per part, and hand the items out one by
one or, with ``batch_size``, in batches of columns, counting them. The dataset object holds the
settings, the epoch (in shared memory, so persistent workers see ``set_epoch``) and the resume
state (:mod:`nnh_data.order.resume`: a worker yields a prefix of its range, so its progress is one
count). Counting happens when an item is handed to the loader, so prefetched samples are not
counted by a worker's state until the loader yields the batch that holds them.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from nnh_data.augment.params import AugmentationConfig, gen_augmentation_params_batch, param_names
from nnh_data.cache.store import ShardCache
from nnh_data.checks import check_choice, check_int
from nnh_data.columns import num_rows, without_arrow
from nnh_data.images.decoders import DECODER_NAMES, SampleDecoder
from nnh_data.loaders.resplit_guard import check_caller
from nnh_data.order.epoch import UNEVEN, Intervals, WorkerPlan, base_size, rank_span, worker_plan
from nnh_data.order.mixing import MixedOrder, Source, SourceDraws, plan_counts, source_seed
from nnh_data.order.resume import (
    check_matches,
    check_state,
    make_state,
    merge_states,
    pass_base,
    pass_start,
    state_from_loader,
    workers_iterated_error,
)
from nnh_data.precompute.read import PrecomputedParams, load_precomputed_params
from nnh_data.seeding import MASK64
from nnh_data.shards.reading import ShardIndex, build_shard_index
from nnh_data.shards.sources import is_local
from nnh_data.streaming import stages
from nnh_data.streaming.error_policy import ON_ERROR, ErrorPolicy
from nnh_data.streaming.source_reader import SourceReader
from nnh_data.streaming.stages import LEFT_OUT, Progress
from nnh_data.streaming.stats import PARAMS_NS, DataStats, Meter
from nnh_data.topology import built_on_rank0, dist_info, dist_ready, in_worker_process, worker_info
from nnh_data.workers.handoff import handed_out, tensor_columns

__all__ = ["ShardedStreamingDataset", "merge_states", "state_from_loader", "streaming_dataset_of"]

_REMOTE_READAHEAD = 2
_MIX_CHUNK = 4096  # mixed positions interleaved per part
_LABEL_CHUNK = 1 << 20  # planned labels computed at a time


@dataclass
class _Pass:
    """The layout of the iteration a worker is running, and its progress."""

    epoch: int
    base: Intervals
    world_size: int
    num_workers: int
    worker: int
    progress: Progress = field(default_factory=Progress)
    meter: Meter = field(default_factory=Meter.alone)  # counts for ds.stats()


class ShardedStreamingDataset(IterableDataset):
    """An ``IterableDataset`` over tar or Parquet shards, split by samples over ranks and workers.

    Each sample is a dict of its fields plus ``__key__``, ``__shard__`` (URL), ``__index__``
    (sample id), ``__aug__`` (augmentation parameters keyed by id and epoch) and ``__pad__``
    (True for the repeats that make ranks equal). ``source`` is anything
    :func:`build_shard_index` takes (URLs, a glob, a brace pattern), a built ``ShardIndex``, or
    a list of :class:`~nnh_data.order.mixing.Source` to mix several datasets; ``epoch_size`` sets
    the samples per epoch (see :func:`~nnh_data.order.mixing.plan_counts`). With either, samples
    also carry ``__source__`` (the source's name, default its position in the list) and
    ``__repeat__`` (True for a sample drawn again in the same epoch, which gets its own
    parameters); ``__index__`` is then the id within its source. ``shuffle_window`` bounds the
    in-window shuffle (and the decoded samples held in memory); ``readahead`` is the number of
    read blocks fetched ahead in a thread (default 2 for remote filesystems, 0 for local ones,
    where a thread only adds hand-off cost). ``cache_dir``: a node-local folder that remote
    shards are read through, shared by every process of the node (one download per shard per
    node, evicted by the known future order; :mod:`nnh_data.cache.store`); ``cache_limit``
    bounds it (bytes, or text such as "50GB"), ``cache_prefetch`` is the whole shards each
    worker fetches ahead. With ``on_error="skip"`` unreadable samples are left out
    (a damaged shard keeps the samples that can be read, :func:`build_shard_index`), counted
    in ``error_counts`` and warned about once per shard; the rank then yields fewer than
    ``len()`` samples. With DataLoader workers, take and restore the
    state through torchdata's ``StatefulDataLoader`` (:func:`streaming_loader`).

    With ``batch_size`` the dataset yields batches instead of samples, for
    ``DataLoader(ds, batch_size=None)``: dicts of columns (:mod:`nnh_data.columns`) holding
    ``batch_size`` consecutive samples of the same stream, ``__aug__`` as the columns of
    ``gen_augmentation_params_batch``, ``__index__`` and ``__pad__`` as numpy arrays, Parquet
    numeric columns as numpy arrays and other values as lists; no dict is built per sample.
    Worker ranges are cut in whole batches, so ``len()`` is the rank's number of batches
    whatever ``num_workers``. ``decode`` (a callable, or a name of
    :data:`~nnh_data.images.decoders.DECODER_NAMES`: webdataset's decoders) then receives each
    batch. Mixed sources must then have the same fields.

    Example:
        >>> ds = ShardedStreamingDataset("data/train-{000000..000009}.tar")  # doctest: +SKIP
        >>> loader = streaming_loader(ds, batch_size=32, num_workers=4)  # doctest: +SKIP
        >>> for epoch in range(3):  # doctest: +SKIP
        ...     ds.set_epoch(epoch)
        ...     for batch in loader: ...
    """

    def __init__(
        self,
        source: str | Sequence[str] | ShardIndex | Source | Sequence[Source],
        *,
        epoch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        epoch: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        aug_config: AugmentationConfig | None = None,
        rank_aware_params: bool = False,
        uneven: str = "pad",
        on_error: str = "raise",
        decode: Callable[[dict], Any] | str | None = None,
        shuffle_window: int = 1024,
        readahead: int | None = None,
        format: str | None = None,
        storage_options: dict[str, Any] | None = None,
        index_path: str | None = None,
        batch_size: int | None = None,
        precomputed: str | PrecomputedParams | None = None,
        cache_dir: str | os.PathLike | None = None,
        cache_limit: int | str | None = None,
        cache_prefetch: int = 1,
    ) -> None:
        self.sources, self._mixed = _as_sources(source, epoch_size)
        self.on_error = on_error = check_choice("on_error", on_error, ON_ERROR)
        defaults = {"format": format, "storage_options": storage_options,
                    "index_path": index_path, "on_error": on_error}  # fmt: skip
        indexes = [_index_of(s, rank, world_size, defaults) for s in self.sources]
        self._counts = plan_counts([i.total_samples for i in indexes], self.sources, epoch_size)
        self.index = indexes[0] if len(indexes) == 1 else ShardIndex(
            tuple(info for i in indexes for info in i.shards))  # fmt: skip
        self.rank, self.world_size = dist_info(rank, world_size)
        self.seed = check_int("seed", seed, low=0, high=MASK64)
        epoch = check_int("epoch", epoch, low=0, high=MASK64)
        self.window = check_int("shuffle_window", shuffle_window, low=1) if shuffle else 0
        if readahead is None:
            readahead = 0 if _is_local(self.index) else _REMOTE_READAHEAD
        self.readahead = check_int("readahead", readahead, low=0)
        self.uneven = check_choice("uneven", uneven, UNEVEN)
        self.aug_config = _checked_config(aug_config)
        self.decode = _checked_decode(decode, self.aug_config)
        self.batch_size = None if batch_size is None else check_int("batch_size", batch_size, low=1)
        self.rank_aware_params = bool(rank_aware_params)
        self.storage_options = storage_options
        self.cache = _cache_of(cache_dir, cache_limit)
        self.cache_prefetch = check_int("cache_prefetch", cache_prefetch, low=0)
        # Shared with DataLoader workers (fork and spawn pass shared-memory tensors by handle),
        # in one segment (each costs a shared-memory file): the epoch, a flag set while workers
        # iterate, the epoch of the last pass started and whether a repeat was warned about
        # (``_passes``), and the samples skipped per shard.
        self._shared = torch.zeros(4 + len(self.index.shards), dtype=torch.int64).share_memory_()
        self._shared[0], self._shared[2] = epoch, -1
        self._passes = self._shared[2:4]
        urls = [info.url for info in self.index.shards]
        lost = [None if info.error is None else info.lost for info in self.index.shards]
        self._errors = ErrorPolicy(on_error, urls, self._shared[4:], lost)
        self.data_stats = DataStats()  # what every process reading this dataset counts
        self._skipped_before = sum(self.error_counts.values())
        self._readers = _source_readers(
            self.sources, indexes, self._counts, seed=self.seed, window=self.window,
            mixed=self._mixed, errors=self._errors, storage_options=storage_options,
            readahead=self.readahead, cache=self.cache, cache_prefetch=self.cache_prefetch,
        )  # fmt: skip
        self._fingerprint = _fingerprint(self.sources, indexes, self._counts, self._mixed)
        self._loader_batch = 1
        self._pending: dict | None = None
        self._pass: _Pass | None = None
        self._params = _Parameters(
            self.aug_config, self.seed, self.rank if self.rank_aware_params else None,
            self.world_size, _precomputed_of(precomputed, self._mixed),
        )  # fmt: skip
        self._check_precomputed()
        self._params.columns(np.zeros(0, np.int64), epoch)  # validates the settings now
        if self._mixed and self.batch_size is not None:
            _check_same_fields(self._readers)

    # ------------------------------------------------------------------ epoch, length, state

    @property
    def total_samples(self) -> int:
        """Samples in one epoch over all ranks (pads not counted)."""
        return sum(self._counts)

    @property
    def epoch(self) -> int:
        """The epoch the next pass iterates (shared with the DataLoader workers)."""
        return int(self._shared[0])

    @property
    def error_counts(self) -> dict[str, int]:
        """Samples lost as unreadable per shard URL (``on_error="skip"``): those the index
        could not read of a damaged shard (counted once; every damaged shard is listed, and its
        count is a lower bound, maybe 0, where ``index.shards[i].loss`` says "at least" or "an
        unknown number"), plus those skipped while reading, by this process and its
        DataLoader workers."""
        return self._errors.counts()

    def stats(self) -> dict[str, float]:
        """Where this rank's data time went since the epoch was set, summed over this
        process and its DataLoader workers: ``samples`` and ``bytes`` read, ``read_s``,
        ``decode_s``, ``params_s``, ``wait_s`` (the loop's wait, when reported), ``gets``,
        ``retries``, ``cache_hits``, ``cache_misses``, ``cache_evictions``, ``skipped`` (see
        :mod:`nnh_data.streaming.stats`; :func:`~nnh_data.streaming.stats.sum_over_ranks` adds the
        ranks').

        Example:
            >>> ds.stats()["read_s"]  # doctest: +SKIP
            0.42
        """
        skipped = sum(self.error_counts.values()) - self._skipped_before
        return self.data_stats.epoch(skipped)

    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch ``epoch`` next, also in persistent DataLoader workers; a new epoch
        starts from its beginning (a resume state loaded for this same epoch is kept).
        :meth:`stats` counts from here."""
        check_caller()
        self.data_stats.start_epoch()
        self._skipped_before = sum(self.error_counts.values())
        epoch = check_int("epoch", epoch, low=0, high=MASK64)
        if epoch != self.epoch:
            self._shared[0] = epoch
            self._pending, self._pass = None, None
        self._check_precomputed()  # an epoch the table lacks fails here, not in a worker

    def set_loader_batch_size(self, batch_size: int) -> None:
        """Cut worker ranges in whole batches of the loader's ``batch_size`` (per-sample mode),
        so a DataLoader with workers yields exactly ``ceil(len(ds) / batch_size)`` batches
        with at most one short batch per rank. :func:`streaming_loader` calls it."""
        if self.batch_size is not None:
            raise ValueError(
                "set_loader_batch_size is for per-sample mode; this dataset yields batches of "
                f"batch_size={self.batch_size} already"
            )
        self._loader_batch = check_int("batch_size", batch_size, low=1)

    @property
    def _unit(self) -> int:
        """Items per loader batch: worker ranges are cut in multiples of it."""
        return self.batch_size or self._loader_batch

    @property
    def _settings(self) -> dict[str, Any]:
        """What a state records of this dataset (:data:`nnh_data.order.resume.SETTING_KEYS`)."""
        return {"seed": self.seed, "total": self.total_samples, "window": self.window,
                "uneven": self.uneven, "shards": self._fingerprint,
                "batch_size": self.batch_size, "unit": self._unit}  # fmt: skip

    def __len__(self) -> int:
        """Samples (batches, with ``batch_size``) this rank yields in the next pass, over all
        its workers (pads included); for a single worker's state (inside StatefulDataLoader
        workers), the length of the whole pass that state belongs to."""
        base = pass_base(self._pending, self.total_samples, self.uneven)
        length = rank_span(base_size(base), self.world_size, self.rank, self.uneven).length
        return length if self.batch_size is None else -(-length // self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe progress of this epoch (see :mod:`nnh_data.order.resume`).

        Raises ``RuntimeError`` in the main process after DataLoader workers iterated this
        dataset: their progress is not visible here, so the state would replay the epoch.
        """
        if self._pending is not None:
            return copy.deepcopy(self._pending)
        if int(self._shared[1]) and not in_worker_process():
            raise workers_iterated_error()
        run = self._pass
        if run is None or run.epoch != self.epoch:
            run = _Pass(self.epoch, [(0, self.total_samples)], self.world_size, 1, 0)
        return make_state(self._settings, epoch=run.epoch, base=run.base,
                          world_size=run.world_size, num_workers=run.num_workers,
                          worker=run.worker, handed_out=run.progress.handed_out())  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """Resume from ``state_dict()`` output: the next pass yields the rest of that epoch.

        Every field is checked now (``ValueError`` naming it), and the state must belong to
        this dataset (its shard fingerprint, seed, size, ...). ``strict=False`` also loads a
        state of an older version, without a fingerprint (the shard list is then unchecked:
        a warning says so). torchdata's ``StatefulDataLoader`` calls this with the state alone.
        """
        state = check_state(state, strict=strict)
        check_matches(state, self._settings, world_size=self.world_size, strict=strict)
        self._shared[0], self._shared[1] = state["epoch"], 0
        self._pending, self._pass = state, None

    def planned_labels(
        self, states: Sequence[Mapping[str, Any] | None] = (None,)
    ) -> Iterator[dict[str, np.ndarray]]:
        """The labels of what this rank hands out in its pass of the current epoch, computed
        without reading a shard: chunks of ``__index__``, ``__pad__``, ``__source__`` (the
        source's position) and ``__repeat__``, in no particular order.

        ``states[k]`` is the state worker ``k`` of ``len(states)`` resumes from, as a
        ``StatefulDataLoader`` restores them (:func:`~nnh_data.order.resume.loader_states`); one
        state with every count re-splits what its epoch has left; ``(None,)``: the whole
        epoch. :class:`~nnh_data.audit.epoch_audit.EpochAudit` compares what a loop consumed
        with it.
        """
        mixed = MixedOrder(tuple(self._counts), self.seed, self.epoch)
        for k, state in enumerate(states):
            if state is not None:
                check_matches(check_state(state), self._settings)
            base, consumed = pass_start(
                state, total=self.total_samples, uneven=self.uneven, world_size=self.world_size,
                num_workers=len(states), worker=k, unit=self._unit,
            )  # fmt: skip
            plan = worker_plan(base, self.world_size, self.rank, len(states), k, self.uneven,
                               consumed, self._unit)  # fmt: skip
            yield from _plan_labels(self._readers, mixed, plan)

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        check_caller()
        return self._iterate(rows=False)

    def loader_view(self) -> IterableDataset:
        """This dataset as :func:`~nnh_data.streaming.loader.streaming_loader` hands it to its
        loader in per-sample mode without ``decode``: the same samples, state and length, each
        sample a row of columns that :func:`~nnh_data.workers.handoff.collate_rows` batches, so
        no dict is built per sample. Attributes are this dataset's (``view.set_epoch(...)``
        works)."""
        if self.batch_size is not None or self.decode is not None:
            raise ValueError("loader_view is for per-sample datasets without decode")
        return _LoaderView(self)

    def _iterate(self, rows: bool) -> Iterator[Any]:
        """A pass: samples (or batches, with ``batch_size``); with ``rows``, the samples as
        rows of columns (:func:`stages.hand_out_rows`)."""
        # Resolved here, not in the generator: StatefulDataLoader snapshots the state right
        # after iter(), before the first item is requested.
        worker, num_workers = worker_info()
        self._shared[1] = int(in_worker_process())
        state, self._pending = self._pending, None
        if state is not None and state["epoch"] != self.epoch:
            state = None  # set_epoch moved on (seen by a persistent worker)
        self._note_pass(resumed=state is not None, worker=worker)
        base, consumed = pass_start(
            state, total=self.total_samples, uneven=self.uneven, world_size=self.world_size,
            num_workers=num_workers, worker=worker, unit=self._unit,
        )  # fmt: skip
        run = self._pass = _Pass(self.epoch, base, self.world_size, num_workers, worker,
                                 meter=self.data_stats.meter(self.cache))  # fmt: skip
        run.progress.consumed = consumed
        plan = worker_plan(base, self.world_size, self.rank, num_workers, worker, self.uneven,
                           consumed, self._unit)  # fmt: skip
        self._check_precomputed()
        # batches and rows taken as columns; samples built from columns at hand-out
        kind = stages.COLUMNS if self.batch_size is not None or rows else stages.VALUE_COLUMNS
        columns = functools.partial(self._columns, run.meter, epoch=run.epoch)
        parts = stages.with_parameters(self._parts(plan, kind, run), columns)
        if rows:
            return stages.hand_out_rows(parts, run.progress, self._skipped)
        if self.batch_size is None:
            finish = None if self.decode is None else self._finish
            return stages.hand_out_samples(parts, run.progress, finish, self._skipped)
        return stages.hand_out_batches(parts, self.batch_size, run.progress, self._finish)

    def _note_pass(self, resumed: bool, worker: int) -> None:
        """Warn once per dataset when a shuffled pass starts at the epoch of the pass before
        (a hand-written loop that forgot ``set_epoch``): it repeats that order and those
        parameters. Worker 0 (or the main process) keeps the count for the pass."""
        if worker != 0:
            return
        epoch, (last, warned) = self.epoch, self._passes.tolist()
        self._passes[0] = epoch
        if resumed or last != epoch or warned or not self.window:
            return
        self._passes[1] = 1
        warnings.warn(
            f"ShardedStreamingDataset iterated again at epoch {epoch}: the same order and "
            "augmentation parameters as the pass before; call ds.set_epoch(epoch) before each "
            "epoch (a set meant to repeat, for evaluation: ShardedStreamingDataset(..., "
            "shuffle=False))", RuntimeWarning, stacklevel=4,
        )  # fmt: skip

    def _parts(self, plan: WorkerPlan, rows: stages.Rows, run: _Pass) -> Iterator[stages.Part]:
        """The worker's rows in hand-out order: one source's own, or the sources' mixed.
        With a cache, the sources also plan what the worker reads in the next epoch."""
        upcoming = None if self.cache is None else worker_plan(
            [(0, self.total_samples)], self.world_size, self.rank, run.num_workers, run.worker,
            self.uneven, 0, self._unit)  # fmt: skip
        return _worker_parts(self._readers, MixedOrder(tuple(self._counts), self.seed, run.epoch),
                             plan, upcoming, rows, run.num_workers, run.meter)  # fmt: skip

    def _columns(self, meter: Meter, keys: np.ndarray, epoch: int) -> dict[str, np.ndarray]:
        """A part's parameters (see :class:`_Parameters`), timed; the part is counted."""
        meter.part(keys.size)
        began = time.perf_counter_ns()
        columns = self._params.columns(keys, epoch)
        meter.add(PARAMS_NS, time.perf_counter_ns() - began)
        return columns

    def _finish(self, item: Any) -> Any:
        """The item as handed out: rows skipped as unreadable dropped (batches), ``decode``
        applied (a batch without it as tensors and packed fields, :mod:`nnh_data.workers.handoff`);
        ``LEFT_OUT`` when nothing is left."""
        if self.batch_size is None:
            return self._decoded(item, 1)
        if (item := self._errors.readable(item)) is LEFT_OUT:
            return LEFT_OUT
        if self.decode is None:
            return tensor_columns(item)
        return handed_out(self._decoded(without_arrow(item), num_rows(item)))

    def _decoded(self, item: Any, items: int) -> Any:
        """``decode`` applied to ``item`` (of ``items`` rows), timed in the parts the pass's
        meter samples."""
        meter = self._pass.meter
        if not meter.timing:
            return self._errors.decoded(self.decode, item)
        began = time.perf_counter_ns()
        item = self._errors.decoded(self.decode, item)
        meter.decoded(time.perf_counter_ns() - began, items)
        return item

    def _skipped(self, label: dict) -> None:
        """Count an unreadable sample as it comes to be handed out."""
        source = label.get("__source__", 0)
        reader = next(r for r in self._readers if r.labels.get("__source__", 0) == source)
        self._errors.count(reader.shard_of(label["__index__"]))

    def _check_precomputed(self) -> None:
        """Fail now when the precomputed table does not cover the next pass."""
        self._params.check(self.epoch, self.total_samples)


def streaming_dataset_of(data: Any) -> ShardedStreamingDataset | None:
    """The :class:`ShardedStreamingDataset` ``data`` is, or that a loader reads (its dataset,
    or the :meth:`~ShardedStreamingDataset.loader_view` it iterates); None for anything else.

    Example:
        >>> streaming_dataset_of(streaming_loader(ds, 64)) is ds  # doctest: +SKIP
        True
    """
    for _ in range(3):  # the dataset, a loader's dataset, or a loader's view of it
        if isinstance(data, ShardedStreamingDataset):
            return data
        data = getattr(data, "dataset", None)
    return None


class _LoaderView(IterableDataset):
    """See :meth:`ShardedStreamingDataset.loader_view`."""

    def __init__(self, dataset: ShardedStreamingDataset) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[tuple[dict, int]]:
        check_caller()
        return self.dataset._iterate(rows=True)

    def __len__(self) -> int:
        return len(self.dataset)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.dataset.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)


@dataclass(frozen=True)
class _Parameters:
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


def _source_readers(
    sources: list[Source],
    indexes: list[ShardIndex],
    counts: list[int],
    *,
    seed: int,
    window: int,
    mixed: bool,
    errors: ErrorPolicy,
    storage_options: dict[str, Any] | None,
    readahead: int,
    cache: ShardCache | None,
    cache_prefetch: int,
) -> list[SourceReader]:
    """One reader per source, drawing ``counts[s]`` per epoch; parameters keyed by source
    (``key_offset``) and repeat (``key_stride``)."""
    infos = [info for index in indexes for info in index.shards]
    nullable = sorted({name for info in infos for name in info.nullable})
    readers, first_shard, key_offset = [], 0, 0
    for s, (source, index) in enumerate(zip(sources, indexes)):
        shard_counts = tuple(i.num_samples for i in index.shards)
        draws = SourceDraws(shard_counts, source_seed(seed, s), counts[s], window)
        name = s if source.name is None else source.name
        readers.append(SourceReader(
            index, draws, errors=errors, first_shard=first_shard,
            key_offset=key_offset, key_stride=sum(i.total_samples for i in indexes),
            labels={"__source__": name} if mixed else None, repeats=mixed,
            storage_options=source.storage_options or storage_options,
            nullable=nullable, readahead=readahead, cache=cache, cache_prefetch=cache_prefetch,
        ))  # fmt: skip
        first_shard += len(index.shards)
        key_offset += index.total_samples
    return readers


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


def _plan_labels(
    readers: list[SourceReader], mixed: MixedOrder, plan: WorkerPlan
) -> Iterator[dict[str, np.ndarray]]:
    """The labels of ``plan``'s rows, by source, in chunks of at most ``_LABEL_CHUNK``."""
    if len(readers) == 1:
        draws = [(plan.positions, list(plan.pads))]
    else:
        draws = _source_draws(mixed, plan)
    for s, (intervals, pads) in enumerate(draws):
        source = readers[s].draws
        spans = [(a, min(a + _LABEL_CHUNK, hi)) for lo, hi in intervals
                 for a in range(lo, hi, _LABEL_CHUNK)]  # fmt: skip
        for a, b in spans:
            yield _labels(s, *source.sample_ids(mixed.epoch, a, b), pad=False)
        for j in range(0, len(pads), _LABEL_CHUNK):
            got = [source.sample_ids(mixed.epoch, p, p + 1) for p in pads[j : j + _LABEL_CHUNK]]
            yield _labels(s, *(np.concatenate(c) for c in zip(*got)), pad=True)


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


def _cache_of(cache_dir: str | os.PathLike | None, limit: int | str | None) -> ShardCache | None:
    """The node-local shard cache in ``cache_dir``, or None without one."""
    if cache_dir is None:
        if limit is not None:
            raise ValueError(
                f"cache_limit={limit!r} needs a cache_dir (a node-local folder) to limit; "
                "pass cache_dir too, or leave cache_limit=None"
            )
        return None
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise ValueError(f"cache_dir must be a folder path or None, got {cache_dir!r}")
    return ShardCache(cache_dir, limit)


def _as_sources(source: Any, epoch_size: int | None) -> tuple[list[Source], bool]:
    """``source`` as a list of :class:`Source`, and whether the dataset mixes (labels its
    samples with their source and repeats): several sources, ``Source`` objects, or an
    ``epoch_size``."""
    if isinstance(source, Source):
        return [source], True
    if isinstance(source, (list, tuple)) and source and isinstance(source[0], Source):
        bad = [i for i, s in enumerate(source) if not isinstance(s, Source)]
        if bad:
            raise ValueError(f"source must be all Source objects or none, got others at {bad}")
        names = [i if s.name is None else s.name for i, s in enumerate(source)]
        if len(set(names)) < len(names):
            raise ValueError(f"source names must be distinct, got {names}")
        return list(source), True
    return [Source(source)], epoch_size is not None


def _index_of(
    source: Source, rank: int | None, world_size: int | None, defaults: dict[str, Any]
) -> ShardIndex:
    """The index of ``source``: given, built here, or built on rank 0 and broadcast under a
    process group (when rank and world size are not given)."""
    if isinstance(source.source, ShardIndex):
        return source.source
    settings = {k: getattr(source, k, None) or v for k, v in defaults.items()}
    build = functools.partial(build_shard_index, source.source, **settings)
    shared = rank is None and world_size is None and dist_ready()
    return built_on_rank0(build) if shared else build()


def _is_local(index: ShardIndex) -> bool:
    """True when the shards lie on a local or in-memory filesystem (judged by the first)."""
    return not index.shards or is_local(index.shards[0].url)


def _fingerprint(
    sources: list[Source], indexes: list[ShardIndex], counts: list[int], mixed: bool
) -> str:
    """What a state checks: the shard list of one source, or of every source with its name
    and draws."""
    if not mixed:
        return indexes[0].fingerprint()
    parts = [[s.name, i.fingerprint(), c] for s, i, c in zip(sources, indexes, counts)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _precomputed_of(
    precomputed: str | os.PathLike | PrecomputedParams | None, mixed: bool
) -> PrecomputedParams | None:
    if precomputed is not None and mixed:
        raise ValueError(
            "precomputed parameters cover the ids of one source read once per epoch; with "
            "several sources or an epoch_size, leave precomputed=None (parameters are generated)"
        )
    if isinstance(precomputed, (str, os.PathLike)):
        return load_precomputed_params(precomputed)
    return precomputed


def _checked_config(config: AugmentationConfig | None) -> AugmentationConfig | None:
    if config is not None and not isinstance(config, AugmentationConfig):
        got = type(config).__name__
        raise ValueError(f"aug_config must be an AugmentationConfig or None, got {got}")
    return config


def _checked_decode(
    decode: Callable[[Any], Any] | str | None, config: AugmentationConfig | None
) -> Callable[[Any], Any] | None:
    """``decode`` as a callable: a name of ``DECODER_NAMES`` is that :class:`SampleDecoder`;
    a crop decoder needs a config with crop parameters."""
    if isinstance(decode, str):
        if decode not in DECODER_NAMES:
            raise ValueError(
                f"decode must be one of {', '.join(map(repr, DECODER_NAMES))}, a callable on "
                f"samples or None, got {decode!r}"
            )
        return SampleDecoder(decode)
    if decode is not None and not callable(decode):
        raise ValueError(f"decode must be a callable, a decoder name or None, got {decode!r}")
    crops = isinstance(decode, SampleDecoder) and decode.crop_size is not None
    if crops and "crop_x" not in param_names(config):
        raise ValueError(
            f"decode={decode!r} crops with the samples' crop parameters, but aug_config has none: "
            "pass aug_config=get_preset('imagenet') or an AugmentationConfig with crop=True"
        )
    return decode


def _check_same_fields(readers: list[SourceReader]) -> None:
    """Batch mode: mixed sources must have the same fields (one sample of each is read)."""
    fields = {s: r.field_names() for s, r in enumerate(readers) if r.index.total_samples}
    first = next(iter(fields.values()), None)
    differ = {s: f for s, f in fields.items() if f != first}
    if differ:
        raise ValueError(
            "with batch_size, mixed sources must have the same fields; source 0 has "
            f"{first}, but " + ", ".join(f"source {s} has {f}" for s, f in differ.items())
        )
