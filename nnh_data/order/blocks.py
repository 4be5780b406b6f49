"""The read blocks behind a worker's epoch positions: which shard pieces to read, in what order.

A block is ``(shard, start, stop, concat start)``: samples ``start:stop`` of ``shard``, which
sit at ``concat start`` in the concatenation of the shards. :func:`read_plan` covers sorted
positions with the windows they touch (so a window's rows can be taken in its permuted order
once read), in concat order, each shard piece cut by the reader's ``split`` (bounded reads);
:func:`pad_plan` gives one one-sample block per pad. Pure: integers in and out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np

from nnh_data.order.epoch import EpochOrder, Intervals, coalesce
from nnh_data.order.lanes import LaneOrder

__all__ = ["Block", "pad_plan", "read_plan"]

Block = tuple[int, int, int, int]  # (shard, start, stop, concat start)


def read_plan(
    order: EpochOrder | LaneOrder,
    positions: Intervals,
    window: int,
    split: Callable[[int, int, int], list[tuple[int, int]]],
) -> Iterator[Block]:
    """The blocks that cover sorted epoch ``positions``: the windows they touch (the whole
    range without shuffle, ``window=0``), in order, each shard piece cut by
    ``split(shard, start, stop)``.

    Example:
        >>> order = EpochOrder((3, 3), window=0)
        >>> list(read_plan(order, [(1, 5)], 0, lambda s, a, b: [(a, b)]))
        [(0, 1, 3, 1), (1, 0, 2, 3)]
    """
    size = window or 1
    spans = coalesce(
        [(a // size * size, min(-(-b // size) * size, order.total)) for a, b in positions]
    )
    for lo, hi in spans:
        for shard, start, stop in order.pieces(lo, hi):
            for a, b in split(shard, start, stop):
                yield shard, a, b, lo + (a - start)
            lo += stop - start


def pad_plan(order: EpochOrder | LaneOrder, pads: Iterable[int]) -> Iterator[Block]:
    """One one-sample block per pad: the sample at each epoch position of ``pads``."""
    for position in pads:
        concat = int(order.concat_positions(np.array([position]))[0])
        ((shard, start, stop),) = order.pieces(concat, concat + 1)
        yield shard, start, stop, concat
