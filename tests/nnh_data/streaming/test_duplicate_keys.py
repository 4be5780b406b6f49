"""DuplicateKeys: a block's keys against those of the shards read before it."""

from __future__ import annotations

import pytest

from nnh_data.streaming.duplicate_keys import DuplicateKeys


def test_duplicate_keys_counts_what_a_shard_read_before_holds():
    """Unit table: keys in any order, blocks of a shard in any order, a shard read again."""
    keys = DuplicateKeys()
    assert keys.count("a", ["3", "1", "2"]) == 0
    assert keys.count("b", ["9", "8"]) == 0  # disjoint ranges: nothing compared
    with pytest.warns(UserWarning, match="key '1' is in two shards, a and c"):
        assert keys.count("c", ["5", "1", "8", "7"]) == 2
    assert keys.count("a", ["1", "2", "3"]) == 0  # a was read first
    assert keys.count("c", ["8"]) == 1  # no second warning
    assert keys.count("a", []) == 0
