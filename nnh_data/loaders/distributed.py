"""The plain distributed loader for map-style datasets: a ``DataLoader`` over a
``DistributedSampler``.

Design. ``create_distributed_loader`` chooses its defaults from the machine (workers per rank,
pinned memory on CUDA), logged once; a dataset with ``set_epoch`` is wrapped in
:class:`SharedEpochDataset`, so the epoch reaches persistent workers. The ids of an epoch's
samples are ``list(sampler)``: :func:`nnh_data.loaders.gather.gather_for_metrics` takes them
and removes the sampler's repeats.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
)

from nnh_data.topology import dist_info, env_int
from nnh_data.workers.signals import shielded_worker_init

logger = logging.getLogger(__name__)

__all__ = [
    "WORKER_KEYS",
    "SharedEpochDataset",
    "create_distributed_loader",
    "default_num_workers",
    "loader_kwargs_checked",
]


_SAMPLER_KEYS = ("sampler", "batch_sampler")

# DataLoader arguments that only matter with worker processes: the rank-cached loader gives
# them to its first pass (which reads the dataset) and serves from the cache without workers.
WORKER_KEYS = ("num_workers", "prefetch_factor", "worker_init_fn", "multiprocessing_context")


def create_distributed_loader(
    dataset: Dataset,
    loader_kwargs: Mapping[str, Any] | None,
    device: torch.device | str,
    log_fn: Callable[[str], Any] | None = None,
    is_eval: bool = False,
) -> tuple[DataLoader, DistributedSampler]:
    """A ``DataLoader`` over this rank's share of ``dataset``, and its ``DistributedSampler``.

    Training shuffles (call ``sampler.set_epoch(e)`` before each epoch: the order is drawn from
    (seed 0, epoch), so without the call every epoch repeats the same order); with
    ``loader_kwargs["drop_last"]`` it drops both the samples that do not divide evenly over the
    ranks (sampler) and the last short batch (loader). Evaluation keeps the dataset order and
    drops nothing (the sampler pads the last ranks with repeats, which ``gather_for_metrics``
    removes). ``loader_kwargs["shuffle"]`` sets the sampler's shuffle (default: not
    ``is_eval``). A dataset with ``set_epoch`` comes back wrapped in
    :class:`SharedEpochDataset` (``loader.dataset.dataset`` is yours), so that its
    ``set_epoch`` (or ``loader.dataset.set_epoch``) reaches persistent workers too.
    Defaults, each overridden by ``loader_kwargs``: ``num_workers`` from
    :func:`default_num_workers`, ``pin_memory`` on CUDA, ``persistent_workers`` with workers.
    Workers ignore the signals meant for their rank (:mod:`nnh_data.workers.signals`).
    Works without a process group (rank and world size from :func:`nnh_data.topology.dist_info`).

    Args:
        dataset: a map-style dataset.
        loader_kwargs: ``DataLoader`` arguments (``batch_size``, ``collate_fn``, ...);
            ``shuffle`` and ``drop_last`` go to the sampler; not ``sampler`` or
            ``batch_sampler``.
        device: where the batches will go; CUDA turns ``pin_memory`` on.
        log_fn: receives one line saying what was chosen (default: this module's logger, INFO).
        is_eval: evaluation order (no shuffle, no drop).

    Returns:
        ``(loader, sampler)``.

    Example:
        >>> ds = torch.utils.data.TensorDataset(torch.arange(10))
        >>> kwargs = {"batch_size": 4, "num_workers": 0}
        >>> loader, sampler = create_distributed_loader(ds, kwargs, "cpu", log_fn=print)
        ... # doctest: +ELLIPSIS
        distributed loader: rank 0/1 reads 10 of 10 samples, shuffle=True, ...
        >>> sampler.set_epoch(1)  # before each epoch
        >>> [len(x) for x, in loader]
        [4, 4, 2]
    """
    kwargs, shuffle, drop_last = loader_kwargs_checked(loader_kwargs, is_eval)
    rank, world_size = dist_info()
    if _has_set_epoch(dataset):
        dataset = SharedEpochDataset(dataset)
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, drop_last=drop_last
    )
    workers, source = default_num_workers()
    if "num_workers" in kwargs:
        source = "loader_kwargs"
    kwargs.setdefault("num_workers", workers)
    kwargs.setdefault("pin_memory", torch.device(device).type == "cuda")
    kwargs.setdefault("persistent_workers", kwargs["num_workers"] > 0)
    kwargs["worker_init_fn"] = shielded_worker_init(kwargs.get("worker_init_fn"))
    loader = DataLoader(dataset, sampler=sampler, drop_last=drop_last, **kwargs)
    (log_fn or logger.info)(
        f"distributed loader: rank {rank}/{world_size} reads {len(sampler)} of {len(dataset)} "
        f"samples, shuffle={shuffle}, drop_last={drop_last}, "
        f"batch_size={loader.batch_size}, num_workers={loader.num_workers} ({source}), "
        f"pin_memory={loader.pin_memory}, persistent_workers={loader.persistent_workers}"
    )
    return loader, sampler


def default_num_workers() -> tuple[int, str]:
    """DataLoader workers for one rank, and where the number comes from: ``SLURM_CPUS_PER_TASK``
    when set (Slurm counts CPUs per rank), else this process's CPUs (``os.sched_getaffinity``)
    divided by the ranks on this node (``LOCAL_WORLD_SIZE``, as torchrun sets it).

    Example:
        >>> default_num_workers()  # doctest: +SKIP
        (8, 'SLURM_CPUS_PER_TASK')
    """
    slurm = env_int("SLURM_CPUS_PER_TASK", low=1)
    if slurm is not None:
        return slurm, "SLURM_CPUS_PER_TASK"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = env_int("LOCAL_WORLD_SIZE", low=1) or 1
    return (cpus or 1) // local, f"{cpus} CPUs / {local} local ranks"


def loader_kwargs_checked(
    loader_kwargs: Mapping[str, Any] | None, is_eval: bool
) -> tuple[dict, bool, bool]:
    """A copy of ``loader_kwargs`` without the sampler's settings, and those settings: the
    ``shuffle`` (default: not ``is_eval``) and ``drop_last`` to use."""
    kwargs = dict(loader_kwargs or {})
    for key in _SAMPLER_KEYS:
        if key in kwargs:
            raise ValueError(
                f"loader_kwargs[{key!r}] is not allowed: the loader builds its own sampler "
                "(set its shuffle and drop_last with those keys, is_eval= for evaluation)"
            )
    shuffle = bool(kwargs.pop("shuffle", not is_eval))
    drop_last = bool(kwargs.pop("drop_last", False))
    if drop_last and is_eval:
        warnings.warn("drop_last=True is ignored with is_eval=True: evaluation sees every sample",
                      stacklevel=3)  # fmt: skip
    return kwargs, shuffle, drop_last and not is_eval


class SharedEpochDataset(Dataset):
    """``dataset`` whose ``set_epoch`` reaches the copies in DataLoader workers.

    A worker holds its own copy of the dataset, made when it starts; a persistent worker keeps
    it, so a ``set_epoch`` in the main process never reaches it and parameters keyed by epoch
    would stay at the epoch the workers started in. This wrapper keeps the epoch in a
    shared-memory tensor (fork and spawn pass it by handle, as ``ShardedStreamingDataset``
    does) and calls the local copy's ``set_epoch`` before serving the first batch of a new
    epoch: one integer read per batch. ``dataset``'s own ``set_epoch`` is made to write that
    tensor too (an attribute set on the instance), so ``ds.set_epoch(e)`` and
    ``loader.dataset.set_epoch(e)`` both reach the workers; a dataset that takes no attributes
    (``__slots__``, frozen) is told with a warning to call the wrapper's. Other attributes are
    read from ``dataset``.

    Example:
        >>> loader = DataLoader(SharedEpochDataset(ds), batch_size=32, num_workers=4,
        ...                     persistent_workers=True)  # doctest: +SKIP
        >>> ds.set_epoch(1)  # the workers serve epoch 1 from the next iter()
    """

    def __init__(self, dataset: Dataset) -> None:
        if not _has_set_epoch(dataset):
            raise ValueError(f"dataset must have a set_epoch method, got {type(dataset).__name__}")
        self.dataset = dataset
        self._epoch = torch.full((1,), -1, dtype=torch.int64).share_memory_()
        self._applied: int | None = None  # the epoch this process's copy was given
        _SharedSetEpoch.install(dataset, self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Give ``dataset`` the epoch here and, from their next batch, in every worker."""
        self._epoch[0] = epoch
        _SharedSetEpoch.plain(self.dataset, epoch)
        self._applied = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        self._follow()
        return self.dataset[index]

    def __getitems__(self, indices: Sequence[Any]) -> Any:
        self._follow()
        getitems = getattr(self.dataset, "__getitems__", None)
        return getitems(indices) if getitems else [self.dataset[i] for i in indices]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("dataset", "_epoch", "_applied"):
            raise AttributeError(name)  # not (yet) set: unpickling, copying
        return getattr(self.dataset, name)

    def _follow(self) -> None:
        epoch = int(self._epoch[0])
        if epoch >= 0 and epoch != self._applied:
            _SharedSetEpoch.plain(self.dataset, epoch)
            self._applied = epoch


def _has_set_epoch(dataset: Dataset) -> bool:
    """Whether the dataset's class defines ``set_epoch``."""
    return callable(getattr(type(dataset), "set_epoch", None))


class _SharedSetEpoch:
    """Set on a dataset instance in place of its ``set_epoch``: also writes the epoch into the
    shared tensor of every :class:`SharedEpochDataset` over it."""

    def __init__(self, dataset: Dataset, method: Callable[[Any, int], Any]) -> None:
        self.dataset, self.method, self.shared = dataset, method, []

    def __call__(self, epoch: int) -> Any:
        for shared in self.shared:
            shared[0] = epoch
        return self.method(self.dataset, epoch)

    @classmethod
    def install(cls, dataset: Dataset, shared: torch.Tensor) -> None:
        note = getattr(dataset, "__dict__", {}).get("set_epoch")
        if not isinstance(note, cls):
            note = cls(dataset, type(dataset).set_epoch)
            try:
                dataset.set_epoch = note
            except AttributeError:
                warnings.warn(f"{type(dataset).__name__} takes no attributes: its own set_epoch "
                              "does not reach DataLoader workers; call loader.dataset.set_epoch",
                              RuntimeWarning, stacklevel=4)  # fmt: skip
                return
        note.shared.append(shared)

    @classmethod
    def plain(cls, dataset: Dataset, epoch: int) -> None:
        """``dataset.set_epoch(epoch)`` as its class defines it, writing no shared tensor."""
        type(dataset).set_epoch(dataset, epoch)
