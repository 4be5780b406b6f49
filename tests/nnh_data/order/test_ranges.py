"""DistributedRangeSplitter: exact tiling, O(1) lookups, precise errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nnh_data import DistributedRangeSplitter


@pytest.mark.parametrize(
    ("total", "world", "expected"),
    [
        (23, 4, [(0, 6), (6, 12), (12, 18), (18, 23)]),
        (100, 4, [(0, 25), (25, 50), (50, 75), (75, 100)]),
        (3, 5, [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]),
        (0, 2, [(0, 0), (0, 0)]),
        (7, 1, [(0, 7)]),
    ],
)
def test_known_splits(total, world, expected):
    splitter = DistributedRangeSplitter(total, world)
    assert splitter.get_all_ranges() == expected
    assert splitter.validate_ranges()


@given(st.integers(0, 10**12), st.integers(1, 1000))
def test_ranges_tile_exactly(total, world):
    splitter = DistributedRangeSplitter(total, world)
    ranges = splitter.get_all_ranges()
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [e - s for s, e in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert splitter.validate_ranges()


@given(st.integers(1, 10**12), st.integers(1, 1000), st.data())
def test_rank_for_sample_matches_ranges(total, world, data):
    splitter = DistributedRangeSplitter(total, world)
    sample = data.draw(st.integers(0, total - 1))
    start, end = splitter.get_rank_range(splitter.get_rank_for_sample(sample))
    assert start <= sample < end


def test_rank_for_every_sample_small():
    splitter = DistributedRangeSplitter(23, 4)
    owners = [splitter.get_rank_for_sample(i) for i in range(23)]
    assert owners == [0] * 6 + [1] * 6 + [2] * 6 + [3] * 5


def test_accepts_numpy_integers():
    splitter = DistributedRangeSplitter(np.int64(10), np.int32(3))
    assert splitter.get_rank_range(np.int64(2)) == (7, 10)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"total_samples": -1, "world_size": 2}, ["total_samples", "-1"]),
        ({"total_samples": 10, "world_size": 0}, ["world_size", "0"]),
        ({"total_samples": 10.0, "world_size": 2}, ["total_samples", "float"]),
        ({"total_samples": 10, "world_size": True}, ["world_size", "bool"]),
        ({"total_samples": "10", "world_size": 2}, ["total_samples", "str"]),
    ],
)
def test_bad_constructor_arguments(kwargs, words):
    with pytest.raises(ValueError) as err:
        DistributedRangeSplitter(**kwargs)
    assert all(w in str(err.value) for w in words)


@pytest.mark.parametrize("rank", [-1, 4, 1.0, False])
def test_bad_rank(rank):
    with pytest.raises(ValueError, match="rank"):
        DistributedRangeSplitter(23, 4).get_rank_range(rank)


@pytest.mark.parametrize("sample_id", [-1, 23, 2.5])
def test_bad_sample_id(sample_id):
    with pytest.raises(ValueError, match="sample_id"):
        DistributedRangeSplitter(23, 4).get_rank_for_sample(sample_id)
