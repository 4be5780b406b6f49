"""nnh_data.cache.policy, pure: byte counts, keys, next uses, victims and read schedules as
tables, against brute force with hypothesis, and on the benchmark's demand trace."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nnh_data.cache.policy import (
    Plan,
    choose_victims,
    next_uses,
    parse_size,
    read_schedule,
    shard_key,
)
from nnh_data.order.epoch import EpochOrder, worker_plan
from tests.nnh_data.cache.helpers import load_bench

INF = float("inf")
BAD_LIMITS = ["", "GB", "5 XB", "-1GB", "1e9", 0, -5, True, 1.5, None]


# ---------------------------------------------------------------- arguments and keys


@pytest.mark.parametrize(
    ("text", "expected"),
    [("50GB", 50 * 10**9), ("1.5GiB", 3 << 29), ("10 kB", 10_000), ("7MiB", 7 << 20),
     ("100", 100), (4096, 4096), ("2tb", 2 * 10**12), (".5KiB", 512)],
)  # fmt: skip
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", BAD_LIMITS)
def test_bad_limits_name_cache_limit(bad):
    with pytest.raises(ValueError, match="cache_limit"):
        parse_size(bad)


def test_keys_depend_on_url_size_and_version():
    key = shard_key("s3://b/a.tar", 10, "ETag=1")
    assert key == shard_key("s3://b/a.tar", 10, "ETag=1")
    others = {shard_key("s3://b/b.tar", 10, "ETag=1"), shard_key("s3://b/a.tar", 11, "ETag=1"),
              shard_key("s3://b/a.tar", 10, "ETag=2")}  # fmt: skip
    assert key not in others and len(others) == 3


# ---------------------------------------------------------------- next uses


A = (["x", "y", "x", "z"], [0, 4, 8, 12], 4, 2)
B = (["z", "y"], [5, 9], 6, 1)


@pytest.mark.parametrize(
    ("plans", "keys", "expected"),
    [
        # x: a at 8 -> (8-4)*2 = 8; y: a at 4 -> 0 (b's 9 -> 3); z: a 16, b's 5 is past; w: never
        ([A, B], ["x", "y", "z", "w"], [8.0, 0.0, 16.0, INF]),
        ([], ["x"], [INF]),
        ([A], [], []),
        ([(["a"], [3], 3, 1)], ["a"], [0.0]),  # a read at the position is next, at 0
        ([(["a", "b"], [1, 6], 2, 3)], ["a", "b"], [INF, 12.0]),  # a's read is past
        ([(["a", "b", "a"], [0, 5, 9], 3, 2)], ["a", "b"], [12.0, 4.0]),  # a's second read
        ([(["a"], [10], 0, 1), (["a"], [4], 2, 4)], ["a"], [8.0]),  # the nearer plan wins
        ([(["a"], [10], 0, 1), (["b"], [4], 2, 4)], ["b", "a"], [8.0, 10.0]),  # keys' order
    ],
)
def test_next_uses_table(plans, keys, expected):
    plans = [Plan(k, np.array(t, dtype=np.int64), p, w) for k, t, p, w in plans]
    assert next_uses(plans, keys).tolist() == expected


_plan = st.builds(
    lambda reads, position, workers: Plan(
        [k for k, _ in reads], np.sort(np.array([t for _, t in reads], dtype=np.int64)),
        position, workers,
    ),
    st.lists(st.tuples(st.sampled_from("abcde"), st.integers(0, 30)), max_size=12),
    st.integers(0, 30),
    st.integers(1, 4),
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(plans=st.lists(_plan, max_size=4), keys=st.lists(st.sampled_from("abcdef"), unique=True))
def test_next_uses_matches_brute_force(plans, keys):
    def brute(key):
        return min(
            [(int(t) - p.position) * p.num_workers for p in plans
             for k, t in zip(p.keys, p.times) if k == key and t >= p.position],
            default=INF,
        )  # fmt: skip

    assert next_uses(plans, keys).tolist() == [brute(key) for key in keys]


# ---------------------------------------------------------------- victims


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
        ([1, 1], [np.inf, np.inf], 1, np.inf, (), None),  # needed never: still not after inf
        ([1, 1, 1], [5, 5, 5], 2, 0, (), [0, 1]),  # ties: in index order
        ([10, 1], [np.inf, 9], 5, 0, (), [0]),  # one large shard frees enough
        ([1, 4, 1], [7, 8, 9], 3, 7.5, (1,), None),  # the one big enough is pinned
    ],
)
def test_choose_victims_table(sizes, uses, need, distance, refused, expected):
    asked = []

    def evictable(i):
        asked.append(i)
        return i not in refused

    assert choose_victims(sizes, uses, need, distance, evictable) == expected
    assert len(asked) == len(set(asked))  # each asked at most once, only as far as needed


@settings(max_examples=300, deadline=None)
@given(
    shards=st.lists(st.tuples(st.integers(1, 5), st.sampled_from([0.0, 1.0, 2.0, 3.0, INF]),
                              st.booleans()), max_size=8),
    need=st.integers(0, 20),
    distance=st.sampled_from([0.0, 1.0, 2.5, INF]),
)  # fmt: skip
def test_choose_victims_frees_enough_by_farthest_use_or_nothing(shards, need, distance):
    sizes = [size for size, _, _ in shards]
    uses = [use for _, use, _ in shards]
    pinned = {i for i, (_, _, pin) in enumerate(shards) if pin}
    chosen = choose_victims(sizes, uses, need, distance, lambda i: i not in pinned)
    eligible = [i for i in range(len(shards)) if uses[i] > distance and i not in pinned]
    if sum(sizes[i] for i in eligible) < need:
        assert chosen is None
        return
    assert chosen is not None and set(chosen) <= set(eligible)
    assert [uses[i] for i in chosen] == sorted((uses[i] for i in chosen), reverse=True)
    freed = sum(sizes[i] for i in chosen)
    assert freed >= need and (not chosen or freed - sizes[chosen[-1]] < need)
    nearest = min((uses[i] for i in chosen), default=INF)
    assert all(uses[i] <= nearest for i in eligible if i not in chosen)  # none farther skipped


# ---------------------------------------------------------------- read schedules


ONE = dict(seed=0, epoch=0, window=0, world_size=1, rank=0, num_workers=1, worker=0)


@pytest.mark.parametrize(
    ("counts", "layout", "expected"),
    [
        ([4, 4], {}, [(0, 0), (1, 4)]),  # one reader: the second shard at its 5th item
        ([4, 4], dict(num_workers=2, worker=1), [(1, 0)]),  # worker 1 of 2: the second half
        ([4, 4], dict(window=4), [(0, 0), (1, 4)]),  # a window of one shard
        ([4, 4], dict(consumed=5), [(1, 0)]),  # resumed after 5 items: the rest of shard 1
        ([4, 4], dict(next_epoch=True), [(0, 0), (1, 4), (0, 8), (1, 12)]),  # then epoch 1
        # rank 1 of 2 reads positions 5-8 (shards 1, 2), then pads its first sample (shard 1)
        ([3, 3, 3], dict(seed=1, world_size=2, rank=1), [(1, 0), (2, 1), (1, 4)]),
        ([3, 2], dict(world_size=2, rank=1, uneven="drop"), [(1, 0)]),
        ([5, 0, 3], dict(seed=2, epoch=1, window=3), [(2, 0), (0, 3)]),  # the empty shard: never
    ],
)
def test_read_schedule_table(counts, layout, expected):
    assert read_schedule(counts, **{**ONE, **layout}) == expected


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


# ---------------------------------------------------------------- on the demand trace


def test_belady_from_plans_fetches_less_than_lru_on_the_trace():
    """96 equal shards, 4 ranks x 2 workers, 4 epochs in the real order: epochs 1-3 fetch at
    most 0.8x (cache of 25%) and 0.7x (50%) what LRU fetches, near the offline optimum."""
    bench = load_bench()
    trace = bench.demand_trace()
    for capacity, bound in ((24, 0.8), (48, 0.7)):
        lru, plans, optimum = (bench.count_fetches(trace, capacity, p)
                               for p in ("lru", "plans", "optimum"))  # fmt: skip
        assert plans <= bound * lru, (capacity, plans, lru)
        assert optimum <= plans <= 1.05 * optimum, (capacity, plans, optimum)
