"""``ShardedStreamingDataset``: every sample once per epoch, equal counts per rank, exact resume.

Design. The epoch order and its split are the pure functions of :mod:`nnh_data.order`: shards
are shuffled, then samples within windows of ``shuffle_window``; the order is cut into one
contiguous range per rank (``DistributedRangeSplitter``), padded (``uneven="pad"``) or truncated
(``"drop"``) to one length, then into one contiguous range per DataLoader worker. A worker reads
the concat range behind its positions sequentially in blocks (:func:`split_shard_range`), one
block fetched ahead in a thread while the current one is decoded, and emits each window's samples
in the window's permuted order, with parameters from ``gen_augmentation_params_batch`` computed
once per window. With ``batch_size`` the same stream is cut into batches of columns, and
worker ranges are cut in whole batches (``unit`` of :func:`nnh_data.order.worker_plan`).

Resume. A worker yields a prefix of its range, so what a rank's loader handed out is described
by one count per worker, and under DDP every rank has the same counts (same step count, same
layout). The state is ``{"version", "epoch", "seed", "total", "window", "uneven", "base",
"world_size", "num_workers", "batch_size", "consumed"}``: ``base`` is the list of
epoch-position intervals the pass walks (the whole epoch unless it was resumed) and
``consumed[k]`` the samples worker ``k`` handed out (in whole batches with ``batch_size``).
Inside a DataLoader worker the dataset only knows its own count (the others are ``None``); that
state resumes the same worker of the same layout, which is exactly what torchdata's
``StatefulDataLoader`` does with it. A state with every count (``num_workers=0``, or merged with
:func:`merge_states` / :func:`state_from_loader`) resumes with any world size and worker count:
the samples left over (:func:`nnh_data.order.remaining`) become the new base, split again.
Counting happens when a sample is handed to the loader, so prefetched samples are not counted
by a worker's state until the loader yields the batch that holds them.
"""

from __future__ import annotations

import copy
import functools
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch
from fsspec.utils import get_protocol
from torch.utils.data import IterableDataset

from nnh_data import batching
from nnh_data.augment import AugmentationConfig, gen_augmentation_params_batch
from nnh_data.batching import Columns
from nnh_data.checks import check_choice, check_int
from nnh_data.order import (
    UNEVEN,
    EpochOrder,
    Intervals,
    base_size,
    coalesce,
    rank_span,
    remaining,
    worker_plan,
)
from nnh_data.precompute import PrecomputedParams, load_precomputed_params
from nnh_data.readahead import read_ahead
from nnh_data.seeding import MASK64
from nnh_data.shards import (
    ShardError,
    ShardIndex,
    StaleIndexError,
    build_shard_index,
    decode_shard_columns,
    decode_shard_range,
    decode_tar_each,
    fetch_shard_range,
    forget_open_files,
    split_shard_range,
)
from nnh_data.topology import built_on_rank0, dist_info, dist_ready, in_worker_process, worker_info

__all__ = ["ShardedStreamingDataset", "merge_states", "state_from_loader"]

STATE_VERSION = 1
_READ_BYTES = 8 << 20
_GROUP = 1024  # samples emitted per group without shuffle
_DONE = object()  # end marker of _picked
_ON_ERROR = ("raise", "skip")
_LOCAL_PROTOCOLS = ("file", "local", "memory")
_REMOTE_READAHEAD = 2
_LAYOUT_KEYS = (
    "version", "epoch", "seed", "total", "window", "uneven", "base", "world_size", "batch_size",
    "unit", "shards",
)  # fmt: skip
_SHARDS_HINT = (
    " (a fingerprint of the shard names and sample counts, which define the order and the "
    "ids): resume with the same shards, in the same order, with the same contents"
)
_SKIPPED = "__skipped__"  # column of the rows of unreadable blocks, in batch mode


def _is_local(index: ShardIndex) -> bool:
    """True when the shards lie on a local or in-memory filesystem (judged by the first)."""
    return not index.shards or get_protocol(index.shards[0].url) in _LOCAL_PROTOCOLS


@dataclass
class _Pass:
    """The layout and progress of the iteration a worker is running.

    A window's samples are handed out from a stack (:func:`_picked`), so the count is the items
    before the window plus those popped off its stack: no bookkeeping per sample.
    """

    epoch: int
    base: Intervals
    world_size: int
    num_workers: int
    worker: int
    consumed: int  # items handed out before the current window
    stack: list = field(default_factory=list)
    window: int = 0  # items of the current window

    def start_window(self, stack: list) -> None:
        """Count the current window as handed out; ``stack`` (from ``_picked``) is the next."""
        self.consumed = self.handed_out()
        self.stack, self.window = stack, max(0, len(stack) - 1)

    def handed_out(self) -> int:
        """Items handed out so far in this pass (a resumed count included)."""
        return self.consumed + self.window - max(0, len(self.stack) - 1)


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
        if isinstance(source, ShardIndex):
            self.index = source
        else:
            build = functools.partial(
                build_shard_index, source, format=format, storage_options=storage_options,
                index_path=index_path, on_error=on_error,
            )  # fmt: skip
            shared = rank is None and world_size is None and dist_ready()
            self.index = built_on_rank0(build) if shared else build()
        self.rank, self.world_size = dist_info(rank, world_size)
        self.seed = check_int("seed", seed, low=0, high=MASK64)
        epoch = check_int("epoch", epoch, low=0, high=MASK64)
        self.window = check_int("shuffle_window", shuffle_window, low=1) if shuffle else 0
        if readahead is None:
            readahead = 0 if _is_local(self.index) else _REMOTE_READAHEAD
        self.readahead = check_int("readahead", readahead, low=0)
        self.uneven = check_choice("uneven", uneven, UNEVEN)
        if aug_config is not None and not isinstance(aug_config, AugmentationConfig):
            got = type(aug_config).__name__
            raise ValueError(f"aug_config must be an AugmentationConfig or None, got {got}")
        if decode is not None and not callable(decode):
            raise ValueError(f"decode must be a callable on samples or None, got {decode!r}")
        self.aug_config = aug_config
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
        if precomputed is not None:
            precomputed.check_covers(*self._precomputed_settings())
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
        if self._precomputed is not None:  # an epoch the table lacks fails here, not in a worker
            self._precomputed.check_covers(*self._precomputed_settings())

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

    def __len__(self) -> int:
        """Samples (batches, with ``batch_size``) this rank yields in the next pass, over all
        its workers (pads included).

        For a single worker's state (inside StatefulDataLoader workers) this is the length of
        the whole pass that state belongs to.
        """
        state = self._pending
        if state is not None and None in state["consumed"]:
            base = [tuple(i) for i in state["base"]]
        else:
            base = self._next_base(state)
        length = rank_span(base_size(base), self.world_size, self.rank, self.uneven).length
        return length if self.batch_size is None else -(-length // self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe progress of this epoch (see the module docstring).

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
            run = _Pass(self.epoch, [(0, self.total_samples)], self.world_size, 1, 0, 0)
        consumed: list[int | None] = [None] * run.num_workers
        consumed[run.worker] = run.handed_out()
        return {
            "version": STATE_VERSION,
            "epoch": run.epoch,
            "seed": self.seed,
            "total": self.total_samples,
            "window": self.window,
            "uneven": self.uneven,
            "base": [list(i) for i in run.base],
            "world_size": run.world_size,
            "num_workers": run.num_workers,
            "batch_size": self.batch_size,
            "unit": self._unit,
            "shards": self._fingerprint,
            "consumed": consumed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()`` output: the next pass yields the rest of that epoch."""
        state = _checked_state(state)
        mine = {"seed": self.seed, "total": self.total_samples, "window": self.window,
                "uneven": self.uneven, "shards": self._fingerprint}  # fmt: skip
        for key, value in mine.items():
            if key == "shards" and state[key] is None:
                warnings.warn("state has no shard fingerprint: not checked", stacklevel=2)
            elif state[key] != value:
                raise ValueError(
                    f"state[{key!r}] is {state[key]!r} but this dataset has {value!r}"
                    + (_SHARDS_HINT if key == "shards" else "")
                )
        self._shared[0], self._shared[1] = state["epoch"], 0
        self._pending, self._pass = state, None

    def _next_base(self, state: dict | None) -> Intervals:
        """Positions a pass walks after a state with every worker's count (or from scratch)."""
        if state is None:
            return [(0, self.total_samples)]
        base = [tuple(i) for i in state["base"]]
        layout = (state["world_size"], state["num_workers"], self.uneven)
        return remaining(base, *layout, state["consumed"], state["unit"])

    def _start_pass(self, worker: int, num_workers: int) -> _Pass:
        """The pass of this worker: the pending state (if any) resolved, then forgotten."""
        state, self._pending = self._pending, None
        if state is not None and state["epoch"] != self.epoch:
            state = None  # set_epoch moved on (seen by a persistent worker)
        if state is None or None not in state["consumed"]:
            return _Pass(
                self.epoch, self._next_base(state), self.world_size, num_workers, worker, 0
            )
        layout = (state["world_size"], state["num_workers"], state["unit"])
        if layout != (self.world_size, num_workers, self._unit) or (
            state["consumed"][worker] is None
        ):
            raise ValueError(
                "this state holds the progress of one DataLoader worker of world_size="
                f"{layout[0]}, num_workers={layout[1]}, batch_size={layout[2]}; it cannot resume "
                f"worker {worker} of world_size={self.world_size}, num_workers={num_workers}, "
                f"batch_size={self._unit}: merge the workers' states with merge_states() "
                "or state_from_loader() to change the layout"
            )
        base = [tuple(i) for i in state["base"]]
        consumed = state["consumed"][worker]
        return _Pass(self.epoch, base, self.world_size, num_workers, worker, consumed)

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[dict]:
        # Resolved here, not in the generator: StatefulDataLoader snapshots the state right
        # after iter(), before the first sample is requested.
        worker, num_workers = worker_info()
        self._shared[1] = int(in_worker_process())
        forget_open_files()
        run = self._pass = self._start_pass(worker, num_workers)
        layout = (run.base, run.world_size, self.rank, num_workers, worker, self.uneven)
        plan = worker_plan(*layout, run.consumed, self._unit)
        if self._precomputed is not None:
            self._precomputed.check_covers(*self._precomputed_settings())
        if self._order is None or self._order.epoch != self.epoch:
            self._order = EpochOrder(self._counts, self.seed, self.epoch, self.window)
        walk = self._samples if self.batch_size is None else self._batches
        return walk(self._order, run, plan.positions, plan.pads)

    def _taken(
        self, order: EpochOrder, cursor: _Cursor, positions: Intervals
    ) -> Iterator[tuple[Any, np.ndarray]]:
        """Per window of ``positions``: the rows of the concat range it covers, and the concat
        positions in epoch order."""
        for group in _groups(positions, self.window or _GROUP):
            concat = order.concat_positions(group)
            yield cursor.take(int(concat.min()), int(concat.max()) + 1), concat

    def _samples(self, order: EpochOrder, run: _Pass, positions: Intervals, pads: list[int]):
        blocks = read_ahead(self._fetch, self._blocks(order, positions), self.readahead)
        cursor = _Cursor(((b[3], self._decoded(b, payload)) for b, payload in blocks), len)
        decoded = None if self.decode is None else self._decode_item
        for taken, concat in self._taken(order, cursor, positions):
            stack = _picked(taken, (concat - concat.min()).tolist())
            del taken  # the stack holds the samples now, and lets go of each as it is handed out
            run.start_window(stack)
            ids = order.ids_at_concat(concat)
            for sample, gid, aug in zip(iter(stack.pop, _DONE), ids.tolist(), self._params(ids)):
                if sample is None:
                    self._count_skipped(int(np.searchsorted(self._starts, gid, "right")) - 1)
                    continue
                sample["__index__"] = gid
                sample["__aug__"] = aug
                if decoded is None:
                    yield sample
                elif (sample := decoded(sample)) is not _DONE:
                    yield sample
        run.start_window([])
        for position in pads:
            sample = self._pad(order, position)
            run.consumed += 1
            if sample is not None and decoded is not None:
                sample = decoded(sample)
            if sample is not None and sample is not _DONE:
                yield sample

    def _decode_item(self, item: Any) -> Any:
        """``decode(item)`` (a sample or a batch), its errors named by shard and key; ``_DONE``
        when it raised and ``on_error="skip"`` left the item out."""
        try:
            return self.decode(item)
        except Exception as exc:
            shards, keys = item["__shard__"], item["__key__"]
            url, key = (shards, keys) if isinstance(keys, str) else (shards[0], keys[0])
            error = ShardError(url, f"sample {key!r}", f"decode raised {exc!r}")
            if self.on_error == "raise":
                raise error from exc
            self._skip(error)
            self._count_skipped(self._shard_number[url], 1 if isinstance(keys, str) else len(keys))
            return _DONE

    def _pad(self, order: EpochOrder, position: int) -> dict | None:
        block = _pad_block(order, position)
        (sample,) = self._decoded(block, self._fetch(block))
        if sample is not None:
            ids = order.ids_at_concat(np.array([block[3]]))
            sample.update(__index__=int(ids[0]), __aug__=next(self._params(ids)), __pad__=True)
        return sample

    def _batches(self, order: EpochOrder, run: _Pass, positions: Intervals, pads: list[int]):
        """Batches of ``batch_size`` consecutive items of this worker (the last may be short)."""
        size, pending, count = self.batch_size, [], 0
        for part in self._parts(order, positions, pads):
            pending.append(part)
            count += batching.num_rows(part)
            if count < size:
                continue
            rows, start = batching.concat(pending), 0
            while count - start >= size:
                batch = self._finished(batching.cut(rows, start, start + size))
                start += size
                run.consumed += size
                if batch is not None:
                    yield batch
            pending = [batching.cut(rows, start, count)] if start < count else []
            count -= start
        if count:
            batch = self._finished(batching.concat(pending))
            run.consumed += count
            if batch is not None:
                yield batch

    def _parts(self, order: EpochOrder, positions: Intervals, pads: list[int]) -> Iterator[Columns]:
        """This worker's items in order as columns: one part per window, then one per pad."""
        blocks = read_ahead(self._fetch, self._blocks(order, positions), self.readahead)
        columns = ((b[3], self._columns(b, payload)) for b, payload in blocks)
        cursor = _Cursor(columns, batching.num_rows, batching.cut, batching.concat)
        for rows, concat in self._taken(order, cursor, positions):
            yield batching.take(rows, concat - concat.min())
        for position in pads:
            yield self._pad_columns(order, position)

    def _finished(self, batch: Columns) -> Any:
        """A batch with the rows skipped as unreadable dropped, decoded; ``None`` when every
        row was skipped."""
        skipped = batch.pop(_SKIPPED, None)
        if skipped is not None:
            for flag, url in zip(skipped, batch["__shard__"]):
                if flag:
                    self._count_skipped(self._shard_number[url])
            keep = [i for i, flag in enumerate(skipped) if not flag]
            if not keep:
                return None
            batch = batching.take(batch, np.array(keep, dtype=np.int64))
        if self.decode is None:
            return batch
        batch = self._decode_item(batch)
        return None if batch is _DONE else batch

    def _columns(self, block: tuple[int, int, int, int], payload: object) -> Columns:
        """The samples of a block as columns, metadata set (``_SKIPPED`` if unreadable)."""
        shard, start, stop, _ = block
        info = self.index.shards[shard]
        try:
            if isinstance(payload, ShardError):
                raise payload
            cols = decode_shard_columns(info, payload, start, stop)
        except ShardError as exc:
            self._skip(exc)
            cols = {_SKIPPED: [True] * (stop - start)}
        cols["__shard__"] = [info.url] * (stop - start)
        cols["__index__"] = np.arange(start, stop, dtype=np.int64) + self._starts[shard]
        cols["__pad__"] = np.zeros(stop - start, dtype=bool)
        cols["__aug__"] = self._param_columns(cols["__index__"])
        return cols

    def _pad_columns(self, order: EpochOrder, position: int) -> Columns:
        block = _pad_block(order, position)
        cols = self._columns(block, self._fetch(block))
        cols["__pad__"][:] = True
        return cols

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

    def _params(self, ids: np.ndarray) -> Iterator[dict]:
        """Per-sample ``__aug__`` dicts of ``ids`` (the values of :meth:`_param_columns`)."""
        cols = self._param_columns(ids)
        return iter(batching.rows_of(list(cols), [c.tolist() for c in cols.values()]))

    def _precomputed_settings(self) -> tuple:
        """What :meth:`PrecomputedParams.check_covers` checks for the next pass."""
        return (self.aug_config, self.seed, self.epoch, self.total_samples,
                self.rank_aware_params, self.world_size)  # fmt: skip

    def _blocks(
        self, order: EpochOrder, positions: Intervals
    ) -> Iterator[tuple[int, int, int, int]]:
        """``(shard, start, stop, concat start)`` read blocks that cover ``positions``: the
        windows they touch, read in order in pieces of at most ``_READ_BYTES``."""
        size, total = self.window or 1, self.total_samples
        spans = coalesce(
            [(a // size * size, min(-(-b // size) * size, total)) for a, b in positions]
        )
        for lo, hi in spans:
            for shard, start, stop in order.pieces(lo, hi):
                info = self.index.shards[shard]
                for a, b in split_shard_range(info, start, stop, max_bytes=_READ_BYTES):
                    yield shard, a, b, lo + (a - start)
                lo += stop - start

    def _fetch(self, block: tuple[int, int, int, int]) -> object:
        """Read one block; a ``ShardError`` is returned, to be handled where it is decoded."""
        shard, start, stop, _ = block
        try:
            info = self.index.shards[shard]
            return fetch_shard_range(
                info, start, stop, storage_options=self.storage_options, nullable=self._nullable
            )
        except ShardError as exc:
            return exc

    def _decoded(self, block: tuple[int, int, int, int], payload: object) -> list[dict | None]:
        """The samples of a block (``None`` for those skipped as unreadable), ``__shard__`` and
        ``__pad__`` set."""
        shard, start, stop, _ = block
        info = self.index.shards[shard]
        constants = {"__shard__": info.url, "__pad__": False}
        try:
            if isinstance(payload, ShardError):
                raise payload
            return list(decode_shard_range(info, payload, start, stop, constants))
        except ShardError as exc:
            if not isinstance(payload, bytes) or isinstance(exc, StaleIndexError):
                self._skip(exc)
                return [None] * (stop - start)
            if self.on_error == "raise":
                raise
        samples: list[dict | None] = []
        for item in decode_tar_each(info, payload, start, stop):  # drop only the bad samples
            if isinstance(item, ShardError):
                self._skip(item)
                samples.append(None)
            else:
                samples.append({**item, **constants})
        return samples

    def _skip(self, exc: ShardError) -> None:
        """Raise ``exc``, or (``on_error="skip"``) warn once per shard: the samples are left
        out, and counted when their turn to be handed out comes (another worker may read the
        same block for other samples)."""
        if self.on_error == "raise" or isinstance(exc, StaleIndexError):
            raise exc
        if exc.url not in self._warned:
            self._warned.add(exc.url)
            warnings.warn(f"skipping unreadable samples: {exc}", stacklevel=2)

    def _count_skipped(self, shard: int, count: int = 1) -> None:
        self._shared[2 + shard] += count


def _pad_block(order: EpochOrder, position: int) -> tuple[int, int, int, int]:
    """The one-sample read block of the sample at epoch ``position``."""
    concat = int(order.concat_positions(np.array([position]))[0])
    ((shard, start, stop),) = order.pieces(concat, concat + 1)
    return shard, start, stop, concat


def _groups(positions: Intervals, size: int) -> Iterator[np.ndarray]:
    """Sorted ``positions`` cut at multiples of ``size``: one array per window they touch."""
    pending: list[np.ndarray] = []
    window = -1
    for a, b in positions:
        while a < b:
            w = a // size
            end = min(b, (w + 1) * size)
            if w != window and pending:
                yield np.concatenate(pending)
                pending = []
            window = w
            pending.append(np.arange(a, end, dtype=np.int64))
            a = end
    if pending:
        yield np.concatenate(pending)


def _picked(samples: list, indices: list[int]) -> list:
    """``samples[i] for i in indices`` as a stack over ``_DONE``, to hand out with
    ``iter(stack.pop, _DONE)``: each sample is let go of as it is handed out, so the memory of
    consumed samples is reused while it is still in cache."""
    stack = [_DONE]
    stack += map(samples.__getitem__, reversed(indices))
    return stack


class _Cursor:
    """The rows of a stream of ``(concat start, rows)`` blocks, taken by increasing concat
    ranges and let go of once taken. ``rows`` is a list of samples, or anything with a
    ``size(rows)``, a ``cut(rows, start, stop)`` and a ``join(list of rows)``."""

    def __init__(
        self,
        blocks: Iterator[tuple[int, Any]],
        size: Callable[[Any], int],
        cut: Callable[[Any, int, int], Any] = lambda rows, a, b: rows[a:b],
        join: Callable[[list], Any] = lambda pieces: list(chain.from_iterable(pieces)),
    ) -> None:
        self._blocks = blocks
        self._size, self._cut, self._join = size, cut, join
        self._lo = self._len = 0
        self._rows: Any = []

    def take(self, lo: int, hi: int) -> Any:
        pieces = []
        while lo < hi:
            if lo >= self._lo + self._len:
                self._lo, self._rows = next(self._blocks)
                self._len = self._size(self._rows)
                continue
            assert lo >= self._lo, "read blocks must follow the windows in order"
            stop = min(hi, self._lo + self._len)
            pieces.append(self._cut(self._rows, lo - self._lo, stop - self._lo))
            lo = stop
        self._rows = self._cut(self._rows, lo - self._lo, self._len)
        self._len -= lo - self._lo
        self._lo = lo
        return pieces[0] if len(pieces) == 1 else self._join(pieces)


def _checked_state(state: Mapping[str, Any]) -> dict:
    """A deep copy of ``state`` after checking its shape (ValueError naming what is wrong)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"state must be a dict from state_dict(), got {type(state).__name__}")
    state = copy.deepcopy(dict(state))
    state.setdefault("batch_size", None)  # states of older per-sample passes leave it out
    state.setdefault("unit", state["batch_size"] or 1)
    state.setdefault("shards", None)  # older states: no fingerprint to check
    missing = [k for k in (*_LAYOUT_KEYS, "num_workers", "consumed") if k not in state]
    if missing:
        raise ValueError(f"state must hold the keys of state_dict(); missing {missing}")
    if state["version"] != STATE_VERSION:
        raise ValueError(f"state['version'] must be {STATE_VERSION}, got {state['version']!r}")
    if state["batch_size"] is not None:
        check_int("state['batch_size']", state["batch_size"], low=1)
    num_workers = check_int("state['num_workers']", state["num_workers"], low=1)
    consumed = state["consumed"]
    if (
        not isinstance(consumed, list)
        or len(consumed) != num_workers
        or consumed == [None] * num_workers
    ):
        raise ValueError(
            f"state['consumed'] must be a list of {num_workers} counts (None for unknown ones, "
            f"not all), got {consumed!r}"
        )
    return state


def merge_states(states: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One state with every worker's count, from the states of one rank's DataLoader workers.

    Load it into a new dataset to resume with another world size or number of workers.

    Example:
        >>> a = {"version": 1, "epoch": 0, "seed": 0, "total": 8, "window": 4, "uneven": "pad",
        ...      "base": [[0, 8]], "world_size": 1, "num_workers": 2, "consumed": [3, None]}
        >>> merge_states([a, {**a, "consumed": [None, 1]}])["consumed"]
        [3, 1]
    """
    checked = [_checked_state(s) for s in states]
    if not checked:
        raise ValueError("states must hold at least one state, got none")
    merged = checked[0]
    for other in checked[1:]:
        for key in (*_LAYOUT_KEYS, "num_workers"):
            if other[key] != merged[key]:
                raise ValueError(f"states differ in {key!r}: {merged[key]!r} vs {other[key]!r}")
        for k, count in enumerate(other["consumed"]):
            if count is not None and merged["consumed"][k] not in (None, count):
                raise ValueError(
                    f"states disagree on worker {k}: {merged['consumed'][k]} vs {count}"
                )
            merged["consumed"][k] = count if count is not None else merged["consumed"][k]
    missing = [k for k, count in enumerate(merged["consumed"]) if count is None]
    if missing:
        raise ValueError(f"states must cover every worker; no count for workers {missing}")
    return merged


def state_from_loader(loader_state: Mapping[str, Any]) -> dict[str, Any]:
    """The dataset state inside a torchdata ``StatefulDataLoader.state_dict()``, its workers
    merged (see :func:`merge_states`).

    Example:
        >>> state = state_from_loader(loader.state_dict())  # doctest: +SKIP
        >>> new_ds.load_state_dict(state)  # any world size / num_workers  # doctest: +SKIP
    """
    if "_snapshot" not in loader_state:  # num_workers=0
        return merge_states([loader_state["dataset_state"]])
    if loader_state["_steps_since_snapshot"]:
        raise ValueError(
            "loader_state was taken between snapshots; create the StatefulDataLoader with "
            "snapshot_every_n_steps=1 (the default)"
        )
    workers = loader_state["_snapshot"]["_worker_snapshots"].values()
    return merge_states(w["dataset_state"] for w in workers)
