"""One pass of a source read through the node-local shard cache (:mod:`nnh_data.cache.store`).

A :class:`CachedPass` stands between a pass's read blocks and its
:class:`~nnh_data.shards.reading.ShardReader` when the dataset has a ``cache_dir`` and the source is
remote. It publishes the pass's plan (the shard of every run of blocks and when the pass reads
it, then the same for the next epoch, timed in samples read), moves the position as blocks are
fetched, and reads each shard from a pinned local copy, held from the first block of its run to
the last (a shard's blocks are consecutive in a pass, except across mixing cycles and for pads).
The cache never changes what is read: a shard it has no room for is read from the remote, as
without a cache, and a local copy that fails to read or to decode is removed and the block
read from the remote. The session lives in the thread that fetches: :meth:`CachedPass.blocks`
opens it when the first block is asked for and closes it when the blocks are done or dropped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import BinaryIO

import numpy as np

from nnh_data.cache.session import CacheSession
from nnh_data.cache.store import ShardCache
from nnh_data.columns import Columns
from nnh_data.errors import ShardError
from nnh_data.order.blocks import Block
from nnh_data.shards.index import ShardInfo
from nnh_data.shards.reading import ShardReader

__all__ = ["CachedPass"]


class CachedPass:
    """The blocks ``blocks`` of a pass over ``shards``, read through ``cache``; ``following``:
    the next epoch's blocks (planned, not read). ``prefetch``: whole shards fetched ahead;
    ``num_workers``: the DataLoader workers taking turns with this one."""

    def __init__(
        self,
        cache: ShardCache,
        reader: ShardReader,
        shards: Sequence[ShardInfo],
        blocks: Sequence[Block],
        following: Sequence[Block] = (),
        *,
        prefetch: int = 1,
        num_workers: int = 1,
    ) -> None:
        self.cache, self.reader, self.shards = cache, reader, shards
        self.prefetch, self.num_workers = prefetch, num_workers
        self._blocks = list(blocks)
        self._times = _read_times(self._blocks)
        following = list(following)
        self._plan = _runs(self._blocks, self._times) + _runs(
            following, _read_times(following) + self._times[-1]
        )
        self._session: CacheSession | None = None
        self._next = 0  # the number of the next block fetched
        self._pinned: ShardInfo | None = None
        self._file: BinaryIO | None = None
        self._from_copy: set[str] = set()  # URLs of the shards read from a local copy
        self._damaged: list[ShardInfo] = []  # copies that failed to decode, to discard
        self.local = False  # the last block fetched came from a local copy

    def blocks(self) -> Iterator[Block]:
        """The pass's blocks, the cache session open while they are read."""
        self._session = self.cache.session(
            storage_options=self.reader.storage_options, prefetch=self.prefetch,
            num_workers=self.num_workers,
        )  # fmt: skip
        try:
            self._session.set_plan([self.shards[s] for s, _ in self._plan],
                                   [t for _, t in self._plan])  # fmt: skip
            yield from self._blocks
            self._discard_damaged()
        finally:
            self._session.close()

    def fetch(self, info: ShardInfo, start: int, stop: int) -> bytes | Columns:
        """What :meth:`ShardReader.fetch` gives, read from the local copy when there is one.
        Called once per block of :meth:`blocks`, in order."""
        session = self._session
        assert session is not None, "fetch is called for the blocks of blocks()"
        session.advance(int(self._times[self._next]))
        self._next += 1
        self._discard_damaged()
        if info is not self._pinned:
            self._unpin()
            self._pinned, self._file = info, session.open(info)
        if self._file is not None:
            try:
                payload = self.reader.fetch(info, start, stop, self._file)
                self._from_copy.add(info.url)
                self.local = True
                return payload
            except ShardError:
                self._discard(info)  # a bad local copy: read the remote, download it again
        self.local = False
        return self.reader.fetch(info, start, stop)

    def copy_failed(self, info: ShardInfo) -> bool:
        """Report that a block of ``info`` did not decode: True when it was read from a local
        copy (then the copy is removed and the block is to be read with :meth:`fetch_remote`),
        False when it came from the remote (the error is the shard's). Any thread."""
        if info.url not in self._from_copy:
            return False
        self._damaged.append(info)  # removed by the fetching thread, which owns the session
        return True

    def fetch_remote(self, info: ShardInfo, start: int, stop: int) -> bytes | Columns:
        """The block read from the remote, around the cache (any thread)."""
        r = self.reader
        return ShardReader(r.storage_options, r.nullable, r.arrow).fetch(info, start, stop)

    def _discard_damaged(self) -> None:
        while self._damaged:
            self._discard(self._damaged.pop())

    def _discard(self, info: ShardInfo) -> None:
        assert self._session is not None
        self._session.discard(info)
        if info is self._pinned:
            self._file = None  # the rest of the run reads the remote

    def _unpin(self) -> None:
        if self._file is not None and self._session is not None:
            self._session.release(self._pinned)
        self._pinned, self._file = None, None


def _read_times(blocks: Sequence[Block]) -> np.ndarray:
    """When each block is read, in samples read before it (one more entry: the total)."""
    sizes = np.fromiter((stop - start for _, start, stop, _ in blocks), np.int64, len(blocks))
    return np.concatenate(([0], np.cumsum(sizes)))


def _runs(blocks: Sequence[Block], times: np.ndarray) -> list[tuple[int, int]]:
    """``(shard, time)`` of each run of consecutive blocks of one shard."""
    runs: list[tuple[int, int]] = []
    for block, t in zip(blocks, times.tolist()):
        if not runs or runs[-1][0] != block[0]:
            runs.append((block[0], t))
    return runs
