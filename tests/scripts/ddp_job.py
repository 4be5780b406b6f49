"""Started by tests under torchrun, srun and sbatch: initialise DDP, all-reduce, make rank 1 fail
under on_rank, and print one JSON line per process. ``python ddp_job.py [DEVICE]``: the tests
pass ``cpu`` so that they also hold on a machine with fewer GPUs than ranks."""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

from nnh_train import RankError, aggregate_metrics, get_dist_info, initialize_ddp, on_rank


@on_rank(1)
def _fail_on_rank_one() -> None:
    raise ValueError("rank 1 cannot go on")


def main() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        device = sys.argv[1] if len(sys.argv) > 1 else None
        distributed, rank, local_rank, world_size, device = initialize_ddp(60, device=device)
    total = torch.tensor([rank + 1.0])
    if distributed:
        dist.all_reduce(total)
    report = {
        "distributed": distributed, "rank": rank, "local_rank": local_rank,
        "world_size": world_size, "device": str(device), "sum": total.item(),
        "mean_rank": aggregate_metrics({"rank": rank}, world_size, device)["rank"],
        "again_is_none": initialize_ddp() is None,
        "info": [str(x) for x in get_dist_info()],
        "warnings": [str(w.message) for w in caught],
        "master": [os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")],
        "job": [os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_JOB_NODELIST")],
    }
    if world_size > 1:
        try:
            _fail_on_rank_one()
        except RankError as exc:
            report["error_rank"] = exc.rank
        dist.destroy_process_group()
    os.write(1, (json.dumps(report) + "\n").encode())  # one write: ranks share the pipe


if __name__ == "__main__":
    main()
