"""Benchmark: time per step of NNHandler against a hand-written DDP loop, 2 gloo processes.

Prints one JSON object. Both sides train the same MLP (``--width`` wide, 3 layers) with Adam on
the same in-memory data (a ``TensorDataset`` of ``--samples`` rows, ``--batch`` per rank), from
the same weights, for one epoch per round; the two sides take turns (which goes first alternates)
so that a change in machine load affects both. The hand-written loop is the minimal one:
``DistributedSampler`` + ``DataLoader``, ``sampler.set_epoch``, zero_grad / forward / backward /
step and ``loss.item()`` per step. NNHandler adds its per-step all_gather (NaN and signal flags,
loss and sample count), its bookkeeping and a progress bar (disabled here with TQDM_DISABLE=1, as
the bench output is not a terminal). A third side, the loop plus that one all_gather per step
(``ratio_vs_loop_with_flags``), separates the cost of the exchange from the rest. ``ratio`` =
NNHandler's best seconds per step over the rounds / the loop's best (the least disturbed rounds
of a shared machine); ``ratio_median`` compares the medians. ``cpu_ratio`` compares rank 0's
process CPU time per step (all its threads, gloo's included; best rounds), which a loaded machine
disturbs less than wall time: what NNHandler adds in work, not in waiting. Target: ``ratio`` <=
1.03.

    .venv/bin/python tools/bench/trainer.py [--rounds 8] [--width 512] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from nnh_train import NNHandler

WORLD = 2


def model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 64, generator=generator)
    return TensorDataset(x, torch.randint(0, 10, (samples,), generator=generator))


def hand_written(data: TensorDataset, args: argparse.Namespace) -> int:
    """One epoch of the minimal DDP loop; the number of steps."""
    net = DistributedDataParallel(model(args.width))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    sampler.set_epoch(0)
    total, steps = 0.0, 0
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        total += loss.item()
        steps += 1
    return steps


def hand_written_with_flags(data: TensorDataset, args: argparse.Namespace) -> int:
    """The minimal loop plus what NNHandler needs for ranks to agree: one all_gather per step
    of the loss and a flag, run during the backward and waited for before the step."""
    net = DistributedDataParallel(model(args.width))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    sampler.set_epoch(0)
    steps = 0
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(net(x), y)
        row = torch.stack([loss.detach().double(), torch.zeros((), dtype=torch.float64)])
        rows = [torch.empty_like(row) for _ in range(WORLD)]
        work = dist.all_gather(rows, row, async_op=True)
        loss.backward()
        work.wait()
        if not all(map(math.isfinite, torch.stack(rows)[:, 0].tolist())):
            raise FloatingPointError("non-finite loss")
        optimizer.step()
        steps += 1
    return steps


def with_handler(data: TensorDataset, args: argparse.Namespace) -> int:
    """One epoch of NNHandler on the same model and data; the number of steps."""
    handler = NNHandler(model(args.width), device="cpu")
    handler.log_fn = lambda line: None
    handler.set_optimizer(torch.optim.Adam, lr=1e-3)
    handler.set_loss_fn(nn.functional.cross_entropy)
    handler.set_train_loader(data, batch_size=args.batch, num_workers=0)
    handler.train(1)
    return handler.step


def timed(fn, data: TensorDataset, args: argparse.Namespace) -> tuple[float, float]:
    """Wall and CPU seconds per step of ``fn``, both ranks starting together."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    steps = fn(data, args)
    cpu = time.process_time() - cpu
    dist.barrier()
    return (time.perf_counter() - start) / steps, cpu / steps


def rank_main(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))  # fmt: skip
    torch.set_num_threads(1)  # one core per rank on a 2-core machine
    dist.init_process_group("gloo")
    data = dataset(args.samples)
    sides = {"handler": with_handler, "hand": hand_written, "flags": hand_written_with_flags}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for fn in sides.values():  # warm-up
        timed(fn, data, args)
    for round_ in range(args.rounds):
        for name in list(sides)[:: 1 if round_ % 2 else -1]:
            times[name].append(timed(sides[name], data, args))
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(times, fh)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--samples", type=int, default=12_800)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    os.environ["TQDM_DISABLE"] = "1"  # read by tqdm at import, in the spawned processes
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(rank_main, args=(args, free_port(), out), nprocs=WORLD)
        with open(out) as fh:
            measured = json.load(fh)
    times = {name: [wall for wall, _ in rounds] for name, rounds in measured.items()}
    cpu = {name: min(c for _, c in rounds) for name, rounds in measured.items()}
    handler, hand, flags = (min(times[name]) for name in ("handler", "hand", "flags"))
    median = statistics.median(times["handler"]) / statistics.median(times["hand"])
    print(json.dumps({
        "world_size": WORLD,
        "width": args.width,
        "batch_per_rank": args.batch,
        "steps_per_round": args.samples // (WORLD * args.batch),
        "rounds": args.rounds,
        "handler_ms_per_step": round(handler * 1e3, 3),
        "hand_written_ms_per_step": round(hand * 1e3, 3),
        "ratio": round(handler / hand, 3),
        "ratio_median": round(median, 3),
        "hand_written_with_flags_ms_per_step": round(flags * 1e3, 3),
        "ratio_vs_loop_with_flags": round(handler / flags, 3),
        "ratio_per_round": [round(a / b, 3) for a, b in zip(times["handler"], times["hand"])],
        "cpu_ms_per_step": {name: round(value * 1e3, 3) for name, value in cpu.items()},
        "cpu_ratio": round(cpu["handler"] / cpu["hand"], 3),
        "cpu_ratio_vs_loop_with_flags": round(cpu["handler"] / cpu["flags"], 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
