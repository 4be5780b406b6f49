"""Epoch order and the rank/worker split: tables, then properties against a list-based oracle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nnh_data.order.epoch import (
    EpochOrder,
    coalesce,
    hashed_permutation,
    rank_span,
    remaining,
    virtual_to_positions,
    worker_plan,
)
from nnh_data.order.ranges import DistributedRangeSplitter


def _expand(intervals):
    return [p for a, b in intervals for p in range(a, b)]


def _oracle_items(base, world, rank, workers, worker, uneven):
    """(position, is_pad) items of one worker, built from plain lists."""
    virtual = _expand(base)
    total = len(virtual)
    start, end = DistributedRangeSplitter(total, world).get_rank_range(rank)
    length = -(-total // world) if uneven == "pad" else total // world
    real = virtual[start:end][:length]
    items = [(p, False) for p in real]
    items += [(virtual[(start + j) % total], True) for j in range(length - len(real))]
    a, b = DistributedRangeSplitter(length, workers).get_rank_range(worker)
    return items[a:b]


def _plan_items(plan):
    return [(p, False) for p in _expand(plan.positions)] + [(p, True) for p in plan.pads]


bases = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), max_size=4).map(
    lambda pairs: coalesce([(a, a + n) for a, n in pairs])
)


@pytest.mark.parametrize(
    ("total", "world", "rank", "uneven", "expected"),
    [
        (10, 3, 0, "pad", (0, 4, 4)),
        (10, 3, 2, "pad", (7, 3, 4)),
        (10, 3, 0, "drop", (0, 3, 3)),
        (2, 5, 4, "pad", (2, 0, 1)),
        (2, 5, 4, "drop", (2, 0, 0)),
        (0, 2, 1, "pad", (0, 0, 0)),
    ],
)
def test_rank_span_table(total, world, rank, uneven, expected):
    span = rank_span(total, world, rank, uneven)
    assert (span.start, span.real, span.length) == expected


def test_rank_span_rejects_unknown_uneven():
    with pytest.raises(ValueError, match="uneven must be one of 'pad', 'drop', got 'odd'"):
        rank_span(10, 2, 0, "odd")


@pytest.mark.parametrize(
    ("base", "lo", "hi", "expected"),
    [
        ([(0, 10)], 2, 5, [(2, 5)]),
        ([(0, 3), (5, 8), (10, 12)], 2, 7, [(2, 3), (5, 8), (10, 11)]),
        ([(4, 6), (9, 10)], 2, 3, [(9, 10)]),
        ([(4, 6)], 1, 1, []),
    ],
)
def test_virtual_to_positions_table(base, lo, hi, expected):
    assert virtual_to_positions(base, lo, hi) == expected


def test_remaining_table():
    assert remaining([(0, 10)], 2, 1, "pad", [3]) == [(3, 5), (8, 10)]
    assert remaining([(0, 10)], 3, 2, "pad", [1, 0]) == [(1, 4), (5, 7), (8, 10)]
    assert remaining([(0, 10)], 3, 1, "drop", [0]) == [(0, 3), (4, 10)]  # position 3 dropped
    assert remaining([(0, 10)], 3, 1, "pad", [4]) == []


def test_remaining_rejects_bad_counts():
    with pytest.raises(ValueError, match="consumed must hold 2 counts"):
        remaining([(0, 10)], 1, 2, "pad", [1])
    with pytest.raises(ValueError, match=r"consumed must be in \[0, 5\], got 6"):
        remaining([(0, 10)], 2, 1, "pad", [6])


def test_order_without_shuffle_is_the_identity():
    order = EpochOrder((3, 0, 4), window=0)
    assert order.sample_ids(np.arange(7)).tolist() == list(range(7))
    assert list(order.pieces(2, 6)) == [(0, 2, 3), (2, 0, 3)]


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 30), max_size=8),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 5),
    window=st.integers(1, 17),
)
def test_order_is_a_permutation_with_local_windows(counts, seed, epoch, window):
    order = EpochOrder(tuple(counts), seed=seed, epoch=epoch, window=window)
    total = sum(counts)
    ids = order.sample_ids(np.arange(total))
    assert sorted(ids.tolist()) == list(range(total))
    concat = order.concat_positions(np.arange(total))
    assert (concat // window == np.arange(total) // window).all()  # a window stays in its span
    pieces = list(order.pieces(0, total))
    assert sum(stop - start for _, start, stop in pieces) == total
    again = EpochOrder(tuple(counts), seed=seed, epoch=epoch, window=window)
    assert again.sample_ids(np.arange(total)).tolist() == ids.tolist()


def test_epochs_and_seeds_change_the_order():
    keys = [(0, 0), (0, 1), (1, 0)]
    orders = [EpochOrder((50, 50, 50), seed=s, epoch=e, window=32) for s, e in keys]
    ids = [o.sample_ids(np.arange(150)).tolist() for o in orders]
    assert ids[0] != ids[1] and ids[0] != ids[2] and ids[1] != ids[2]


def test_hashed_permutation_is_pure_and_varies_with_key():
    assert hashed_permutation(20, 3).tolist() == hashed_permutation(20, 3).tolist()
    assert hashed_permutation(20, 3).tolist() != hashed_permutation(20, 4).tolist()


def test_the_order_is_pinned_and_the_same_window_by_window():
    """The exact order (a change of it would change every stream), and each window's positions
    alone give the positions of the whole range."""
    from nnh_data.seeding import sample_seeds

    assert hashed_permutation(8, 7).tolist() == [0, 2, 3, 4, 7, 6, 1, 5]
    for size, key in [(1, 0), (300, 9), (1024, 5), (1000, 2**64 - 1), (20_000, 3)]:
        hashes = sample_seeds(key, np.arange(size, dtype=np.int64))
        expected = np.argsort(hashes, kind="quicksort")
        assert hashed_permutation(size, key).tolist() == expected.tolist()
    order = EpochOrder((5, 7, 4), seed=3, epoch=2, window=4)
    whole = order.concat_positions(np.arange(16)).tolist()
    assert whole == [0, 3, 1, 2, 7, 5, 6, 4, 9, 8, 10, 11, 14, 12, 13, 15]
    windows = [order.concat_positions(np.arange(a, a + 4)).tolist() for a in range(0, 16, 4)]
    assert sum(windows, []) == whole and order.concat_positions(np.array([6, 7])).tolist() == [6, 4]


@settings(max_examples=80, deadline=None)
@given(
    base=bases,
    world=st.integers(1, 5),
    workers=st.integers(1, 4),
    uneven=st.sampled_from(["pad", "drop"]),
)
def test_plans_match_the_oracle_and_cover_the_base(base, world, workers, uneven):
    lengths, seen = set(), []
    for rank in range(world):
        rank_items = []
        for k in range(workers):
            plan = worker_plan(base, world, rank, workers, k, uneven)
            items = _plan_items(plan)
            assert items == _oracle_items(base, world, rank, workers, k, uneven)
            assert len(items) == plan.length
            rank_items += items
        lengths.add(len(rank_items))
        seen += [p for p, pad in rank_items if not pad]
    assert len(lengths) == 1  # every rank yields the same count
    assert len(seen) == len(set(seen))
    if uneven == "pad":
        assert sorted(seen) == _expand(base)
    else:
        assert len(seen) == world * (len(_expand(base)) // world)


@settings(max_examples=80, deadline=None)
@given(
    base=bases,
    world=st.integers(1, 5),
    workers=st.integers(1, 3),
    new_world=st.integers(1, 5),
    new_workers=st.integers(1, 3),
    fractions=st.lists(st.floats(0, 1), min_size=3, max_size=3),
)
def test_resume_yields_exactly_what_is_left(
    base, world, workers, new_world, new_workers, fractions
):
    """Handed-out prefixes plus a new split of `remaining` cover the base once (pad mode)."""
    lengths = [worker_plan(base, world, 0, workers, k, "pad").length for k in range(workers)]
    consumed = [int(f * n) for f, n in zip(fractions, lengths)]
    handed = [
        p
        for rank in range(world)
        for k in range(workers)
        for p, pad in _oracle_items(base, world, rank, workers, k, "pad")[: consumed[k]]
        if not pad
    ]
    left = remaining(base, world, workers, "pad", consumed)
    assert sorted(handed + _expand(left)) == _expand(base)
    rest = [
        p
        for rank in range(new_world)
        for k in range(new_workers)
        for p in _expand(worker_plan(left, new_world, rank, new_workers, k, "pad").positions)
    ]
    assert sorted(rest) == _expand(left)


def test_worker_plan_skips_the_handed_out_items():
    plan = worker_plan([(0, 10)], 3, 2, 2, 1, "pad", consumed=1)
    assert (plan.positions, plan.pads, plan.length, plan.consumed) == ([], [7], 2, 1)
    with pytest.raises(ValueError, match=r"consumed must be in \[0, 2\], got 3"):
        worker_plan([(0, 10)], 3, 2, 2, 1, "pad", consumed=3)
