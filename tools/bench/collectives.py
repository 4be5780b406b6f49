"""Benchmark: ``aggregate_metrics`` on a 16-key dict against plain all_reduces, 2 gloo processes.

Prints one JSON object. Figures are microseconds per call (the best of several rounds, the one
least disturbed by other load; ``aggregate_metrics`` uses one ``all_gather`` of 32 float64 sums
and counts) and ratios against baselines timed in the same processes:
``aggregate_vs_bare`` (one bare ``all_reduce`` of a preallocated 16-element tensor, the floor;
target <= 1.3) and ``separate_vs_aggregate`` (16 separate one-value ``all_reduce`` calls, the
naive loop over the dict; target >= 8).

    .venv/bin/python tools/bench/collectives.py [--iters 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nnh_train import aggregate_metrics

KEYS, WORLD = 16, 2
CPU = torch.device("cpu")


def per_call_us(fn: Callable[[], object], iters: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def rank_main(rank: int, folder: str, iters: int, rounds: int) -> None:
    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1 for each worker
    store = f"file://{os.path.join(folder, 'store')}"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=WORLD)
    metrics = {f"metric_{i:02d}": float(rank + i) for i in range(KEYS)}
    flat = torch.zeros(KEYS)

    def separate() -> None:
        for value in metrics.values():
            dist.all_reduce(torch.tensor(value))

    cases = {
        "bare_allreduce": lambda: dist.all_reduce(flat),
        "aggregate_metrics": lambda: aggregate_metrics(metrics, WORLD, CPU),
        "separate_allreduces": separate,
    }
    for fn in cases.values():  # warm-up: connections, allocator
        per_call_us(fn, 20)
    best = {name: float("inf") for name in cases}
    for _ in range(rounds):  # interleaved, so that load bursts hit every case alike
        for name, fn in cases.items():
            best[name] = min(best[name], per_call_us(fn, iters))
    if rank == 0:
        with open(os.path.join(folder, "result.json"), "w") as fh:
            json.dump(best, fh)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(rank_main, args=(folder, args.iters, args.rounds), nprocs=WORLD)
        with open(os.path.join(folder, "result.json")) as fh:
            best = json.load(fh)
    bare, packed, loop = (best[k] for k in ("bare_allreduce", "aggregate_metrics",
                                            "separate_allreduces"))
    print(json.dumps({
        "world_size": WORLD, "backend": "gloo", "keys": KEYS, "iters": args.iters,
        "rounds": args.rounds,
        "bare_allreduce_us": round(bare, 1),
        "aggregate_metrics_us": round(packed, 1),
        "separate_allreduces_us": round(loop, 1),
        "aggregate_vs_bare": round(packed / bare, 2),
        "separate_vs_aggregate": round(loop / packed, 1),
    }))


if __name__ == "__main__":
    main()
