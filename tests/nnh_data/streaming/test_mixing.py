"""Mixing sources in ShardedStreamingDataset: exact counts, proportions in every window, the same
multiset whatever the layout, elastic resume, coverage across epochs, tar and Parquet mixed."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from nnh_data import ShardedStreamingDataset, Source, state_from_loader, streaming_loader
from tests.support import simulated

WEIGHTS = (0.5, 0.3, 0.2)


@pytest.fixture
def three(tar_shards):
    """Tar sources of 1,000 / 500 / 300 samples in 4 / 2 / 2 shards."""
    return [
        tar_shards([250] * 4, name="a", size=8),
        tar_shards([250] * 2, name="b", size=8),
        tar_shards([150] * 2, name="c", size=8),
    ]


def weighted(three, **kw) -> ShardedStreamingDataset:
    sources = [Source(urls, weight=w, name=n) for urls, w, n in zip(three, WEIGHTS, "abc")]
    return ShardedStreamingDataset(sources, epoch_size=2000, seed=7, shuffle_window=64, **kw)


def pairs(samples) -> list[tuple[str, int]]:
    return [(s["__source__"], s["__index__"]) for s in samples if not s["__pad__"]]


def test_weights_give_exact_counts_and_every_window_its_share(three):
    ds = weighted(three)
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        sources = [s["__source__"] for s in ds]
        assert len(ds) == len(sources) == 2000
        assert Counter(sources) == {"a": 1000, "b": 600, "c": 400}
        for lo in range(0, 2000 - 100 + 1):
            window = Counter(sources[lo : lo + 100])
            for name, share in zip("abc", WEIGHTS):
                assert abs(window[name] - 100 * share) <= 2, (epoch, lo, window)


def test_samples_carry_their_source_id_and_own_data(three):
    repeats = Counter()
    for sample in weighted(three):
        name, index = sample["__source__"], sample["__index__"]
        assert int(sample["cls"]) == index  # each fixture numbers its samples from 0
        assert sample["__shard__"].rsplit("/", 1)[-1].startswith(name)
        repeats[name] += sample["__repeat__"]
    assert repeats == {"a": 0, "b": 100, "c": 100}  # 600 of 500 and 400 of 300 drawn


def keyed(samples) -> Counter:
    """The multiset of (source, id, parameters) of the samples that are not pads."""
    return Counter((s["__source__"], s["__index__"], s["__aug__"]["rotation"])
                   for s in samples if not s["__pad__"])  # fmt: skip


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("workers", [0, 2])
def test_epoch_multiset_and_parameters_do_not_depend_on_the_layout(three, world, workers,
                                                                    monkeypatch):  # fmt: skip
    expected = keyed(weighted(three, epoch=1))
    got = []
    for rank in range(world):
        ds = weighted(three, epoch=1, rank=rank, world_size=world)
        got += simulated(ds, workers, monkeypatch)
    assert len(got) == -(-2000 // world) * world
    assert keyed(got) == expected and sum(expected.values()) == 2000


def test_two_epochs_differ_in_order_and_parameters(three):
    ds = weighted(three)
    first = list(ds)
    ds.set_epoch(1)
    second = list(ds)
    assert pairs(first) != pairs(second)
    assert Counter(s["__source__"] for s in second) == Counter(s["__source__"] for s in first)
    one = {(s["__source__"], s["__index__"]): s["__aug__"]["rotation"] for s in first}
    two = {(s["__source__"], s["__index__"]): s["__aug__"]["rotation"] for s in second}
    shared = set(one) & set(two)
    assert shared and any(one[k] != two[k] for k in shared)


def test_a_source_drawn_below_its_size_covers_it_before_repeating(tar_shards):
    urls = tar_shards([250] * 4, name="big", size=8)
    ds = ShardedStreamingDataset([Source(urls, choose=400)], seed=3, shuffle_window=50)
    seen: list[int] = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        ids = [s["__index__"] for s in ds]
        assert len(ids) == 400 and len(set(ids)) == 400
        seen += ids
    assert len(set(seen[:1000])) == 1000  # every sample once before any twice
    assert set(seen) == set(range(1000))


def test_a_source_drawn_above_its_size_flags_repeats_with_their_own_parameters(tar_shards):
    urls = tar_shards([10, 10], name="small", size=8)
    ds = ShardedStreamingDataset(urls, epoch_size=50, seed=1, shuffle_window=4)
    samples = list(ds)
    counts = Counter(s["__index__"] for s in samples)
    assert len(samples) == 50 and set(counts.values()) == {2, 3}
    firsts = {s["__index__"] for s in samples if not s["__repeat__"]}
    assert firsts == set(range(20)) and sum(not s["__repeat__"] for s in samples) == 20
    by_id: dict[int, list] = {}
    for s in samples:
        by_id.setdefault(s["__index__"], []).append(s["__aug__"]["rotation"])
    assert all(len(set(angles)) == len(angles) for angles in by_id.values())


def test_resume_from_four_ranks_to_two_yields_exactly_the_rest(three):
    batches, k = 16, 5
    handed: list = []
    states = []
    for rank in range(4):
        ds = weighted(three, rank=rank, world_size=4)
        loader = DataLoader(ds, batch_size=batches, collate_fn=list)
        it = iter(loader)
        for _ in range(k):
            handed += next(it)
        states.append(ds.state_dict())
    assert all(s["consumed"] == states[0]["consumed"] for s in states)
    rest = []
    for rank in range(2):
        ds = weighted(three, rank=rank, world_size=2)
        ds.load_state_dict(states[0])
        rest += list(ds)
    assert sorted(pairs(handed) + pairs(rest)) == sorted(pairs(weighted(three)))


def test_stateful_loader_with_workers_resumes_a_mix(three):
    ds = weighted(three)
    loader = streaming_loader(ds, batch_size=32, num_workers=2, collate_fn=list)
    it = iter(loader)
    handed = [s for _ in range(20) for s in next(it)]
    state = state_from_loader(loader.state_dict())
    del it, loader
    fresh = weighted(three)
    fresh.load_state_dict(state)
    rest = list(StatefulDataLoader(fresh, batch_size=None, num_workers=0))
    assert sorted(pairs(handed) + pairs(rest)) == sorted(pairs(weighted(three)))


def plain(value):
    """A value of a row of columns as Python: numpy and Arrow scalars unwrapped."""
    return value.as_py() if hasattr(value, "as_py") else getattr(value, "item", lambda: value)()


@pytest.mark.parametrize("epoch", [0, 1])
def test_per_sample_and_row_passes_of_a_mix_hand_out_the_same(three, epoch):
    # per-sample: each source's samples built in its own order, then interleaved; rows (what a
    # loader collates): the sources' rows gathered into the mixed order. Sample by sample equal
    samples = list(weighted(three, epoch=epoch))
    rows = [{name: plain(col[i]) if name != "__aug__" else {k: plain(v[i]) for k, v in col.items()}
             for name, col in columns.items()}
            for columns, i in weighted(three, epoch=epoch).loader_view()]  # fmt: skip
    assert len(samples) == len(rows) == 2000
    assert samples == rows and [list(s) for s in samples] == [list(r) for r in rows]


def test_tar_and_parquet_sources_mix(tar_shards, parquet_shards):
    tar = tar_shards([30, 30], name="t", size=8)
    table = parquet_shards([25, 15], name="p")
    ds = ShardedStreamingDataset([Source(tar, repeat=1), Source(table, choose=20, name="pq")],
                                 seed=2)  # fmt: skip
    samples = list(ds)
    assert Counter(s["__source__"] for s in samples) == {0: 60, "pq": 20}
    assert all(s["id"] == s["__index__"] for s in samples if s["__source__"] == "pq")
    assert all(int(s["cls"]) == s["__index__"] for s in samples if s["__source__"] == 0)


def test_batch_mode_mixes_sources_with_the_same_fields(three):
    ds = weighted(three, batch_size=64)
    batches = list(ds)
    assert len(batches) == len(ds) == -(-2000 // 64)
    names = [n for b in batches for n in b["__source__"]]
    assert Counter(names) == {"a": 1000, "b": 600, "c": 400}
    assert sorted(zip(names, np.concatenate([b["__index__"] for b in batches]).tolist())) == sorted(
        pairs(weighted(three)))  # fmt: skip


def test_batch_mode_refuses_sources_with_other_fields(tar_shards, parquet_shards):
    sources = [Source(tar_shards([4], size=8)), Source(parquet_shards([4]))]
    with pytest.raises(ValueError, match="same fields"):
        ShardedStreamingDataset(sources, batch_size=2)


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        (lambda u: [Source(u, name="x"), Source(u, name="x")], "distinct"),
        (lambda u: [Source(u), u], "all Source objects"),
        (lambda u: [Source(u, choose=5), Source(u, choose=5)], "epoch_size"),
    ],
)
def test_bad_mixes_are_value_errors(tar_shards, sources, message):
    urls = tar_shards([4], size=8)
    with pytest.raises(ValueError, match=message):
        ShardedStreamingDataset(sources(urls), epoch_size=6)


def test_one_source_without_settings_is_the_plain_dataset(tar_shards):
    urls = tar_shards([7, 5], size=8)
    plain = [(s["__index__"], s["__aug__"]) for s in ShardedStreamingDataset(urls, seed=4)]
    ds = ShardedStreamingDataset([Source(urls)], seed=4)
    assert [(s["__index__"], s["__aug__"]) for s in ds] == plain
    assert {s["__source__"] for s in ds} == {0}
