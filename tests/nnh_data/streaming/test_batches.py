"""ShardedStreamingDataset(batch_size=B): columnar batches of the per-sample stream.

The batches must hold exactly the samples (fields, metadata, parameters) the per-sample mode
yields, in the same order; every rank gets ``len(ds)`` batches whatever the number of workers;
resume works through StatefulDataLoader and across batch sizes and world sizes.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from nnh_data.augment.params import PARAM_NAMES
from nnh_data.augment.transforms import apply_augmentation
from nnh_data.packed import PackedField
from nnh_data.shards.reading import build_shard_index
from nnh_data.streaming.dataset import ShardedStreamingDataset, state_from_loader
from tests.nnh_data.streaming.test_dataset import LAYOUTS
from tests.support import simulated

SETTINGS = {"seed": 5, "shuffle_window": 4}
pytestmark = pytest.mark.filterwarnings(
    "ignore:This DataLoader will create", "ignore:.set_vital. is deprecated"
)


def _rows(batch: dict) -> list[dict]:
    """The samples of a batch as dicts, values as the per-sample mode gives them."""
    n = len(batch["__index__"])
    rows = []
    for i in range(n):
        row = {k: _plain(v[i]) for k, v in batch.items() if k != "__aug__"}
        aug = {k: _plain(v[i]) for k, v in batch["__aug__"].items()}
        rows.append({**row, "__aug__": aug})
    return rows


def _plain(value):
    return value.item() if isinstance(value, (np.generic, torch.Tensor)) else value


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("size", [1, 4, 5])
def test_batches_hold_the_per_sample_stream_in_order(fmt, workers, size, shards, monkeypatch):
    index = build_shard_index(shards(fmt, LAYOUTS["uneven"]))
    for rank in range(3):
        kw = {"rank": rank, "world_size": 3, **SETTINGS}
        samples = simulated(ShardedStreamingDataset(index, **kw), workers, monkeypatch)
        batched = ShardedStreamingDataset(index, batch_size=size, **kw)
        batches = simulated(batched, workers, monkeypatch)
        assert [row for b in batches for row in _rows(b)] == samples
        assert len(batches) == len(batched) == -(-len(samples) // size)
        assert sorted(len(b["__index__"]) for b in batches)[1:] == [size] * (len(batches) - 1)


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_sample_once_and_equal_batches_per_rank(fmt, layout, shards, monkeypatch):
    index = build_shard_index(shards(fmt, LAYOUTS[layout]))
    for world in range(1, 5):
        for workers in range(4):
            for size in (1, 3, 8):
                datasets = [
                    ShardedStreamingDataset(
                        index, rank=r, world_size=world, batch_size=size, **SETTINGS
                    )
                    for r in range(world)
                ]
                per_rank = [simulated(ds, workers, monkeypatch) for ds in datasets]
                assert {len(b) for b in per_rank} == {len(datasets[0])}
                real = [
                    i
                    for batches in per_rank
                    for b in batches
                    for i, pad in zip(b["__index__"].tolist(), b["__pad__"].tolist())
                    if not pad
                ]
                assert sorted(real) == list(range(index.total_samples)), Counter(real)


def _items(batch: dict) -> list[tuple[int, bool]]:
    return list(zip(batch["__index__"].tolist(), batch["__pad__"].tolist()))


def _check_union(handed: list, rest: list, total: int) -> None:
    real = [i for i, pad in handed + rest if not pad]
    assert sorted(real) == list(range(total)), Counter(real).most_common(3)


@pytest.mark.timeout(240)
def test_stateful_loader_resumes_batches_with_two_workers(tar_shards):
    urls = tar_shards([13, 0, 21, 8])
    handed, states = [], []
    for rank in range(2):
        ds = ShardedStreamingDataset(urls, rank=rank, world_size=2, batch_size=3, **SETTINGS)
        loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
        it = iter(loader)
        handed += [item for _ in range(3) for item in _items(next(it))]
        states.append(loader.state_dict())
        del it, loader
    rest = []
    for rank in range(2):
        ds = ShardedStreamingDataset(urls, rank=rank, world_size=2, batch_size=3, **SETTINGS)
        loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
        loader.load_state_dict(states[rank])
        rest += [item for batch in loader for item in _items(batch)]
    _check_union(handed, rest, 42)

    merged = state_from_loader(states[0])  # another world size, per-sample mode
    assert merged == state_from_loader(states[1]) and merged["batch_size"] == 3
    rest = []
    for rank in range(3):
        ds = ShardedStreamingDataset(urls, rank=rank, world_size=3, **SETTINGS)
        ds.load_state_dict(merged)
        rest += [(s["__index__"], s["__pad__"]) for s in ds]
    _check_union(handed, rest, 42)


def test_plain_loader_state_resumes_with_another_batch_size(parquet_shards):
    urls = parquet_shards([10, 7, 9])
    handed, states = [], []
    for rank in range(2):
        ds = ShardedStreamingDataset(urls, rank=rank, world_size=2, batch_size=4, **SETTINGS)
        it = iter(DataLoader(ds, batch_size=None))
        handed += [item for _ in range(2) for item in _items(next(it))]
        states.append(ds.state_dict())
    assert states[0] == states[1] and states[0]["consumed"] == [8]
    rest = []
    for rank in range(3):
        ds = ShardedStreamingDataset(urls, rank=rank, world_size=3, batch_size=5, **SETTINGS)
        ds.load_state_dict(states[0])
        length = len(ds)  # of the resumed pass (the state serves one pass)
        batches = list(ds)
        assert len(batches) == length
        rest += [item for b in batches for item in _items(b)]
    _check_union(handed, rest, 26)


def test_a_worker_state_names_the_batch_size_it_needs(tar_shards):
    ds = ShardedStreamingDataset(tar_shards([6, 6]), batch_size=2)
    state = {**ds.state_dict(), "num_workers": 2, "consumed": [2, None]}
    other = ShardedStreamingDataset(tar_shards([6, 6]), batch_size=3)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size=2.*batch_size=3"):
        list(other)


def test_parquet_columns_come_as_tensors_and_packed_fields(tmp_path):
    table = pa.table(
        {
            "i": pa.array(range(6), pa.int32()),
            "f": [0.5, None, 1.5, 2.0, 2.5, 3.0],
            "b": [True, False] * 3,
            "s": list("abcdef"),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=6)
    (batch,) = ShardedStreamingDataset(str(tmp_path / "t.parquet"), shuffle=False, batch_size=6)
    assert batch["i"].dtype == torch.int32 and batch["i"].tolist() == list(range(6))
    assert batch["b"].dtype == torch.bool and batch["s"] == list("abcdef")
    assert isinstance(batch["s"], PackedField) and batch["s"][2] == "c"
    assert batch["f"] == [0.5, None, 1.5, 2.0, 2.5, 3.0]  # nulls keep Python values
    assert batch["__key__"] == [f"t/{i}" for i in range(6)]


def test_skip_drops_unreadable_rows_and_still_counts_them(tar_shards):
    urls = tar_shards([4, 4, 4])
    index = build_shard_index(urls)
    with open(urls[1], "r+b") as f:
        f.truncate(512 * 5)
    ds = ShardedStreamingDataset(index, shuffle=False, on_error="skip", batch_size=3)
    with pytest.warns(UserWarning, match="shard-000001"):
        batches = list(ds)
    assert [b["__index__"].tolist() for b in batches] == [[0, 1, 2], [3], [8], [9, 10, 11]]
    assert ds.error_counts == {urls[1]: 4} and ds.state_dict()["consumed"] == [12]


def test_decode_receives_each_batch(tar_shards):
    ds = ShardedStreamingDataset(tar_shards([3, 2]), batch_size=2, decode=lambda b: len(b["cls"]))
    assert list(ds) == [2, 2, 1]


def test_batch_size_is_checked(tar_shards):
    with pytest.raises(ValueError, match=r"batch_size must be in \[1, inf\), got 0"):
        ShardedStreamingDataset(tar_shards([3]), batch_size=0)


def test_batch_parameters_apply_like_the_samples_own(parquet_shards):
    urls = parquet_shards([5, 4])
    samples = list(ShardedStreamingDataset(urls, **SETTINGS))
    (batch,) = DataLoader(ShardedStreamingDataset(urls, batch_size=9, **SETTINGS), batch_size=None)
    assert all(isinstance(batch["__aug__"][k], torch.Tensor) for k in (*PARAM_NAMES, "seed"))
    images = torch.rand(9, 3, 12, 12, generator=torch.Generator().manual_seed(0))
    expected = apply_augmentation(images, [s["__aug__"] for s in samples])
    torch.testing.assert_close(apply_augmentation(images, batch["__aug__"]), expected)


def test_a_per_sample_state_resumes_in_batch_mode(tar_shards):
    urls = tar_shards([9, 4, 7])
    handed, states = [], []
    for rank in range(2):
        ds = ShardedStreamingDataset(urls, rank=rank, world_size=2, **SETTINGS)
        it = iter(ds)
        handed += [(s["__index__"], s["__pad__"]) for s in (next(it) for _ in range(3))]
        states.append(ds.state_dict())
    assert states[0] == states[1] and states[0]["batch_size"] is None
    rest = []
    for rank in range(3):
        ds = ShardedStreamingDataset(urls, rank=rank, world_size=3, batch_size=2, **SETTINGS)
        ds.load_state_dict(states[0])
        rest += [item for b in ds for item in _items(b)]
    _check_union(handed, rest, 20)


@pytest.mark.parametrize("shuffle_window", [4, 1000])
def test_long_parquet_bytes_batches_hold_the_per_sample_stream(tmp_path, shuffle_window):
    """Long bytes (kept as views of the decoded pages, their views taken by the shuffle), nulls
    among them, and short text (joined as read) give the per-sample stream, in the batches and
    in their pickled (packed) form, pads included."""
    import pickle

    paths, first = [], 0
    for i, count in enumerate(LAYOUTS["uneven"]):
        ids = range(first, first + count)
        blobs = [None if g % 5 == 2 else bytes([g]) * (70 + 9 * g) for g in ids]
        table = pa.table({"blob": pa.array(blobs, pa.binary()), "text": [f"t{g}" for g in ids]})
        paths.append(str(tmp_path / f"long-{i}.parquet"))
        pq.write_table(table, paths[-1], row_group_size=3)
        first += count
    index = build_shard_index(paths)
    for rank in range(3):
        kw = {"rank": rank, "world_size": 3, "seed": 5, "shuffle_window": shuffle_window}
        samples = list(ShardedStreamingDataset(index, **kw))
        batches = list(ShardedStreamingDataset(index, batch_size=5, **kw))
        assert isinstance(batches[0]["blob"], PackedField)
        assert [row for b in batches for row in _rows(b)] == samples
        packed = [pickle.loads(pickle.dumps(b)) for b in batches]
        assert [row for b in packed for row in _rows(b)] == samples
