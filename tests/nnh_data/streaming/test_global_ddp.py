"""Global batches in real processes: 2 and 4 gloo ranks, each with ``streaming_loader`` and
DataLoader workers, hand out the global batches of a 1-process run (sample ids and
parameters), each rank its share of every one; a 4-rank run stopped mid-epoch resumes on 2."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from nnh_data.shards.reading import build_shard_index
from nnh_data.streaming.dataset import ShardedStreamingDataset, state_from_loader
from nnh_data.streaming.loader import streaming_loader
from tests.support import run_distributed

SIZE, PARTITIONS = 8, 4
SETTINGS = {"global_batch_size": SIZE, "partitions": PARTITIONS, "seed": 3, "shuffle_window": 5}


def _rows(batch: dict) -> list[tuple[int, bool, int]]:
    ids, pads = batch["__index__"].tolist(), batch["__pad__"].tolist()
    return list(zip(ids, pads, batch["__aug__"]["seed"].tolist()))


def _steps(per_rank: list[list[list]], per_step: int) -> list[list]:
    """Each step's rows over all ranks, sorted (``per_step`` loader batches a rank)."""
    count = len(per_rank[0]) // per_step
    return [sorted(row for batches in per_rank
                   for batch in batches[k * per_step : (k + 1) * per_step] for row in batch)
            for k in range(count)]  # fmt: skip


def _rank_batches(rank: int, world: int, urls: list[str], workers: int, epoch: int) -> list:
    """This rank's loader batches of ``epoch`` (rank and world size from the gloo group)."""
    assert dist.is_initialized() and dist.get_world_size() == world
    ds = ShardedStreamingDataset(urls, epoch=epoch, **SETTINGS)
    loader = streaming_loader(ds, SIZE // world // 2, num_workers=workers)
    return [_rows(batch) for batch in loader]


def _one_process(urls: list[str], epoch: int) -> list[list]:
    ds = ShardedStreamingDataset(urls, rank=0, world_size=1, epoch=epoch, **SETTINGS)
    return _steps([[_rows(b) for b in streaming_loader(ds, SIZE)]], 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "workers"), [(2, 2), (4, 1)])
def test_gloo_ranks_with_workers_hand_out_the_one_process_global_batches(world, workers,
                                                                          tar_shards):  # fmt: skip
    urls = tar_shards([13, 0, 21, 8, 9])
    build_shard_index(urls)  # the index sidecar, once
    per_rank = run_distributed(_rank_batches, world, urls, workers, 1, timeout=240)
    assert len({len(batches) for batches in per_rank}) == 1  # equal batches on every rank
    assert _steps(per_rank, 2) == _one_process(urls, 1)


def _stop_after(rank: int, world: int, urls: list[str], batches: int) -> dict:
    """``batches`` loader batches of this rank, then its loader's state, merged."""
    ds = ShardedStreamingDataset(urls, **SETTINGS)
    loader = streaming_loader(ds, SIZE // world, num_workers=1)  # resumed with 2 workers
    it = iter(loader)
    taken = [_rows(next(it)) for _ in range(batches)]
    return {"batches": taken, "state": state_from_loader(loader.state_dict())}


def _resume(rank: int, world: int, urls: list[str], state: dict) -> list:
    ds = ShardedStreamingDataset(urls, **SETTINGS)
    ds.load_state_dict(state)
    return [_rows(batch) for batch in streaming_loader(ds, SIZE // world, num_workers=2)]


@pytest.mark.timeout(300)
def test_four_ranks_stopped_mid_epoch_resume_on_two(tar_shards):
    urls = tar_shards([13, 0, 21, 8, 9])
    build_shard_index(urls)
    stopped = run_distributed(_stop_after, 4, urls, 3, timeout=240)
    states = [r["state"] for r in stopped]
    assert all(state == states[0] for state in states)  # the same global step on every rank
    rest = run_distributed(_resume, 2, urls, states[0], timeout=240)
    done = _steps([r["batches"] for r in stopped], 1) + _steps(rest, 1)
    assert done == _one_process(urls, 0)
