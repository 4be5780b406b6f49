"""Benchmark: nnh against LitData, MosaicML Streaming, WebDataset and Hugging Face datasets.

Prints one JSON object. Every system reads the same samples written by its own writer
(``nnh_data.write_shards`` tar, LitData's ``BinaryWriter`` chunks, ``streaming.MDSWriter``
shards, ``webdataset.ShardWriter`` tar, ``datasets``' ``to_parquet``); the nnh tar is also read
by WebDataset (``webdataset_on_nnh_tar``), the ShardWriter tar by nnh (``nnh_on_wds_tar``) and
the ``datasets`` Parquet by nnh (``nnh_on_parquet``, compared with ``datasets``). Each system
is one function (:func:`nnh_loader`, :func:`litdata_loader`, ...) that builds the loader its
user writes: shuffled batches of 256 through its own loader (nnh: ``streaming_loader``;
LitData: ``StreamingDataLoader``; the others: ``torch.utils.data.DataLoader``), with a
per-sample function applied the way the system offers (nnh ``decode=``, LitData
``transform=``, MosaicML a ``__getitem__`` override, WebDataset and ``datasets`` ``.map``).

What is measured, per run, each run a fresh process (so every run pays its first-time costs,
as a training job does), the systems taking turns within a round and the first system
rotating from round to round (the machine's load moves between rounds):

- ``cpu_us_per_row``: CPU time per sample of the main process (all its threads) and every
  DataLoader worker (waited for, so their time is counted), from building the dataset to the
  last batch: what a user's machine spends. Steady on a loaded machine, where the rate is not.
  ``epoch_cpu_us_per_row`` leaves out building the dataset and loader (what this script counted
  before); ``workers_cpu_us_per_row`` is the workers' part.
- ``rate``: samples per second over the same span (wall time).
- ``peak_pss_mib``: the largest sum of the proportional set sizes of the run's process and its
  descendants (the workers), sampled every 50 ms from outside, the same way for every system.

Cases (``w0`` / ``w2``: 0 and 2 DataLoader workers):

- ``small``: ``--samples`` samples of a 3 KiB payload and an int label (nnh's tar stores the
  label as text, ``b"17"``), no per-sample function: each system's batches as it makes them
  (nnh: packed bytes and its labels and parameters; the others: lists of bytes).
- ``fn``: the same samples through :func:`per_sample` (the payload kept, the label as an
  int): the same function in every system, and batches that hold the same values.
- ``jpeg``: ``--images`` 224x224 JPEGs through :func:`per_image` (PIL decode to a uint8
  tensor), the same in every system; ``jpeg_decode`` is that decode alone on the same images
  in a fresh process, the floor of every system's CPU per image (``ceiling_vs_<peer>``: the
  most a system running this decode could lead by).
- ``first_batch``: seconds from building the dataset (after the imports) to the first batch
  with 0 workers, on 10,000 shards of 10 samples (nnh finds its index sidecar on disk, as a
  training job after the first does), and its CPU seconds.

Ratios are ``nnh_vs_<system>`` per round (above 1: nnh better: its rate over the other's; the
other's CPU or memory over nnh's), with their median and range over the rounds. ``--before
DIR`` adds a system ``nnh_before``: nnh's code imported from the checkout ``DIR`` (its
``PYTHONPATH``) reading the nnh data, for a before/after in the same rounds.

Peers: LitData from ``pip install litdata -c <(echo torch==2.13.0)`` (pin torch: an unpinned
install pulls a CUDA build). MosaicML Streaming 0.13 requires torchvision and transformers and
pins an older numpy: install it beside the environment, ``pip install --no-deps --target DIR
mosaicml-streaming brotli python-snappy cramjam zstd catalogue`` (xxhash comes with the
project's environment), and pass ``--mosaic-path DIR``; this script stubs the few torchvision
and transformers names that ``import streaming`` touches (nothing here uses them).

    .venv/bin/python tools/bench/peers.py [--samples 100000] [--images 6000] [--rounds 3]
        [--cases small,fn,jpeg,first_batch] [--systems nnh,litdata,datasets,mosaic,webdataset]
        [--workers 0,2] [--data-dir DIR] [--mosaic-path DIR] [--before DIR]
    .venv/bin/python tools/bench/peers.py --cases hf  # nnh_on_parquet vs datasets, and
        # ``exact``: every sample once and equal batches per rank at 2 and 3 ranks (issue 33)
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.machinery
import io
import itertools
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# this folder's streaming.py (the nnh benchmark) would shadow MosaicML's ``streaming`` package
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

SAMPLE_BYTES = 3072
BATCH = 256
PER_SHARD = 5000  # ~15 MiB shards (chunks) for the throughput cases
MANY_SHARDS, MANY_PER_SHARD = 10_000, 10
IMAGE_SIDE = 224
DISTINCT_IMAGES = 500  # images are drawn from a pool: decode costs the same, writing is quicker
PSS_POLL_S = 0.05
CASES = ("small", "fn", "jpeg", "first_batch")


# ---------------------------------------------------------------- samples and functions


def small_samples(count: int, first: int = 0):
    """``count`` samples: a 3 KiB payload (rotations of one seeded random block, so every
    system stores the same distinct bytes) and an int label."""
    payload = np.random.default_rng(0).bytes(SAMPLE_BYTES)
    for g in range(first, first + count):
        k = g % SAMPLE_BYTES
        yield {"__key__": f"{g:09d}", "bin": payload[k:] + payload[:k], "cls": g % 1000}


def jpeg_pool() -> list[bytes]:
    """``DISTINCT_IMAGES`` smooth random 224x224 RGB JPEGs (quality 90, ~10-20 KB)."""
    from PIL import Image

    rng = np.random.default_rng(1)
    pool = []
    for _ in range(DISTINCT_IMAGES):
        small = Image.fromarray(rng.integers(0, 256, (14, 14, 3), dtype=np.uint8))
        image = np.asarray(small.resize((IMAGE_SIDE, IMAGE_SIDE), Image.BILINEAR), np.int16)
        noisy = np.clip(image + rng.integers(-8, 9, image.shape), 0, 255).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(noisy).save(out, format="JPEG", quality=90)
        pool.append(out.getvalue())
    return pool


def jpeg_samples(count: int):
    pool = jpeg_pool()
    for g in range(count):
        yield {"__key__": f"{g:09d}", "jpg": pool[g % len(pool)], "cls": g % 1000}


def decode_jpeg(data: bytes):
    """The decode every system runs on an image: PIL to a (224, 224, 3) uint8 tensor."""
    import torch
    from PIL import Image

    return torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB")))


def per_sample(sample: dict) -> dict:
    """The per-sample function of the ``fn`` case, the same in every system: the payload as it
    is, the label as an int (nnh's and WebDataset's tar hold it as text)."""
    return {"bin": sample["bin"], "cls": int(sample["cls"])}


def per_image(sample: dict) -> dict:
    """The per-sample function of the ``jpeg`` case: the image decoded, the label as an int."""
    return {"image": decode_jpeg(sample["jpg"]), "cls": int(sample["cls"])}


FUNCTIONS = {"small": None, "fn": per_sample, "jpeg": per_image}


# ---------------------------------------------------------------- writers (each format's own)


def stub_mosaic_imports() -> None:
    """``import streaming`` imports torchvision (no wheel for torch 2.13 on CPU) and a few
    names of transformers; none is used here."""
    if "torchvision" in sys.modules:
        return
    names = {"torchvision": {}, "torchvision.datasets": {"VisionDataset": object},
             "torchvision.transforms": {}, "torchvision.transforms.functional": {"to_tensor": None},
             "transformers": {}, "transformers.models": {}, "transformers.models.auto": {},
             "transformers.models.auto.tokenization_auto": {"AutoTokenizer": None},
             "transformers.feature_extraction_utils": {"BatchFeature": dict},
             "transformers.tokenization_utils_base": {"BatchEncoding": dict}}  # fmt: skip
    for name, attributes in names.items():
        module = sys.modules[name] = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__path__ = []
        module.__dict__.update(attributes)


def write_nnh(samples, folder: str, per_shard: int) -> None:
    from nnh_data.shards.writer import write_shards

    write_shards(samples, f"{folder}/s-%06d.tar", max_count=per_shard)


def write_wds(samples, folder: str, per_shard: int) -> None:
    import webdataset as wds

    os.makedirs(folder, exist_ok=True)
    with wds.ShardWriter(f"{folder}/s-%06d.tar", maxcount=per_shard, verbose=0) as sink:
        for sample in samples:
            sink.write(sample)


def write_litdata(samples, folder: str, per_shard: int) -> None:
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(folder, chunk_size=per_shard)
    for i, sample in enumerate(samples):
        writer[i] = {k: v for k, v in sample.items() if k != "__key__"}
    writer.done()
    writer.merge()


def write_mosaic(samples, folder: str, per_shard: int) -> None:
    stub_mosaic_imports()
    from streaming import MDSWriter

    samples = iter(samples)
    first = next(samples)
    columns = {name: "bytes" for name in first if name not in ("__key__", "cls")}
    columns["cls"] = "int"
    # MDS cuts shards by bytes: each sample's bytes and its 4-byte offset, plus a header
    size = sum(len(v) + 4 for k, v in first.items() if k in columns and k != "cls") + 8 + 4
    with MDSWriter(out=folder, columns=columns, size_limit=size * per_shard + 64) as out:
        for sample in itertools.chain([first], samples):
            out.write({k: v for k, v in sample.items() if k in columns})
    for name in [n for n in sys.modules if n.split(".")[0] in ("torchvision", "transformers")]:
        del sys.modules[name]  # the stubs: ``datasets`` (writing Parquet next) looks for them


def write_parquet(samples, folder: str, per_shard: int) -> None:
    """Parquet shards written by Hugging Face ``datasets`` (``to_parquet``), then converted once
    into its Arrow cache by ``Dataset.from_parquet`` (what a user's first run does; a later run
    maps the cache)."""
    import datasets

    datasets.disable_progress_bars()
    os.makedirs(folder)
    samples, k = iter(samples), 0
    while rows := list(itertools.islice(samples, per_shard)):
        part = datasets.Dataset.from_dict({name: [row[name] for row in rows] for name in rows[0]})
        part.to_parquet(f"{folder}/train-{k:05d}.parquet")
        k += 1
    datasets.Dataset.from_parquet(parquet_files(folder), cache_dir=f"{folder}/.hf-cache")


def parquet_files(folder: str) -> list[str]:
    return sorted(f"{folder}/{name}" for name in os.listdir(folder) if name.endswith(".parquet"))


WRITERS = {"nnh": write_nnh, "webdataset": write_wds, "litdata": write_litdata,
           "mosaic": write_mosaic, "parquet": write_parquet}  # fmt: skip


@functools.lru_cache
def shard_pattern(folder: str) -> str:
    """A brace pattern of the tar shards of ``folder`` (what a user passes nnh and WebDataset;
    a user types it, so :func:`run_first_batch` lists the folder before its clock starts)."""
    count = sum(1 for name in os.listdir(folder) if name.endswith(".tar"))
    return f"{folder}/s-{{000000..{count - 1:06d}}}.tar"


# ---------------------------------------------------------------- systems (one function each)


def nnh_loader(folder: str, workers: int, function: Callable | None):
    """nnh: ``ShardedStreamingDataset(decode=function)`` through ``streaming_loader``."""
    from nnh_data import ShardedStreamingDataset, streaming_loader

    source = folder if parquet_files(folder) else shard_pattern(folder)
    ds = ShardedStreamingDataset(source, decode=function)
    return streaming_loader(ds, BATCH, num_workers=workers)


def litdata_loader(folder: str, workers: int, function: Callable | None):
    """LitData: ``StreamingDataset(transform=function)`` through ``StreamingDataLoader``."""
    from litdata import StreamingDataLoader, StreamingDataset

    ds = StreamingDataset(folder, shuffle=True, transform=function)
    return StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers)


def mosaic_loader(folder: str, workers: int, function: Callable | None):
    """MosaicML Streaming: ``StreamingDataset`` (its ``__getitem__`` overridden to apply
    ``function``, as its documentation shows) through ``DataLoader``."""
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    class Applied(StreamingDataset):
        def __getitem__(self, index):
            return function(super().__getitem__(index))

    clean_stale_shared_memory()
    kind = StreamingDataset if function is None else Applied
    ds = kind(local=folder, shuffle=True, batch_size=BATCH)
    return DataLoader(ds, batch_size=BATCH, num_workers=workers)


def webdataset_loader(folder: str, workers: int, function: Callable | None):
    """WebDataset: ``WebDataset(...).shuffle(1000)`` then ``.map(function)`` (without one, the
    payload and the label as an int) through ``DataLoader``."""
    import webdataset as wds
    from torch.utils.data import DataLoader

    pipeline = wds.WebDataset(shard_pattern(folder), shardshuffle=True, empty_check=False)
    pipeline = pipeline.shuffle(1000)
    if function is None:
        pipeline = pipeline.to_tuple("bin", "cls").map(_payload_and_label)
    else:
        pipeline = pipeline.map(function)
    return DataLoader(pipeline, batch_size=BATCH, num_workers=workers)


def datasets_loader(folder: str, workers: int, function: Callable | None, rank: int = 0,
                    world: int = 1):  # fmt: skip
    """Hugging Face ``datasets``, as its docs give for streaming to DDP: ``Dataset.from_parquet``
    (its Arrow cache, made by :func:`write_parquet`), ``to_iterable_dataset(num_shards=<the
    shard count>)``, ``shuffle(seed, buffer_size=1000)``, ``split_dataset_by_node``, then
    ``.map(function)``, batched by ``DataLoader``."""
    import datasets
    from datasets.distributed import split_dataset_by_node
    from torch.utils.data import DataLoader

    datasets.disable_progress_bars()
    files = parquet_files(folder)
    table = datasets.Dataset.from_parquet(files, cache_dir=f"{folder}/.hf-cache")
    stream = table.to_iterable_dataset(num_shards=len(files)).shuffle(seed=0, buffer_size=1000)
    stream = split_dataset_by_node(stream, rank=rank, world_size=world)
    if function is not None:
        stream = stream.map(function, remove_columns=list(table.column_names))
    return DataLoader(stream, batch_size=BATCH, num_workers=workers)


def _payload_and_label(sample: tuple) -> tuple:
    return sample[0], int(sample[1])


@dataclass(frozen=True)
class System:
    """A system as measured: the format it reads, the loader function, its package."""

    format: str
    loader: Callable[[str, int, Callable | None], object]
    package: str


SYSTEMS = {
    "nnh": System("nnh", nnh_loader, "nnh_data"),
    "nnh_before": System("nnh", nnh_loader, "nnh_data"),  # --before: another checkout's code
    "nnh_on_wds_tar": System("webdataset", nnh_loader, "nnh_data"),
    "litdata": System("litdata", litdata_loader, "litdata"),
    "mosaic": System("mosaic", mosaic_loader, "streaming"),
    "webdataset": System("webdataset", webdataset_loader, "webdataset"),
    "webdataset_on_nnh_tar": System("nnh", webdataset_loader, "webdataset"),
    "datasets": System("parquet", datasets_loader, "datasets"),
    "nnh_on_parquet": System("parquet", nnh_loader, "nnh_data"),
}
CROSS_FORMAT = ("nnh_on_wds_tar", "webdataset_on_nnh_tar")  # measured on the small samples
NO_FIRST_BATCH = ("parquet",)  # 10,000 Parquet shards: not written


# ---------------------------------------------------------------- one run (child side)


def rows_of(batch) -> int:
    return len(batch["cls"] if isinstance(batch, dict) else batch[1])


def count_worker_messages():
    """Counters of the bytes and messages DataLoader workers pickle into their queues: a
    ``ForkingPickler`` that counts, installed before the workers fork (they inherit it and the
    shared counters)."""
    import multiprocessing.queues as queues

    from torch.utils.data import get_worker_info

    counts = multiprocessing.Array("q", 2)  # bytes, messages
    base = queues._ForkingPickler

    class Counting(base):
        @classmethod
        def dumps(cls, obj, protocol=None):
            data = base.dumps(obj, protocol)
            if get_worker_info() is not None:
                with counts.get_lock():
                    counts[0] += len(data)
                    counts[1] += 1
            return data

    queues._ForkingPickler = Counting
    return counts


def cpu_seconds() -> tuple[float, float]:
    """This process's CPU time (all threads) and that of its children waited for (in
    microseconds, where ``os.times`` counts 10 ms ticks)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), children.ru_utime + children.ru_stime


def run_epoch(system: str, folder: str, workers: int, case: str) -> dict:
    """One epoch as a user runs it: build the dataset and loader, take every batch; the CPU per
    sample of every process (the workers waited for), with and without the build."""
    counts = count_worker_messages()
    start, (main0, kids0) = time.perf_counter(), cpu_seconds()
    loader = SYSTEMS[system].loader(folder, workers, FUNCTIONS[case])
    built = time.process_time()
    rows = batches = 0
    for batch in loader:
        rows += rows_of(batch)
        batches += 1
    seconds = time.perf_counter() - start
    del loader, batch  # the workers end
    gc.collect()
    for process in multiprocessing.active_children():
        process.join()  # waited for: their CPU time is counted
    main, kids = cpu_seconds()
    total = main - main0 + kids - kids0
    out = {"rate": rows / seconds, "rows": rows, "cpu_us_per_row": 1e6 * total / rows,
           "epoch_cpu_us_per_row": 1e6 * (total - (built - main0)) / rows,
           "workers_cpu_us_per_row": 1e6 * (kids - kids0) / rows,
           "main_cpu_ms_per_batch": 1e3 * (main - built) / batches}  # fmt: skip
    if workers:
        out["pickled_bytes_per_batch"] = counts[0] / batches
    return out


def run_decode_only(count: int) -> dict:
    """:func:`decode_jpeg` alone on ``count`` images of the pool: the floor of the JPEG cases."""
    pool = jpeg_pool()
    decode_jpeg(pool[0])  # torch and PIL imported before the clock, as in the loaders' runs
    cpu = time.process_time()
    for i in range(count):
        decode_jpeg(pool[i % len(pool)])
    return {"cpu_us_per_row": 1e6 * (time.process_time() - cpu) / count}


def run_first_batch(system: str, folder: str) -> dict:
    if SYSTEMS[system].format in ("nnh", "webdataset"):  # the tar readers take a brace pattern
        shard_pattern(folder)
    start, cpu = time.perf_counter(), time.process_time()
    next(iter(SYSTEMS[system].loader(folder, 0, None)))
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu}


def child(system: str, case: str, folder: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    if system == "mosaic":
        stub_mosaic_imports()
    if system != "decode":
        __import__(SYSTEMS[system].package)  # imported before the clock starts
    if case == "first_batch":
        out = run_first_batch(system, folder)
    elif case == "jpeg_decode":
        out = run_decode_only(int(folder))  # the image count, for this case
    else:
        base, workers = case.rsplit("_w", 1)
        out = run_epoch(system, folder, int(workers), base)
    print(json.dumps(out))


# ---------------------------------------------------------------- rounds (parent side)


def prepare(data: str, args: argparse.Namespace) -> None:
    """Write each data set the cases need (kept when ``data`` already holds it)."""
    formats = sorted({SYSTEMS[s].format for s in args.systems})
    sets = {"small": (lambda: small_samples(args.samples), PER_SHARD),
            "many": (lambda: small_samples(MANY_SHARDS * MANY_PER_SHARD), MANY_PER_SHARD),
            "jpeg": (lambda: jpeg_samples(args.images), PER_SHARD // 5)}  # fmt: skip
    needed = {"small": bool({"small", "fn", "exact"} & set(args.cases)),
              "many": "first_batch" in args.cases, "jpeg": "jpeg" in args.cases}  # fmt: skip
    for name, (samples, per_shard) in sets.items():
        for fmt in formats:
            folder = data_folder(data, name, fmt, args)
            skip = name == "many" and fmt in NO_FIRST_BATCH
            if skip or not needed[name] or os.path.exists(f"{folder}/.done"):
                continue
            shutil.rmtree(folder, ignore_errors=True)
            start = time.perf_counter()
            WRITERS[fmt](samples(), folder, per_shard)
            if fmt in ("nnh", "webdataset"):  # the sidecar a job after the first finds
                from nnh_data.shards.reading import build_shard_index

                build_shard_index(shard_pattern(folder))
            open(f"{folder}/.done", "w").close()
            print(f"wrote {folder} in {time.perf_counter() - start:.1f} s", file=sys.stderr)


def data_folder(data: str, name: str, fmt: str, args: argparse.Namespace) -> str:
    size = {"small": f"-{args.samples}", "jpeg": f"-{args.images}", "many": ""}[name]
    return f"{data}/{name}{size}/{fmt}"


def tree_pss_kib(pid: int) -> int:
    """The summed ``Pss`` of process ``pid`` and its descendants (0 for those that ended)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += map(int, f.read().split())
        except (OSError, StopIteration):
            continue
    return total


def run_child(system: str, case: str, folder: str, args: argparse.Namespace) -> dict:
    """One run in a fresh process, its peak PSS watched from here."""
    cmd = [sys.executable, __file__, "--child", system, case, folder]
    env = dict(os.environ)
    paths = {"mosaic": args.mosaic_path, "nnh_before": args.before}
    if paths.get(system):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [paths[system], env.get("PYTHONPATH")]))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    peak, done = 0, threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.wait(PSS_POLL_S):
            peak = max(peak, tree_pss_kib(proc.pid))

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    load = os.getloadavg()[0]
    out, err = proc.communicate()
    done.set()
    thread.join()
    if proc.returncode:
        raise RuntimeError(f"{system} {case} failed:\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result.update(peak_pss_mib=peak / 1024, load=load)
    return result


def figures_of(case: str, result: dict) -> dict[str, tuple[float, bool]]:
    """The figures a run gives, each with whether higher is better."""
    if case == "jpeg_decode":
        return {"jpeg_decode_cpu_us_per_row": (result["cpu_us_per_row"], False)}
    if case == "first_batch":
        return {"first_batch_s": (result["seconds"], False),
                "first_batch_cpu_s": (result["cpu_seconds"], False)}  # fmt: skip
    out = {case: (result["rate"], True), f"{case}_peak_pss_mib": (result["peak_pss_mib"], False)}
    for name in ("cpu_us_per_row", "epoch_cpu_us_per_row"):
        out[f"{case}_{name}"] = (result[name], False)
    return out


def summary(results: dict, systems: list[str]) -> dict:
    """Per figure: each system's values per round, and ``nnh_vs_<system>`` per round with
    their median and range."""
    figures: dict = {}
    for (name, system), runs in results.items():
        figures.setdefault(name, {})[system] = [round(v, 3 if v < 10 else 1) for v, _ in runs]
    pairs = [("nnh", s) for s in systems if s not in ("nnh", "nnh_on_parquet")]
    pairs.append(("nnh_on_parquet", "datasets"))  # the same Parquet files
    ratios: dict = {}
    for name, entry in figures.items():
        for ours, theirs in pairs:
            if ours not in entry or theirs not in entry:
                continue
            higher = results[(name, ours)][0][1]
            values = zip(entry[ours], entry[theirs])
            ratios[f"{name}:{ours}_vs_{theirs}"] = spread(
                [n / p if higher else p / n for n, p in values if n and p])
    floor = figures.get("jpeg_decode_cpu_us_per_row", {}).get("decode")
    for case in ("jpeg_w0", "jpeg_w2"):
        for system, cpu in figures.get(f"{case}_cpu_us_per_row", {}).items():
            if floor and system != "nnh":
                ratios[f"{case}_cpu_us_per_row:ceiling_vs_{system}"] = spread(
                    [c / f for c, f in zip(cpu, floor)])
    return {"ratios": ratios, "figures": figures}


def spread(values: list[float]) -> dict[str, object]:
    """The median, the range and the values of per-round ratios."""
    return {"median": round(statistics.median(values), 2),
            "range": [round(min(values), 2), round(max(values), 2)],
            "rounds": [round(v, 2) for v in values]}  # fmt: skip


def case_list(args: argparse.Namespace) -> list[str]:
    return [c for case in args.cases if case != "exact" for c in (
        (case,) if case == "first_batch" else (f"{case}_w{w}" for w in args.workers))]  # fmt: skip


def run_rounds(data: str, args: argparse.Namespace) -> tuple[dict, dict]:
    """Every case for every system, systems taking turns within each round (the first system
    rotating); the figures by (figure, system) and the per-batch details and loads."""
    results: dict = {}
    details: dict = {}
    for r in range(args.rounds):
        turn = args.systems[r % len(args.systems) :] + args.systems[: r % len(args.systems)]
        if "jpeg" in args.cases:
            result = run_child("decode", "jpeg_decode", str(args.images), args)
            print(f"round {r} jpeg_decode: {result}", file=sys.stderr)
            for name, figure in figures_of("jpeg_decode", result).items():
                results.setdefault((name, "decode"), []).append(figure)
        for case in case_list(args):
            for system in turn:
                if system in CROSS_FORMAT and not case.startswith(("small", "first")):
                    continue
                if SYSTEMS[system].format in NO_FIRST_BATCH and case == "first_batch":
                    continue
                folder = case_folder(data, system, case, args)
                result = run_child(system, case, folder, args)
                print(f"round {r} {case} {system}: {result}", file=sys.stderr)
                for name, figure in figures_of(case, result).items():
                    results.setdefault((name, system), []).append(figure)
                for key in ("main_cpu_ms_per_batch", "pickled_bytes_per_batch",
                            "workers_cpu_us_per_row", "load"):  # fmt: skip
                    if key in result:
                        runs = details.setdefault(f"{case}:{key}", {}).setdefault(system, [])
                        runs.append(round(result[key], 2))
    return results, details


def exactness(data: str, args: argparse.Namespace) -> dict:
    """nnh and ``datasets`` at 2 and 3 ranks (20 shards of the small samples: 3 does not divide
    them) and 0 / 2 workers, rank by rank in a fresh process: whether the ranks together give
    every sample once and whether each rank gets the same number of batches."""
    folder = data_folder(data, "small", "parquet", args)
    runs = {f"{system}_world{world}_w{workers}": json.loads(subprocess.run(
        [sys.executable, __file__, "--exact", system, str(world), str(workers), folder],
        capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        for system in ("nnh", "datasets") for world in (2, 3) for workers in (0, 2)}  # fmt: skip
    return runs


def run_exact(system: str, world: int, workers: int, folder: str) -> dict:
    """The keys each rank of ``world`` gets and its batch count."""
    import warnings

    warnings.filterwarnings("ignore")
    seen: dict[str, int] = {}
    batches, samples = [], []
    for rank in range(world):
        if system == "nnh":
            from nnh_data import ShardedStreamingDataset, streaming_loader

            ds = ShardedStreamingDataset(folder, rank=rank, world_size=world)
            loader = streaming_loader(ds, BATCH, num_workers=workers)
        else:
            loader = datasets_loader(folder, workers, None, rank, world)
        batches.append(0)
        samples.append(0)
        for batch in loader:
            keys = batch["__key__"]
            batches[-1] += 1
            samples[-1] += len(keys)
            pads = batch["__pad__"].tolist() if "__pad__" in batch else [False] * len(keys)
            for key, pad in zip(keys, pads):
                if not pad:
                    seen[key] = seen.get(key, 0) + 1
    total = count_rows(folder)
    return {"every_sample_once": len(seen) == total and set(seen.values()) == {1},
            "missing": total - len(seen), "repeated": sum(c - 1 for c in seen.values()),
            "batches_per_rank": batches, "samples_per_rank": samples,
            "equal_batches": len(set(batches)) == 1}  # fmt: skip


def count_rows(folder: str) -> int:
    import pyarrow.parquet as pq

    return sum(pq.read_metadata(path).num_rows for path in parquet_files(folder))


def case_folder(data: str, system: str, case: str, args: argparse.Namespace) -> str:
    name = {"first": "many", "jpeg": "jpeg"}.get(case.split("_")[0], "small")
    return data_folder(data, name, SYSTEMS[system].format, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--images", type=int, default=6_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--systems", default=None)  # all but nnh_before; --cases hf: its two
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--mosaic-path", default=None)
    parser.add_argument("--before", default=None)
    parser.add_argument("--child", nargs=3, metavar=("SYSTEM", "CASE", "FOLDER"))
    parser.add_argument("--exact", nargs=4, metavar=("SYSTEM", "WORLD", "WORKERS", "FOLDER"))
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.exact:
        system, world, workers, folder = args.exact
        print(json.dumps(run_exact(system, int(world), int(workers), folder)))
        return
    args.cases = args.cases.split(",")
    if "hf" in args.cases:  # the Hugging Face datasets rows: nnh on its Parquet, and exactness
        args.cases = [c for c in args.cases if c != "hf"] + ["exact"]
        args.cases += [] if "small" in args.cases else ["small"]
        args.systems = args.systems or "nnh_on_parquet,datasets"
    args.systems = (args.systems or "nnh,litdata,datasets,mosaic,webdataset").split(",")
    args.workers = [int(w) for w in args.workers.split(",")]
    if args.before:
        args.systems.append("nnh_before")
    if args.mosaic_path:  # for the writer, here; the runs get it in their PYTHONPATH
        sys.path.insert(0, args.mosaic_path)
    data = args.data_dir or tempfile.mkdtemp(prefix="nnh-peers-")
    try:
        prepare(data, args)
        load_before = os.getloadavg()
        results, details = run_rounds(data, args)
        out = summary(results, args.systems)
        if "exact" in args.cases:
            out["exact"] = exactness(data, args)
        out.update(samples=args.samples, images=args.images, rounds=args.rounds,
                   details=details, load_before=[round(x, 2) for x in load_before],
                   load_after=[round(x, 2) for x in os.getloadavg()])  # fmt: skip
        print(json.dumps(out))
    finally:
        if args.data_dir is None:
            shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
