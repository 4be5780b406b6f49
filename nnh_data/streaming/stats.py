"""Where a streaming epoch's time goes: counters of every process that reads, summed per epoch.

Design. A dataset makes a :class:`DataStats`: a shared-memory int64 table with one row per
process that reads (row 0: the process that iterates without workers; row ``1 + k``:
DataLoader worker ``k``), passed to workers by handle like the dataset's epoch (fork and spawn).
A pass adds to its own row through a :class:`Meter`, so counting takes no lock and sends no
message; each addition is one numpy call on a slice, which other threads of the process (the
read-ahead thread) cannot interleave. Counting happens once per read block and once per part
(a window of up to 1,024 samples), and a ``decode`` function is timed on one call in
``DECODE_SAMPLING`` (scaled up), so nothing is added per sample: a few microseconds per block.
The main process sums the rows: :meth:`DataStats.epoch` is the epoch so far on this rank (the
sums minus what they were when the epoch was set), :func:`sum_over_ranks` adds the ranks' in
one ``all_reduce`` and :func:`describe` makes the one line a log gets.

What is counted: ``handed_out``, the samples the passes handed out (this rank's share of the
epoch, pads included, samples left out as unreadable not), and ``samples`` and ``bytes`` read
(a tar block's bytes; for Parquet the file's bytes in proportion to the rows read). The two
differ where a shuffle window is shared: a window's samples are drawn in a random order from
all of it, so every worker and rank whose share lies in a window reads the whole window (the
share of each is scattered over it): a data set smaller than ``shuffle_window`` is read once
per worker and rank (400 samples, 2 workers: 800 read), a large one about one window more per
worker and rank than its share (the windows at the ends of its range). Then: seconds reading
(the fetch, including a cache download it waits for), decoding (shards to rows, and ``decode``)
and computing parameters; remote ``gets`` (one per block read from remote storage around a
cache; the cache's own downloads are its ``cache_misses``), ``retries`` (reads done again),
this process's cache ``hits``, ``misses`` and ``evictions``, samples ``skipped`` as unreadable,
``duplicate_keys``, samples read whose key a shard read before holds
(:mod:`nnh_data.streaming.duplicate_keys`), and ``wait_s``, the training loop's wait for
batches, when the loop reports it (:func:`timed`, or ``NNHandler``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from nnh_data.topology import group_size, in_worker_process, worker_info

__all__ = [
    "BYTES",
    "CACHE_EVICTIONS",
    "CACHE_HITS",
    "CACHE_MISSES",
    "DECODE_NS",
    "DECODE_SAMPLING",
    "DECODE_USER_NS",
    "DUPLICATE_KEYS",
    "FIELDS",
    "GETS",
    "PARAMS_NS",
    "READ_NS",
    "RETRIES",
    "SAMPLES",
    "WAIT_NS",
    "DataStats",
    "Meter",
    "describe",
    "sum_over_ranks",
    "timed",
]

FIELDS = ("samples", "bytes", "read_ns", "gets", "decode_ns", "decode_user_ns", "params_ns",
          "wait_ns", "retries", "cache_hits", "cache_misses", "cache_evictions",
          "handed_out", "duplicate_keys")  # fmt: skip
(SAMPLES, BYTES, READ_NS, GETS, DECODE_NS, DECODE_USER_NS, PARAMS_NS, WAIT_NS, RETRIES,
 CACHE_HITS, CACHE_MISSES, CACHE_EVICTIONS, HANDED_OUT,
 DUPLICATE_KEYS) = range(len(FIELDS))  # fmt: skip
_READ_FIELDS = (SAMPLES, BYTES, READ_NS, GETS)  # counted by the fetching threads
ROWS = 64  # the main process and 63 workers; more workers share rows (a count may be lost)
DECODE_SAMPLING = 16
_CACHE = {"hits": CACHE_HITS, "downloads": CACHE_MISSES, "around": CACHE_MISSES,
          "evictions": CACHE_EVICTIONS}  # fmt: skip
T = TypeVar("T")


class Meter:
    """One pass's counting in this process, on the process's ``row`` of the table.

    Only the thread that hands items out writes the row: a thread that fetches counts its
    reads in a list of its own (:meth:`reads`, :meth:`read`), which :meth:`part` folds into
    the row once per part. ``decode`` is timed on the parts :attr:`timing` is set for (one in
    ``DECODE_SAMPLING``, the first included) and scaled by items. ``cache``: the shard cache
    the pass reads through; its counts of this process since the pass began are copied in.
    """

    def __init__(self, row: np.ndarray, cache: Any = None) -> None:
        self.row, self.cache = row, cache
        self.timing = True  # time decode in the current part
        self._start = row.copy()
        self._reads: list[list[int]] = []
        self._parts = self._items = self._timed_items = self._timed_ns = 0
        self._cache_start = None if cache is None else _cache_vector(cache.process_counts())

    @classmethod
    def alone(cls) -> Meter:
        """A meter on a row of its own, counted nowhere (a pass outside a dataset)."""
        return cls(np.zeros(len(FIELDS), np.int64))

    def reads(self) -> list[int]:
        """A count of reads for one fetching thread: pass it to :meth:`read`."""
        counts = [0] * len(_READ_FIELDS)
        self._reads.append(counts)
        return counts

    @staticmethod
    def read(counts: list[int], samples: int, nbytes: int, ns: int, remote: bool) -> None:
        """One block read in ``ns`` nanoseconds (any thread: ``counts`` is that thread's)."""
        counts[0] += samples
        counts[1] += nbytes
        counts[2] += ns
        counts[3] += remote

    def add(self, field: int, amount: int) -> None:
        """Add to a field (the thread that hands items out)."""
        self.row[field] += amount

    def decoded(self, ns: int, items: int) -> None:
        """``decode`` took ``ns`` on ``items`` items of a timed part."""
        self._timed_ns += ns
        self._timed_items += items

    def part(self, items: int) -> None:
        """A part of ``items`` items is handed out next: fold the reads, the sampled decode
        time and the cache's counts into the row, and say whether to time this part."""
        self._items += items
        self.row[HANDED_OUT] += items
        self.timing = self._parts % DECODE_SAMPLING == 0
        self._parts += 1
        for field, counts in zip(_READ_FIELDS, zip(*self._reads)):
            self.row[field] = self._start[field] + sum(counts)
        if self._timed_items:
            estimate = self._timed_ns * self._items // self._timed_items
            self.row[DECODE_USER_NS] = self._start[DECODE_USER_NS] + estimate
        if self.cache is not None:
            now = _cache_vector(self.cache.process_counts()) - self._cache_start
            self.row[CACHE_HITS : CACHE_EVICTIONS + 1] = (
                self._start[CACHE_HITS : CACHE_EVICTIONS + 1] + now
            )


class DataStats:
    """The counters of one dataset in every process that reads it (see the module)."""

    def __init__(self) -> None:
        self.table = torch.zeros((ROWS, len(FIELDS)), dtype=torch.int64).share_memory_()
        self._base = np.zeros(len(FIELDS), np.int64)
        self._view: tuple[int, np.ndarray] | None = None  # (pid, the table as numpy)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_view": None}  # a numpy view would travel as a copy

    def meter(self, cache: Any = None) -> Meter:
        """A :class:`Meter` on this process's row (call it where the pass starts)."""
        worker, _ = worker_info()
        return Meter(self._rows()[1 + worker % (ROWS - 1) if in_worker_process() else 0], cache)

    def start_epoch(self) -> None:
        """Count from here (the main process calls it when the epoch is set)."""
        self._base = self._rows().sum(axis=0)

    def epoch(self, skipped: int = 0) -> dict[str, float]:
        """This epoch so far, over this process and its workers: counts, and times in
        seconds (``read_s``, ``decode_s``, ``params_s``, ``wait_s``)."""
        totals = self._rows().sum(axis=0) - self._base
        totals[DECODE_NS] += totals[DECODE_USER_NS]
        out: dict[str, float] = {}
        for name, value in zip(FIELDS, totals.tolist()):
            if name == "decode_user_ns":
                continue
            out[name[:-3] + "_s" if name.endswith("_ns") else name] = (
                value / 1e9 if name.endswith("_ns") else value)
        out["handed_out"] -= skipped
        out["skipped"] = skipped
        return out

    def waited(self, seconds: float) -> None:
        """Add ``seconds`` the training loop waited for a batch (main process)."""
        self._rows()[0, WAIT_NS] += int(seconds * 1e9)

    def _rows(self) -> np.ndarray:
        if self._view is None or self._view[0] != os.getpid():
            self._view = (os.getpid(), self.table.numpy())
        return self._view[1]


def _cache_vector(counts: Mapping[str, int]) -> np.ndarray:
    out = np.zeros(CACHE_EVICTIONS - CACHE_HITS + 1, np.int64)
    for name, field in _CACHE.items():
        out[field - CACHE_HITS] += counts.get(name, 0)
    return out


def timed(batches: Iterable[T], stats: DataStats) -> Iterator[T]:
    """``batches`` as they come, the time spent waiting for each added to ``stats``
    (``dataset.data_stats``): the training loop's data wait.

    Example:
        >>> for batch in timed(loader, ds.data_stats):  # doctest: +SKIP
        ...     train_step(batch)
    """
    it = iter(batches)
    while True:
        start = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        stats.waited(time.perf_counter() - start)
        yield batch


def sum_over_ranks(
    stats: Mapping[str, float], group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """``stats`` (one rank's, from ``ds.stats()``) summed over the ranks of ``group`` in one
    ``all_reduce``; every rank gets the sums. Call it on every rank."""
    names = list(stats)
    if group_size(group) == 1:
        return dict(stats)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    values = torch.tensor([float(stats[n]) for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(values, group=group)
    return {n: (v if n.endswith("_s") else int(v)) for n, v in zip(names, values.tolist())}


def describe(stats: Mapping[str, float]) -> str:
    """One line for a log: what was read and where the time went.

    The share handed out is named apart from the samples read only where they differ (a set
    smaller than the shuffle window is read whole by every worker and rank), and duplicate keys
    only where there were some; stats from before either count was kept read as before.

    Example:
        >>> describe({"handed_out": 1024, "samples": 2048, "bytes": 6_400_000, "read_s": 0.4,
        ...           "decode_s": 1.2, "params_s": 0.1, "wait_s": 0.3, "gets": 0, "retries": 0,
        ...           "cache_hits": 0, "cache_misses": 0, "cache_evictions": 0, "skipped": 0,
        ...           "duplicate_keys": 2})
        'data: 1,024 samples handed out, 2,048 read (6.4 MB); reading 0.40 s, decoding 1.20 s, parameters 0.10 s, loop waiting 0.30 s; 0 GETs, 0 retries; cache 0 hits, 0 misses, 0 evictions; 0 skipped; 2 duplicate keys'
    """  # noqa: E501
    s = stats
    handed_out, duplicates = s.get("handed_out", s["samples"]), s.get("duplicate_keys", 0)
    megabytes = s["bytes"] / 1e6
    amount = (f"{s['samples']:,} samples, {megabytes:.1f} MB read" if handed_out == s["samples"]
              else f"{handed_out:,} samples handed out, {s['samples']:,} read ({megabytes:.1f} MB)")
    return (
        f"data: {amount}; reading "
        f"{s['read_s']:.2f} s, decoding {s['decode_s']:.2f} s, parameters {s['params_s']:.2f} s, "
        f"loop waiting {s['wait_s']:.2f} s; {s['gets']:,} GETs, {s['retries']:,} retries; cache "
        f"{s['cache_hits']:,} hits, {s['cache_misses']:,} misses, {s['cache_evictions']:,} "
        f"evictions; {s['skipped']:,} skipped"
        + (f"; {duplicates:,} duplicate keys" if duplicates else "")
    )  # fmt: skip
