"""Global batches as pure arithmetic: the same global batches at every world size that fits,
every sample once, equal loader batches per rank at any worker count, resume from any step at
any fitting world size, and reads that enter each lane window once."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nnh_data.order.global_batches import (
    LANES,
    GlobalBatches,
    RankShare,
    check_world_size,
    fitting_world_sizes,
    read_pieces,
    worker_batches,
    worker_length,
)
from nnh_data.order.resume import global_start


def _items(batch) -> list[tuple[int, int, bool]]:
    """``(lane, item, pad)`` of each item of a batch, in order."""
    return [(lane, j, pad) for lane, lo, hi, pad in zip(batch.lane.tolist(), batch.lo.tolist(),
            batch.hi.tolist(), batch.pad.tolist()) for j in range(lo, hi)]  # fmt: skip


def loader_order(share: RankShare, start: int, workers: int, skips=None) -> list[list]:
    """The loader batches of a rank as a DataLoader takes them: worker ``i % workers`` yields
    the ``i``-th, until every worker is done."""
    skips = skips or [0] * workers
    per = [[_items(b) for b in worker_batches(share, start, workers, w, skips[w])]
           for w in range(workers)]  # fmt: skip
    out = []
    for i in itertools.count():
        w, j = i % workers, i // workers
        if j >= len(per[w]):
            break
        out.append(per[w][j])
    assert sum(map(len, per)) == len(out)  # workers run out in worker order
    return out


def global_steps(gb: GlobalBatches, world: int, unit: int, workers: int, start_step: int = 0):
    """Each step's items over every rank, as sorted lists, from ``start_step``."""
    steps: list[list] = [[] for _ in range(gb.steps - start_step)]
    for rank in range(world):
        share = RankShare(gb, world, rank, unit)
        flat = [item for batch in loader_order(share, start_step * share.share, workers)
                for item in batch]  # fmt: skip
        assert all(len(b) == unit for b in loader_order(share, 0, workers))  # equal batches
        assert len(flat) == share.length - start_step * share.share
        for k in range(len(steps)):
            steps[k] += flat[k * share.share : (k + 1) * share.share]
    return [sorted(s) for s in steps]


@pytest.mark.parametrize(
    ("size", "partitions", "fits"),
    [
        (512, 64, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]),
        (96, 64, [1, 2, 4, 8, 16, 32]),
        (12, 4, [1, 2, 4, 12]),
        (8, 3, [1]),
        (6, 3, [1, 3, 6]),
        (1, 64, [1]),
    ],
)
def test_fitting_world_sizes(size, partitions, fits):
    assert fitting_world_sizes(size, partitions) == fits


def test_a_world_size_that_does_not_fit_is_refused_naming_those_that_do():
    with pytest.raises(ValueError, match=r"world_size=3 does not fit .*: 1, 2, 4, 8, 16, 32"):
        check_world_size(3, 96, 64)
    with pytest.raises(ValueError, match=r"batch_size=3 must divide .* = 8\): one of 1, 2, 4, 8"):
        RankShare(GlobalBatches(100, 64, 8), world_size=8, rank=0, unit=3)


@pytest.mark.parametrize(
    ("total", "size", "partitions", "uneven", "steps", "kept", "lengths"),
    [
        (10, 4, 2, "pad", 3, 10, [2, 2, 2, 0, 2, 2, 0, 0]),
        (10, 4, 2, "drop", 2, 8, [2, 2, 0, 0, 2, 2, 0, 0]),
        (0, 4, 2, "pad", 0, 0, [0] * 8),
        (3, 8, 4, "pad", 1, 3, [2, 0, 0, 0, 1, 0, 0, 0] + [0] * 8),
        (3, 8, 4, "drop", 0, 0, [0] * 16),
        (40, 2, 4, "pad", 20, 40, [5] * 8),  # gcd(4, 2) = 2 partitions of one item a step
    ],
)
def test_lane_lengths(total, size, partitions, uneven, steps, kept, lengths):
    gb = GlobalBatches(total, size, partitions, uneven)
    assert (gb.steps, gb.kept) == (steps, kept)
    assert np.diff(gb.lane_starts).tolist() == lengths
    assert gb.lanes == len(lengths) == gb.groups * LANES


def test_locate_is_a_bijection_onto_the_lanes_and_pads_repeat_the_first_steps():
    gb = GlobalBatches(total=13, global_batch_size=4, partitions=4)
    lane, item, pad = gb.locate(np.arange(gb.steps * 4))
    assert pad.tolist() == [False] * 13 + [True] * 3
    real = set(zip(lane[:13].tolist(), item[:13].tolist()))
    assert real == {(lane, j) for lane in range(gb.lanes) for j in range(gb.lane_length(lane))}
    assert list(zip(lane[13:], item[13:])) == list(zip(lane[:3], item[:3]))


@settings(max_examples=60)
@given(
    total=st.integers(0, 120),
    size=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24]),
    partitions=st.sampled_from([1, 2, 3, 4, 8, 16]),
    uneven=st.sampled_from(["pad", "drop"]),
)
def test_same_global_batches_at_every_fitting_layout(total, size, partitions, uneven):
    gb = GlobalBatches(total, size, partitions, uneven)
    reference = global_steps(gb, 1, size, 1)
    real = [(lane, j) for step in reference for lane, j, pad in step if not pad]
    assert sorted(real) == sorted(set(real)) and len(real) == gb.kept  # every sample once
    assert all(len(step) == size for step in reference)  # pads fill the last step
    for world in fitting_world_sizes(size, partitions):
        share = size // world
        for unit in [d for d in range(1, share + 1) if share % d == 0]:
            for workers in (1, 2, 3, 4):
                assert global_steps(gb, world, unit, workers) == reference, (world, unit, workers)


@settings(max_examples=60)
@given(
    total=st.integers(1, 120),
    size=st.sampled_from([2, 4, 6, 8, 12]),
    partitions=st.sampled_from([2, 4, 8]),
    data=st.data(),
)
def test_resume_at_any_fitting_world_size_from_any_step(total, size, partitions, data):
    gb = GlobalBatches(total, size, partitions, "pad")
    fits = fitting_world_sizes(size, partitions)
    reference = global_steps(gb, 1, size, 1)
    first, then = data.draw(st.sampled_from(fits)), data.draw(st.sampled_from(fits))
    workers, unit = data.draw(st.sampled_from([1, 2, 3])), size // first
    step = data.draw(st.integers(0, gb.steps))
    # every worker of the first layout handed out its batches of the first `step` steps
    handed = [len(range(w, step, workers)) * unit for w in range(workers)]
    state = {"global_batch_size": size, "world_size": first, "start": [0, 0],
             "consumed": handed, "unit": unit}  # fmt: skip
    start, skip = global_start(state, world_size=then, num_workers=1, worker=0, unit=1)
    assert (start, skip) == (step * (size // then), 0)
    assert global_steps(gb, then, 1, 2, start_step=step) == reference[step:]


@settings(max_examples=40)
@given(
    total=st.integers(0, 200),
    partitions=st.sampled_from([2, 4, 8]),
    data=st.data(),
)
def test_a_worker_resumed_inside_its_pass_yields_the_rest_of_its_batches(total, partitions, data):
    size = 8
    gb = GlobalBatches(total, size, partitions, data.draw(st.sampled_from(["pad", "drop"])))
    world = data.draw(st.sampled_from(fitting_world_sizes(size, partitions)))
    unit = data.draw(st.sampled_from([d for d in (1, 2, 4, 8) if (size // world) % d == 0]))
    workers = data.draw(st.integers(1, 4))
    share = RankShare(gb, world, data.draw(st.integers(0, world - 1)), unit)
    for w in range(workers):
        whole = [_items(b) for b in worker_batches(share, 0, workers, w)]
        flat = [item for batch in whole for item in batch]
        assert len(flat) == worker_length(share, 0, workers, w)
        skip = data.draw(st.integers(0, len(flat)))
        rest = [item for b in worker_batches(share, 0, workers, w, skip) for item in _items(b)]
        assert rest == flat[skip:]


@settings(max_examples=40)
@given(
    total=st.integers(0, 300),
    window=st.sampled_from([1, 3, 8, 64]),
    data=st.data(),
)
def test_reads_enter_each_lane_window_once_in_the_order_needed(total, window, data):
    size, partitions = 16, 4
    gb = GlobalBatches(total, size, partitions, data.draw(st.sampled_from(["pad", "drop"])))
    world = data.draw(st.sampled_from([1, 2, 4]))
    workers = data.draw(st.sampled_from([1, 2, 4]))
    reads: Counter = Counter()
    for rank in range(world):
        share = RankShare(gb, world, rank, size // world)
        for w in range(workers):
            pieces = list(read_pieces(worker_batches(share, 0, workers, w), gb, window))
            needed = [(lane, j) for b in worker_batches(share, 0, workers, w)
                      for lane, j, pad in _items(b) if not pad]  # fmt: skip
            got = [(p.lane, j) for p in pieces if not p.pad for j in range(p.lo, p.hi)]
            assert set(needed) <= set(got)
            first_needed = list(dict.fromkeys((lane, j // window) for lane, j in needed))
            assert [(p.lane, p.lo // window) for p in pieces if not p.pad] == first_needed
            reads.update((p.lane, p.lo // window) for p in pieces if not p.pad)
    # lanes of whole partitions, workers dividing LANES, a loader batch of whole partitions:
    # no lane window is read by two workers or two ranks
    assert set(reads.values()) <= {1}
