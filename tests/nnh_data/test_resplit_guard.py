"""Framework wrappers that would shard an nnh loader a second time stop at its first use with
the fix (the real classes, one process); other callers, and a wrapper hidden behind a user's
dataset, pass (the audit judges the latter: tests/examples/test_accelerate_train.py)."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader, IterableDataset

from nnh_data import RankCachedSampler, ShardedStreamingDataset


@pytest.fixture
def dataset(tar_shards):
    return ShardedStreamingDataset(tar_shards([6, 5], size=8), seed=0)


def test_accelerates_iterable_dataset_shard(dataset):
    shard = pytest.importorskip("accelerate.data_loader").IterableDatasetShard
    wrapped = shard(dataset, batch_size=2, num_processes=2, process_index=0)
    with pytest.raises(RuntimeError, match=r"IterableDatasetShard.*Fix: .*accelerator.prepare"):
        next(iter(wrapped))
    with pytest.raises(RuntimeError, match="IterableDatasetShard"):
        wrapped.set_epoch(1)


def test_accelerates_dispatcher(dataset):
    dispatcher = pytest.importorskip("accelerate.data_loader").DataLoaderDispatcher
    pytest.importorskip("accelerate").PartialState(cpu=True)
    loader = dispatcher(dataset, batch_size=2)
    with pytest.raises(RuntimeError, match=r"DataLoaderDispatcher.*send_to_device"):
        next(iter(loader))


def test_lightnings_sampler_wrapper_around_the_rank_cached_sampler():
    distributed = pytest.importorskip("lightning.fabric.utilities.distributed")
    wrapper = distributed.DistributedSamplerWrapper(RankCachedSampler(10), num_replicas=2, rank=0)
    with pytest.raises(RuntimeError, match=r"use_distributed_sampler=False"):
        list(wrapper)


class PassThrough(IterableDataset):
    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __iter__(self):
        yield from self.dataset


def test_other_callers_pass(dataset):
    assert len(list(DataLoader(dataset, batch_size=4))) == 3
    dataset.set_epoch(2)
    shard = pytest.importorskip("accelerate.data_loader").IterableDatasetShard
    assert len(list(shard(PassThrough(dataset), batch_size=2, num_processes=2))) == 6
