"""The CUDA/NCCL paths on a GPU machine (none in CI): run with one process per GPU,

    torchrun --standalone --nproc-per-node $(nvidia-smi -L | wc -l) tests/scripts/gpu_check.py

Each rank checks initialisation (nccl, its own GPU), aggregation, object exchange and on_rank
errors through NCCL; rank 0 then checks ParallelExecutor and parallel_on_all_devices. Prints one
JSON line per rank and exits non-zero on the first failed check.
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed as dist

from nnh_train import (
    ParallelExecutor,
    RankError,
    aggregate_metrics,
    broadcast_data,
    gather_to_rank0,
    get_dist_info,
    initialize_ddp,
    on_rank,
    parallel_on_all_devices,
    parallelize_on_gpus,
)


@on_rank(0)
def _fail_on_rank_zero() -> None:
    raise ValueError("rank 0 fails on purpose")


def _device_name(*, device: torch.device) -> str:
    return str(torch.ones(2, device=device).device)


@parallelize_on_gpus()
def _twice(x: torch.Tensor, *, device: torch.device) -> torch.Tensor:
    return x.to(device) * 2


def check_ddp() -> dict:
    distributed, rank, local_rank, world, device = initialize_ddp(use_distributed=True)
    assert distributed and device == torch.device("cuda", local_rank % torch.cuda.device_count())
    assert dist.get_backend() == "nccl"
    assert get_dist_info() == (True, rank, local_rank, world, device)
    total = torch.ones(1, device=device)
    dist.all_reduce(total)
    metrics = aggregate_metrics({"loss": float(rank), "nan": math.nan}, world, device)
    assert metrics["loss"] == (world - 1) / 2 and math.isnan(metrics["nan"])
    assert broadcast_data({"from": rank}) == {"from": 0}
    gathered = gather_to_rank0(rank)
    assert gathered == (list(range(world)) if rank == 0 else None)
    try:
        _fail_on_rank_zero()
        raise AssertionError("on_rank did not raise")
    except RankError as exc:
        assert exc.rank == 0
    dist.destroy_process_group()
    return {"rank": rank, "device": str(device), "all_reduce": total.item()}


def check_executor() -> dict:
    with ParallelExecutor() as executor:
        devices = executor.run(_device_name)
    assert devices == [f"cuda:{i}" for i in range(torch.cuda.device_count())], devices
    doubled = _twice(torch.ones(3))
    assert all(t.device.type == "cpu" and t.tolist() == [2.0] * 3 for t in doubled)
    batch = torch.arange(8.0, device="cuda:0").reshape(4, 2)
    out = parallel_on_all_devices(lambda b: b * 3)(batch)
    assert out.tolist() == (batch * 3).tolist()
    return {"executor_devices": devices}


if __name__ == "__main__":
    report = check_ddp()
    if report["rank"] == 0:
        report.update(check_executor())
    report["ok"] = True
    os.write(1, (json.dumps(report) + "\n").encode())
