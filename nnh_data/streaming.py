"""``ShardedStreamingDataset``: every sample once per epoch, equal counts per rank, exact resume.

Design. The epoch order and its split are the pure functions of :mod:`nnh_data.order`: shards
are shuffled, then samples within windows of ``shuffle_window``; the order is cut into one
contiguous range per rank, padded (``uneven="pad"``) or truncated (``"drop"``) to one length,
then into one contiguous range per DataLoader worker (in whole loader batches). A pass of a
worker is the chain of generator stages of :mod:`nnh_data.stages`: plan the read blocks behind
its positions, read them (one block fetched ahead in a thread while the current one is
decoded), assemble each window's rows in the window's permuted order, add the parameters of
``gen_augmentation_params_batch`` once per window, and hand the items out one by one or, with
``batch_size``, in batches of columns, counting them. The dataset object holds the settings,
the epoch (in shared memory, so persistent workers see ``set_epoch``) and the resume state
(:mod:`nnh_data.resume`: a worker yields a prefix of its range, so its progress is one count).
Counting happens when an item is handed to the loader, so prefetched samples are not counted
by a worker's state until the loader yields the batch that holds them.
"""

from __future__ import annotations

import copy
import functools
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch
from fsspec.utils import get_protocol
from torch.utils.data import IterableDataset

from nnh_data import stages
from nnh_data.augment import AugmentationConfig, gen_augmentation_params_batch
from nnh_data.batching import Columns, take
from nnh_data.checks import check_choice, check_int
from nnh_data.order import UNEVEN, EpochOrder, Intervals, base_size, rank_span, worker_plan
from nnh_data.precompute import PrecomputedParams, load_precomputed_params
from nnh_data.readahead import read_ahead
from nnh_data.resume import (
    check_matches,
    check_state,
    make_state,
    merge_states,
    pass_base,
    pass_start,
    state_from_loader,
)
from nnh_data.seeding import MASK64
from nnh_data.shards import (
    ShardError,
    ShardIndex,
    ShardReader,
    StaleIndexError,
    build_shard_index,
    decode_shard_columns,
    decode_shard_range,
    decode_tar_each,
    split_shard_range,
)
from nnh_data.stages import LEFT_OUT, SKIPPED, Progress
from nnh_data.topology import built_on_rank0, dist_info, dist_ready, in_worker_process, worker_info

__all__ = ["ShardedStreamingDataset", "merge_states", "state_from_loader"]

_READ_BYTES = 8 << 20
_ON_ERROR = ("raise", "skip")
_LOCAL_PROTOCOLS = ("file", "local", "memory")
_REMOTE_READAHEAD = 2


def _is_local(index: ShardIndex) -> bool:
    """True when the shards lie on a local or in-memory filesystem (judged by the first)."""
    return not index.shards or get_protocol(index.shards[0].url) in _LOCAL_PROTOCOLS


@dataclass
class _Pass:
    """The layout of the iteration a worker is running, and its progress."""

    epoch: int
    base: Intervals
    world_size: int
    num_workers: int
    worker: int
    progress: Progress = field(default_factory=Progress)


class ShardedStreamingDataset(IterableDataset):
    """An ``IterableDataset`` over tar or Parquet shards, split by samples over ranks and workers.

    Each sample is a dict of its fields plus ``__key__``, ``__shard__`` (URL), ``__index__``
    (global sample id), ``__aug__`` (augmentation parameters keyed by id and epoch) and
    ``__pad__`` (True for the repeats that make ranks equal). ``source`` is anything
    :func:`build_shard_index` takes (URLs, a glob, a brace pattern) or a built ``ShardIndex``.
    ``shuffle_window`` bounds the in-window shuffle (and the decoded samples held in memory);
    ``readahead`` is the number of read blocks fetched ahead in a thread; by default 2 for remote
    filesystems and 0 for local and in-memory ones, where a thread only adds hand-off cost. With
    ``on_error="skip"`` unreadable shards and samples are left out, counted in
    ``error_counts`` (per shard URL, per process) and warned about once per shard; the rank
    then yields fewer than ``len()`` samples; a shard found unreadable while indexing ``source``
    is kept with 0 samples instead (its ``ShardInfo.error`` set). With DataLoader workers, take
    and restore the state through torchdata's ``StatefulDataLoader``: the dataset object in the
    main process does not see its workers' progress.

    With ``batch_size`` the dataset yields batches instead of samples, for
    ``DataLoader(ds, batch_size=None)``: dicts of columns (:mod:`nnh_data.batching`) holding
    ``batch_size`` consecutive samples of the same stream, ``__aug__`` as the columns of
    ``gen_augmentation_params_batch``, ``__index__`` and ``__pad__`` as numpy arrays, Parquet
    numeric columns as numpy arrays and other values as lists. No dict is built per sample,
    so Parquet streams at about the speed of pyarrow itself. Worker ranges are cut in whole
    batches, so ``len()`` is the rank's number of batches whatever ``num_workers``, and a rank
    has at most one short batch (its last). ``decode`` then receives each batch.

    Example:
        >>> ds = ShardedStreamingDataset("data/train-{000000..000009}.tar")  # doctest: +SKIP
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=4)  # doctest: +SKIP
        >>> for epoch in range(3):  # doctest: +SKIP
        ...     ds.set_epoch(epoch)
        ...     for batch in loader: ...
    """

    def __init__(
        self,
        source: str | Sequence[str] | ShardIndex,
        *,
        shuffle: bool = True,
        seed: int = 0,
        epoch: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        aug_config: AugmentationConfig | None = None,
        rank_aware_params: bool = False,
        uneven: str = "pad",
        on_error: str = "raise",
        decode: Callable[[dict], Any] | None = None,
        shuffle_window: int = 1024,
        readahead: int | None = None,
        format: str | None = None,
        storage_options: dict[str, Any] | None = None,
        index_path: str | None = None,
        batch_size: int | None = None,
        precomputed: str | PrecomputedParams | None = None,
    ) -> None:
        self.on_error = check_choice("on_error", on_error, _ON_ERROR)
        self.index = _index_of(source, rank, world_size, format=format, on_error=on_error,
                               storage_options=storage_options, index_path=index_path)  # fmt: skip
        self.rank, self.world_size = dist_info(rank, world_size)
        self.seed = check_int("seed", seed, low=0, high=MASK64)
        epoch = check_int("epoch", epoch, low=0, high=MASK64)
        self.window = check_int("shuffle_window", shuffle_window, low=1) if shuffle else 0
        if readahead is None:
            readahead = 0 if _is_local(self.index) else _REMOTE_READAHEAD
        self.readahead = check_int("readahead", readahead, low=0)
        self.uneven = check_choice("uneven", uneven, UNEVEN)
        self.aug_config = _checked_config(aug_config)
        if decode is not None and not callable(decode):
            raise ValueError(f"decode must be a callable on samples or None, got {decode!r}")
        self.batch_size = None if batch_size is None else check_int("batch_size", batch_size, low=1)
        self.rank_aware_params = bool(rank_aware_params)
        self.decode = decode
        self.storage_options = storage_options
        self._counts = tuple(info.num_samples for info in self.index.shards)
        self._starts = np.concatenate(([0], np.cumsum(self._counts, dtype=np.int64)))
        self._nullable = sorted({name for info in self.index.shards for name in info.nullable})
        self._fingerprint = self.index.fingerprint()
        self._shard_number = {info.url: i for i, info in enumerate(self.index.shards)}
        # Shared with DataLoader workers (fork and spawn pass shared-memory tensors by handle):
        # the epoch, a flag set while workers iterate, and the samples skipped per shard.
        self._shared = torch.zeros(2 + len(self._counts), dtype=torch.int64).share_memory_()
        self._shared[0] = epoch
        self._warned: set[str] = set()
        self._loader_batch = 1
        self._order: EpochOrder | None = None
        self._pending: dict | None = None
        self._pass: _Pass | None = None
        if isinstance(precomputed, (str, os.PathLike)):
            precomputed = load_precomputed_params(precomputed)
        self._precomputed = precomputed
        self._check_precomputed()
        self._param_columns(np.zeros(0, np.int64))  # validates the parameter settings now

    # ------------------------------------------------------------------ epoch, length, state

    @property
    def total_samples(self) -> int:
        """Samples in one epoch over all ranks (pads not counted)."""
        return self.index.total_samples

    @property
    def epoch(self) -> int:
        """The epoch the next pass iterates (shared with the DataLoader workers)."""
        return int(self._shared[0])

    @property
    def error_counts(self) -> dict[str, int]:
        """Samples skipped as unreadable per shard URL, by this process and its DataLoader
        workers (``on_error="skip"``)."""
        counts = self._shared[2:].tolist()
        return {info.url: n for info, n in zip(self.index.shards, counts) if n}

    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch ``epoch`` next, also in persistent DataLoader workers; a new epoch
        starts from its beginning (a resume state loaded for this same epoch is kept)."""
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
        """What a state records of this dataset (:data:`nnh_data.resume.SETTING_KEYS`)."""
        return {"seed": self.seed, "total": self.total_samples, "window": self.window,
                "uneven": self.uneven, "shards": self._fingerprint,
                "batch_size": self.batch_size, "unit": self._unit}  # fmt: skip

    def __len__(self) -> int:
        """Samples (batches, with ``batch_size``) this rank yields in the next pass, over all
        its workers (pads included).

        For a single worker's state (inside StatefulDataLoader workers) this is the length of
        the whole pass that state belongs to.
        """
        base = pass_base(self._pending, self.total_samples, self.uneven)
        length = rank_span(base_size(base), self.world_size, self.rank, self.uneven).length
        return length if self.batch_size is None else -(-length // self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe progress of this epoch (see :mod:`nnh_data.resume`).

        Raises ``RuntimeError`` in the main process after DataLoader workers iterated this
        dataset: their progress is not visible here, so the state would replay the epoch.
        """
        if self._pending is not None:
            return copy.deepcopy(self._pending)
        if int(self._shared[1]) and not in_worker_process():
            raise RuntimeError(
                "DataLoader workers iterated this dataset, and the dataset object in the main "
                "process does not see their progress: take the state from the loader instead, "
                "`loader.state_dict()` of torchdata's StatefulDataLoader (what "
                "nnh_data.streaming_loader returns), and resume with loader.load_state_dict()"
            )
        run = self._pass
        if run is None or run.epoch != self.epoch:
            run = _Pass(self.epoch, [(0, self.total_samples)], self.world_size, 1, 0)
        return make_state(self._settings, epoch=run.epoch, base=run.base,
                          world_size=run.world_size, num_workers=run.num_workers,
                          worker=run.worker, handed_out=run.progress.handed_out())  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()`` output: the next pass yields the rest of that epoch."""
        state = check_state(state)
        check_matches(state, self._settings)
        self._shared[0], self._shared[1] = state["epoch"], 0
        self._pending, self._pass = state, None

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        # Resolved here, not in the generator: StatefulDataLoader snapshots the state right
        # after iter(), before the first item is requested.
        worker, num_workers = worker_info()
        self._shared[1] = int(in_worker_process())
        state, self._pending = self._pending, None
        if state is not None and state["epoch"] != self.epoch:
            state = None  # set_epoch moved on (seen by a persistent worker)
        base, consumed = pass_start(
            state, total=self.total_samples, uneven=self.uneven, world_size=self.world_size,
            num_workers=num_workers, worker=worker, unit=self._unit,
        )  # fmt: skip
        run = self._pass = _Pass(self.epoch, base, self.world_size, num_workers, worker)
        run.progress.consumed = consumed
        plan = worker_plan(base, self.world_size, self.rank, num_workers, worker, self.uneven,
                           consumed, self._unit)  # fmt: skip
        self._check_precomputed()
        if self._order is None or self._order.epoch != self.epoch:
            self._order = EpochOrder(self._counts, self.seed, self.epoch, self.window)
        parts = stages.with_parameters(self._parts(self._order, plan), self._param_columns)
        if self.batch_size is None:
            return stages.hand_out_samples(parts, run.progress, self._finish, self._skipped)
        return stages.hand_out_batches(parts, self.batch_size, run.progress, self._finish)

    def _parts(self, order: EpochOrder, plan) -> Iterator[stages.Part]:
        """Plan, read and assemble: the worker's rows in hand-out order, window by window."""
        rows = stages.SAMPLES if self.batch_size is None else stages.COLUMNS
        reader = ShardReader(self.storage_options, self._nullable)
        blocks = chain(
            stages.read_plan(order, plan.positions, self.window, self._split),
            stages.pad_plan(order, plan.pads),
        )
        fetched = read_ahead(functools.partial(self._fetch, reader), blocks, self.readahead)
        decoded = ((b[3], self._rows_of(b, payload, rows)) for b, payload in fetched)
        return stages.assemble(decoded, order, plan.positions, self.window, len(plan.pads), rows)

    def _split(self, shard: int, start: int, stop: int) -> list[tuple[int, int]]:
        return split_shard_range(self.index.shards[shard], start, stop, max_bytes=_READ_BYTES)

    def _fetch(self, reader: ShardReader, block: stages.Block) -> object:
        """Read one block; a ``ShardError`` is returned, to be handled where it is decoded."""
        shard, start, stop, _ = block
        try:
            return reader.fetch(self.index.shards[shard], start, stop)
        except ShardError as exc:
            return exc

    def _rows_of(self, block: stages.Block, payload: object, rows: stages.Rows) -> Any:
        """The rows of a block (unreadable samples as ``None`` rows), ``__shard__`` set."""
        shard, start, stop, _ = block
        info = self.index.shards[shard]
        try:
            if isinstance(payload, ShardError):
                raise payload
            if rows is stages.SAMPLES:
                out = list(decode_shard_range(info, payload, start, stop))
            else:
                out = decode_shard_columns(info, payload, start, stop)
        except ShardError as exc:
            out = rows.from_samples(self._salvaged(info, payload, start, stop, exc))
        return rows.label(out, "__shard__", info.url)

    def _salvaged(self, info, payload: object, start: int, stop: int, exc: ShardError) -> list:
        """The samples of an unreadable block that can be read one at a time (``None`` for
        the others), or ``exc`` raised (``on_error="raise"``, a stale index)."""
        if not isinstance(payload, bytes) or isinstance(exc, StaleIndexError):
            self._skip(exc)
            return [None] * (stop - start)
        if self.on_error == "raise":
            raise exc
        samples = decode_tar_each(info, payload, start, stop)
        for item in samples:
            if isinstance(item, ShardError):
                self._skip(item)
        return [None if isinstance(s, ShardError) else s for s in samples]

    def _finish(self, item: Any) -> Any:
        """The item (a sample or a batch) as handed out: rows skipped as unreadable dropped,
        ``decode`` applied, its errors named by shard and key; ``LEFT_OUT`` when nothing is
        left or ``decode`` raised and ``on_error="skip"`` left it out."""
        if self.batch_size is not None and (item := self._readable(item)) is LEFT_OUT:
            return LEFT_OUT
        if self.decode is None:
            return item
        try:
            return self.decode(item)
        except Exception as exc:
            shards, keys = item["__shard__"], item["__key__"]
            url, key = (shards, keys) if isinstance(keys, str) else (shards[0], keys[0])
            error = ShardError(url, f"sample {key!r}", f"decode raised {exc!r}")
            if self.on_error == "raise":
                raise error from exc
            self._skip(error)
            for shard in [shards] if isinstance(keys, str) else shards:
                self._count_skipped(shard)
            return LEFT_OUT

    def _readable(self, batch: Columns) -> Any:
        """``batch`` without the rows flagged unreadable (counted now), or ``LEFT_OUT``."""
        flags = batch.pop(SKIPPED, None)
        if flags is None:
            return batch
        for flag, url in zip(flags, batch["__shard__"]):
            if flag:
                self._count_skipped(url)
        keep = [i for i, flag in enumerate(flags) if not flag]
        return take(batch, np.array(keep, dtype=np.int64)) if keep else LEFT_OUT

    def _skipped(self, label: dict) -> None:
        """Count an unreadable sample as it comes to be handed out."""
        shard = int(np.searchsorted(self._starts, label["__index__"], "right")) - 1
        self._shared[2 + shard] += 1

    def _skip(self, exc: ShardError) -> None:
        """Raise ``exc``, or (``on_error="skip"``) warn once per shard: the samples are left
        out, and counted when their turn to be handed out comes (another worker may read the
        same block for other samples)."""
        if self.on_error == "raise" or isinstance(exc, StaleIndexError):
            raise exc
        if exc.url not in self._warned:
            self._warned.add(exc.url)
            warnings.warn(f"skipping unreadable samples: {exc}", stacklevel=2)

    def _count_skipped(self, url: str) -> None:
        self._shared[2 + self._shard_number[url]] += 1

    def _param_columns(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """The parameters of ``ids`` as columns, ``seed`` as int64 (its 64 bits, signed: what
        tensors hold and ``apply_augmentation`` takes)."""
        rank = self.rank if self.rank_aware_params else None
        if self._precomputed is not None:
            cols = self._precomputed.batch(ids, self.epoch, rank)
        elif rank is None:
            cols = gen_augmentation_params_batch(
                ids, config=self.aug_config, base_seed=self.seed, epoch=self.epoch,
                rank_aware=False,
            )  # fmt: skip
        else:
            cols = gen_augmentation_params_batch(
                ids, rank, self.world_size, self.aug_config, self.seed, self.epoch
            )
        cols["seed"] = cols["seed"].view(np.int64)
        return cols

    def _check_precomputed(self) -> None:
        """Fail now when the precomputed table does not cover the next pass."""
        if self._precomputed is not None:
            self._precomputed.check_covers(self.aug_config, self.seed, self.epoch,
                                           self.total_samples, self.rank_aware_params,
                                           self.world_size)  # fmt: skip


def _index_of(
    source: str | Sequence[str] | ShardIndex, rank: int | None, world_size: int | None, **kw: Any
) -> ShardIndex:
    """``source`` as an index: built here, or on rank 0 and broadcast under a process group
    (when rank and world size are not given)."""
    if isinstance(source, ShardIndex):
        return source
    build = functools.partial(build_shard_index, source, **kw)
    shared = rank is None and world_size is None and dist_ready()
    return built_on_rank0(build) if shared else build()


def _checked_config(config: AugmentationConfig | None) -> AugmentationConfig | None:
    if config is not None and not isinstance(config, AugmentationConfig):
        got = type(config).__name__
        raise ValueError(f"aug_config must be an AugmentationConfig or None, got {got}")
    return config
