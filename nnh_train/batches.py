"""The handler's loaders and batches: building a loader, walking an epoch, reading a batch.

Design. :class:`~nnh_train.NNHandler` sees data through the functions here, so its loop reads
the same whatever the loader is: a map-style dataset gets a distributed or rank-cached loader
(:func:`make_loader`), a ``ShardedStreamingDataset`` its ``StatefulDataLoader``, a user's
``DataLoader`` is kept. An epoch is walked as ``(batch, size, pad mask)`` triples
(:func:`counted`), grouped for gradient accumulation with the time spent waiting for them
(:func:`groups`, :class:`EpochClock`); a mid-epoch resume starts from the loader's saved state,
a stream state merged over workers, or a replay of the sampler's indices that reads none of the
skipped samples (:func:`resumed`). Batches are ``(inputs, target, ...)`` sequences, dicts or
single tensors, and every function that looks into one (:func:`batch_size_of`,
:func:`split_batch`, :func:`to_device`, :func:`select_rows`) handles the three the same way.
The trade-off: pads are told by position in the rank's epoch order, which only a
``DistributedSampler`` or the rank cache says; any other loader marks its pads itself, with a
``__pad__`` field.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from nnh_data.checks import check_int
from nnh_data.loaders import (
    RankCache,
    SharedEpochDataset,
    create_distributed_loader,
    create_rank_cached_dataloader,
)
from nnh_data.streaming import ShardedStreamingDataset, streaming_dataset_of
from nnh_data.streaming.loader import streaming_loader
from nnh_data.streaming.stats import sum_over_ranks
from nnh_data.workers.signals import shielded_worker_init

__all__ = [
    "Counted",
    "EpochClock",
    "batch_ids",
    "batch_size_of",
    "counted",
    "data_figures",
    "epoch_ids",
    "groups",
    "iterate",
    "loader_length",
    "make_loader",
    "pad_flags",
    "resumed",
    "select_rows",
    "set_epoch",
    "split_batch",
    "to_device",
    "warn_epoch_unseen",
]

Counted = tuple[Any, int, torch.Tensor | None]
"""A batch, its size and its pad mask (None when it has no pads)."""


def make_loader(
    data: Dataset | DataLoader, batch_size: int | None, cache: bool, kwargs: dict[str, Any],
    *, is_eval: bool, device: torch.device, log_fn: Callable[[str], Any],
) -> DataLoader:  # fmt: skip
    """The loader for ``data``: a ``DataLoader`` as it is (its workers shielded from the rank's
    signals), a ``ShardedStreamingDataset``'s streaming loader, else a distributed loader
    (rank-cached with ``cache``) with ``batch_size`` and the loader arguments ``kwargs``."""
    if isinstance(data, DataLoader):
        if batch_size is not None or kwargs or cache:
            raise ValueError("a DataLoader is used as it is: pass no batch_size, cache or "
                             "loader arguments with it")  # fmt: skip
        warn_epoch_unseen(data)
        data.worker_init_fn = shielded_worker_init(data.worker_init_fn)
        return data
    batch_size = check_int("batch_size", batch_size, low=1)
    if isinstance(data, ShardedStreamingDataset) and not cache:
        if "shuffle" in kwargs:
            raise ValueError("shuffle is the ShardedStreamingDataset's own: set it with "
                             "ShardedStreamingDataset(..., shuffle=), not in the loader "
                             "arguments")  # fmt: skip
        return streaming_loader(data, batch_size, **kwargs)
    if isinstance(data, IterableDataset) and not cache:
        raise ValueError(
            "dataset must be map-style, a ShardedStreamingDataset or a DataLoader, got "
            f"the IterableDataset {type(data).__name__}"
        )
    make = create_rank_cached_dataloader if cache else create_distributed_loader
    loader, _ = make(data, {"batch_size": batch_size, **kwargs}, device, log_fn=log_fn,
                     is_eval=is_eval)  # fmt: skip
    return loader


def warn_epoch_unseen(loader: DataLoader) -> None:
    """Warn when ``set_epoch`` on the given loader's dataset would not reach its persistent
    workers (each keeps the copy it started with)."""
    dataset = loader.dataset
    shared = streaming_dataset_of(loader) is not None or isinstance(dataset, SharedEpochDataset)
    if loader.persistent_workers and callable(getattr(dataset, "set_epoch", None)) and not shared:
        warnings.warn(
            f"the DataLoader's dataset {type(dataset).__name__} has set_epoch, which the "
            "handler calls every epoch, but its persistent workers keep the epoch they started "
            "with: give the dataset itself to set_train_loader, or wrap it: "
            "DataLoader(SharedEpochDataset(dataset), ...)", RuntimeWarning, stacklevel=4,
        )  # fmt: skip


# ---------------------------------------------------------------------- an epoch


@dataclass
class EpochClock:
    """Wall time of an epoch and the part of it spent waiting for batches."""

    start: float
    waited: float = 0.0

    def finish(self) -> tuple[float, float]:
        """(seconds since ``start``, seconds waited)."""
        return time.perf_counter() - self.start, self.waited


def groups(batches: Iterator[Any], size: int, clock: EpochClock) -> Iterator[list[Any]]:
    """Lists of ``size`` items of ``batches`` (the last may be shorter), timing the waits.

    Example:
        >>> [len(g) for g in groups(iter(range(7)), 3, EpochClock(0.0))]
        [3, 3, 1]
    """
    while True:
        start = time.perf_counter()
        group = list(islice(batches, size))
        clock.waited += time.perf_counter() - start
        if not group:
            return
        yield group


def counted(batches: Iterator[Any], flags: np.ndarray | None, seen: int) -> Iterator[Counted]:
    """(batch, size, pad mask or None) for each batch; ``flags`` marks pads by position in the
    rank's epoch order, from ``seen`` on; a batch's own ``__pad__`` wins."""
    for batch in batches:
        size = batch_size_of(batch)
        if isinstance(batch, Mapping) and "__pad__" in batch:
            pads = torch.as_tensor(batch["__pad__"], dtype=torch.bool).reshape(-1)
        elif flags is not None:
            pads = torch.as_tensor(flags[seen : seen + size])
        else:
            pads = None
        seen += size
        yield batch, size, pads if pads is not None and bool(pads.any()) else None


def epoch_ids(loader: DataLoader) -> np.ndarray | None:
    """The global sample ids of this rank's epoch, in order, when the sampler says them."""
    sampler = loader.sampler
    if isinstance(loader.dataset, RankCache):
        return loader.dataset.ids[np.fromiter(sampler, dtype=np.int64)]
    if isinstance(sampler, DistributedSampler):
        return np.fromiter(sampler, dtype=np.int64)
    return None


def pad_flags(loader: DataLoader) -> np.ndarray | None:
    """True for the repeats in this rank's epoch order (None when there are none): a
    ``DistributedSampler`` appends them (positions past the dataset, then split rank::world),
    the rank cache flags them."""
    sampler, flags = loader.sampler, None
    if isinstance(loader.dataset, RankCache):
        flags = loader.dataset.pads[np.fromiter(sampler, dtype=np.int64)]
    elif isinstance(sampler, DistributedSampler) and not sampler.drop_last:
        real = len(range(sampler.rank, len(sampler.dataset), sampler.num_replicas))
        flags = np.arange(len(sampler)) >= real
    return flags if flags is not None and flags.any() else None


def batch_ids(
    batch: Any, order: np.ndarray | None, start: int, size: int, distributed: bool
) -> torch.Tensor:
    """The sample ids of a batch: its ``__index__``, the sampler's, or (one process) its
    positions in the loader's order."""
    if isinstance(batch, Mapping) and "__index__" in batch:
        return torch.as_tensor(batch["__index__"], dtype=torch.int64).reshape(-1)
    if order is None and not distributed:
        return torch.arange(start, start + size)
    if order is None:
        raise ValueError("predict under DDP needs sample ids: a map-style dataset, a "
                         "DataLoader over a DistributedSampler, or dict batches with "
                         "'__index__'")  # fmt: skip
    return torch.as_tensor(order[start : start + size])


def set_epoch(loader: DataLoader, epoch: int) -> None:
    """Tell the sampler and the dataset the epoch (each that has ``set_epoch``)."""
    batch_sampler = getattr(loader.batch_sampler, "sampler", None)
    for holder in (loader.sampler, batch_sampler, loader.dataset):
        if hasattr(holder, "set_epoch"):
            holder.set_epoch(epoch)


def iterate(loader: DataLoader) -> Iterator[Any]:
    """``iter(loader)``, leaving the global generator as it was when it starts persistent
    workers. A DataLoader draws its workers' base seed from that generator when it starts
    them: at the first epoch with persistent workers, at every epoch without. A resumed run
    starts them at a later epoch, and the draw would shift its random stream (dropout...)."""
    starts = loader.persistent_workers and loader.num_workers > 0 and loader._iterator is None
    if not starts:
        return iter(loader)
    with torch.random.fork_rng(devices=[]):
        return iter(loader)


def resumed(loader: DataLoader, resume: dict[str, Any], skip: int) -> tuple[Iterator[Any], int]:
    """``loader``'s batches from batch ``skip`` of the epoch on, and the batch this rank is at:
    from the loader's saved state, from a stream state merged over workers (another world
    size: the rest is split again, so the rank is at its epoch's batches less those left), or
    by replaying the sampler."""
    if resume.get("dataset") is not None:
        epoch_batches = len(loader)
        loader.dataset.load_state_dict(resume["dataset"])
        at = epoch_batches - len(loader)  # before iterating: that starts the pass
        return iterate(loader), at
    if resume["loader"] is not None:
        loader.load_state_dict(resume["loader"])
        return iterate(loader), skip
    if isinstance(loader.dataset, IterableDataset) or loader.batch_sampler is None:
        batches = iterate(loader)
        for _ in islice(batches, skip):  # no sampler to replay: read and drop
            pass
        return batches, skip
    # DataLoader draws its worker seed before the sampler draws its order: draw it too, so
    # a sampler on the global generator (RandomSampler) replays the same order.
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
    rest = list(islice(iter(loader.batch_sampler), skip, None))
    replay = DataLoader(
        loader.dataset, batch_sampler=rest, num_workers=loader.num_workers,
        collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn, generator=loader.generator,
        multiprocessing_context=loader.multiprocessing_context,
        prefetch_factor=loader.prefetch_factor,
    )  # fmt: skip
    return iter(replay), skip


def data_figures(loader: DataLoader, waited: float, distributed: bool) -> dict[str, float]:
    """The epoch's figures of a streaming dataset (its ``stats()`` and the seconds the loop
    waited), summed over the ranks in one ``all_reduce`` under DDP (call it on every rank), as
    ``data_<name>``; {} for other datasets."""
    dataset = streaming_dataset_of(loader)
    if dataset is None:
        return {}
    data = {**dataset.stats(), "wait_s": 0.0 if math.isnan(waited) else waited}
    data = sum_over_ranks(data) if distributed else data
    return {f"data_{name}": value for name, value in data.items()}


def loader_length(loader: DataLoader) -> int | None:
    """``len(loader)``, or None for a loader without a length."""
    try:
        return len(loader)
    except TypeError:
        return None


# ---------------------------------------------------------------------- a batch


def batch_size_of(batch: Any) -> int:
    """The number of samples in ``batch``: its first tensor's rows (a dict's ``__index__``
    first), or the length of a list of plain values.

    Example:
        >>> batch_size_of((torch.zeros(5, 3), torch.zeros(5)))
        5
    """
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, Mapping):
        return batch_size_of(
            batch["__index__"] if "__index__" in batch else next(iter(batch.values()))
        )
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], (torch.Tensor, Mapping)):
        return batch_size_of(batch[0])
    if isinstance(batch, (list, tuple, np.ndarray)):
        return len(batch)
    raise ValueError(f"cannot tell the batch size of a {type(batch).__name__} batch")


def split_batch(batch: Any) -> tuple[Any, Any]:
    """(inputs, target): ``(x, y, ...)`` gives ``(x, y)``; anything else is both."""
    if isinstance(batch, (list, tuple)):
        return batch[0], batch[1] if len(batch) > 1 else batch[0]
    return batch, batch


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it on ``device`` (copied without blocking)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def select_rows(batch: Any, keep: torch.Tensor) -> Any:
    """The rows ``keep`` of every tensor and per-sample list of ``batch``."""
    if isinstance(batch, torch.Tensor):
        return batch[keep.to(batch.device)]
    if isinstance(batch, Mapping):
        return {key: select_rows(value, keep) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], (torch.Tensor, Mapping)):
        return type(batch)(select_rows(value, keep) for value in batch)
    if isinstance(batch, (list, tuple)):
        return [value for value, kept in zip(batch, keep.tolist()) if kept]
    return batch
