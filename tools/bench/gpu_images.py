"""Images/s at 224 px through the whole loader with the GPU decode stage, against the CPU decode
path and against torchvision's GPU decode plus crop. Prepared to finish in under 5 minutes on
one GPU with 16 CPU cores (not yet run: no GPU was lent when it was written).

The corpus is ``tools/bench/images.py``'s ImageNet-like one (240 dead-leaves JPEGs, quality 90,
short side 300-500 px) repeated to ``--images`` samples in 16 tar shards. Three pipelines, each
``streaming_loader`` with ``--workers`` workers, batches of 256, the ``imagenet`` preset's crops,
ending with a (256, 3, 224, 224) uint8 batch on the device, after a warm-up epoch, taking turns
in each of ``--rounds`` rounds:

- ``cpu``: the workers decode (``SampleDecoder("torchrgb8", crop_size=224)``: ``decode_crop``
  with the installed CPU backends); the main process moves the batch to the device;
- ``gpu_stage``: the workers hand the bytes out; :class:`~nnh_data.images.GpuCropDecoder`
  decodes the crops with nvImageCodec (region = the crop), resizes and flips on the device;
- ``torchvision``: the same stage with ``decoder="torchvision"`` (whole-file ``decode_jpeg`` on
  the device, the crop sliced), where torchvision imports.

Prints one JSON object: images/s per pipeline and round, the ratios (median and range over the
rounds), PSNR of the stage's crops against the CPU path's on one batch (mean and lowest), the
device's name and the load average. ``--device cpu`` runs the same plumbing on the CPU
(nvImageCodec's CPU decoder; seconds with ``--images 512 --workers 1 --rounds 1``), to check the
script on a machine without CUDA.

On a lent GPU machine (its python3 has torch and torchvision, not nnh's other needs), carry the
wheels, downloaded here in the repository's root (``.whl`` ignored by ``.git/info/exclude``)::

    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \\
        nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.3.2.43 simplejpeg==1.9.0 \\
        webdataset==1.0.2 torchdata==0.11.0 braceexpand==0.1.7     # 29 MB

and run there (the CUDA tests of the stage, then this script)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site:$PWD &&
    python3 -m pytest -q -p no:cacheprovider tests/nnh_data/images/test_gpu_decode.py &&
    python3 tools/bench/gpu_images.py --images 20000 --workers 8 --rounds 3

    python tools/bench/gpu_images.py [--images 20000] [--workers 8] [--rounds 3] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch

from nnh_data import SampleDecoder, ShardedStreamingDataset, get_preset, streaming_loader
from nnh_data.images import GpuCropDecoder
from nnh_data.shards.writer import write_shards

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from images import corpus  # noqa: E402

SIZE, BATCH, SEED, SHARDS = 224, 256, 0, 16


def loader(folder: str, decode, workers: int):
    ds = ShardedStreamingDataset(f"{folder}/s-{{000000..{SHARDS - 1:06d}}}.tar", seed=SEED,
                                 aug_config=get_preset("imagenet"), batch_size=BATCH,
                                 decode=decode, index_path=f"{folder}/index.json")  # fmt: skip
    return ds, streaming_loader(ds, batch_size=BATCH, num_workers=workers)


def has_torchvision() -> bool:
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except (ImportError, RuntimeError):  # RuntimeError: a wheel built for another torch
        return False
    return True


def pipelines(folder: str, workers: int, device: str) -> dict:
    """Each pipeline: (dataset, loader, what turns a batch into the device's images)."""
    cpu = loader(folder, SampleDecoder("torchrgb8", crop_size=SIZE), workers)
    raw = loader(folder, None, workers)
    out = {"cpu": (*cpu, lambda b: b["jpg"].to(device, non_blocking=True))}
    stage = GpuCropDecoder(SIZE, device=device, decoder="nvimgcodec", augment=False)
    out["gpu_stage"] = (*raw, lambda b: stage(b)["jpg"])
    if has_torchvision():
        tv = GpuCropDecoder(SIZE, device=device, decoder="torchvision", augment=False)
        out["torchvision"] = (*raw, lambda b: tv(b)["jpg"])
    return out


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def epoch(ds, batches, finish, number: int, device: str) -> tuple[int, float]:
    ds.set_epoch(number)
    synchronize(device)
    start, count = time.perf_counter(), 0
    for batch in batches:
        count += finish(batch).shape[0]
    synchronize(device)
    return count, time.perf_counter() - start


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * math.log10(255**2 / mse)


def quality(folder: str, device: str) -> list[float]:
    """PSNR (mean, lowest) of the stage's crops against the CPU path's, on one batch."""
    _, cpu = loader(folder, SampleDecoder("torchrgb8", crop_size=SIZE), 0)
    _, raw = loader(folder, None, 0)
    want = next(iter(cpu))["jpg"].numpy()
    stage = GpuCropDecoder(SIZE, device=device, decoder="nvimgcodec", augment=False)
    got = stage(next(iter(raw)))["jpg"].cpu().numpy()
    values = [psnr(g, w) for g, w in zip(got, want)]
    return [round(float(np.mean(values)), 1), round(float(np.min(values)), 1)]


def spread(values: np.ndarray) -> list[float]:
    return [round(float(np.median(values)), 2), round(float(values.min()), 2),
            round(float(values.max()), 2)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs CUDA (--device cpu checks the plumbing)"}))
        return
    name = torch.cuda.get_device_name(args.device) if args.device != "cpu" else "cpu"
    out = {"device": name, "images": args.images, "workers": args.workers,
           "load_average_before": round(os.getloadavg()[0], 2)}  # fmt: skip
    pool = corpus("imagenet_like", 7)
    samples = ({"__key__": f"{i:08d}", "jpg": pool[i % len(pool)], "cls": b"%d" % (i % 1000)}
               for i in range(args.images))  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        write_shards(samples, f"{folder}/s-%06d.tar", max_count=-(-args.images // SHARDS))
        runs = pipelines(folder, args.workers, args.device)
        rates = {name: [] for name in runs}
        for number in range(args.rounds + 1):
            for name, (ds, batches, finish) in runs.items():
                count, seconds = epoch(ds, batches, finish, number, args.device)
                if number:  # the first epoch warms up workers, caches and the decoders
                    rates[name].append(round(count / seconds, 1))
        out["images_per_s"] = rates
        stage = np.array(rates["gpu_stage"])
        for name in (n for n in rates if n != "gpu_stage"):
            out[f"gpu_stage_vs_{name}"] = spread(stage / np.array(rates[name]))
        out["psnr_gpu_stage_vs_cpu_mean_lowest"] = quality(folder, args.device)
    out["load_average_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
