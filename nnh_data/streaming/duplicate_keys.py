"""Keys that two shards share: found as blocks are read, warned once, counted.

Design. Two shards holding the same ``__key__`` give two samples of one key (two copies of a
shard, two data sets numbered alike, Parquet files of one stem in two folders), which nothing
downstream can tell apart. A :class:`DuplicateKeys` keeps, for each shard a process reads, the
range of its keys (smallest, largest) and the 64-bit hashes of its keys; a block's keys are
compared with those of the shards read before it (first read earlier in the process) whose
range overlaps the block's, so shards of sorted, disjoint keys (webdataset's numbering, row
numbers of Parquet files of different names) cost a ``min``, a ``max`` and a hash per key
(~0.05 us a sample), and the exact comparison (``np.isin``) is paid only where ranges overlap.
The count is of the samples read whose key a shard read before holds: one per extra copy of a
key, each epoch. Trade-offs: at most ``MAX_KEYS`` hashes per process (8 bytes each) are kept,
so past them a key is compared only with those; a DataLoader worker or rank compares the
shards it reads, so a key shared by shards that two workers read is not found; two keys of
one 64-bit hash would count as one (odds ~n^2 / 2^65).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["MAX_KEYS", "DuplicateKeys"]

MAX_KEYS = 1 << 22  # key hashes kept per process (32 MiB)


@dataclass
class _Shard:
    order: int  # when the process first read it
    low: str
    high: str
    hashes: list[np.ndarray] = field(default_factory=list)  # sorted and unique once compacted
    # the shards before it whose range overlaps its own, as of a version of the ranges
    before: tuple[int, list[tuple[str, _Shard]]] = (-1, [])

    def compacted(self) -> np.ndarray:
        if len(self.hashes) != 1:
            self.hashes = [np.unique(np.concatenate(self.hashes))]
        return self.hashes[0]


class DuplicateKeys:
    """The keys of the shards read in this process; see the module docstring."""

    def __init__(self) -> None:
        self._shards: dict[str, _Shard] = {}
        self._kept = self._version = 0  # _version: ranges added or grown
        self._warned = False

    def __getstate__(self) -> dict:
        return {}  # each process finds its own: a worker starts empty

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def count(self, url: str, keys: Sequence[str]) -> int:
        """How many of ``keys`` (a block of shard ``url``) a shard read before holds; the
        first time any is found, a warning names one and both shards."""
        if not keys:
            return 0
        low, high = min(keys), max(keys)
        hashes = np.fromiter(map(hash, keys), np.int64, len(keys))
        shard = self._shards.get(url)
        if shard is None:
            shard = self._shards[url] = _Shard(len(self._shards), low, high)
            self._version += 1
        elif low < shard.low or high > shard.high:
            shard.low, shard.high = min(shard.low, low), max(shard.high, high)
            self._version += 1
        found = np.zeros(len(keys), bool)
        for other_url, other in self._before(shard):
            hit = np.isin(hashes, other.compacted())
            if hit.any() and not self._warned:
                self._warn(keys[int(hit.argmax())], other_url, url)
            found |= hit
        if self._kept < MAX_KEYS:
            shard.hashes.append(hashes)
            self._kept += hashes.size
        return int(found.sum())

    def _before(self, shard: _Shard) -> list[tuple[str, _Shard]]:
        """The shards read before ``shard`` whose key range overlaps its own, found again (a
        loop over the shards, in Python) only after a range was added or grew."""
        if shard.before[0] != self._version:
            found = [(url, other) for url, other in self._shards.items() if other.order <
                     shard.order and other.low <= shard.high and shard.low <= other.high]
            shard.before = (self._version, found)
        return shard.before[1]

    def _warn(self, key: str, first: str, second: str) -> None:
        self._warned = True
        warnings.warn(
            f"key {key!r} is in two shards, {first} and {second}: each gives a sample of that "
            "__key__ (counted in ds.stats()['duplicate_keys'])",
            stacklevel=4,
        )
