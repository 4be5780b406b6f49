"""Source mixing: count tables and errors, then properties of the draws and the interleave
against plain oracles (brute-force occurrence counts, an exact sort of every draw's time)."""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nnh_data.order.epoch import EpochOrder
from nnh_data.order.mixing import (
    MixedOrder,
    Source,
    SourceDraws,
    draw_segments,
    epoch_positions,
    plan_counts,
    source_seed,
)


def _w(*weights):
    return [Source(f"s{i}", weight=w) for i, w in enumerate(weights)]


def _plain(n):
    return [Source(f"s{i}") for i in range(n)]


# ---------------------------------------------------------------- Source and plan_counts


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"source": None}, "source must be shards"),
        ({"weight": 1, "repeat": 2}, "at most one of weight, repeat, choose.*weight=1, repeat=2"),
        ({"repeat": 1, "choose": 3}, "at most one"),
        ({"weight": 0}, "weight must be a finite number > 0, got 0"),
        ({"weight": -1.5}, "weight must be a finite number > 0, got -1.5"),
        ({"weight": math.nan}, "weight must be a finite number > 0, got nan"),
        ({"repeat": math.inf}, "repeat must be a finite number > 0, got inf"),
        ({"repeat": "2"}, "repeat must be a finite number > 0, got '2'"),
        ({"weight": True}, "weight must be a finite number > 0, got True"),
        ({"choose": -1}, r"choose must be in \[0, inf\), got -1"),
        ({"choose": 2.5}, "choose must be an integer, got float 2.5"),
        ({"name": 3}, "name must be a str or None, got 3"),
    ],
)
def test_source_rejects(kwargs, message):
    kwargs = {"source": "data/*.tar", **kwargs}
    with pytest.raises(ValueError, match=message):
        Source(**kwargs)


def test_source_normalises_settings():
    assert Source("x", weight=2).weight == 2.0
    assert Source("x", repeat=np.float32(0.5)).repeat == 0.5
    assert Source("x", choose=np.int64(7)).choose == 7
    assert Source("x", choose=0).choose == 0


@pytest.mark.parametrize(
    ("sources", "sizes", "epoch_size", "expected"),
    [
        (_w(0.5, 0.3, 0.2), [1000, 500, 300], 2000, [1000, 600, 400]),  # the issue's table
        (_w(0.5, 0.3, 0.2), [1000, 500, 300], None, [900, 540, 360]),  # epoch = sum of sizes
        (_w(0.1, 0.2, 0.7), [5, 5, 5], 10, [1, 2, 7]),  # decimal weights are taken exactly
        (_w(1, 1, 1), [9, 9, 9], 10, [4, 3, 3]),  # ties go to the earlier source
        (_w(1, 2), [0, 0], None, [0, 0]),
        (_plain(3), [10, 0, 5], None, [10, 0, 5]),  # no setting: read once per epoch
        (_plain(1), [1000], 250, [250]),  # one source with an epoch size
        (_plain(2), [300, 100], 200, [150, 50]),  # ... shares in proportion to sizes
        (_plain(2), [300, 100], 800, [600, 200]),
        ([Source("a", choose=100), *_w(1, 1)], [7, 9, 9], 301, [100, 101, 100]),
        ([Source("a", choose=100), *_plain(2)], [7, 30, 10], 140, [100, 30, 10]),
        ([Source("a", choose=100), *_plain(1)], [7, 30], None, [100, 30]),
        ([Source("a", repeat=2.5), *_plain(1)], [10, 7], None, [25, 7]),
        ([Source("a", repeat=0.5), Source("b", repeat=0.5)], [3, 3], None, [2, 1]),
        ([Source("a", repeat=0.5)], [3], None, [2]),  # 1.5 rounds half up
        ([Source("a", repeat=0.5)], [3], 2, [2]),
        ([Source("a", repeat=0.1)], [3], None, [0]),
        ([Source("a", choose=0), *_plain(1)], [5, 8], None, [0, 8]),
        ([Source("a", choose=4), Source("b", repeat=1)], [5, 8], 12, [4, 8]),
    ],
)
def test_plan_counts_table(sources, sizes, epoch_size, expected):
    assert plan_counts(sizes, sources, epoch_size) == expected


@pytest.mark.parametrize(
    ("sources", "sizes", "epoch_size", "message"),
    [
        ([], [], None, "sources must hold at least one Source, got none"),
        (_plain(2), [3], None, r"sizes must hold one size per source \(2\), got \[3\]"),
        (_plain(1), [-1], None, r"sizes\[0\] must be in \[0, inf\), got -1"),
        (_plain(1), [3], -2, r"epoch_size must be in \[0, inf\), got -2"),
        (
            [Source("a", choose=700, name="wiki"), Source("b", repeat=2)],
            [10, 250],
            1000,
            r"epoch_size is 1000 but choose/repeat fix 1200 draws "
            r"\(source 0 \('wiki'\): 700, source 1: 500\)",
        ),
        (
            [Source("a", choose=900)],
            [10],
            1000,
            "fix 900 draws .*no other source takes the 100 left",
        ),
        (
            [Source("a", choose=1000), *_w(0.5)],
            [10, 10],
            1000,
            "choose/repeat fix all of it .*nothing is left for source 1",
        ),
        (
            [Source("a", choose=10), *_plain(1)],
            [10, 10],
            10,
            "nothing is left for source 1",
        ),
        (
            [Source("a", weight=0.5, name="big"), Source("b"), Source("c")],
            [10, 10, 10],
            None,
            r"ambiguous: weighted source 0 \('big'\); no weight, repeat or choose: sources 1, 2;",
        ),
        (
            [Source("a", weight=0.5), Source("b", weight=0.5, name="e")],
            [10, 0],
            20,
            r"sources of 0 samples cannot be drawn: source 1 \('e'\) asked for 10$",
        ),
        ([Source("a", choose=3)], [0], None, "cannot be drawn: source 0 asked for 3$"),
        (_plain(2), [0, 0], 5, "cannot be drawn: source 0 asked for 3, source 1 asked for 2$"),
    ],
)
def test_plan_counts_errors(sources, sizes, epoch_size, message):
    with pytest.raises(ValueError, match=message):
        plan_counts(sizes, sources, epoch_size)


@given(
    st.lists(st.floats(0.01, 100), min_size=1, max_size=6),
    st.integers(0, 10**6),
    st.data(),
)
def test_plan_counts_weights_sum_and_stay_within_one_of_share(weights, epoch_size, data):
    sizes = data.draw(st.lists(st.integers(1, 10**6), min_size=len(weights), max_size=len(weights)))
    counts = plan_counts(sizes, _w(*weights), epoch_size)
    assert sum(counts) == epoch_size
    total = sum(Fraction(repr(w)) for w in weights)
    for count, w in zip(counts, weights):
        assert abs(count - epoch_size * Fraction(repr(w)) / total) < 1


# ---------------------------------------------------------------- one source's draws


def test_source_seed():
    assert source_seed(7, 0) == 7
    seeds = {source_seed(7, s) for s in range(1, 50)} | {source_seed(8, 1), 7, 8}
    assert len(seeds) == 52
    with pytest.raises(ValueError, match="index must be in"):
        source_seed(7, -1)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((4, 6, 0, 0, 4), [(0, 0, 4)]),
        ((4, 6, 1, 0, 4), [(0, 4, 6), (1, 0, 2)]),
        ((4, 6, 1, 2, 3), [(1, 0, 1)]),
        ((6, 6, 5, 1, 6), [(5, 1, 6)]),  # count == size: cycle e is epoch e
        ((7, 3, 1, 0, 7), [(2, 1, 3), (3, 0, 3), (4, 0, 2)]),  # whole passes plus a part
        ((3, 3, 2, 2, 2), []),
        ((0, 0, 4, 0, 0), []),
    ],
)
def test_draw_segments_table(args, expected):
    assert draw_segments(*args) == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, 0, 0, 0, 1), "size must be > 0 to draw count=2 samples per epoch, got 0"),
        ((4, 6, 0, 0, 5), r"hi must be in \[0, 4\], got 5"),
        ((4, 6, 0, 3, 2), r"lo must be in \[0, 2\], got 3"),
        ((4, 6, -1, 0, 1), r"epoch must be in \[0, inf\), got -1"),
    ],
)
def test_draw_segments_errors(args, message):
    with pytest.raises(ValueError, match=message):
        draw_segments(*args)


@given(st.integers(0, 30), st.integers(1, 30), st.integers(0, 5), st.data())
def test_draw_segments_walk_one_stream(count, size, epoch, data):
    hi = data.draw(st.integers(0, count))
    lo = data.draw(st.integers(0, hi))
    stream = [
        k * size + p for k, a, b in draw_segments(count, size, epoch, lo, hi) for p in range(a, b)
    ]
    assert stream == list(range(epoch * count + lo, epoch * count + hi))


shard_counts = st.lists(st.integers(0, 12), min_size=1, max_size=6).filter(lambda c: sum(c) > 0)


@settings(deadline=None)
@given(shard_counts, st.integers(0, 2**64 - 1), st.integers(0, 9), st.sampled_from([0, 1, 3, 8]))
def test_epoch_positions_inverts_the_order(counts, seed, epoch, window):
    order = EpochOrder(tuple(counts), seed, epoch, window)
    positions = np.arange(order.total)
    assert epoch_positions(order, order.sample_ids(positions)).tolist() == positions.tolist()
    with pytest.raises(ValueError, match=f"ids must be in \\[0, {order.total}\\)"):
        epoch_positions(order, [order.total])


@pytest.mark.parametrize("window", [0, 1, 64, 1024])
@pytest.mark.parametrize("counts", [(1000,), (300, 0, 200, 500), (7,) * 140 + (20,)])
def test_source_below_its_size_covers_everything_before_a_repeat(counts, window):
    """1,000 samples drawn 400 per epoch: epochs 0-2 see all 1,000 before any sample twice."""
    src = SourceDraws(counts, seed=11, draws=400, window=window)
    epochs = [src.sample_ids(e, 0, 400) for e in range(3)]
    ids = np.concatenate([ids for ids, _ in epochs]).tolist()
    assert sorted(ids[:1000]) == list(range(1000))
    assert [occ.max() for _, occ in epochs[:2]] == [0, 0]  # no repeat within epochs 0 and 1
    assert set(ids[:400]) != set(ids[400:800])  # and another subset each epoch


@settings(deadline=None)
@given(shard_counts, st.integers(0, 2**64 - 1), st.integers(0, 6), st.sampled_from([0, 1, 4]))
def test_one_source_drawn_its_size_is_the_single_source_order(counts, seed, epoch, window):
    size = sum(counts)
    src = SourceDraws(tuple(counts), source_seed(seed, 0), size, window)
    ids, occurrences = src.sample_ids(epoch, 0, size)
    today = EpochOrder(tuple(counts), seed, epoch, window).sample_ids(np.arange(size))
    assert ids.tolist() == today.tolist()
    assert not occurrences.any()


def _brute_occurrences(ids):
    seen: Counter = Counter()
    out = []
    for i in ids:
        out.append(seen[i])
        seen[i] += 1
    return out


@settings(deadline=None)
@given(
    shard_counts,
    st.integers(0, 2**64 - 1),
    st.integers(0, 40),
    st.integers(0, 6),
    st.sampled_from([0, 1, 3, 5]),
    st.data(),
)
def test_occurrence_matches_a_brute_force_count(counts, seed, draws, epoch, window, data):
    src = SourceDraws(tuple(counts), seed, draws, window)
    ids, occurrences = src.sample_ids(epoch, 0, draws)
    assert len(ids) == draws
    assert occurrences.tolist() == _brute_occurrences(ids.tolist())
    hi = data.draw(st.integers(0, draws))
    lo = data.draw(st.integers(0, hi))
    part_ids, part_occurrences = src.sample_ids(epoch, lo, hi)
    assert part_ids.tolist() == ids[lo:hi].tolist()
    assert part_occurrences.tolist() == occurrences[lo:hi].tolist()


def test_occurrence_rejects_a_cycle_outside_the_epoch():
    src = SourceDraws((5, 5), seed=0, draws=4)
    with pytest.raises(ValueError, match=r"cycle must be in \[0, 1\], got 2"):
        src.occurrence(epoch=2, cycle=2, ids=[0])  # epoch 2 reads stream [8, 12): cycles 0, 1
    with pytest.raises(ValueError, match="draws must be 0 for a source of 0 samples, got 3"):
        SourceDraws((0,), seed=0, draws=3)


# ---------------------------------------------------------------- the interleave


def _key(counts, phases, s, j):
    """The exact sort key of draw j of source s: its time (j + u_s) / c_s, then s."""
    return Fraction((j << 53) + phases[s], counts[s]), s


def _oracle(counts, phases):
    """Every draw sorted by its exact key."""
    draws = sorted((_key(counts, phases, s, j), j) for s, c in enumerate(counts) for j in range(c))
    return [s for (_, s), _ in draws], [j for _, j in draws]


def _is_prefix(mix, before):
    """Whether taking ``before[s]`` first draws of each source takes every key below the rest."""
    taken = [_key(mix.counts, mix.phases, s, b - 1) for s, b in enumerate(before) if b]
    rest = [_key(mix.counts, mix.phases, s, b) for s, b in enumerate(before) if b < mix.counts[s]]
    return not taken or not rest or max(taken) < min(rest)


small_counts = st.lists(st.integers(0, 40), min_size=1, max_size=5)
special_phases = st.one_of(st.integers(0, 2**53 - 1), st.sampled_from([0, 1, 2**52, 2**53 - 1]))


@given(small_counts, st.data())
def test_merge_is_the_exact_sort_also_on_ties(counts, data):
    """Phases equal, 0 or a unit apart make exact ties and float near-ties."""
    phases = data.draw(st.lists(special_phases, min_size=len(counts), max_size=len(counts)))
    if data.draw(st.booleans()):
        phases = [phases[0] + data.draw(st.integers(0, 1)) for _ in counts]
    mix = MixedOrder(tuple(counts))
    object.__setattr__(mix, "phases", tuple(phases))  # forced phases, through the public methods
    source, draw = mix.assign(0, sum(counts))
    expected = _oracle(counts, phases)
    assert (source.tolist(), draw.tolist()) == expected
    p = data.draw(st.integers(0, sum(counts)))
    assert mix.draws_before(p) == [
        expected[0][:p].count(s) for s in range(len(counts))
    ]


@given(small_counts, st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_mixed_order_is_the_exact_sort(counts, seed, epoch):
    mix = MixedOrder(tuple(counts), seed, epoch)
    source, draw = mix.assign(0, mix.total)
    assert (source.tolist(), draw.tolist()) == _oracle(counts, mix.phases)


@settings(deadline=None)
@given(
    st.lists(st.integers(0, 10**12), min_size=1, max_size=8).filter(lambda c: sum(c) > 0),
    st.integers(0, 2**64 - 1),
    st.integers(0, 1000),
    st.data(),
)
def test_mixed_order_slices_agree_with_a_larger_slice(counts, seed, epoch, data):
    """Slices of huge epochs (float times near-tie often): every cut is an exact prefix, a range
    is the exact sort of the draws it holds, and its sub-ranges agree with it."""
    mix = MixedOrder(tuple(counts), seed, epoch)
    lo = data.draw(st.integers(0, mix.total))
    hi = data.draw(st.integers(lo, min(mix.total, lo + 3000)))
    ranges = mix.draw_range(lo, hi)
    for before in zip(*ranges):
        assert _is_prefix(mix, before)
    source, draw = mix.assign(lo, hi)
    draws = sorted(
        (_key(counts, mix.phases, s, j), j) for s, r in enumerate(ranges) for j in range(*r)
    )
    assert (source.tolist(), draw.tolist()) == ([s for (_, s), _ in draws], [j for _, j in draws])
    mid = data.draw(st.integers(lo, hi))
    for a, b in ((lo, mid), (mid, hi)):
        part = mix.assign(a, b)
        assert part[0].tolist() == source[a - lo : b - lo].tolist()
        assert part[1].tolist() == draw[a - lo : b - lo].tolist()


@given(small_counts.filter(lambda c: sum(c) > 0), st.integers(0, 2**64 - 1), st.data())
def test_mixed_order_slices_and_draws(counts, seed, data):
    mix = MixedOrder(tuple(counts), seed, data.draw(st.integers(0, 100)))
    source, draw = mix.assign(0, mix.total)
    for s, c in enumerate(counts):
        assert draw[source == s].tolist() == list(range(c))  # each draw once, in order
    hi = data.draw(st.integers(0, mix.total))
    lo = data.draw(st.integers(0, hi))
    part = mix.assign(lo, hi)
    assert part[0].tolist() == source[lo:hi].tolist() and part[1].tolist() == draw[lo:hi].tolist()
    assert mix.draws_before(lo) == [int((source[:lo] == s).sum()) for s in range(len(counts))]


def _window_deviation(counts, source, length):
    """Largest |count of s in any `length` consecutive positions - share of s|, per source."""
    hits = np.zeros((len(source) + 1, len(counts)))
    hits[1:][np.arange(len(source)), source] = 1
    cumulative = np.cumsum(hits, axis=0)
    windows = cumulative[length:] - cumulative[:-length]
    share = np.asarray(counts) * length / sum(counts)
    return np.abs(windows - share).max(axis=0)


@given(
    st.lists(st.integers(0, 300), min_size=1, max_size=6).filter(lambda c: sum(c) > 0),
    st.integers(0, 2**64 - 1),
    st.integers(0, 50),
    st.integers(1, 200),
)
def test_every_window_holds_each_source_in_proportion(counts, seed, epoch, length):
    """Within 1 + w_s (S - 2) of the share, S the sources with draws: 2 for three sources."""
    mix = MixedOrder(tuple(counts), seed, epoch)
    assume(length <= mix.total)
    live = sum(1 for c in counts if c)
    bound = [1 + c / mix.total * max(live - 2, 0) for c in counts]
    deviation = _window_deviation(counts, mix.assign(0, mix.total)[0], length)
    assert (deviation <= np.asarray(bound) + 1e-9).all()


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_issue_table_windows_of_100_within_two(seed):
    counts = plan_counts([1000, 500, 300], _w(0.5, 0.3, 0.2), 2000)
    for epoch in range(4):
        source = MixedOrder(tuple(counts), seed, epoch).assign(0, 2000)[0]
        assert np.bincount(source).tolist() == [1000, 600, 400]
        assert _window_deviation(counts, source, 100).max() <= 2
    uneven = (977, 611, 412)  # not a multiple of the window: the bound still holds
    assert _window_deviation(uneven, MixedOrder(uneven, seed, 0).assign(0, 2000)[0], 100).max() <= 2


def test_epochs_and_seeds_differ_and_one_source_is_the_identity():
    orders = [MixedOrder((1000, 600, 400), seed, epoch) for seed, epoch in ((0, 0), (0, 1), (1, 0))]
    sources = [order.assign(0, 2000)[0].tolist() for order in orders]
    assert sources[0] != sources[1] and sources[0] != sources[2]
    source, draw = MixedOrder((50,), seed=3, epoch=7).assign(10, 50)
    assert source.tolist() == [0] * 40 and draw.tolist() == list(range(10, 50))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: MixedOrder(()), r"counts must hold one count per source, got \(\)"),
        (lambda: MixedOrder((3, -1)), r"counts\[1\] must be in \[0, inf\), got -1"),
        (lambda: MixedOrder((3,), seed=-1), r"seed must be in \[0, 18446744073709551615\]"),
        (lambda: MixedOrder((3, 2)).assign(2, 6), r"hi must be in \[0, 5\], got 6"),
        (lambda: MixedOrder((3, 2)).draw_range(3, 2), r"lo must be in \[0, 2\], got 3"),
        (lambda: MixedOrder((3, 2)).draws_before(6), r"p must be in \[0, 5\], got 6"),
    ],
)
def test_mixed_order_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_empty_mix():
    source, draw = MixedOrder((0, 0)).assign(0, 0)
    assert source.size == draw.size == 0


def test_source_draws_keeps_recent_cycle_orders():
    src = SourceDraws((3, 4), seed=5, draws=7, window=2)
    assert src.order(1) is src.order(1)
    for cycle in range(10):
        expected = EpochOrder((3, 4), 5, cycle, 2).sample_ids(np.arange(7))
        assert src.order(cycle).sample_ids(np.arange(7)).tolist() == expected.tolist()
    assert src == SourceDraws((3, 4), seed=5, draws=7, window=2)
    assert hash(src) == hash(SourceDraws((3, 4), seed=5, draws=7, window=2))
