"""Images/s of ``decode_crop`` against the reference decode (full Pillow decode, crop the same
box, BILINEAR resize, flip) on the ``imagenet`` preset's crops, and end to end through
``streaming_loader`` against WebDataset with the reference decode.

Two corpora are generated (JPEG quality 90, "dead leaves" pictures: discs with a power-law size
distribution, as natural images have, textured with multi-octave noise and grain): ImageNet-like
(short side 300-500 px) and large (long side 1,500-3,000 px); output 224. Per-process figures
run in this process with one torch thread (as in a DataLoader worker), the decoders taking turns
within each round; ``nnh_pillow`` is ``decode_crop`` without simplejpeg (the fallback);
``ceiling_vs_reference`` is the rate of a bare 1/8-scale decode of every file (simplejpeg, no
crop or resize) over the reference's: no decoder that reads every coefficient beats it. PSNR is
against the reference, per image, then averaged. The end-to-end figure streams tar shards
written by webdataset's ``ShardWriter`` through 2 DataLoader workers, batches of 64, two epochs
after a warm-up. Prints one JSON object.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch
import webdataset as wds
from PIL import Image, ImageDraw, ImageFilter
from torch.utils.data import DataLoader

import nnh_data.images.crop_decoder as image_decode
from nnh_data import (
    SampleDecoder,
    ShardedStreamingDataset,
    decode_crop,
    gen_augmentation_params,
    get_preset,
    streaming_loader,
)
from nnh_data.images.crop_decoder import decode_crop_reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import best_rates  # noqa: E402

SIZE, QUALITY, SEED = 224, 90, 0
IMAGENET = get_preset("imagenet")
CORPORA = {"imagenet_like": (300, 500, 240), "large": (1500, 3000, 24)}  # short/long side, count
E2E_IMAGES, E2E_BATCH, E2E_WORKERS = 512, 64, 2


def picture(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A dead-leaves picture with texture and grain."""
    image = Image.new("RGB", (width, height), tuple(int(c) for c in rng.integers(0, 256, 3)))
    draw, side = ImageDraw.Draw(image), max(width, height)
    for r in np.clip(side * 0.01 / rng.uniform(0.02, 1, 600) ** 0.9, 2, side / 2):
        x, y = rng.uniform(0, width), rng.uniform(0, height)
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        draw.ellipse((x - r, y - r * rng.uniform(0.5, 1.5), x + r, y + r), fill=fill)
    pixels = np.asarray(image.filter(ImageFilter.GaussianBlur(0.6)), np.float32)
    for octave in range(1, 10):  # multi-octave value noise
        cells = 2**octave
        grid = (max(2, cells * height // side), max(2, cells * width // side))
        small = Image.fromarray(rng.integers(0, 256, (*grid, 3), dtype=np.uint8))
        noise = np.asarray(small.resize((width, height), Image.BICUBIC), np.float32) - 128
        pixels += 0.6 * noise * 0.8**octave
    pixels += rng.normal(0, 4, (height, width, 1))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def corpus(name: str, seed: int) -> list[bytes]:
    """JPEGs of ``name``: ImageNet-like sizes are short side x (1-1.5), large ones long side x
    (1-1.5)^-1; 30% portrait."""
    low, high, count = CORPORA[name]
    rng, out = np.random.default_rng(seed), []
    for _ in range(count):
        side, aspect = int(rng.integers(low, high + 1)), rng.uniform(1.0, 1.5)
        size = (int(side * aspect), side) if name == "imagenet_like" else (side, int(side / aspect))
        size = size[::-1] if rng.random() < 0.3 else size
        buffer = __import__("io").BytesIO()
        picture(rng, *size).save(buffer, "JPEG", quality=QUALITY)
        out.append(buffer.getvalue())
    return out


def eighth_scale_decode(data: bytes, params: dict, size: int) -> np.ndarray:
    """The least any JPEG path here can do: decode the whole file at 1/8 scale (every
    coefficient is still Huffman-decoded), no crop, no resize. Its rate over the reference's
    is the ceiling of ``nnh_vs_reference``."""
    height, width = image_decode.simplejpeg.decode_jpeg_header(data)[:2]
    return image_decode.simplejpeg.decode_jpeg(data, "RGB", min_height=-(-height // 8),
                                               min_width=-(-width // 8))  # fmt: skip


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * math.log10(255**2 / mse)


def without_simplejpeg(fn):
    def call(*args):
        saved, image_decode.simplejpeg = image_decode.simplejpeg, None
        try:
            return fn(*args)
        finally:
            image_decode.simplejpeg = saved

    return call


def per_process(images: list[bytes], repeats: int) -> dict:
    params = [gen_augmentation_params(i, IMAGENET, SEED) for i in range(len(images))]

    def run(fn):
        return lambda: sum(1 for d, p in zip(images, params) if fn(d, p, SIZE) is not None)

    fns = {"reference": decode_crop_reference, "nnh": decode_crop,
           "nnh_pillow": without_simplejpeg(decode_crop)}  # fmt: skip
    if image_decode.simplejpeg is not None:
        fns["eighth_scale_decode_only"] = eighth_scale_decode
    rates = best_rates({k: run(fn) for k, fn in fns.items()}, repeats)
    quality = {}
    for name in ("nnh", "nnh_pillow"):
        values = [psnr(fns[name](d, p, SIZE), decode_crop_reference(d, p, SIZE))
                  for d, p in zip(images, params)]  # fmt: skip
        quality[f"psnr_{name}_mean"] = round(float(np.mean(values)), 1)
        quality[f"psnr_{name}_min"] = round(float(np.min(values)), 1)
    return {
        "images": len(images),
        "mean_kb": round(sum(map(len, images)) / len(images) / 1e3, 1),
        **{f"{k}_per_s": round(v, 1) for k, v in rates.items()},
        "nnh_vs_reference": round(rates["nnh"] / rates["reference"], 2),
        "nnh_pillow_vs_reference": round(rates["nnh_pillow"] / rates["reference"], 2),
        "ceiling_vs_reference": round(
            rates.get("eighth_scale_decode_only", 0) / rates["reference"], 2
        ),
        **quality,
    }


def reference_sample(sample: dict) -> tuple[torch.Tensor, int]:
    """WebDataset's side: the reference decode of the sample's crop, as a CHW uint8 tensor."""
    params = gen_augmentation_params(int(sample["__key__"]), IMAGENET, SEED)
    pixels = decode_crop_reference(sample["jpg"], params, SIZE)
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous(), int(sample["cls"])


def epochs_per_s(loader, epochs: int, set_epoch=lambda epoch: None) -> float:
    """Images/s of ``epochs`` epochs after a warm-up one (workers started, files cached)."""
    set_epoch(0)
    for _ in loader:
        pass
    start, count = time.perf_counter(), 0
    for epoch in range(1, 1 + epochs):
        set_epoch(epoch)
        count += sum(len(batch["cls"] if isinstance(batch, dict) else batch[1]) for batch in loader)
    return count / (time.perf_counter() - start)


def end_to_end(images: list[bytes], folder: str) -> dict:
    with wds.ShardWriter(os.path.join(folder, "e2e-%04d.tar"), maxcount=len(images) // 4,
                         verbose=0) as sink:  # fmt: skip
        for i, data in enumerate(images):
            sink.write({"__key__": f"{i:06d}", "jpg": data, "cls": str(i % 1000).encode()})
    urls = os.path.join(folder, "e2e-{0000..0003}.tar")
    ds = ShardedStreamingDataset(urls, seed=SEED, aug_config=IMAGENET, batch_size=E2E_BATCH,
                                 decode=SampleDecoder("torchrgb8", crop_size=SIZE))  # fmt: skip
    nnh = streaming_loader(ds, batch_size=E2E_BATCH, num_workers=E2E_WORKERS)
    pipeline = wds.WebDataset(urls, shardshuffle=False, empty_check=False).map(reference_sample)
    webdataset = DataLoader(pipeline, batch_size=E2E_BATCH, num_workers=E2E_WORKERS,
                            persistent_workers=True)  # fmt: skip
    rates = {"webdataset_reference_per_s": epochs_per_s(webdataset, 2),
             "nnh_per_s": epochs_per_s(nnh, 2, ds.set_epoch)}  # fmt: skip
    return {
        "images": len(images),
        "workers": E2E_WORKERS,
        **{k: round(v, 1) for k, v in rates.items()},
        "nnh_vs_webdataset_reference": round(
            rates["nnh_per_s"] / rates["webdataset_reference_per_s"], 2
        ),
    }


def main() -> None:
    torch.set_num_threads(1)
    out = {"backend": image_decode.JPEG_BACKEND, "size": SIZE, "quality": QUALITY}
    for k, name in enumerate(CORPORA):
        out[name] = per_process(corpus(name, k), repeats=5)
    with tempfile.TemporaryDirectory() as folder:
        images = corpus("imagenet_like", 7)
        images = (images * -(-E2E_IMAGES // len(images)))[:E2E_IMAGES]
        out["end_to_end"] = end_to_end(images, folder)
    out["load_average"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
