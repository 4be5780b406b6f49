"""The handler's loader and batch helpers (nnh_train/batches.py), as tables on plain lists,
tensors and DataLoaders in one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from nnh_data import ShardedStreamingDataset, streaming_loader
from nnh_train.batches import (
    EpochClock,
    batch_ids,
    batch_size_of,
    counted,
    data_figures,
    epoch_ids,
    groups,
    loader_length,
    make_loader,
    pad_flags,
    resumed,
    select_rows,
    set_epoch,
    split_batch,
    to_device,
)
from tests.support import data

X = torch.arange(10.0).reshape(5, 2)
Y = torch.arange(5)


@pytest.mark.parametrize(
    "batch, size",
    [
        (X, 5),
        ((X, Y), 5),
        ([X, Y, ["a"] * 5], 5),
        ({"x": X, "__index__": torch.arange(3)}, 3),  # the index says the size
        ({"x": X}, 5),
        ([{"x": X}], 5),
        (["a", "b"], 2),
        (np.zeros(4), 4),
    ],
)
def test_batch_size_of(batch, size):
    assert batch_size_of(batch) == size


def test_batch_size_of_an_unknown_batch_names_its_type():
    with pytest.raises(ValueError, match="cannot tell the batch size of a int batch"):
        batch_size_of(3)


@pytest.mark.parametrize(
    "batch, expected",
    [((X, Y), (X, Y)), ((X, Y, Y), (X, Y)), ([X], (X, X)), (X, (X, X)), ({"x": X}, ("d", "d"))],
)
def test_split_batch(batch, expected):
    got = split_batch(batch)
    expected = tuple(batch if e == "d" else e for e in expected)
    assert all(g is e for g, e in zip(got, expected))


def test_select_rows_keeps_the_same_rows_of_every_part():
    keep = torch.tensor([True, False, True, False, True])
    got = select_rows({"x": X, "pair": (Y, ["a", "b", "c", "d", "e"])}, keep)
    assert torch.equal(got["x"], X[[0, 2, 4]])
    assert torch.equal(got["pair"][0], Y[[0, 2, 4]])
    assert select_rows(["a", "b", "c", "d", "e"], keep) == ["a", "c", "e"]
    assert select_rows(7, keep) == 7  # not per-sample: kept as it is


def test_to_device_keeps_the_structure():
    batch = {"pair": (X, [Y]), "name": "n"}
    got = to_device(batch, torch.device("cpu"))
    assert isinstance(got["pair"], tuple) and isinstance(got["pair"][1], list)
    assert torch.equal(got["pair"][0], X) and got["name"] == "n"


@pytest.mark.parametrize("items, size, expected", [
    (range(7), 3, [[0, 1, 2], [3, 4, 5], [6]]),
    (range(6), 3, [[0, 1, 2], [3, 4, 5]]),
    (range(2), 1, [[0], [1]]),
    (range(0), 2, []),
])  # fmt: skip
def test_groups(items, size, expected):
    clock = EpochClock(0.0)
    assert list(groups(iter(items), size, clock)) == expected
    assert clock.waited >= 0


def test_counted_takes_pads_from_flags_or_from_the_batch():
    flags = np.array([False, False, False, True, True])
    batches = [torch.zeros(2), torch.zeros(2), {"x": torch.zeros(1), "__pad__": [False]}]
    got = list(counted(iter(batches), flags, 0))
    assert [size for _, size, _ in got] == [2, 2, 1]
    assert got[0][2] is None  # no pad: no mask
    assert got[1][2].tolist() == [False, True]
    assert got[2][2] is None  # the batch's own flag wins over the position's
    _, _, pads = next(counted(iter([torch.zeros(2)]), flags, 3))  # from a later position
    assert pads.tolist() == [True, True]


def test_pad_flags_and_epoch_ids_of_a_distributed_sampler():
    # 5 samples on 2 ranks: rank 1 gets 1, 3 and a repeat of 0
    sampler = DistributedSampler(range(5), num_replicas=2, rank=1, shuffle=False)
    loader = DataLoader(TensorDataset(torch.arange(5)), sampler=sampler, batch_size=2)
    assert pad_flags(loader).tolist() == [False, False, True]
    assert epoch_ids(loader).tolist() == [1, 3, 0]
    rank0 = DistributedSampler(range(5), num_replicas=2, rank=0, shuffle=False)
    assert pad_flags(DataLoader(range(5), sampler=rank0)) is None  # 0, 2, 4: no repeat
    plain = DataLoader(range(5))
    assert pad_flags(plain) is None and epoch_ids(plain) is None


def test_batch_ids_from_the_batch_the_order_or_the_position():
    assert batch_ids({"__index__": [[4], [2]]}, None, 0, 2, True).tolist() == [4, 2]
    assert batch_ids(X, np.array([9, 8, 7, 6]), 1, 2, True).tolist() == [8, 7]
    assert batch_ids(X, None, 3, 2, False).tolist() == [3, 4]
    with pytest.raises(ValueError, match="predict under DDP needs sample ids"):
        batch_ids(X, None, 0, 2, True)


class Epochs(TensorDataset):
    epoch = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def test_set_epoch_reaches_the_sampler_and_the_dataset():
    dataset = Epochs(torch.arange(4))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0)
    set_epoch(DataLoader(dataset, sampler=sampler), 3)
    assert sampler.epoch == 3 and dataset.epoch == 3


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


def test_loader_length():
    assert loader_length(DataLoader(range(5), batch_size=2)) == 3
    assert loader_length(DataLoader(Stream())) is None


def test_resumed_replays_the_sampler_from_the_batch_given():
    torch.manual_seed(0)
    whole = [b.tolist() for b in DataLoader(range(10), batch_size=3, shuffle=True)]
    torch.manual_seed(0)
    loader = DataLoader(range(10), batch_size=3, shuffle=True)
    batches, at = resumed(loader, {"loader": None}, 2)
    assert at == 2 and [b.tolist() for b in batches] == whole[2:]


def test_resumed_reads_and_drops_without_a_sampler():
    batches, at = resumed(DataLoader(Stream()), {"loader": None}, 2)
    assert at == 2 and [b.item() for b in batches] == [2]


@pytest.mark.parametrize("data_, kwargs, error", [
    (DataLoader(range(4)), {"batch_size": 2}, "a DataLoader is used as it is"),
    (Stream(), {"batch_size": 2}, "dataset must be map-style.*the IterableDataset Stream"),
    (data(4), {}, "batch_size must be an integer"),
])  # fmt: skip
def test_make_loader_errors_name_the_argument(data_, kwargs, error):
    with pytest.raises(ValueError, match=error):
        make_loader(data_, kwargs.pop("batch_size", None), False, kwargs, is_eval=False,
                    device=torch.device("cpu"), log_fn=print)  # fmt: skip


def test_data_figures_of_a_stream_and_of_other_loaders(tar_shards):
    assert data_figures(DataLoader(range(4)), 1.0, False) == {}
    loader = streaming_loader(ShardedStreamingDataset(tar_shards([7, 9])), 4)
    assert sum(len(batch["__key__"]) for batch in loader) == 16
    figures = data_figures(loader, float("nan"), False)  # a wait not measured counts as 0
    assert figures["data_samples"] == 16 and figures["data_wait_s"] == 0.0
    assert data_figures(loader, 0.5, False)["data_wait_s"] == 0.5
