"""Launched by ``torchrun --standalone --nproc-per-node N``: each rank iterates its share of the
shards given as argv[1] with a DataLoader (one worker), runs one all-reduce per batch as a DDP
step would, and checks with collectives that the batch counts agree and that the ranks together
saw every sample exactly once. Prints one JSON line per rank; exits non-zero on a failed check."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from nnh_data.streaming.dataset import ShardedStreamingDataset


def main(source: str) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = ShardedStreamingDataset(source, seed=1, shuffle_window=4)  # rank/world from the group
    loader = DataLoader(ds, batch_size=4, num_workers=1)
    batches, seen = 0, []
    for batch in loader:
        step = torch.ones(1)
        dist.all_reduce(step)  # a DDP step: hangs if one rank ran out of batches early
        batches += 1
        seen += batch["__index__"][~batch["__pad__"]].tolist()
    counts = torch.tensor([batches, batches])
    dist.all_reduce(counts[:1], op=dist.ReduceOp.MIN)
    dist.all_reduce(counts[1:], op=dist.ReduceOp.MAX)
    everything: list = [None] * world
    dist.all_gather_object(everything, seen)
    union = sorted(i for part in everything for i in part)
    ok = counts[0] == counts[1] == batches and union == list(range(ds.total_samples))
    report = {"rank": rank, "world": ds.world_size, "batches": batches, "ok": bool(ok)}
    os.write(1, (json.dumps(report) + "\n").encode())  # one write: ranks share the pipe
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
