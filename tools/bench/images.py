"""Per-image CPU time of ``decode_crop`` against the reference decode (full Pillow decode, crop
the same box, BILINEAR resize, flip) and the other pip backends on the ``imagenet`` preset's
crops, and through ``streaming_loader`` against LitData with the reference decode.

Two corpora are generated (JPEG quality 90, "dead leaves" pictures: discs with a power-law size
distribution, as natural images have, textured with multi-octave noise and grain): ImageNet-like
(short side 300-500 px) and large (long side 1,500-3,000 px); output 224. Per image, every candidate
runs once per round, timed by ``time.process_time`` (CPU time of the process, all threads: the
machine is shared), one torch thread. The candidates take turns by blocks of ``BLOCK`` images, in a
new random order for every block, as a loader decodes image after image with one decoder: with turns
per image in a rotating order, each candidate always ran right after the same neighbour, and the one
after the reference paid for the reference's whole-image decode in the caches (``nnh``, right after
it, measured 1.56x where the same decode forced, next in turn, measured 1.85x). Candidates:
``reference``; ``nnh`` (``decode_crop``, the cost model choosing among the installed backends);
``nnh_<backend>`` (each backend alone); the other pip backends where installed, each with its own
fastest use of the same box: ``pyvips`` (shrink-on-load at the same DCT scale, sequential access,
crop), ``turbojpeg`` (PyTurboJPEG's scaled decode; needs the system's libturbojpeg), ``torchvision``
(``decode_jpeg`` on the CPU, whole file); and ``floor``: simplejpeg's 1/8-scale decode of the rows
down to the crop's bottom, no crop or resize (the Huffman pass over the rows that must be read: the
most any decoder of these files can skip to). Figures per round are the reference's CPU time over
each candidate's; the JSON gives the median and range over the rounds, PSNR against the reference
(mean, lowest image) and the targets.

``--loader``: 2,048 ImageNet-like JPEGs (the corpus repeated), ``streaming_loader`` with 2
workers, ``SampleDecoder("torchrgb8", crop_size=224)``, batches of 64, against LitData's
``StreamingDataLoader`` (2 workers) whose transform applies the reference decode to the same
preset's crops; each a fresh process per round, CPU per image of all processes. ``--fit`` prints
the cost model's coefficients refitted on the per-image times (non-negative least squares).

    .venv/bin/python tools/bench/images.py [--rounds 5] [--loader] [--fit]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VIPS_CONCURRENCY", "1")  # pyvips: one thread, as the others

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter

import nnh_data.images.crop_decoder as crop_decoder
from nnh_data.augment.params import crop_box, gen_augmentation_params, get_preset
from nnh_data.images.crop_decoder import decode_crop, decode_crop_reference
from nnh_data.images.jpeg_backends import SCALES, crop_job, installed_backends
from nnh_data.images.jpeg_frame import read_frame, rows_for, with_height

SIZE, QUALITY, SEED = 224, 90, 0
IMAGENET = get_preset("imagenet")
CORPORA = {"imagenet_like": (300, 500, 240), "large": (1500, 3000, 24)}  # short/long side, count
TARGETS = {"imagenet_like": 1.7, "large": 2.5}  # nnh over the reference, median over rounds
LOADER_IMAGES, LOADER_BATCH, LOADER_WORKERS = 2048, 64, 2
BLOCK = 8  # images a candidate decodes in a row (see the module docstring)


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
        buffer = io.BytesIO()
        picture(rng, *size).save(buffer, "JPEG", quality=QUALITY)
        out.append(buffer.getvalue())
    return out


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * math.log10(255**2 / mse)


def _scale_of(box: tuple[int, int, int, int]) -> int:
    fits = min(box[2] - box[0], box[3] - box[1]) // SIZE
    return next((s for s in SCALES if s <= fits), 1)


def _finish(array: np.ndarray, box, scale: int, params: dict) -> np.ndarray:
    """A peer's decoded array resized and flipped by Pillow, as a user of that peer would."""
    image = Image.fromarray(array).resize((SIZE, SIZE), Image.BILINEAR,
                                          box=tuple(v / scale for v in box))  # fmt: skip
    if params.get("flip"):
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(image)


def peers() -> dict:
    """The other pip backends that are installed, each ``(data, params) -> pixels``."""
    out = {}
    try:
        import pyvips

        pyvips.cache_set_max(0)

        def vips(data, params):
            head = read_frame(data)
            box = crop_box(params, head.width, head.height)
            scale = _scale_of(box)
            image = pyvips.Image.new_from_buffer(data, "", shrink=scale, access="sequential")
            left, top = box[0] // scale, box[1] // scale
            right = min(image.width, -(-box[2] // scale) + 1)
            bottom = min(image.height, -(-box[3] // scale) + 1)
            array = image.crop(left, top, right - left, bottom - top).numpy()
            shifted = (box[0] - left * scale, box[1] - top * scale,
                       box[2] - left * scale, box[3] - top * scale)  # fmt: skip
            return _finish(array, shifted, scale, params)

        out["pyvips"] = vips
    except (ImportError, OSError):
        pass
    try:
        import turbojpeg

        jpeg = turbojpeg.TurboJPEG()

        def turbo(data, params):
            width, height = jpeg.decode_header(data)[:2]
            box = crop_box(params, width, height)
            scale = _scale_of(box)
            array = jpeg.decode(data, pixel_format=turbojpeg.TJPF_RGB, scaling_factor=(1, scale))
            return _finish(array, box, scale, params)

        out["turbojpeg"] = turbo
    except (ImportError, OSError, RuntimeError):
        pass
    try:
        from torchvision.io import ImageReadMode, decode_jpeg

        def torchvision(data, params):
            image = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                                mode=ImageReadMode.RGB)  # fmt: skip
            return _finish(image.permute(1, 2, 0).numpy(), crop_box(params, *image.shape[:0:-1]),
                           1, params)  # fmt: skip

        out["torchvision"] = torchvision
    except (ImportError, OSError, RuntimeError):
        pass
    return out


def floor(data: bytes, params: dict) -> np.ndarray:
    """The Huffman pass over the rows down to the crop's bottom (1/8 scale, no crop, resize)."""
    import simplejpeg

    head = read_frame(data)
    rows = rows_for(head, crop_box(params, head.width, head.height)[3])
    cut = with_height(data, head, rows)
    return simplejpeg.decode_jpeg(cut, "RGB", strict=False, min_height=-(-rows // 8),
                                  min_width=-(-head.width // 8))  # fmt: skip


def candidates() -> dict:
    """Every candidate as ``(data, params) -> pixels`` (``floor`` gives no crop)."""
    def alone(backend):
        def run(data, params):
            saved = crop_decoder.installed_backends
            crop_decoder.installed_backends = lambda: (backend,)
            try:
                return decode_crop(data, params, SIZE)
            finally:
                crop_decoder.installed_backends = saved
        return run

    out = {"reference": lambda d, p: decode_crop_reference(d, p, SIZE),
           "nnh": lambda d, p: decode_crop(d, p, SIZE)}  # fmt: skip
    out.update({f"nnh_{b.name}": alone(b) for b in installed_backends()})
    out.update(peers())
    if "simplejpeg" in {b.name for b in installed_backends()}:
        out["floor"] = floor
    return out


def per_process(name: str, images: list[bytes], rounds: int) -> tuple[dict, dict]:
    """The corpus's figures, and the per-image CPU seconds ``{candidate: (rounds, images)}``."""
    params = [gen_augmentation_params(i, IMAGENET, SEED) for i in range(len(images))]
    fns = candidates()
    reference = [fns["reference"](d, p) for d, p in zip(images, params)]
    quality = {}
    for key, fn in fns.items():
        if key not in ("reference", "floor"):
            values = [psnr(fn(d, p), r) for d, p, r in zip(images, params, reference)]
            quality[key] = (round(float(np.mean(values)), 1), round(float(np.min(values)), 1))
    times = {key: np.zeros((rounds, len(images))) for key in fns}
    keys = list(fns)
    for r in range(rounds):
        for b, first in enumerate(range(0, len(images), BLOCK)):
            # a new order for each block: a candidate's neighbours change
            for key in np.random.default_rng((r, b)).permutation(keys):
                for i in range(first, min(first + BLOCK, len(images))):
                    start = time.process_time()
                    fns[key](images[i], params[i])
                    times[key][r, i] = time.process_time() - start
    ratios = {k: times["reference"].sum(1) / v.sum(1) for k, v in times.items()}
    out = {"images": len(images), "mean_kb": round(sum(map(len, images)) / len(images) / 1e3, 1),
           "reference_ms": round(float(np.median(times["reference"].sum(1))) / len(images) * 1e3,
                                 2)}
    for key, ratio in ratios.items():
        out[f"{key}_vs_reference"] = [round(float(np.median(ratio)), 2),
                                      round(float(ratio.min()), 2), round(float(ratio.max()), 2)]
    out["psnr_mean_lowest"] = quality
    peer_best = max((float(np.median(ratios[k])) for k in peers()), default=0.0)
    nnh = float(np.median(ratios["nnh"]))
    out["targets"] = {f"vs_reference>={TARGETS[name]}": nnh >= TARGETS[name],
                      "psnr_lowest>=30": quality["nnh"][1] >= 30,
                      "psnr_mean>=38": quality["nnh"][0] >= 38,
                      "vs_best_other_backend>=1": nnh >= peer_best}  # fmt: skip
    return out, times


def fit(images: dict[str, list[bytes]], times: dict[str, dict]) -> dict:
    """Each backend's cost coefficients refitted (the features of ``JpegBackend.cost_ms``)."""
    from scipy.optimize import nnls

    out = {}
    for backend in installed_backends():
        rows, seconds = [], []
        for name, corpus_images in images.items():
            for i, data in enumerate(corpus_images):
                job = crop_job(data, gen_augmentation_params(i, IMAGENET, SEED), SIZE)
                left, top, right, bottom = job.box
                crop = (right - left) * (bottom - top) / 1e6
                read = bottom if backend.region else job.rows
                scale = 1 if backend.region else job.scale
                pixels = crop if backend.region else job.frame.width * job.rows / 1e6
                row = [1.0, job.nbytes / 1e6 * read / job.frame.height, 0.0, 0.0, 0.0, 0.0,
                       crop / scale**2]  # fmt: skip
                row[2 + (1, 2, 4, 8).index(scale)] = pixels
                rows.append(row)
                seconds.append(float(np.median(times[name][f"nnh_{backend.name}"][:, i])) * 1e3)
        a, y = np.array(rows), np.array(seconds)
        weights = 1 / np.sqrt(y)
        coefficients, _ = nnls(a * weights[:, None], y * weights)
        error = np.abs(a @ coefficients - y) / y
        out[backend.name] = {"coefficients_ms": np.round(coefficients, 3).tolist(),
                             "median_error": round(float(np.median(error)), 3)}  # fmt: skip
    return out


# ------------------------------------------------------------------ through the loader


def write_corpora(folder: str) -> None:
    from litdata.streaming.writer import BinaryWriter

    from nnh_data.shards.writer import write_shards

    pool = corpus("imagenet_like", 7)
    samples = [{"__key__": f"{i:06d}", "jpg": pool[i % len(pool)], "cls": str(i % 1000).encode()}
               for i in range(LOADER_IMAGES)]  # fmt: skip
    write_shards(iter(samples), f"{folder}/nnh/s-%06d.tar", max_count=LOADER_IMAGES // 8)
    writer = BinaryWriter(f"{folder}/litdata", chunk_size=LOADER_IMAGES // 8)
    for i, sample in enumerate(samples):
        writer[i] = {"jpg": sample["jpg"], "cls": i % 1000, "index": i}
    writer.done()
    writer.merge()


def _litdata_item(sample: dict) -> dict:
    """LitData's side: the reference decode of the preset's crop of the sample."""
    params = gen_augmentation_params(int(sample["index"]), IMAGENET, SEED)
    pixels = decode_crop_reference(sample["jpg"], params, SIZE)
    image = torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))  # as nnh's
    return {"image": image, "cls": sample["cls"]}


def loader_child(system: str, folder: str) -> dict:
    """One epoch in this (fresh) process: CPU microseconds per image of all processes."""
    import glob

    if system == "nnh":
        from nnh_data import SampleDecoder, ShardedStreamingDataset, streaming_loader

        ds = ShardedStreamingDataset(sorted(glob.glob(f"{folder}/nnh/*.tar")), seed=SEED,
                                     aug_config=IMAGENET, batch_size=LOADER_BATCH,
                                     decode=SampleDecoder("torchrgb8", crop_size=SIZE))  # fmt: skip
        loader = streaming_loader(ds, batch_size=LOADER_BATCH, num_workers=LOADER_WORKERS)
    else:
        from litdata import StreamingDataLoader, StreamingDataset

        ds = StreamingDataset(f"{folder}/litdata", shuffle=True, transform=_litdata_item)
        loader = StreamingDataLoader(ds, batch_size=LOADER_BATCH, num_workers=LOADER_WORKERS)
    rows, start, cpu = 0, time.perf_counter(), time.process_time()
    for batch in loader:
        rows += len(batch["cls"])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    del loader
    import gc

    gc.collect()
    children = os.times().children_user + os.times().children_system
    return {"rows": rows, "images_per_s": rows / seconds,
            "cpu_us_per_image": 1e6 * (cpu + children) / rows}


def through_loader(rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        write_corpora(folder)
        runs = {"nnh": [], "litdata": []}
        for _ in range(rounds):
            for system in runs:
                out = subprocess.run([sys.executable, __file__, "--loader-child", system, folder],
                                     capture_output=True, text=True, check=True)  # fmt: skip
                runs[system].append(json.loads(out.stdout.strip().splitlines()[-1]))
    cpu = np.array([other["cpu_us_per_image"] / n["cpu_us_per_image"]
                    for n, other in zip(runs["nnh"], runs["litdata"])])  # fmt: skip
    rate = np.array([n["images_per_s"] / other["images_per_s"]
                     for n, other in zip(runs["nnh"], runs["litdata"])])  # fmt: skip
    return {"images": LOADER_IMAGES, "workers": LOADER_WORKERS,
            "nnh_cpu_us_per_image": [round(r["cpu_us_per_image"]) for r in runs["nnh"]],
            "litdata_cpu_us_per_image": [round(r["cpu_us_per_image"]) for r in runs["litdata"]],
            "nnh_vs_litdata_cpu": [round(float(np.median(cpu)), 2), round(float(cpu.min()), 2),
                                   round(float(cpu.max()), 2)],
            "nnh_vs_litdata_rate": [round(float(np.median(rate)), 2), round(float(rate.min()), 2),
                                    round(float(rate.max()), 2)],
            "target_cpu>=1.3": bool(np.median(cpu) >= 1.3)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loader", action="store_true", help="also the figure against LitData")
    parser.add_argument("--loader-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fit", action="store_true", help="refit the cost model's coefficients")
    parser.add_argument("--loader-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loader_child:
        print(json.dumps(loader_child(*args.loader_child)))
        return
    torch.set_num_threads(1)
    out = {"backends": [b.name for b in installed_backends()], "size": SIZE,
           "load_average_before": round(os.getloadavg()[0], 2)}  # fmt: skip
    if not args.loader_only:
        images = {name: corpus(name, k) for k, name in enumerate(CORPORA)}
        times = {}
        for name, corpus_images in images.items():
            out[name], times[name] = per_process(name, corpus_images, args.rounds)
        if args.fit:
            out["fit"] = fit(images, times)
    if args.loader or args.loader_only:
        out["loader"] = through_loader(args.rounds)
    out["load_average_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
