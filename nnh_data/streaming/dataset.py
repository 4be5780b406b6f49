"""``ShardedStreamingDataset``: every sample once per epoch, equal counts per rank, exact resume.

Design. The epoch order and its split are the pure functions of :mod:`nnh_data.order.epoch`:
shards are shuffled, then samples within windows of ``shuffle_window``; the order is cut into
one contiguous range per rank, padded (``uneven="pad"``) or truncated (``"drop"``) to one
length, then into one contiguous range per DataLoader worker (in whole loader batches). A
worker's pass is run by the :class:`~nnh_data.streaming.pipeline.Pipeline` (read, assemble,
mix, parameters, hand out). The dataset object holds the settings (checked and shaped by
:mod:`nnh_data.streaming.arguments`), the epoch (in shared memory, so persistent workers see
``set_epoch``) and the resume state (:mod:`nnh_data.order.resume`: a worker yields a prefix of
its range, so its progress is one count). Counting happens when an item is handed to the
loader, so prefetched samples are not counted by a worker's state until the loader yields the
batch that holds them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from nnh_data.augment.params import AugmentationConfig
from nnh_data.checks import check_choice, check_int
from nnh_data.order.epoch import UNEVEN
from nnh_data.order.global_batches import GlobalBatches
from nnh_data.order.mixing import Source
from nnh_data.order.resume import (
    merge_states,
    state_from_loader,
)
from nnh_data.precompute.read import PrecomputedParams
from nnh_data.resplit_guard import check_caller
from nnh_data.seeding import MASK64
from nnh_data.shards.index import ShardIndex
from nnh_data.streaming.arguments import (
    cache_of,
    checked_config,
    checked_decode,
    checked_global,
    default_readahead,
    open_sources,
    precomputed_of,
)
from nnh_data.streaming.epoch_state import GlobalEpochState, Layout, epoch_state
from nnh_data.streaming.error_policy import ON_ERROR, ErrorPolicy
from nnh_data.streaming.pipeline import Parameters, Pipeline
from nnh_data.streaming.stats import DataStats
from nnh_data.topology import dist_info, worker_info
from nnh_data.workers.unsendable import guard_worker_queue

__all__ = ["ShardedStreamingDataset", "merge_states", "state_from_loader", "streaming_dataset_of"]


class ShardedStreamingDataset(IterableDataset):
    """An ``IterableDataset`` over tar or Parquet shards, split by samples over ranks and workers.

    Each sample is a dict of its fields plus ``__key__``, ``__shard__`` (URL), ``__index__``
    (sample id), ``__aug__`` (augmentation parameters keyed by id and epoch) and ``__pad__``
    (True for the repeats that make ranks equal); mixed sources add ``__source__`` and
    ``__repeat__``. The arguments, by what they decide:

    - what to read: ``source``, ``format``, ``storage_options``, ``index_path``, ``epoch_size``;
    - the order and split: ``shuffle``, ``seed``, ``epoch``, ``shuffle_window``, ``rank``,
      ``world_size``, ``uneven``, ``global_batch_size`` and ``partitions``;
    - what each sample carries: ``aug_config``, ``rank_aware_params``, ``precomputed``,
      ``decode``, ``batch_size``;
    - how it is read: ``readahead``, ``cache_dir``, ``cache_limit``, ``cache_prefetch``,
      ``on_error``.

    With DataLoader workers, take and restore the state through ``streaming_loader``.

    Args:
        source: URLs, a glob, a brace pattern or a folder (anything :func:`build_shard_index`
            takes; tar, Parquet or Arrow IPC, a ``datasets`` ``save_to_disk`` folder, any
            fsspec filesystem), a built ``ShardIndex``, or a list
            of :class:`~nnh_data.order.mixing.Source` to mix several datasets (samples then
            carry ``__source__``, the source's name or position, and ``__repeat__``, True for
            a sample drawn again in the same epoch, which gets its own parameters;
            ``__index__`` is the id within its source).
        epoch_size: samples per epoch over all ranks (default: the sources' sizes; see
            :func:`~nnh_data.order.mixing.plan_counts`); mixes even one source.
        shuffle: shuffle shards, then samples within windows; False keeps the stored order.
        seed: the base seed of the order and of the parameters (0 to 2**64 - 1).
        epoch: the epoch the first pass iterates (``set_epoch`` moves it).
        rank, world_size: this rank and the number of ranks (default: ``torch.distributed``,
            else the ``RANK``/``WORLD_SIZE`` variables, else 0 and 1).
        aug_config: the :class:`~nnh_data.augment.params.AugmentationConfig` of ``__aug__``
            (None: the default parameters).
        rank_aware_params: key parameters by (rank, world size) as well as the sample id.
        uneven: ``"pad"`` repeats a few samples, flagged ``__pad__``, so every rank yields the
            same count; ``"drop"`` truncates to the shortest rank.
        on_error: ``"raise"`` (a :class:`~nnh_data.errors.ShardError` naming shard and
            position) or ``"skip"``: unreadable samples are left out, counted in
            :attr:`error_counts`, warned about once per shard (the rank then yields fewer
            than ``len()``).
        decode: a callable on each sample (each batch, with ``batch_size``), a name of
            :data:`~nnh_data.images.decoders.DECODER_NAMES` (webdataset's decoders, chosen by
            each field's extension), or a mapping from field name to such a name.
        shuffle_window: samples shuffled together (and decoded samples held in memory).
        readahead: read blocks fetched ahead in a thread (default 2 for remote filesystems,
            0 for local ones, where a thread only adds hand-off cost).
        format: ``"tar"``, ``"parquet"`` or ``"arrow"`` (default: by extension).
        storage_options: fsspec options of the shards' filesystem.
        index_path: where the index sidecar is kept (default beside the shards).
        batch_size: yield batches of this many consecutive samples instead of samples, for
            ``DataLoader(ds, batch_size=None)``: dicts of columns (:mod:`nnh_data.columns`),
            ``__aug__`` as the columns of ``gen_augmentation_params_batch``, numbers as numpy
            arrays; worker ranges are cut in whole batches, so ``len()`` counts batches.
            Mixed sources must then have the same fields.
        precomputed: a table written by ``nnh-precompute`` (a folder or a loaded
            :class:`~nnh_data.precompute.read.PrecomputedParams`) to look parameters up in.
        cache_dir: a node-local folder that remote shards are read through, shared by every
            process of the node (one download per shard per node, evicted by the known
            future order; :mod:`nnh_data.cache`).
        cache_limit: the cache's size bound (bytes, or text such as ``"50GB"``).
        cache_prefetch: whole shards each worker fetches ahead into the cache.
        global_batch_size: global batches of this many samples, the same ids and parameters
            at every world size that divides it and divides ``partitions`` or is a multiple of
            it (others are refused), each rank's share in loader batches that divide it, at any
            worker count; the state is the global step (``docs/global_batches.md``).
        partitions: the partitions of global batches, fixed for the run (default 64).

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
        global_batch_size: int | None = None,
        partitions: int | None = None,
    ) -> None:
        self.on_error = check_choice("on_error", on_error, ON_ERROR)
        data = open_sources(source, epoch_size, rank, world_size, {
            "format": format, "storage_options": storage_options, "index_path": index_path,
            "on_error": self.on_error})  # fmt: skip
        self.sources, self.index = data.sources, data.index
        self.rank, self.world_size = dist_info(rank, world_size)
        self.seed = check_int("seed", seed, low=0, high=MASK64)
        epoch = check_int("epoch", epoch, low=0, high=MASK64)
        self.window = check_int("shuffle_window", shuffle_window, low=1) if shuffle else 0
        self.readahead = check_int(
            "readahead", default_readahead(self.index) if readahead is None else readahead, low=0)
        self.uneven = check_choice("uneven", uneven, UNEVEN)
        self.aug_config = checked_config(aug_config)
        self.decode = checked_decode(decode, self.aug_config)
        self.batch_size = None if batch_size is None else check_int("batch_size", batch_size, low=1)
        self.rank_aware_params = bool(rank_aware_params)
        self.storage_options = storage_options
        self.cache = cache_of(cache_dir, cache_limit)
        self.cache_prefetch = check_int("cache_prefetch", cache_prefetch, low=0)
        steps = checked_global(global_batch_size, partitions, data, on_error=self.on_error,
            rank_aware_params=self.rank_aware_params, batch_size=self.batch_size)  # fmt: skip
        self.global_batch_size, self.partitions = steps or (None, None)
        # Shared with DataLoader workers (fork and spawn pass shared-memory tensors by handle),
        # in one segment (each costs a shared-memory file): the epoch state's four numbers,
        # then the samples skipped per shard.
        shared = torch.zeros(4 + len(self.index.shards), dtype=torch.int64).share_memory_()
        errors = ErrorPolicy.of_shards(self.on_error, self.index.shards, shared[4:])
        params = Parameters(self.aug_config, self.seed,
                            self.rank if self.rank_aware_params else None, self.world_size,
                            precomputed_of(precomputed, data.mixed))  # fmt: skip
        self._pipeline = Pipeline.create(
            data, window=self.window, storage_options=storage_options, readahead=self.readahead,
            cache=self.cache, cache_prefetch=self.cache_prefetch, seed=self.seed, params=params,
            errors=errors, decode=self.decode, batch_size=self.batch_size)  # fmt: skip
        self._state = epoch_state(Layout(
            sum(data.counts), self.world_size, self.rank, self.uneven, self.seed, self.window,
            data.fingerprint(), self.batch_size), epoch, shared[:4], steps)  # fmt: skip
        self.data_stats = DataStats()  # what every process reading this dataset counts
        self._skipped_before = sum(self.error_counts.values())
        self._check_precomputed()
        params.columns(np.zeros(0, np.int64), epoch)  # validates the settings now

    @property
    def total_samples(self) -> int:
        """Samples in one epoch over all ranks (pads not counted)."""
        return self._state.layout.total

    @property
    def global_batches(self) -> GlobalBatches | None:
        """The arithmetic of its global batches (steps, their samples), None without."""
        return self._state.batches if isinstance(self._state, GlobalEpochState) else None

    @property
    def epoch(self) -> int:
        """The epoch the next pass iterates (shared with the DataLoader workers)."""
        return self._state.epoch

    @property
    def error_counts(self) -> dict[str, int]:
        """Samples lost as unreadable per shard URL (``on_error="skip"``): what the index could
        not read of a damaged shard (every damaged shard listed; a lower bound where
        ``index.shards[i].loss`` says so), plus what this process and its workers skipped."""
        return self._pipeline.errors.counts()

    def stats(self) -> dict[str, float]:
        """Where this rank's data time went since the epoch was set, summed over this process
        and its DataLoader workers: samples and bytes read, read/decode/params/wait seconds,
        gets, retries, cache hits, misses and evictions, skipped (:mod:`nnh_data.streaming.stats`).

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
        self._state.set_epoch(check_int("epoch", epoch, low=0, high=MASK64))
        self._check_precomputed()  # an epoch the table lacks fails here, not in a worker

    def set_loader_batch_size(self, batch_size: int) -> None:
        """Cut worker ranges in whole batches of the loader's ``batch_size`` (per-sample mode),
        so a DataLoader with workers yields exactly ``ceil(len(ds) / batch_size)`` batches
        with at most one short batch per rank (global batches: a divisor of a rank's share).
        :func:`streaming_loader` calls it."""
        if self.batch_size is not None:
            raise ValueError(
                "set_loader_batch_size is for per-sample mode; this dataset yields batches of "
                f"batch_size={self.batch_size} already"
            )
        self._state.set_loader_batch(check_int("batch_size", batch_size, low=1))

    def __len__(self) -> int:
        """Samples (batches, with ``batch_size``) this rank yields in the next pass, over all
        its workers (pads included); for a single worker's state (inside StatefulDataLoader
        workers), the length of the whole pass that state belongs to."""
        return self._state.length()

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe progress of this epoch (see :mod:`nnh_data.order.resume`).

        Raises ``RuntimeError`` in the main process after DataLoader workers iterated this
        dataset: their progress is not visible here, so the state would replay the epoch.
        """
        return self._state.state_dict()

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """Resume from ``state_dict()`` output: the next pass yields the rest of that epoch.
        Every field is checked (``ValueError`` naming it) and must belong to this dataset (shard
        fingerprint, seed, size, ...); ``strict=False`` also loads an older state without a
        fingerprint (the shard list then unchecked, with a warning)."""
        self._state.load_state_dict(state, strict)

    def planned_labels(
        self, states: Sequence[Mapping[str, Any] | None] = (None,)
    ) -> Iterator[dict[str, np.ndarray]]:
        """The labels of what this rank hands out in its pass of the current epoch, computed
        without reading a shard: chunks of ``__index__``, ``__pad__``, ``__source__`` (the
        source's position) and ``__repeat__``, in no particular order (what ``EpochAudit``
        compares with). ``states[k]``: the state worker ``k`` of ``len(states)`` resumes from
        (:func:`~nnh_data.order.resume.loader_states`); ``(None,)``: the whole epoch."""
        for plan in self._state.plans(states):
            yield from self._pipeline.labels(self.epoch, plan)

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
        rows of columns (:func:`~nnh_data.streaming.stages.hand_out_rows`)."""
        # Resolved here, not in the generator: StatefulDataLoader snapshots the state right
        # after iter(), before the first item is requested.
        worker, num_workers = worker_info()
        guard_worker_queue()  # before the worker's first item: what it cannot send is raised
        run, plan = self._state.start(worker, num_workers, self.data_stats.meter(self.cache))
        self._check_precomputed()
        upcoming = None if self.cache is None else self._state.upcoming(worker, num_workers)
        return self._pipeline.items(run, plan, upcoming, rows)

    def _check_precomputed(self) -> None:
        """Fail now when the precomputed table does not cover the next pass."""
        self._pipeline.params.check(self.epoch, self.total_samples)


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
