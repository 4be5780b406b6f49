"""Benchmark: batched ``apply_augmentation`` against a per-sample Python loop of the same calls.

Prints one JSON object. For each device (CPU, and CUDA when available) and image size, images/s
of uint8 RGB batches augmented in one call (moderate preset, keyed noise), of the same samples
one call each (the ``AugmentParams`` path of a Dataset), and of one call with noise drawn from a
``torch.Generator`` (the cost of per-sample keys); ratios are against the loop.

    .venv/bin/python tools/bench/transforms.py [--batch 64] [--sizes 224 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from nnh_data.augment import gen_augmentation_params_batch
from nnh_data.transforms import apply_augmentation


def best_rate(fn, count: int, repeats: int, device: torch.device) -> float:
    """Best items/s of ``fn()`` over ``repeats`` runs after one warm-up run."""
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return count / best


def measure(device: torch.device, batch: int, size: int, repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=gen)
    images, gen = images.to(device), torch.Generator(device).manual_seed(0)
    cols = gen_augmentation_params_batch(np.arange(batch), rank_aware=False)
    rows = [{k: v[i] for k, v in cols.items()} for i in range(batch)]
    batched = best_rate(lambda: apply_augmentation(images, cols), batch, repeats, device)
    one_by_one = lambda: [apply_augmentation(images[i], rows[i]) for i in range(batch)]  # noqa: E731
    loop = best_rate(one_by_one, batch, repeats, device)
    drawn = best_rate(
        lambda: apply_augmentation(images, cols, generator=gen), batch, repeats, device
    )
    return {
        "batched_images_per_s": round(batched, 1),
        "loop_images_per_s": round(loop, 1),
        "generator_noise_images_per_s": round(drawn, 1),
        "batched_vs_loop": round(batched / loop, 2),
        "generator_noise_vs_loop": round(drawn / loop, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 32])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    result: dict[str, object] = {"batch": args.batch, "cpu_threads": torch.get_num_threads()}
    for device in devices:
        for size in args.sizes:
            result[f"{device.type}_{size}px"] = measure(device, args.batch, size, args.repeats)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
