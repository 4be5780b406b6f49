"""DuplicateKeys: a block's keys against those of the shards read before it."""

from __future__ import annotations

import numpy as np
import pytest

from nnh_data.streaming.duplicate_keys import DuplicateKeys


def _count(keys: DuplicateKeys, url: str, first: int, block: list[str]) -> int:
    return keys.count(url, 10, np.arange(first, first + len(block)), block)


def test_duplicate_keys_counts_each_extra_copy_once_per_read():
    """Keys in any order, blocks of a shard in any order and read again, shards interleaved:
    a key that two shards hold counts in the sample read second, at every read of it."""
    keys = DuplicateKeys()
    assert _count(keys, "a", 0, ["3", "1", "2"]) == 0
    assert _count(keys, "b", 0, ["9", "8"]) == 0  # disjoint ranges: nothing compared
    with pytest.warns(UserWarning, match="key '1' is in two shards, a and c"):
        assert _count(keys, "c", 0, ["5", "1", "8", "7"]) == 2
    assert _count(keys, "a", 0, ["3", "1", "2"]) == 0  # read again: as it was first
    assert _count(keys, "c", 2, ["8"]) == 1  # no second warning
    assert _count(keys, "a", 3, ["7", "0"]) == 1  # a's later block: "7" was c's first
    assert _count(keys, "c", 0, ["5", "1", "8", "7"]) == 2
    assert _count(keys, "a", 5, []) == 0


def test_a_key_two_shards_hold_counts_once_whichever_is_read_first():
    for order in (["a", "b"], ["b", "a"]):
        keys = DuplicateKeys()
        with pytest.warns(UserWarning, match="is in two shards"):
            counts = [_count(keys, url, 0, ["x", "y"]) for url in order * 2]
        assert counts == [0, 2, 0, 2]


def test_random_keys_of_many_shards_find_exactly_the_shared_ones():
    """Hash-like keys (every shard's range overlaps every other's), blocks interleaved: the
    count is the number of keys of each block that another shard read before held."""
    rng = np.random.default_rng(0)
    pool = [f"{k:016x}" for k in rng.integers(0, 2**63, 4000)]
    shards = {f"s{i}": list(rng.choice(pool, 50, replace=False)) for i in range(60)}
    keys, held = DuplicateKeys(), {}
    with pytest.warns(UserWarning, match="is in two shards"):
        for first in range(0, 50, 10):
            for url, shard in shards.items():
                block = shard[first:first + 10]
                others = set().union(*(k for u, k in held.items() if u != url))
                counted = keys.count(url, 50, np.arange(first, first + 10), block)
                assert counted == sum(key in others for key in block)
                held.setdefault(url, set()).update(block)
