"""The pass's generator stages on plain lists: assemble, parameters, count."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nnh_data.order.blocks import pad_plan, read_plan
from nnh_data.order.epoch import EpochOrder, worker_plan
from nnh_data.streaming import stages

COUNTS = (5, 0, 7, 4)


def pairs(shard: int, start: int, stop: int) -> list[tuple[int, int]]:
    return [(a, min(a + 2, stop)) for a in range(start, stop, 2)]


def values(rows) -> dict:
    """Rows as columns of lists (a per-sample pass takes them as tuples)."""
    return {name: list(col) for name, col in rows.items()}


def decoded(order: EpochOrder, blocks, rows: stages.Rows):
    """Decode blocks of the fake dataset: sample g is {"g": g}."""
    starts = np.concatenate(([0], np.cumsum(order.counts)))
    for shard, a, b, concat in blocks:
        samples = [{"g": int(starts[shard]) + i} for i in range(a, b)]
        yield concat, rows.from_samples(samples)


@pytest.mark.parametrize("rows", [stages.VALUE_COLUMNS, stages.COLUMNS], ids=["values", "columns"])
@pytest.mark.parametrize("window", [0, 4])
def test_assemble_gives_each_position_its_sample_then_the_pads(rows, window):
    order = EpochOrder(COUNTS, seed=5, window=window)
    plan = worker_plan([(0, 16)], world_size=3, rank=2, num_workers=1, worker=0, uneven="pad")
    blocks = list(read_plan(order, plan.positions, window, pairs))
    blocks += pad_plan(order, plan.pads)
    parts = list(stages.assemble(decoded(order, blocks, rows), order, plan.positions, window,
                                 len(plan.pads), rows))  # fmt: skip
    got = []
    for part in parts:
        g = values(part.rows)["g"]
        assert list(g) == part.labels["__index__"].tolist() == part.keys.tolist()
        got += [(x, bool(p)) for x, p in zip(g, part.labels["__pad__"])]
    positions = np.concatenate([np.arange(a, b) for a, b in plan.positions])
    expected = [(int(g), False) for g in order.sample_ids(positions)]
    expected += [(int(order.sample_ids(np.array([p]))[0]), True) for p in plan.pads]
    assert got == expected


@pytest.mark.parametrize("rows", [stages.VALUE_COLUMNS, stages.COLUMNS], ids=["values", "columns"])
@pytest.mark.parametrize("positions", [[(0, 3)], [(2, 6)], [(5, 9), (13, 14)]])
def test_pads_after_a_window_read_in_part_are_their_own_samples(rows, positions):
    # the last window is read whole but only partly needed: its rest is not the pads' rows
    order = EpochOrder(COUNTS, seed=5, window=4)
    blocks = list(read_plan(order, positions, 4, pairs)) + list(pad_plan(order, [1]))
    parts = list(stages.assemble(decoded(order, blocks, rows), order, positions, 4, 1, rows))
    pad = parts[-1]
    g = values(pad.rows)["g"]
    assert list(g) == pad.labels["__index__"].tolist() == order.sample_ids(np.array([1])).tolist()


def test_window_groups_cut_at_window_edges():
    groups = [g.tolist() for g in stages.window_groups([(0, 3), (5, 9)], 4)]
    assert groups == [[0, 1, 2], [5, 6, 7], [8]]


def make_parts(samples_per_part: list[list[dict | None]]) -> list[stages.Part]:
    parts, first = [], 0
    for rows in samples_per_part:
        ids = np.arange(first, first + len(rows), dtype=np.int64)
        first += len(rows)
        labels = {"__index__": ids, "__pad__": np.zeros(len(rows), bool)}
        parts.append(stages.Part(stages.VALUE_COLUMNS.from_samples(rows), labels, ids))
    return list(stages.with_parameters(parts, lambda ids: {"twice": ids * 2}))


def test_hand_out_samples_labels_counts_and_skips():
    parts = make_parts([[{"k": 0}, None, {"k": 2}], [{"k": 3}]])
    progress, skipped = stages.Progress(), []
    out = stages.hand_out_samples(parts, progress, lambda s: s, skipped.append)
    first = next(out)
    assert first == {"k": 0, "__index__": 0, "__pad__": False, "__aug__": {"twice": 0}}
    assert progress.handed_out() == 1
    assert next(out)["k"] == 2 and progress.handed_out() == 3
    assert [label["__index__"] for label in skipped] == [1]
    assert [s["k"] for s in out] == [3] and progress.handed_out() == 4


def test_hand_out_samples_leaves_out_what_finish_refuses():
    parts = make_parts([[{"k": i} for i in range(4)]])
    def odd(s):
        return s if s["k"] % 2 else stages.LEFT_OUT
    progress = stages.Progress()
    assert [s["k"] for s in stages.hand_out_samples(parts, progress, odd, print)] == [1, 3]
    assert progress.handed_out() == 4


def test_hand_out_batches_cuts_whole_batches_and_counts_them():
    cols = [stages.COLUMNS.from_samples([{"k": i} for i in range(a, b)])
            for a, b in [(0, 3), (3, 4), (4, 9)]]  # fmt: skip
    parts = make_parts([[None] * stages.COLUMNS.size(c) for c in cols])
    for part, c in zip(parts, cols):
        part.rows = c
    progress = stages.Progress()
    batches = list(stages.hand_out_batches(parts, 4, progress, lambda b: b))
    assert [b["k"] for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert [b["__aug__"]["twice"].tolist() for b in batches][-1] == [16]
    assert progress.handed_out() == 9


def test_columns_flag_unreadable_rows():
    cols = stages.COLUMNS.from_samples([{"a": 1}, None])
    assert cols[stages.SKIPPED] == [False, True] and cols["a"] == [1, None]
    assert stages.COLUMNS.label(cols, "u", "x")["u"].to_pylist() == ["x", "x"]  # Arrow text
    assert stages.COLUMNS.label(cols, "n", 5)["n"] == [5, 5]
    assert stages.VALUE_COLUMNS.label(cols, "u", "x")["u"] == ["x", "x"]  # built into samples
    values = stages.VALUE_COLUMNS.from_samples([{"a": 1, "b": 2}, {"a": 3}, None])
    assert values[stages.SKIPPED] == [False, False, True] and values["a"][:2] == [1, 3]
    assert values["b"][0] == 2 and values["b"][1] is not None  # absent, not None: left out


def source_sample(source: int, g: int) -> dict | None:
    """Sample ``g`` of ``source``: source 1's every third unreadable and every other holding
    a field ``h`` more; source 2's holding ``h`` before ``g``."""
    if source == 1 and g % 3 == 0:
        return None
    if source == 2:
        return {"h": -g, "g": g}
    return {"g": g, "h": -g} if source == 1 and g % 2 else {"g": g}


def source_parts(source: int, sizes: list[int], rows: stages.Rows) -> list[stages.Part]:
    """Parts of ``sizes`` rows of samples ``source_sample(source, 100 * source + i)``, each
    assembled as a shuffled window is: rows taken from a block in a permuted order (deferred
    by ``rows`` or not)."""
    parts, rng, first = [], np.random.default_rng(source), 100 * source
    for size in sizes:
        block = rows.from_samples([source_sample(source, first + i) for i in range(size + 2)])
        at = rng.permutation(size + 2)[:size]  # a window read in part
        ids = first + at
        labels = {"__index__": ids, "__pad__": np.zeros(size, bool), "__source__": [source] * size}
        parts.append(stages.Part(rows.take(block, at), labels, ids))
        first += size + 2
    return parts


MIXES = [
    ([[4, 3, 5], [2, 2], [1]], [0, 1, 0, 0, 2, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0]),  # one-row source
    ([[6], [3, 1]], [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]),  # a source exhausted first
    ([[5], [0, 2]], [0, 0, 0, 0, 0, 1, 1]),  # an empty part; one source per chunk
]


def mixed_parts(sizes, sources, chunk, rows, out) -> list[stages.Part]:
    streams = [iter(source_parts(s, n, rows)) for s, n in enumerate(sizes)]
    chunks = [np.array(sources[a : a + chunk]) for a in range(0, len(sources), chunk)]
    return list(stages.mix(streams, chunks, out))


@pytest.mark.parametrize("sizes, sources", MIXES)
@pytest.mark.parametrize("chunk", [1, 3, 4, 100])
def test_mix_of_deferred_windows_is_the_mix_of_taken_ones(sizes, sources, chunk):
    # the same permutations taken at once (deferred) or first per source, then mixed
    def plain(parts):
        return [(values(p.rows), {k: list(v) for k, v in p.labels.items()}, list(p.keys))
                for p in parts]  # fmt: skip

    eager = mixed_parts(sizes, sources, chunk, stages.COLUMNS, stages.COLUMNS)
    deferred = stages.deferred(stages.COLUMNS)
    assert plain(mixed_parts(sizes, sources, chunk, deferred, stages.COLUMNS)) == plain(eager)
    ids = np.concatenate([p.labels["__index__"] for p in eager])
    assert (ids // 100).tolist() == sources == sum((p.labels["__source__"] for p in eager), [])
    expected = [None if source_sample(s, g) is None else g for s, g in zip(sources, ids.tolist())]
    assert sum((p.rows["g"] for p in eager), []) == expected


@pytest.mark.parametrize("sizes, sources", MIXES)
@pytest.mark.parametrize("chunk", [1, 3, 4, 100])
@pytest.mark.parametrize("group", [2, 4, 1024])
def test_a_per_sample_mix_interleaves_each_sources_samples(sizes, sources, chunk, group,
                                                           monkeypatch):  # fmt: skip
    # samples built per source, in slices of ``group`` hand-out rows, then interleaved: the
    # samples of the mixed order, fields in the order of their first source, the unreadable
    # ones told in order
    monkeypatch.setattr(stages, "GROUP", group)
    rows = stages.deferred(stages.VALUE_COLUMNS)
    parts = mixed_parts(sizes, sources, chunk, rows, stages.VALUE_COLUMNS)
    parts = stages.with_parameters(parts, lambda ids: {"twice": ids * 2})
    progress, skipped = stages.Progress(), []
    got = list(stages.hand_out_samples(parts, progress, None, skipped.append))
    ids = [int(p.labels["__index__"][i]) for p in mixed_parts(
        sizes, sources, chunk, stages.COLUMNS, stages.COLUMNS) for i in range(p.keys.size)]
    expected, told = [], []
    for i, (s, g) in enumerate(zip(sources, ids)):
        sample = source_sample(s, g)
        if sample is None:
            told.append({"__index__": g, "__source__": s})
            continue
        first = "h" if set(sources[i // chunk * chunk :][:chunk]) == {2} else "g"
        fields = sorted(sample, key=lambda k: k != first)
        expected.append({**{k: sample[k] for k in fields}, "__index__": g, "__pad__": False,
                         "__aug__": {"twice": 2 * g}, "__source__": s})  # fmt: skip
    assert got == expected and [list(s) for s in got] == [list(s) for s in expected]
    assert skipped == told and progress.handed_out() == len(sources)


def test_hand_out_samples_builds_a_long_part_in_slices():
    # a part of several windows (a mixed chunk): samples built a window at a time, the same
    n = 2500
    rows = [None if i % 700 == 3 else {"k": i} | ({"x": i} if i % 3 else {}) for i in range(n)]
    (part,) = make_parts([rows])
    progress, skipped = stages.Progress(), []
    out = stages.hand_out_samples([part], progress, None, skipped.append)
    first = [next(out) for _ in range(1500)]
    assert progress.handed_out() == 1500 + 3  # three unreadable before
    got = first + list(out)
    expected = [{**r, "__index__": i, "__pad__": False, "__aug__": {"twice": 2 * i}}
                for i, r in enumerate(rows) if r is not None]  # fmt: skip
    assert got == expected and [list(s) for s in got] == [list(s) for s in expected]
    assert [label["__index__"] for label in skipped] == [i for i, r in enumerate(rows) if r is None]
    assert progress.handed_out() == n


def _plain_decoding(parts, progress, decoding, skipped):
    """The plain version of a Decoding: the samples as handed out, each decoded in a
    try/except, one at a time."""
    for sample in stages.hand_out_samples(parts, progress, None, skipped):
        try:
            out = decoding.function(sample)
        except Exception as exc:
            out = decoding.failed(sample, exc)
        if out is not stages.LEFT_OUT:
            yield out


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.one_of(st.none(), st.integers(0, 9)), max_size=6), max_size=4),
       st.sets(st.integers(0, 9)), st.booleans(), st.booleans())  # fmt: skip
def test_decoding_hands_out_what_the_plain_loop_does(parts, bad, skip, timing):
    """The mapped decode gives, counts and skips what a try/except per sample gives; a failure
    is told its own sample, and under a raising policy the pass stops where the loop's does."""

    def decode(sample):
        if sample["k"] in bad:
            raise ValueError(sample["k"])
        return sample["k"] * 10

    def failed(sample, exc):
        if not skip:
            raise RuntimeError(f"at {sample['k']}") from exc
        return stages.LEFT_OUT if sample["k"] % 2 else -sample["k"]

    timed = []
    decoding = stages.Decoding(decode, failed, lambda s: timed.append(1) or decode(s),
                               lambda: timing)  # fmt: skip
    runs = []
    for hand_out in (stages.hand_out_samples, _plain_decoding):
        rows = [[None if k is None else {"k": k} for k in part] for part in parts]
        progress, skipped, got = stages.Progress(), [], []
        out = hand_out(make_parts(rows), progress, decoding, skipped.append)
        try:
            for item in out:
                got.append((item, progress.handed_out()))
        except RuntimeError as exc:
            got.append((str(exc), progress.handed_out()))
        runs.append((got, [label["__index__"] for label in skipped], progress.handed_out()))
    assert runs[0] == runs[1]
    assert bool(timed) == (timing and any(k is not None for part in parts for k in part))


@pytest.mark.parametrize("skip", [False, True])
def test_a_decode_raising_stop_iteration_fails_its_sample_and_loses_no_other(skip):
    """StopIteration from the user's function would end the window's map early, silently:
    it is a failure of its sample like any exception, and the window goes on."""

    def decode(sample):
        if sample["k"] == 2:
            raise StopIteration
        return sample["k"]

    def failed(sample, exc):
        if not skip:
            raise RuntimeError(f"at {sample['k']}") from exc
        return stages.LEFT_OUT

    rows = [[{"k": k} for k in range(5)]]
    out = stages.hand_out_samples(make_parts(rows), stages.Progress(),
                                  stages.Decoding(decode, failed), [].append)  # fmt: skip
    if skip:
        assert list(out) == [0, 1, 3, 4]
    else:
        with pytest.raises(RuntimeError, match="at 2"):
            list(out)


@pytest.mark.parametrize("slice_size", [7, 10**6])
@pytest.mark.parametrize("mixed", [False, True])
def test_samples_built_in_slices_are_the_stream_built_whole(tar_shards, monkeypatch, mixed,
                                                            slice_size):  # fmt: skip
    """A per-sample pass builds its samples a slice at a time (``_SLICE``): the samples, their
    order and parameters, what a decode is given and the resume state are those of slices of
    any other size."""
    from nnh_data import ShardedStreamingDataset, Source

    urls = tar_shards([700, 0, 650, 333], size=8)
    two = [Source(urls[:2], weight=1.0, name="a"), Source(urls[2:], weight=2.0, name="b")]

    def seen(sample: dict) -> tuple:
        return sample["__key__"], sample["__index__"], sample.get("__source__"), sample["__aug__"]

    def stream() -> tuple[list, dict]:
        ds = ShardedStreamingDataset(two if mixed else urls, seed=5, shuffle_window=600,
                                     epoch_size=1700, decode=seen)  # fmt: skip
        it = iter(ds)
        head = [next(it) for _ in range(611)]
        state = ds.state_dict()
        return head + list(it), state

    expected = stream()
    monkeypatch.setattr(stages, "_SLICE", slice_size)
    assert stream() == expected
