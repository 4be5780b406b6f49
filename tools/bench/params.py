"""Benchmark: augmentation-parameter throughput against the original SHA-256 chain and raw Philox.

Prints one JSON object. Figures are params/s over N samples and ratios against baselines
measured in the same process: ``vs_sha256`` (the original library's per-sample SHA-256 chain)
and ``vs_philox`` (numpy Philox ``random((n, 5))``, the limit for five uniforms per sample).

    .venv/bin/python tools/bench/params.py [--samples 1000000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random

import numpy as np
from common import best_rate  # tools/bench/common.py, beside this file

from nnh_data import (
    gen_augmentation_params_batch,
    get_preset,
    stream_distributed_augmentation_chain,
)

FIB = [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]


def sha256_reference(base_seed: int, rank: int, sample_id: int, ranges) -> dict:
    """The original per-sample chain: sha256, 10 rounds over hex + Fibonacci, random.Random."""
    digest = hashlib.sha256(f"{base_seed}:{rank}:{sample_id}".encode()).hexdigest()
    for fib in FIB:
        digest = hashlib.sha256(f"{digest}{fib}".encode()).hexdigest()
    rng = random.Random(int(digest, 16))
    names = ("rotation", "brightness", "noise", "scale", "contrast")
    return {name: rng.uniform(low, high) for name, (low, high) in zip(names, ranges)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    args = parser.parse_args()
    n, ranges = args.samples, get_preset("moderate").ranges()
    ids = np.arange(n, dtype=np.int64)
    philox = np.random.Generator(np.random.Philox(0))

    batch = best_rate(lambda: gen_augmentation_params_batch(ids, rank=0, world_size=1), n, 5)
    chain = best_rate(lambda: sum(1 for _ in stream_distributed_augmentation_chain(n, 0, 1)), n, 2)
    raw = best_rate(lambda: philox.random((n, 5)), n, 5)
    sha = best_rate(lambda: [sha256_reference(0, 0, i, ranges) for i in range(n)], n, 1)
    print(
        json.dumps(
            {
                "samples": n,
                "batch_params_per_s": round(batch),
                "chain_params_per_s": round(chain),
                "sha256_reference_params_per_s": round(sha),
                "philox_raw_params_per_s": round(raw),
                "batch_vs_sha256": round(batch / sha, 1),
                "batch_vs_philox": round(batch / raw, 3),
                "chain_vs_sha256": round(chain / sha, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
