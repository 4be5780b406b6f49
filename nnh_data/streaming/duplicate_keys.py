"""Keys that two shards share: found as blocks are read, warned once, counted.

Design. Two shards holding the same ``__key__`` give two samples of one key (two copies of a
shard, two data sets numbered alike, Parquet files of one stem in two folders), which nothing
downstream can tell apart. A :class:`DuplicateKeys` keeps the 64-bit hashes of the keys a
process has read, each with the number of its shard, in sorted runs merged as they grow (each
under a quarter of the one before it: ~log4(n) runs), a filter of one bit per hash's low 26
bits, and per shard and sample whether it was compared and found. A block's samples not
compared before are looked up in every run (a binary search) only where the filter has their
bit, whatever the order of the keys: hash-like keys overlap every shard's key range, and
comparing shard by shard cost 30-130 us a sample at 50-200 shards read; this costs 0.3-0.4 us
a key at 50-500 shards, the first time a process reads a sample. A block read again costs a
look at its samples' flags. A key two shards hold is found in the one read second, so the
count is one per extra copy of a key, each epoch. Trade-offs: at most ``MAX_KEYS`` hashes per
process (12 bytes each, and the filter's 8 MiB) are kept, so past them a key is compared only
with those; a DataLoader worker or rank compares the shards it reads, so a key shared by
shards that two workers read is not found; two keys of one 64-bit hash would count as one
(odds ~n^2 / 2^65).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MAX_KEYS", "DuplicateKeys"]

MAX_KEYS = 1 << 22  # key hashes kept per process (48 MiB with their shard numbers)
_BITS = 26  # the filter's bits: 2^26, so ~6% of new keys are searched at MAX_KEYS kept
_MASK = (1 << _BITS) - 1


@dataclass
class _Shard:
    number: int
    compared: np.ndarray  # per sample: compared once
    found: np.ndarray  # per sample: its key was in another shard when compared


class _Runs:
    """Runs of (hash, shard number), sorted by hash, equal hashes in the order they came,
    and a bit per hash's low 26 bits, so that most keys never seen need no search."""

    def __init__(self) -> None:
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []
        self.bits = np.zeros(1 << (_BITS - 3), np.uint8)  # 8 MiB, in pages as they are set

    def add(self, hashes: np.ndarray, shard: int) -> None:
        low = hashes & _MASK
        np.bitwise_or.at(self.bits, low >> 3, np.left_shift(1, low & 7).astype(np.uint8))
        run = (hashes, np.full(hashes.size, shard, np.int32))
        while self.runs and self.runs[-1][0].size <= 4 * run[0].size:
            last = self.runs.pop()
            run = (np.concatenate([last[0], run[0]]), np.concatenate([last[1], run[1]]))
        order = np.argsort(run[0], kind="stable")  # equal hashes in the order they came
        self.runs.append((run[0][order], run[1][order]))

    def other(self, hashes: np.ndarray, shard: int) -> np.ndarray:
        """Per hash, the number of another shard holding it, or -1, looking at the first and
        the last of a run's equal hashes (a key missed so is one held by ``shard`` before and
        after another shard: a third copy, of which the second was counted)."""
        out = np.full(hashes.size, -1, np.int64)
        low = hashes & _MASK
        maybe = np.flatnonzero((self.bits[low >> 3] >> (low & 7)) & 1)
        order = maybe[np.argsort(hashes[maybe])]
        needles = hashes[order]  # sorted: numpy's search then walks each run once
        for keys, shards in self.runs:
            at = np.minimum(np.searchsorted(keys, needles), keys.size - 1)
            held = np.flatnonzero(keys[at] == needles)
            if held.size:  # rare: only then the last of the equal hashes is looked for
                last = shards[np.searchsorted(keys, needles[held], "right") - 1]
                first = shards[at[held]]
                pick = np.where(first != shard, first, last)
                rows = order[held]
                out[rows] = np.where((pick != shard) & (out[rows] < 0), pick, out[rows])
        return out


class DuplicateKeys:
    """The keys of the shards read in this process; see the module docstring."""

    def __init__(self) -> None:
        self._shards: dict[str, _Shard] = {}
        self._urls: list[str] = []
        self._runs = _Runs()
        self._kept = 0
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
        if shard is None:
            shard = self._shards[url] = _Shard(len(self._urls), np.zeros(size, bool),
                                               np.zeros(size, bool))  # fmt: skip
            self._urls.append(url)
        hashes = np.fromiter(map(hash, keys), np.int64, len(keys))
        other = self._runs.other(hashes, shard.number)
        found = other >= 0
        if found.any() and not self._warned:
            hit = int(found.argmax())
            self._warn(keys[hit], self._urls[other[hit]], url)
        new = ~shard.compared[rows]
        shard.found[rows] = np.where(new, found, shard.found[rows])
        shard.compared[rows] = True
        if self._kept < MAX_KEYS:
            hashes = hashes if new.all() else hashes[new]
            self._runs.add(hashes, shard.number)
            self._kept += hashes.size
        return int(np.count_nonzero(shard.found[rows]))

    def _warn(self, key: str, first: str, second: str) -> None:
        self._warned = True
        warnings.warn(
            f"key {key!r} is in two shards, {first} and {second}: each gives a sample of that "
            "__key__ (counted in ds.stats()['duplicate_keys'])",
            stacklevel=4,
        )
