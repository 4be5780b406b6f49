"""Benchmark: batched ``apply_augmentation`` against a per-sample Python loop of the same calls,
and against ``kornia.augmentation``, the batched peer users would pick.

Prints one JSON object. For each device (CPU, and CUDA when available) and image size, images/s
of uint8 RGB batches augmented in one call (moderate preset, keyed noise), of the same samples
one call each (the ``AugmentParams`` path of a Dataset), and of one call with noise drawn from a
``torch.Generator`` (the cost of per-sample keys); ratios are against the loop.

The peer: ``nn.Sequential(RandomAffine, ColorJiggle, RandomGaussianNoise)``, every step with
``p=1`` and the preset's ranges (rotation as ``degrees``, ``scale``, the brightness and contrast
factors; the preset has no translation, shear, saturation or hue, so kornia's stay off; noise
``std`` the top of the preset's noise range, since kornia draws no std per sample and the cost
does not depend on it). kornia works on float images in [0, 1]: both sides run on the same
float32 batch, converted from the uint8 batch once outside the timings, and both draw their
parameters inside them (nnh with ``gen_augmentation_params_batch``). ``nnh_vs_kornia`` is nnh's
images/s over kornia's. What differs and costs little: kornia's brightness is additive and its
contrast scales the raw values (nnh's blends with the image mean), and its noise is not
clamped. kornia is a bench-only dependency (``pip install -e .[bench]``); without it the JSON
says so under ``"kornia"`` and these figures are left out.

Rates are the best of ``--repeats`` rounds after a warm-up, the figures of one device and size
taking turns within each round (``best_rates`` of common.py).

    .venv/bin/python tools/bench/transforms.py [--batch 64] [--sizes 224 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import numpy as np
import torch
from common import best_rates  # tools/bench/common.py, beside this file

from nnh_data.augment.params import AugmentationConfig, gen_augmentation_params_batch, get_preset
from nnh_data.augment.transforms import apply_augmentation

try:
    import kornia
    import kornia.augmentation as K
except ImportError:
    kornia = None

PRESET = "moderate"


def kornia_pipeline(config: AugmentationConfig) -> torch.nn.Module:
    """kornia's batched counterpart of ``apply_augmentation`` with ``config``'s ranges."""
    return torch.nn.Sequential(
        K.RandomAffine(degrees=config.rotation_range, scale=config.scale_range, p=1.0),
        K.ColorJiggle(brightness=config.brightness_range, contrast=config.contrast_range, p=1.0),
        K.RandomGaussianNoise(std=config.noise_range[1], p=1.0),
    )


def timed(fn: Callable[[], object], batch: int, device: torch.device) -> Callable[[], int]:
    """``fn`` run to completion on ``device``, returning the images it augmented."""

    def run() -> int:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return batch

    return run


def measure(device: torch.device, batch: int, size: int, repeats: int) -> dict[str, float]:
    config = get_preset(PRESET)
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=gen)
    images, gen = images.to(device), torch.Generator(device).manual_seed(0)
    floats = images.float() / 255  # kornia's input; converted once, outside the timings
    ids = np.arange(batch)
    cols = gen_augmentation_params_batch(ids, config=config, rank_aware=False)
    rows = [{k: v[i] for k, v in cols.items()} for i in range(batch)]
    fns = {
        "batched": lambda: apply_augmentation(images, cols),
        "loop": lambda: [apply_augmentation(images[i], rows[i]) for i in range(batch)],
        "drawn": lambda: apply_augmentation(images, cols, generator=gen),
    }
    if kornia is not None:
        peer = kornia_pipeline(config).to(device)
        fns["nnh_float"] = lambda: apply_augmentation(
            floats, gen_augmentation_params_batch(ids, config=config, rank_aware=False)
        )
        fns["kornia"] = lambda: peer(floats)
    fns = {name: timed(fn, batch, device) for name, fn in fns.items()}
    for fn in fns.values():  # warm-up
        fn()
    rate = best_rates(fns, repeats)
    result = {
        "batched_images_per_s": round(rate["batched"], 1),
        "loop_images_per_s": round(rate["loop"], 1),
        "generator_noise_images_per_s": round(rate["drawn"], 1),
        "batched_vs_loop": round(rate["batched"] / rate["loop"], 2),
        "generator_noise_vs_loop": round(rate["drawn"] / rate["loop"], 2),
    }
    if kornia is not None:
        result["nnh_float_images_per_s"] = round(rate["nnh_float"], 1)
        result["kornia_images_per_s"] = round(rate["kornia"], 1)
        result["nnh_vs_kornia"] = round(rate["nnh_float"] / rate["kornia"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 32])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    result: dict[str, object] = {
        "batch": args.batch,
        "cpu_threads": torch.get_num_threads(),
        "kornia": kornia.__version__ if kornia else "not installed: pip install -e .[bench]",
    }
    for device in devices:
        for size in args.sizes:
            result[f"{device.type}_{size}px"] = measure(device, args.batch, size, args.repeats)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
