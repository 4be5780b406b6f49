"""A lane's sample order: a contiguous part of an epoch's shard order, shuffled in its own windows.

In global-batch mode (:mod:`nnh_data.order.global_batches`) the epoch is cut into lanes: the
shards are permuted as in :class:`~nnh_data.order.epoch.EpochOrder` and laid end to end
("concat positions"), and lane ``l`` is the contiguous concat range ``[start, start + total)``.
Its samples are shuffled in windows of ``window`` that start at the lane's start (not at
multiples of ``window`` over the epoch), each permuted under a key of (seed, epoch, lane,
window). So a lane never shares a window with another one: whoever reads a lane reads its
windows, and only those, whatever the world size. Positions here are the lane's own,
``[0, total)``; concat positions too (:meth:`LaneOrder.pieces` adds ``start``). The object has
the methods the read stages ask of an order (:mod:`nnh_data.order.blocks`,
:func:`nnh_data.streaming.stages.assemble`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from nnh_data.order.epoch import EpochOrder, hashed_permutation, windowed
from nnh_data.seeding import fold_key, stream_key

__all__ = ["LaneOrder"]

_LANES_DOMAIN = 0x4C414E4553  # "LANES": keeps lane window keys apart from other keys


@dataclass(frozen=True)
class LaneOrder:
    """The order of lane ``lane``: ``total`` samples from concat position ``start`` of
    ``order`` (whose shard permutation and ``window`` apply; its own windows do not).

    Example:
        >>> epoch = EpochOrder(counts=(4, 4), seed=1, epoch=0, window=2)
        >>> lane = LaneOrder(epoch, lane=1, start=3, total=4)
        >>> sorted(lane.sample_ids(np.arange(4)).tolist()) == sorted(
        ...     epoch.ids_at_concat(np.arange(3, 7)).tolist())
        True
    """

    order: EpochOrder
    lane: int
    start: int
    total: int

    @property
    def window(self) -> int:
        """Samples shuffled together (0: no shuffle)."""
        return self.order.window

    def window_permutation(self, w: int) -> np.ndarray:
        """The permutation of the lane's window ``w``."""
        size = min(self.window, self.total - w * self.window)
        key = fold_key(stream_key(self.order.seed, self.order.epoch, 1),
                       (_LANES_DOMAIN, self.lane, w))  # fmt: skip
        return hashed_permutation(size, key)

    def concat_positions(self, positions: np.ndarray) -> np.ndarray:
        """The lane's concat positions of its sorted ``positions``."""
        return windowed(positions, self.window, self.window_permutation)

    def ids_at_concat(self, concat: np.ndarray) -> np.ndarray:
        """Global sample ids at the lane's concat positions ``concat``."""
        return self.order.ids_at_concat(np.asarray(concat, dtype=np.int64) + self.start)

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        """Global sample ids at the lane's sorted ``positions``."""
        return self.ids_at_concat(self.concat_positions(positions))

    def pieces(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """``(shard, start, stop)`` local sample ranges, in order, that hold the lane's concat
        positions ``[lo, hi)``."""
        return self.order.pieces(self.start + lo, self.start + hi)
