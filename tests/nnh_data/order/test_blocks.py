"""The read blocks behind epoch positions (nnh_data.order.blocks), on a table of shard counts."""

from __future__ import annotations

import numpy as np
import pytest

from nnh_data.order.blocks import read_plan
from nnh_data.order.epoch import EpochOrder

COUNTS = (5, 0, 7, 4)


def whole(shard: int, start: int, stop: int) -> list[tuple[int, int]]:
    return [(start, stop)]


def pairs(shard: int, start: int, stop: int) -> list[tuple[int, int]]:
    return [(a, min(a + 2, stop)) for a in range(start, stop, 2)]


@pytest.mark.parametrize("window", [0, 1, 3, 16])
@pytest.mark.parametrize("split", [whole, pairs])
def test_read_plan_covers_the_windows_of_the_positions_in_concat_order(window, split):
    order = EpochOrder(COUNTS, seed=2, window=window)
    blocks = list(read_plan(order, [(2, 6), (9, 11)], window, split))
    concat = [c for _, a, b, c in blocks for c in range(c, c + b - a)]
    assert concat == sorted(set(concat))
    needed = order.concat_positions(np.r_[2:6, 9:11])
    assert set(needed.tolist()) <= set(concat)
    for shard, a, b, _ in blocks:
        assert 0 <= a < b <= COUNTS[shard]
