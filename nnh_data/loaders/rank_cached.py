"""The rank-cached loader: each rank reads its share of a map-style dataset once, then serves every
epoch from memory.

Design. :func:`rank_share` gives a rank's ids (the contiguous or interleaved ids of
``DistributedRangeSplitter``, equalised with flagged repeats or by dropping);
``create_rank_cached_dataloader`` reads them once, collates them into a :class:`RankCache` (one
tensor per field) and serves every epoch from it: a batch is one index operation per field, in
the main process, in an order that :class:`RankCachedSampler` draws from (seed, epoch, rank).
The trade-off: a rank only ever sees its own share (the order within it changes each epoch, not
the split), and memory holds ``1 / world_size`` of the dataset; in exchange the dataset's
``__getitem__`` (decoding, disk, network) runs once per sample per job instead of once per
epoch. Dict samples carry ``__index__`` (global sample id) and ``__pad__`` (True for the
repeats that equalise ranks), as in ``ShardedStreamingDataset``; for other samples the ids of an
epoch are ``loader.dataset.ids[list(sampler)]``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    Sampler,
    Subset,
    default_collate,
)

from nnh_data.checks import check_choice, check_int
from nnh_data.loaders.distributed import WORKER_KEYS, default_num_workers, loader_kwargs_checked
from nnh_data.order.epoch import UNEVEN, hashed_permutation, rank_span
from nnh_data.resplit_guard import check_caller
from nnh_data.seeding import mix64_int, stream_key
from nnh_data.streaming.dataset import ShardedStreamingDataset
from nnh_data.topology import dist_info
from nnh_data.workers.signals import shielded_worker_init

logger = logging.getLogger(__name__)

__all__ = [
    "SPLITS",
    "RankCache",
    "RankCachedSampler",
    "create_rank_cached_dataloader",
    "nbytes",
    "rank_share",
]


SPLITS = ("contiguous", "interleaved")

_CACHE_ORDER_DOMAIN = 0x52414E4B43  # "RANKC": keeps the cache order apart from other streams


def create_rank_cached_dataloader(
    dataset: Dataset | ShardedStreamingDataset,
    loader_kwargs: Mapping[str, Any] | None,
    device: torch.device | str,
    log_fn: Callable[[str], Any] | None = None,
    is_eval: bool = False,
    *,
    split: str = "contiguous",
    uneven: str = "pad",
    seed: int = 0,
    pin_memory: bool | None = None,
    on_device: bool = False,
    max_bytes: int | None = None,
) -> tuple[DataLoader, RankCachedSampler]:
    """A ``DataLoader`` that reads this rank's share of ``dataset`` once and serves it from memory.

    The share is :func:`rank_share` of a map-style dataset, or what a
    ``ShardedStreamingDataset`` yields on this rank in its current epoch (its own ``uneven``
    applies; pass the same here). The first pass reads it with ``loader_kwargs["num_workers"]``
    workers (default :func:`default_num_workers`); it is then collated into one tensor per
    field (or kept as samples when ``loader_kwargs`` has a ``collate_fn``) and every batch is
    gathered from it in the main process. Every rank holds the same number of samples, so every
    rank runs the same number of batches. Training reshuffles the share when
    ``sampler.set_epoch(e)`` is called (the order is a pure function of (seed, epoch, rank));
    evaluation keeps it in order. Cached ``__aug__`` parameters of a stream are those of the
    epoch that was read.

    Args:
        dataset: a map-style dataset or a ``ShardedStreamingDataset`` without ``batch_size``.
        loader_kwargs: ``DataLoader`` arguments; worker arguments apply to the first pass.
        device: where the batches will go.
        log_fn: receives one line with the share and its size (default: the module logger, INFO).
        is_eval: evaluation order (no shuffle, no drop).
        split: ``"contiguous"`` id ranges or ``"interleaved"`` ids (``rank::world_size``).
        uneven: ``"pad"`` (repeat a sample on the shorter ranks) or ``"drop"``.
        seed: seed of the per-epoch order.
        pin_memory: pin the batches (default: ``loader_kwargs["pin_memory"]`` if given, else
            when ``device`` is CUDA and the cache is not on it). Batches are gathered by index,
            so pinning the cache itself would not pin them.
        on_device: hold the cache on ``device``; batches are then gathered there.
        max_bytes: the most memory the cached share may take; a share estimated larger (from
            the bytes of the samples read so far) fails at its first sample, naming both sizes.
            While it is collated, the share briefly takes about twice that.

    Returns:
        ``(loader, sampler)``; ``loader.dataset`` is the :class:`RankCache`.

    Example:
        >>> ds = torch.utils.data.TensorDataset(torch.arange(10))
        >>> kwargs = {"batch_size": 4, "num_workers": 0}
        >>> loader, sampler = create_rank_cached_dataloader(ds, kwargs, "cpu", log_fn=len)
        >>> sampler.set_epoch(1)  # a new order, served from memory
        >>> sorted(torch.cat([x for x, in loader]).tolist())
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    """
    split = check_choice("split", split, SPLITS)
    uneven = check_choice("uneven", uneven, UNEVEN)
    seed = check_int("seed", seed, low=0)
    if max_bytes is not None:
        max_bytes = check_int("max_bytes", max_bytes, low=0)
    kwargs, shuffle, drop_last = loader_kwargs_checked(loader_kwargs, is_eval)
    pin = _pin_memory(device, kwargs.pop("pin_memory", pin_memory), on_device)
    first_pass = {key: kwargs.pop(key) for key in WORKER_KEYS if key in kwargs}
    first_pass.setdefault("num_workers", default_num_workers()[0])
    first_pass["worker_init_fn"] = shielded_worker_init(first_pass.get("worker_init_fn"))
    kwargs.pop("persistent_workers", None)  # the first pass is the only one with workers
    if isinstance(dataset, IterableDataset):
        where = _stream_layout(dataset, split, uneven)
        samples, ids, pads = _stream_share(dataset, first_pass, max_bytes)
    else:
        where = dist_info()
        ids, pads = rank_share(len(dataset), *where, split, uneven)
        reader = _reader(Subset(dataset, ids.tolist()), first_pass)
        samples = _load(reader, len(ids), max_bytes, where[0])
    collate_fn = kwargs.pop("collate_fn", None)
    cache = RankCache(
        samples, ids, pads, collate=collate_fn is None, device=device if on_device else None
    )
    sampler = RankCachedSampler(len(cache), seed=seed, shuffle=shuffle, rank=where[0])
    loader = DataLoader(
        cache, sampler=sampler, drop_last=drop_last, pin_memory=pin, num_workers=0,
        collate_fn=collate_fn or _as_collated, **kwargs,
    )  # fmt: skip
    (log_fn or logger.info)(
        f"rank-cached loader: rank {where[0]}/{where[1]} holds {len(cache)} samples "
        f"({int(pads.sum())} repeats, {split}, uneven={uneven}), {cache.nbytes / 2**20:.1f} MiB "
        f"{f'on {device}' if on_device else 'in host memory'}, shuffle={shuffle}, "
        f"drop_last={drop_last}, batch_size={loader.batch_size}, pin_memory={pin}, "
        f"first pass num_workers={first_pass['num_workers']}"
    )
    return loader, sampler


def rank_share(
    total: int, rank: int, world_size: int, split: str = "contiguous", uneven: str = "pad"
) -> tuple[np.ndarray, np.ndarray]:
    """The sample ids ``rank`` holds, and which of them are repeats that equalise the ranks.

    Every rank gets ``ceil(total / world_size)`` ids with ``"pad"`` (a shorter rank repeats
    the next id in the split order, as ``DistributedSampler`` does) or
    ``total // world_size`` with ``"drop"``. ``"contiguous"`` takes the rank's
    ``DistributedRangeSplitter`` range; ``"interleaved"`` takes ids ``rank, rank + world_size,
    ...`` (a mix of the whole dataset when it is sorted, e.g. by class).

    Example:
        >>> ids, pads = rank_share(10, 2, 3)
        >>> ids.tolist(), pads.tolist()
        ([7, 8, 9, 0], [False, False, False, True])
        >>> rank_share(10, 2, 3, "interleaved")[0].tolist()
        [2, 5, 8, 1]
    """
    check_choice("split", split, SPLITS)
    span = rank_span(total, world_size, rank, uneven)
    j = np.arange(span.length, dtype=np.int64)
    ids = span.start + j if split == "contiguous" else rank + world_size * j
    return ids % max(total, 1), j >= span.real


def _pin_memory(device: torch.device | str, pin_memory: bool | None, on_device: bool) -> bool:
    on_cuda = torch.device(device).type == "cuda"
    if pin_memory is None:
        return on_cuda and not on_device
    if pin_memory and on_device:
        raise ValueError("pin_memory=True does not go with on_device=True: the batches are "
                         "gathered on the device already")  # fmt: skip
    return bool(pin_memory)


def _stream_layout(dataset: Dataset, split: str, uneven: str) -> tuple[int, int]:
    """(rank, world size) of a stream the rank-cached loader can cache; else a ValueError."""
    if not isinstance(dataset, ShardedStreamingDataset):
        raise ValueError("dataset must be map-style or a ShardedStreamingDataset, got the "
                         f"IterableDataset {type(dataset).__name__}")  # fmt: skip
    if dataset.batch_size is not None:
        raise ValueError("dataset must yield samples: create the ShardedStreamingDataset "
                         f"without batch_size (got batch_size={dataset.batch_size})")  # fmt: skip
    if dataset.global_batch_size is not None:
        raise ValueError("the rank-cached loader reorders a rank's share every epoch, so the "
                         "global batches of a dataset with global_batch_size would not be "
                         "kept: iterate it with streaming_loader")  # fmt: skip
    if split != "contiguous":
        raise ValueError(f"split={split!r} does not apply to a ShardedStreamingDataset, which "
                         "splits by its own order: leave split='contiguous'")  # fmt: skip
    if uneven != dataset.uneven:
        raise ValueError(f"uneven={uneven!r} but the dataset has uneven={dataset.uneven!r}: "
                         "pass the same")  # fmt: skip
    return dataset.rank, dataset.world_size


def _stream_share(
    dataset: ShardedStreamingDataset, first_pass: dict, max_bytes: int | None
) -> tuple[list, np.ndarray, np.ndarray]:
    """The samples of this rank's stream, made up to ``len(dataset)`` with flagged repeats
    when samples were skipped (``on_error="skip"``), with their ids and pad flags."""
    length = len(dataset)
    samples = _load(_reader(dataset, first_pass), length, max_bytes, dataset.rank)
    if length and not samples:
        raise ValueError(f"the stream of rank {dataset.rank} yielded no sample of the {length} "
                         "expected (all skipped?): nothing to cache")  # fmt: skip
    picks = np.arange(length) % max(len(samples), 1)
    ids = np.array([samples[p]["__index__"] for p in picks], dtype=np.int64)
    pads = np.array([bool(samples[p]["__pad__"]) for p in picks], dtype=bool)
    pads |= np.arange(length) >= len(samples)
    return [samples[p] for p in picks], ids, pads


def _reader(dataset: Dataset, first_pass: dict) -> DataLoader:
    """The samples of ``dataset`` as they are (no conversion), read with workers."""
    return DataLoader(dataset, batch_size=None, collate_fn=_as_collated, **first_pass)


def _load(source: Iterable, count: int, max_bytes: int | None, rank: int) -> list:
    """The samples of ``source`` (``count`` expected), failing as soon as they look too big."""
    samples, used = [], 0
    for sample in source:
        samples.append(sample)
        if max_bytes is None:
            continue
        used += nbytes(sample)
        needed = used * count // len(samples)
        if needed > max_bytes:
            raise ValueError(
                f"rank {rank}'s share of {count} samples needs about {_mib(needed)} "
                f"({_mib(used / len(samples))} per sample over the {len(samples)} read), more "
                f"than max_bytes={max_bytes} ({_mib(max_bytes)})"
            )
    return samples


def _mib(size: float) -> str:
    return f"{size / 2**20:.2f} MiB"


def _as_collated(batch: Any) -> Any:
    """The collate function of a batch that is already collated."""
    return batch


class RankCache(Dataset):
    """One rank's samples held in memory, served a batch at a time by index.

    With ``collate=True`` the samples are collated once with ``default_collate`` (one tensor
    per numeric field, lists for the rest) and a batch of indices is gathered from the columns:
    the same batch ``default_collate`` would build from those samples, at the cost of one
    index operation per field. Dict samples get ``__index__`` (``ids``) and ``__pad__``
    (``pads``) fields.

    Attributes:
        ids: the global sample id of each entry (int64 array).
        pads: True for the entries that repeat a sample to equalise the ranks.

    Example:
        >>> cache = RankCache([{"x": 1.0}, {"x": 2.0}], ids=[4, 5], pads=[False, False])
        >>> cache.__getitems__([1, 0])["x"]
        tensor([2., 1.], dtype=torch.float64)
    """

    def __init__(
        self,
        samples: Sequence[Any],
        ids: Sequence[int] | np.ndarray,
        pads: Sequence[bool] | np.ndarray,
        *,
        collate: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        self.ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        self.pads = np.asarray(pads, dtype=bool).reshape(-1)
        if not len(samples) == self.ids.size == self.pads.size:
            raise ValueError(f"samples, ids and pads must have one length, got {len(samples)}, "
                             f"{self.ids.size} and {self.pads.size}")  # fmt: skip
        flagged = [_flagged(s, i, p) for s, i, p in zip(samples, self.ids.tolist(), self.pads)]
        self._proto = flagged[0] if flagged else None
        self.collated = collate and bool(flagged)
        data = default_collate(flagged) if self.collated else flagged
        self._data = data if device is None else _to_device(data, torch.device(device))

    def __len__(self) -> int:
        return self.ids.size

    @property
    def nbytes(self) -> int:
        """Bytes the cached data takes (tensors, arrays, strings; 8 per other value)."""
        return nbytes(self._data)

    def __getitem__(self, i: int) -> Any:
        if not self.collated:
            return self._data[i]
        return _take(self._data, self._proto, check_int("i", i, low=0, high=len(self) - 1))

    def __getitems__(self, indices: Sequence[int]) -> Any:
        """The batch of ``indices``: collated when the cache is, else the list of samples."""
        if not self.collated:
            return [self._data[i] for i in indices]
        return _take(self._data, self._proto, torch.as_tensor(indices, dtype=torch.long))


class RankCachedSampler(Sampler[int]):
    """Positions ``0 .. num_samples - 1`` of a rank's cache, in an order drawn from
    (seed, epoch, rank).

    The order is a pure function of (seed, epoch, rank, num_samples): any process computes it,
    and resuming at an epoch gives that epoch's order. The rank is part of it so that ranks do
    not walk their shares in step (with an interleaved split, a global batch would otherwise
    hold runs of neighbouring ids). Without ``shuffle``, positions in order.

    Example:
        >>> sampler = RankCachedSampler(5, seed=1, rank=2)
        >>> sampler.set_epoch(3)
        >>> sorted(sampler)
        [0, 1, 2, 3, 4]
    """

    def __init__(
        self, num_samples: int, *, seed: int = 0, shuffle: bool = True, rank: int = 0
    ) -> None:
        self.num_samples = check_int("num_samples", num_samples, low=0)
        self.seed = check_int("seed", seed, low=0)
        self.rank = check_int("rank", rank, low=0)
        self.shuffle = bool(shuffle)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw the order of epoch ``epoch`` from the next ``iter()`` on."""
        self.epoch = check_int("epoch", epoch, low=0)

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        check_caller()
        if not self.shuffle:
            return iter(range(self.num_samples))
        key = stream_key(self.seed, self.epoch, 1) ^ mix64_int(_CACHE_ORDER_DOMAIN + self.rank)
        return iter(hashed_permutation(self.num_samples, mix64_int(key)).tolist())


def nbytes(value: Any) -> int:
    """Bytes of the data in ``value``: tensors, numpy arrays, ``bytes`` and ``str`` by size,
    containers by their items, 8 for any other value.

    Example:
        >>> nbytes({"x": torch.zeros(4), "label": 3, "name": "cat"})
        27
    """
    if isinstance(value, torch.Tensor):
        return value.element_size() * value.numel()
    if isinstance(value, (np.ndarray, bytes, str)):
        return value.nbytes if isinstance(value, np.ndarray) else len(value)
    if isinstance(value, Mapping):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 8


def _flagged(sample: Any, sample_id: int, pad: bool) -> Any:
    """A dict sample with its ``__index__`` and ``__pad__``; any other sample as it is."""
    if isinstance(sample, Mapping):
        return {**sample, "__index__": sample_id, "__pad__": bool(pad)}
    return sample


def _take(collated: Any, proto: Any, index: torch.Tensor | int) -> Any:
    """Rows ``index`` of ``default_collate`` output, read with the structure of one sample
    (``proto``): what ``default_collate`` gives for those samples (one sample for an int)."""
    if isinstance(proto, Mapping):
        return {key: _take(collated[key], proto[key], index) for key in collated}
    if isinstance(proto, (list, tuple)):
        return _rebuilt(collated, [_take(c, p, index) for c, p in zip(collated, proto)])
    if isinstance(collated, torch.Tensor) or isinstance(index, int):
        return collated[index]
    return type(collated)(collated[i] for i in index.tolist())


def _to_device(data: Any, device: torch.device) -> Any:
    """``data`` with its tensors on ``device``."""
    if isinstance(data, torch.Tensor):
        return data.to(device)
    if isinstance(data, Mapping):
        return {key: _to_device(value, device) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return _rebuilt(data, [_to_device(part, device) for part in data])
    return data


def _rebuilt(like: list | tuple, parts: list) -> list | tuple:
    """``parts`` in a sequence of the type of ``like`` (a namedtuple too)."""
    return type(like)(*parts) if hasattr(like, "_fields") else type(like)(parts)
