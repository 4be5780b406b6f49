"""ShardedStreamingDataset(global_batch_size=G, partitions=P): the same global batches (sample
ids and parameters) at every world size that fits, every sample once, equal loader batches per
rank at any worker count, resume at another world size, and what the mode refuses.

Ranks are simulated in one process; DataLoader workers through the one place that discovers
them (``WORKER``/``NUM_WORKERS``), their batches taken in turn as a DataLoader takes them. A few
tests run real workers (fork and spawn, persistent) and torchdata's StatefulDataLoader.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nnh_data.audit.epoch_audit import EpochAudit
from nnh_data.loaders.rank_cached import create_rank_cached_dataloader
from nnh_data.order.mixing import Source
from nnh_data.shards.reading import build_shard_index
from nnh_data.streaming.dataset import ShardedStreamingDataset, merge_states, state_from_loader
from nnh_data.streaming.loader import streaming_loader
from tests.support import numbered_samples, write_tar

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")
SETTINGS = {"seed": 7, "shuffle_window": 4}


def write_shards(folder: str, counts: list[int]) -> list[str]:
    """Tar shards of numbered samples (``cls`` holds the id) in ``folder``."""
    paths, first = [], 0
    for i, count in enumerate(counts):
        paths.append(f"{folder}/shard-{i:06d}.tar")
        write_tar(paths[-1], numbered_samples(first, count, 16), pax=False)
        first += count
    return paths


def _row(sample: dict) -> tuple[int, bool, int]:
    assert int(sample["cls"]) == sample["__index__"] == sample["__aug__"]["sample_id"]
    return sample["__index__"], bool(sample["__pad__"]), sample["__aug__"]["seed"]


def _batch_rows(batch: dict) -> list[tuple[int, bool, int]]:
    """The rows of a collated batch (or a dataset's batch)."""
    columns = (batch["__index__"], batch["__pad__"], batch["__aug__"]["seed"])
    ids, pads, seeds = (np.asarray(x).tolist() for x in columns)
    return list(zip(ids, map(bool, pads), seeds))


@contextlib.contextmanager
def as_worker(worker: int, workers: int) -> Iterator[None]:
    """Run the block as DataLoader worker ``worker`` of ``workers`` (0: the main process)."""
    if not workers:
        yield
        return
    os.environ["WORKER"], os.environ["NUM_WORKERS"] = str(worker), str(workers)
    try:
        yield
    finally:
        del os.environ["WORKER"], os.environ["NUM_WORKERS"]


def _worker_items(ds: ShardedStreamingDataset, workers: int, worker: int) -> list:
    with as_worker(worker, workers):
        return list(ds)


def simulated_batches(
    ds: ShardedStreamingDataset, workers: int, unit: int, state: dict | None = None
) -> list[list]:
    """The loader batches (rows) of ``ds`` with ``workers`` DataLoader workers (0: none),
    taken in turn from the workers as a DataLoader takes them; each worker's copy of ``ds``
    resumes from ``state`` when one is given."""
    if workers == 0:
        if state is not None:
            ds.load_state_dict(state)
        rows = [_row(s) for s in ds]
        return [rows[i : i + unit] for i in range(0, len(rows), unit)]
    per = []
    for w in range(workers):
        if state is not None:
            ds.load_state_dict(state)
        rows = [_row(s) for s in _worker_items(ds, workers, w)]
        per.append([rows[i : i + unit] for i in range(0, len(rows), unit)])
    out = []
    for i in itertools.count():
        if i // workers >= len(per[i % workers]):
            return out
        out.append(per[i % workers][i // workers])


def steps_of(per_rank: list[list[list]], per_step: int) -> list[list]:
    """Each global step's rows over all ranks, sorted: ``per_step`` loader batches per rank."""
    steps: list[list] = []
    for batches in per_rank:
        for k in range(0, len(batches), per_step):
            if k // per_step == len(steps):
                steps.append([])
            steps[k // per_step] += [row for b in batches[k : k + per_step] for row in b]
    return [sorted(s) for s in steps]


def datasets(index, world: int, **kwargs) -> list[ShardedStreamingDataset]:
    return [ShardedStreamingDataset(index, rank=r, world_size=world, **{**SETTINGS, **kwargs})
            for r in range(world)]  # fmt: skip


def check_epoch(steps: list[list], total: int, size: int) -> None:
    """Every sample once, every step full (pads) or dropped."""
    real = [i for step in steps for i, pad, _ in step if not pad]
    assert sorted(real) == sorted(set(real)), Counter(real).most_common(3)
    assert all(len(step) == size for step in steps)
    assert len(real) in (total, total - total % size)


@settings(max_examples=15)
@given(
    counts=st.lists(st.integers(0, 25), min_size=1, max_size=5),
    size=st.sampled_from([4, 6, 8]),
    partitions=st.sampled_from([2, 4]),
    uneven=st.sampled_from(["pad", "drop"]),
    window=st.sampled_from([1, 4, 16]),
    data=st.data(),
)
def test_same_global_batches_at_every_fitting_layout(counts, size, partitions, uneven, window,
                                                     data):  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        index = build_shard_index(write_shards(folder, counts))
        kw = {"global_batch_size": size, "partitions": partitions, "uneven": uneven,
              "shuffle_window": window, "epoch": data.draw(st.integers(0, 3))}  # fmt: skip
        (one,) = datasets(index, 1, **kw)
        reference = steps_of([simulated_batches(one, 0, size)], 1)
        check_epoch(reference, index.total_samples, size)
        for world in [w for w in (1, 2, 3, 4, 6, 8) if size % w == 0 and partitions % w == 0]:
            share = size // world
            unit = data.draw(st.sampled_from([d for d in range(1, share + 1) if share % d == 0]))
            workers = data.draw(st.sampled_from([0, 1, 2, 4]))
            per_rank = []
            for ds in datasets(index, world, **kw):
                ds.set_loader_batch_size(unit)
                per_rank.append(simulated_batches(ds, workers, unit))
                assert len(per_rank[-1]) * unit == len(ds)  # len() is exact
                assert all(len(b) == unit for b in per_rank[-1])  # equal batches
            assert steps_of(per_rank, share // unit) == reference, (world, unit, workers)


@settings(max_examples=10)
@given(
    counts=st.lists(st.integers(1, 20), min_size=2, max_size=4),
    data=st.data(),
)
def test_resume_at_any_fitting_world_size_from_any_step(counts, data):
    size, partitions = 8, 4
    with tempfile.TemporaryDirectory() as folder:
        index = build_shard_index(write_shards(folder, counts))
        kw = {"global_batch_size": size, "partitions": partitions}
        reference = steps_of([simulated_batches(datasets(index, 1, **kw)[0], 0, size)], 1)
        first, then = (data.draw(st.sampled_from([1, 2, 4])) for _ in range(2))
        workers = data.draw(st.sampled_from([0, 1, 2]))
        step = data.draw(st.integers(0, len(reference)))
        states, done = [], []
        for ds in datasets(index, first, **kw):  # every worker hands out its batches of `step`
            worker_states = []
            for w in range(max(workers, 1)):
                with as_worker(w, workers):
                    it = iter(ds)
                    n = len(range(w, step, max(workers, 1))) * size // first
                    done += [_row(next(it)) for _ in range(n)]
                    worker_states.append(ds.state_dict())
            states.append(merge_states(worker_states))
        assert all(s == states[0] for s in states)
        rest = []
        for ds in datasets(index, then, **kw):
            workers = data.draw(st.sampled_from([0, 2]))
            rest.append(simulated_batches(ds, workers, size // then, states[0]))
        assert sorted(done) == sorted(r for s in reference[:step] for r in s)
        assert steps_of(rest, 1) == reference[step:]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_real_workers_and_persistent_epochs_match_one_process(context, tmp_path):
    index = build_shard_index(write_shards(str(tmp_path), [13, 0, 21, 8, 30]))
    kw = {"global_batch_size": 8, "partitions": 4}
    for epoch in (0, 1):
        (one,) = datasets(index, 1, epoch=epoch, **kw)
        reference = steps_of([simulated_batches(one, 0, 8)], 1)
        if epoch == 0:
            loaders = []
            for ds, workers in zip(datasets(index, 2, **kw), (2, 1)):
                loaders.append((ds, streaming_loader(ds, 2, num_workers=workers,
                                                     multiprocessing_context=context)))
        per_rank = []
        for ds, loader in loaders:  # persistent workers see set_epoch
            ds.set_epoch(epoch)
            per_rank.append([_batch_rows(b) for b in loader])
            assert len(per_rank[-1]) == len(loader)
        assert steps_of(per_rank, 2) == reference


@pytest.mark.timeout(180)
def test_stateful_loader_resumes_its_own_layout_and_merged_states_another(tmp_path):
    index = build_shard_index(write_shards(str(tmp_path), [13, 0, 21, 8, 30]))
    kw = {"global_batch_size": 8, "partitions": 4}
    reference = steps_of([simulated_batches(datasets(index, 1, **kw)[0], 0, 8)], 1)
    done, loader_states = [], []
    for ds in datasets(index, 2, **kw):
        loader = streaming_loader(ds, 2, num_workers=2)
        it = iter(loader)
        done.append([_batch_rows(next(it)) for _ in range(6)])  # 3 steps
        loader_states.append(loader.state_dict())
        del it, loader
    # the same layout: each rank's loader goes on with its own batches
    fresh = datasets(index, 2, **kw)
    for ds, state, first, whole in zip(datasets(index, 2, **kw), loader_states, done, fresh):
        loader = streaming_loader(ds, 2, num_workers=2)
        loader.load_state_dict(state)
        whole.set_loader_batch_size(2)
        assert first + [_batch_rows(b) for b in loader] == simulated_batches(whole, 2, 2)
    # merged: 4 ranks without workers go on with the global batches
    merged = state_from_loader(loader_states[0])
    assert merged["start"] == [0, 0] and sum(merged["consumed"]) == 12
    rest = []
    for ds in datasets(index, 4, **kw):
        rest.append(simulated_batches(ds, 2, 2, merged))
    assert steps_of(done, 2) == reference[:3]
    assert steps_of(rest, 1) == reference[3:]


def test_a_state_stopped_inside_a_step_resumes_only_at_its_world_size(tmp_path):
    index = build_shard_index(write_shards(str(tmp_path), [40]))
    kw = {"global_batch_size": 8, "partitions": 4}
    ds = datasets(index, 2, **kw)[0]
    ds.set_loader_batch_size(2)
    it = iter(ds)
    for _ in range(2):  # one loader batch of the 2 in a step
        next(it)
    state = ds.state_dict()
    other = datasets(index, 4, **kw)[0]
    with pytest.raises(ValueError, match=r"inside global step 0, after 2 of the 4 items .* "
                                         r"only at world_size=2"):  # fmt: skip
        other.load_state_dict(state)
    same = datasets(index, 2, **kw)[0]
    same.load_state_dict(state)
    with pytest.raises(ValueError, match="batch size that divides 2"):
        same.set_loader_batch_size(4)
    same.set_loader_batch_size(1)
    assert len(same) == len(ds) - 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 3, "rank": 0}, r"world_size=3 does not fit .*: 1, 2, 4, 8"),
        ({"partitions": 4, "global_batch_size": None}, "partitions=4 applies to global"),
        ({"rank_aware_params": True}, "rank_aware_params=True keys the parameters"),
        ({"on_error": "skip"}, "on_error='skip' leaves unreadable samples out"),
        ({"batch_size": 3}, r"batch_size=3 must divide .* = 8\)"),
        ({"epoch_size": 20}, "global_batch_size needs one source read once per epoch"),
        ({"global_batch_size": 0}, r"global_batch_size must be in \[1, inf\)"),
    ],
)
def test_what_the_mode_refuses_is_named(kwargs, match, tmp_path):
    index = build_shard_index(write_shards(str(tmp_path), [10, 10]))
    kw = {"global_batch_size": 8, "partitions": 4, "rank": 0, "world_size": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        ShardedStreamingDataset(index, **kw)


def test_mixed_sources_and_wrong_loader_batches_are_refused(tmp_path):
    index = build_shard_index(write_shards(str(tmp_path), [10, 10]))
    with pytest.raises(ValueError, match="a mix"):
        ShardedStreamingDataset([Source(index), Source(index, name="b")], global_batch_size=8)
    ds = ShardedStreamingDataset(index, global_batch_size=8, partitions=4, rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"batch_size=3 must divide .* = 4\): one of 1, 2, 4"):
        streaming_loader(ds, 3)
    with pytest.raises(ValueError, match="rank-cached loader reorders"):
        create_rank_cached_dataloader(ds, {"num_workers": 0}, "cpu")
    plain = ShardedStreamingDataset(index, rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"state\['global_batch_size'\] is 8 but this dataset"):
        plain.load_state_dict(ds.state_dict())


def test_batch_mode_yields_the_same_global_batches(tmp_path):
    index = build_shard_index(write_shards(str(tmp_path), [13, 21, 8]))
    kw = {"global_batch_size": 8, "partitions": 4}
    reference = steps_of([simulated_batches(datasets(index, 1, **kw)[0], 0, 8)], 1)
    per_rank = []
    for ds in datasets(index, 2, batch_size=2, **kw):
        per_rank.append([_batch_rows(b) for w in range(2) for b in _worker_items(ds, 2, w)])
        order = [per_rank[-1][i] for i in _round_robin([len(range(w, len(per_rank[-1]), 2))
                                                        for w in range(2)])]  # fmt: skip
        per_rank[-1] = order
    assert steps_of(per_rank, 2) == reference


def _round_robin(lengths: list[int]) -> list[int]:
    """Positions, in a list of the workers' batches one worker after the other, of the
    batches in the order a DataLoader takes them."""
    starts = np.cumsum([0, *lengths]).tolist()
    return [starts[i % len(lengths)] + i // len(lengths) for i in range(sum(lengths))]


@pytest.mark.timeout(180)
def test_audit_stats_and_decode_in_this_mode(tmp_path):
    index = build_shard_index(write_shards(str(tmp_path), [13, 21, 8]))
    kw = {"global_batch_size": 8, "partitions": 4, "decode": lambda s: {**s, "seen": 1}}
    ds = datasets(index, 1, **kw)[0]
    loader = streaming_loader(ds, 4, num_workers=2)
    audit = EpochAudit(loader)
    for batch in loader:
        assert batch["seen"].tolist() == [1] * 4
        audit.update(batch)
    assert audit.verify().ok
    stats = ds.stats()
    pads = 8 - index.total_samples % 8
    assert stats["samples"] == index.total_samples + pads  # each sample read once, each pad once
    # a resumed pass is audited for the rest of its epoch
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    del it
    again = streaming_loader(datasets(index, 1, **kw)[0], 4, num_workers=2)
    again.load_state_dict(state)
    audit = EpochAudit(again)
    audit.resume(state)
    for batch in again:
        audit.update(batch)
    assert audit.verify().ok


def test_precomputed_parameters_in_this_mode(tmp_path):
    from nnh_data import PrecomputeSpec, get_preset, write_precomputed_params

    index = build_shard_index(write_shards(str(tmp_path), [13, 21]))
    config = get_preset("mild")
    spec = PrecomputeSpec(34, epochs=2, config=config, seed=7, rows_per_file=9)
    write_precomputed_params(spec, tmp_path / "table", progress=False)
    kw = {"global_batch_size": 8, "partitions": 4, "aug_config": config, "epoch": 1}
    for ds in datasets(index, 2, **kw):
        generated = list(ds)
        replayed = list(ShardedStreamingDataset(index, rank=ds.rank, world_size=2, **SETTINGS,
                                                precomputed=str(tmp_path / "table"), **kw))
        assert [s["__aug__"] for s in generated] == [s["__aug__"] for s in replayed]
