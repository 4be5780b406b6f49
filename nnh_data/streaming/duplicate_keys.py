"""Keys that two shards share: found as blocks are read, warned once, counted.

Design. Two shards holding the same ``__key__`` give two samples of one key (two copies of a
shard, two data sets numbered alike, Parquet files of one stem in two folders), which nothing
downstream can tell apart. A :class:`DuplicateKeys` keeps, for each shard a process reads, the
range of its keys (smallest, largest), the 64-bit hashes of its keys and, per sample, whether
it was compared and found; a block's samples not compared before are compared with the shards
whose range overlaps the block's (``np.isin`` of the hashes), so shards of sorted, disjoint
keys (webdataset's numbering, row numbers of Parquet files of different names) cost a ``min``,
a ``max`` and a hash per key the first time a process reads a sample (~0.1 us), and a block
read again costs a look at its samples' flags. A key two shards hold is found in the one read
second, so the count is one per extra copy of a key, each epoch. Trade-offs: at most
``MAX_KEYS`` hashes per process (8 bytes each) are kept, so past them a key is compared only
with those; a DataLoader worker or rank compares the shards it reads, so a key shared by
shards that two workers read is not found; two keys of one 64-bit hash would count as one
(odds ~n^2 / 2^65).
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
    low: str
    high: str
    compared: np.ndarray  # per sample: compared once
    found: np.ndarray  # per sample: its key was in another shard when compared
    hashes: list[np.ndarray] = field(default_factory=list)  # sorted and unique once compacted
    # the other shards whose range overlaps its own, as of a version of the ranges
    overlapping: tuple[int, list[tuple[str, _Shard]]] = (-1, [])

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

    def count(self, url: str, size: int, rows: slice | np.ndarray, keys: Sequence[str]) -> int:
        """How many of the samples ``rows`` (a slice or sample numbers; their ``keys``) of
        shard ``url`` (of ``size`` samples) hold a key that another shard held when the sample
        was first compared; the first time any is found, a warning names one and both shards."""
        shard = self._shards.get(url)
        if shard is not None and shard.compared[rows].all():
            return int(np.count_nonzero(shard.found[rows]))  # read before: nothing compared
        if not keys:
            return 0
        low, high = min(keys), max(keys)
        if shard is None:
            shard = self._shards[url] = _Shard(low, high, np.zeros(size, bool),
                                               np.zeros(size, bool))  # fmt: skip
            self._version += 1
        elif low < shard.low or high > shard.high:
            shard.low, shard.high = min(shard.low, low), max(shard.high, high)
            self._version += 1
        hashes = np.fromiter(map(hash, keys), np.int64, len(keys))
        found = np.zeros(len(keys), bool)
        for other_url, other in self._overlapping(url, shard):
            hit = np.isin(hashes, other.compacted())
            if hit.any() and not self._warned:
                self._warn(keys[int(hit.argmax())], other_url, url)
            found |= hit
        new = ~shard.compared[rows]
        shard.found[rows] = np.where(new, found, shard.found[rows])
        shard.compared[rows] = True
        if self._kept < MAX_KEYS:
            hashes = hashes if new.all() else hashes[new]
            shard.hashes.append(hashes)
            self._kept += hashes.size
        return int(np.count_nonzero(shard.found[rows]))

    def _overlapping(self, url: str, shard: _Shard) -> list[tuple[str, _Shard]]:
        """The other shards whose key range overlaps that of ``shard``, found again (a loop
        over the shards, in Python) only after a range was added or grew."""
        if shard.overlapping[0] != self._version:
            found = [(u, other) for u, other in self._shards.items() if u != url and
                     other.low <= shard.high and shard.low <= other.high]
            shard.overlapping = (self._version, found)
        return shard.overlapping[1]

    def _warn(self, key: str, first: str, second: str) -> None:
        self._warned = True
        warnings.warn(
            f"key {key!r} is in two shards, {first} and {second}: each gives a sample of that "
            "__key__ (counted in ds.stats()['duplicate_keys'])",
            stacklevel=4,
        )
