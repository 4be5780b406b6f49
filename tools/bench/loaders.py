"""Benchmark: the rank-cached loader against a plain DataLoader + DistributedSampler, one process.

Prints one JSON object. The dataset is in memory (3 KiB uint8 images and labels) and its
``__getitem__`` spins 50 us, standing for decoding. Samples/s of an epoch after the first of
``create_rank_cached_dataloader`` versus a plain ``DataLoader`` over a ``DistributedSampler``
(batches of 64, no workers; ``cached_vs_plain``, target >= 5), and versus the same plain loader
with 2 persistent workers (``cached_vs_plain_workers``); rates are the best of a few rounds in
which the loaders take turns (``best_rates`` of common.py), with ``set_epoch`` before every
epoch. The cache's bytes on the largest rank for 1 and 4 ranks (ranks set through
``RANK``/``WORLD_SIZE``, as without a process group; ``bytes_4_vs_1``, target <= 0.3).

    .venv/bin/python tools/bench/loaders.py [--samples 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from common import best_rates  # tools/bench/common.py, beside this file
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from nnh_data.loaders.rank_cached import create_rank_cached_dataloader

SPIN_S = 50e-6
BATCH = 64
IMAGE = (3, 32, 32)


class SpinningDataset(Dataset):
    """``{"image": uint8 (3, 32, 32), "label": int}`` from memory, after 50 us of busy work."""

    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (count, *IMAGE), dtype=torch.uint8, generator=generator)
        self.labels = torch.randint(0, 1000, (count,), generator=generator).tolist()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        deadline = time.perf_counter() + SPIN_S
        while time.perf_counter() < deadline:
            pass
        return {"image": self.images[i], "label": self.labels[i]}


def next_epoch(loader: DataLoader, sampler) -> int:
    """Samples of the next epoch of ``loader`` (after ``sampler.set_epoch``); their count."""
    sampler.set_epoch(sampler.epoch + 1)
    return sum(len(batch["label"]) for batch in loader)


def cache_bytes(dataset: Dataset, world_size: int) -> int:
    """Bytes of the largest rank's cache when ``world_size`` ranks split ``dataset``."""
    sizes = []
    for rank in range(world_size):
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
        loader, _ = create_rank_cached_dataloader(dataset, {"num_workers": 0}, "cpu", log_fn=len)
        sizes.append(loader.dataset.nbytes)
    return max(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for name in ("RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)  # one rank for the rates
    dataset = SpinningDataset(args.samples)
    plain_sampler = DistributedSampler(dataset, num_replicas=1, rank=0)
    plain = DataLoader(dataset, batch_size=BATCH, sampler=plain_sampler)
    workers = DataLoader(dataset, batch_size=BATCH, sampler=plain_sampler, num_workers=2,
                         persistent_workers=True)  # fmt: skip
    start = time.perf_counter()
    cached, cached_sampler = create_rank_cached_dataloader(
        dataset, {"batch_size": BATCH, "num_workers": 0}, "cpu", log_fn=len
    )
    first_pass = time.perf_counter() - start
    next_epoch(workers, plain_sampler)  # start the workers outside the timings
    best = best_rates(
        {
            "plain": lambda: next_epoch(plain, plain_sampler),
            "workers": lambda: next_epoch(workers, plain_sampler),
            "cached": lambda: next_epoch(cached, cached_sampler),
        },
        args.rounds,
    )
    one, four = cache_bytes(dataset, 1), cache_bytes(dataset, 4)
    result = {
        "samples": args.samples,
        "getitem_us": SPIN_S * 1e6,
        "batch_size": BATCH,
        "plain_samples_per_s": round(best["plain"]),
        "plain_2_workers_samples_per_s": round(best["workers"]),
        "cached_epoch2_samples_per_s": round(best["cached"]),
        "cached_vs_plain": round(best["cached"] / best["plain"], 1),
        "cached_vs_plain_workers": round(best["cached"] / best["workers"], 1),
        "cached_first_pass_s": round(first_pass, 2),
        "cache_bytes_1_rank": one,
        "cache_bytes_4_ranks": four,
        "bytes_4_vs_1": round(four / one, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
