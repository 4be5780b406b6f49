"""The node-local shard cache: its pure policy as tables and on a demand trace, then the
protocol with real processes and a real S3 API (moto on loopback)."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nnh_data.order import EpochOrder, worker_plan
from nnh_data.shard_cache import (
    Plan,
    ShardCache,
    choose_victims,
    next_uses,
    parse_size,
    read_schedule,
    shard_key,
)
from tests.support import ROOT

pytestmark = pytest.mark.timeout(120)


def _bench():
    """``tools/bench/cache.py``: the demand trace and the policies simulated on it."""
    spec = importlib.util.spec_from_file_location("bench_cache", ROOT / "tools/bench/cache.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("text", "expected"),
    [("50GB", 50 * 10**9), ("1.5GiB", 3 << 29), ("10 kB", 10_000), ("7MiB", 7 << 20),
     ("100", 100), (4096, 4096), ("2tb", 2 * 10**12), (".5KiB", 512)],
)  # fmt: skip
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GB", "5 XB", "-1GB", "1e9", 0, -5, True, 1.5, None])
def test_bad_limits_name_cache_limit(bad, tmp_path):
    with pytest.raises(ValueError, match="cache_limit"):
        parse_size(bad)
    with pytest.raises(ValueError, match="cache_limit"):
        ShardCache(tmp_path, limit=bad if bad is not None else "none")


def test_cache_dir_must_be_a_writable_folder(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cache_dir must be a folder"):
        ShardCache(tmp_path / "file")
    with pytest.raises(ValueError, match="cache_dir must be a writable folder"):
        ShardCache("/proc/nnh-cache")  # not writable, even by root
    cache = ShardCache(tmp_path / "new" / "cache", limit="1GB")
    assert sorted(os.listdir(cache.cache_dir)) == ["lock", "procs", "shards", "stats", "tmp"]
    assert cache.stats()["files"] == 0 and cache.limit == 10**9


def test_keys_depend_on_url_size_and_version():
    key = shard_key("s3://b/a.tar", 10, "ETag=1")
    assert key == shard_key("s3://b/a.tar", 10, "ETag=1")
    others = {shard_key("s3://b/b.tar", 10, "ETag=1"), shard_key("s3://b/a.tar", 11, "ETag=1"),
              shard_key("s3://b/a.tar", 10, "ETag=2")}  # fmt: skip
    assert key not in others and len(others) == 3


# ---------------------------------------------------------------- the policy, pure


def test_next_uses_table():
    a = Plan(["x", "y", "x", "z"], np.array([0, 4, 8, 12]), position=4, num_workers=2)
    b = Plan(["z", "y"], np.array([5, 9]), position=6, num_workers=1)
    # x: a at 8 -> (8-4)*2 = 8; y: a at 4 -> 0 (b's 9 -> 3); z: a 16, b's 5 is past; w: never
    assert next_uses([a, b], ["x", "y", "z", "w"]).tolist() == [8.0, 0.0, 16.0, np.inf]
    assert next_uses([], ["x"]).tolist() == [np.inf]
    assert next_uses([a], []).tolist() == []


@pytest.mark.parametrize(
    ("sizes", "uses", "need", "distance", "refused", "expected"),
    [
        ([1, 1, 1], [3, np.inf, 9], 1, 0, (), [1]),  # farthest first: never used again
        ([1, 1, 1], [3, np.inf, 9], 2, 0, (), [1, 2]),
        ([1, 1, 1], [3, np.inf, 9], 3, 0, (), [1, 2, 0]),
        ([1, 1, 1], [3, np.inf, 9], 3, 3, (), None),  # never one needed at or before d
        ([1, 1, 1], [3, np.inf, 9], 2, 3, (), [1, 2]),
        ([1, 1, 1], [3, np.inf, 9], 1, 0, (1,), [2]),  # pinned ones are skipped
        ([1, 1, 1], [3, np.inf, 9], 3, 0, (1,), None),
        ([5, 1, 1], [3, np.inf, 9], 4, 0, (), [1, 2, 0]),  # whole shards, until enough
        ([1], [0], 1, 0, (), None),  # needed now
        ([2, 2], [np.inf, np.inf], 0, 0, (), []),
    ],
)
def test_choose_victims_table(sizes, uses, need, distance, refused, expected):
    asked = []

    def evictable(i):
        asked.append(i)
        return i not in refused

    assert choose_victims(sizes, uses, need, distance, evictable) == expected
    assert len(asked) == len(set(asked))  # each asked at most once, only as far as needed


def _schedule_oracle(counts, seed, epoch, window, world, rank, workers, worker):
    """Reads of one worker, position by position: entering a window reads its concat range."""
    order = EpochOrder(tuple(counts), seed, epoch, window)
    plan = worker_plan([(0, order.total)], world, rank, workers, worker, "pad")
    size, out, read = window or 1, [], set()
    positions = [p for a, b in plan.positions for p in range(a, b)]
    for item, p in enumerate(positions):
        w = p // size
        if w not in read:
            read.add(w)
            for shard, _, _ in order.pieces(w * size, min((w + 1) * size, order.total)):
                if not out or out[-1][0] != shard:
                    out.append((shard, item))
    for j, p in enumerate(plan.pads):
        ((shard, _, _),) = order.pieces(*(int(order.concat_positions(np.array([p]))[0]) + d
                                          for d in (0, 1)))  # fmt: skip
        if not out or out[-1][0] != shard:
            out.append((shard, len(positions) + j))
    return out


@settings(max_examples=150, deadline=None)
@given(
    counts=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    window=st.integers(0, 12),
    world=st.integers(1, 3),
    workers=st.integers(1, 3),
    seed=st.integers(0, 3),
    data=st.data(),
)
def test_read_schedule_matches_a_position_by_position_walk(
    counts, window, world, workers, seed, data
):
    rank = data.draw(st.integers(0, world - 1))
    worker = data.draw(st.integers(0, workers - 1))
    layout = dict(world_size=world, rank=rank, num_workers=workers, worker=worker)
    got = read_schedule(counts, seed=seed, epoch=1, window=window, **layout)
    assert got == _schedule_oracle(counts, seed, 1, window, world, rank, workers, worker)


def test_read_schedule_appends_the_next_epoch_after_this_pass():
    args = dict(seed=2, window=8, world_size=2, rank=1, num_workers=2, worker=0)
    counts = [10, 7, 12, 5]
    this = read_schedule(counts, epoch=3, **args)
    following = read_schedule(counts, epoch=4, **args)
    length = worker_plan([(0, 34)], 2, 1, 2, 0, "pad").length
    assert read_schedule(counts, epoch=3, next_epoch=True, **args) == this + [
        (s, length + t) for s, t in following
    ]
    resumed = read_schedule(counts, epoch=3, consumed=3, **args)
    assert resumed[0][1] == 0 and {s for s, _ in resumed} <= {s for s, _ in this}


def test_belady_from_plans_fetches_less_than_lru_on_the_trace():
    """96 equal shards, 4 ranks x 2 workers, 4 epochs in the real order: epochs 1-3 fetch at
    most 0.8x (cache of 25%) and 0.7x (50%) what LRU fetches, near the offline optimum."""
    bench = _bench()
    trace = bench.demand_trace()
    for capacity, bound in ((24, 0.8), (48, 0.7)):
        lru, plans, optimum = (bench.count_fetches(trace, capacity, p)
                               for p in ("lru", "plans", "optimum"))  # fmt: skip
        assert plans <= bound * lru, (capacity, plans, lru)
        assert optimum <= plans <= 1.05 * optimum, (capacity, plans, optimum)
