"""Benchmark: nnh against LitData, MosaicML Streaming and WebDataset on the same samples.

Prints one JSON object. Every system reads the same samples written by its own writer
(``nnh_data.write_shards`` tar, ``litdata.optimize`` chunks, ``streaming.MDSWriter`` shards,
``webdataset.ShardWriter`` tar); the nnh tar is also read by WebDataset
(``webdataset_on_nnh_tar``) and the ShardWriter tar by nnh (``nnh_on_wds_tar``). Each run is a
fresh process, and the systems take turns within each round (the machine's load moves between
rounds). Cases, each system shuffling and batching by 256 through its own loader (nnh:
``streaming_loader``; LitData: ``StreamingDataLoader``; the others: ``torch.utils.data.
DataLoader``):

- ``small_w0`` / ``small_w2``: samples/s over one epoch of ``--samples`` samples (a 3 KiB
  payload and an int label) with 0 and 2 DataLoader workers, the workers' start included, and
  the CPU time per sample of all the processes (``_cpu_us_per_row``: on a shared machine the
  steadier figure). Each run also reports the main process's CPU time per batch and, with
  workers, the bytes the workers pickled into their queues per batch (counted by a
  ``ForkingPickler`` the workers inherit: torch sends a tensor as a shared-memory handle, other
  values by value; nnh sends its small columns through its shared-memory ring, so only their
  places).
- ``peak_pss_mib``: the largest sum of the proportional set sizes of a ``small_w2`` run's
  processes (main and workers), sampled every 50 ms from outside.
- ``first_batch_s``: seconds from building the dataset (after the imports) to the first batch
  with 0 workers, on 10,000 shards of 10 samples (nnh finds its index sidecar on disk, as a
  training job after the first does), and the CPU seconds of that (``first_batch_cpu_s``, all
  threads: on a loaded machine the wall time mostly measures the wait for a core).
- ``jpeg_w0`` / ``jpeg_w2``: images/s over ``--images`` 224x224 JPEGs, every system running the
  same PIL decode (:func:`decode_jpeg`) per sample and the same default collate (nnh: its
  ``decode=``, which ``streaming_loader`` collates with ``default_collate``).
- ``jpeg_decode_cpu_us_per_row``: that decode alone, the same images in a loop in a fresh
  process, once per round: the floor of every system's CPU per image. ``ceiling_vs_<peer>``
  (peer's CPU per image over it) is the most any system running this decode could lead by.

nnh's tar samples hold bytes (the label too: ``b"17"``); nnh reads them without a ``decode``, as
a ``PackedField`` per field. The peers' labels are ints.

Ratios are ``nnh_vs_<peer>``, figure by figure in the same round: above 1 means nnh is better
(its rate over the peer's; the peer's seconds, CPU time or memory over nnh's). The JSON holds
each ratio's range over the rounds, each system's figures per round, and the load averages
before and after.

Peers: ``.venv/bin/pip install -e .[bench] -c <(echo torch==2.13.0)`` (pin torch: an unpinned
install pulls a CUDA build). ``import streaming`` imports torchvision for ``streaming.vision``,
and no torchvision wheel matches torch 2.13 on CPU, so this script installs a stub of the two
torchvision modules that ``streaming.vision`` imports (nothing here uses them).

    .venv/bin/python tools/bench/peers.py [--samples 100000] [--images 10000] [--rounds 3]
        [--cases small,first_batch,jpeg] [--systems nnh,litdata,mosaic,webdataset]
        [--data-dir DIR]  # keeps the written data sets between invocations
    .venv/bin/python tools/bench/peers.py --cases hf  # Hugging Face datasets (hf_datasets_peer)
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.machinery
import io
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import types

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
PEERS = ("litdata", "mosaic", "webdataset")
SYSTEMS = ("nnh", "nnh_on_wds_tar", *PEERS, "webdataset_on_nnh_tar")
CASES = ("small", "first_batch", "jpeg")


# ---------------------------------------------------------------- samples


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


# ---------------------------------------------------------------- writers (each system's own)


def stub_torchvision() -> None:
    """``streaming.vision`` imports torchvision, which has no wheel for torch 2.13 on CPU."""
    if "torchvision" in sys.modules:
        return
    names = ("torchvision", "torchvision.datasets", "torchvision.transforms",
             "torchvision.transforms.functional")  # fmt: skip
    for name in names:
        module = sys.modules[name] = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # transformers asks
    sys.modules["torchvision.datasets"].VisionDataset = object
    sys.modules["torchvision.transforms.functional"].to_tensor = None


def _litdata_item(sample: dict) -> dict:
    return {k: v for k, v in sample.items() if k != "__key__"}


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
        writer[i] = _litdata_item(sample)
    writer.done()
    writer.merge()


def write_mosaic(samples, folder: str, per_shard: int) -> None:
    stub_torchvision()
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


WRITERS = {"nnh": write_nnh, "webdataset": write_wds, "litdata": write_litdata,
           "mosaic": write_mosaic}  # fmt: skip
FORMAT_OF = {"nnh": "nnh", "nnh_on_wds_tar": "webdataset", "litdata": "litdata",
             "mosaic": "mosaic", "webdataset": "webdataset",
             "webdataset_on_nnh_tar": "nnh"}  # fmt: skip


def prepare(data: str, args: argparse.Namespace) -> None:
    """Write each data set the cases need (kept when ``data`` already holds it)."""
    formats = sorted({FORMAT_OF[s] for s in args.systems})
    sets = {"small": (lambda: small_samples(args.samples), PER_SHARD),
            "many": (lambda: small_samples(MANY_SHARDS * MANY_PER_SHARD), MANY_PER_SHARD),
            "jpeg": (lambda: jpeg_samples(args.images), PER_SHARD // 5)}  # fmt: skip
    needed = {"small": "small" in args.cases, "many": "first_batch" in args.cases,
              "jpeg": "jpeg" in args.cases}  # fmt: skip
    for name, (samples, per_shard) in sets.items():
        for fmt in formats:
            folder = f"{data}/{name}-{args.samples if name == 'small' else args.images}/{fmt}"
            if name == "many":
                folder = f"{data}/many/{fmt}"
            if not needed[name] or os.path.exists(f"{folder}/.done"):
                continue
            shutil.rmtree(folder, ignore_errors=True)
            start = time.perf_counter()
            WRITERS[fmt](samples(), folder, per_shard)
            if fmt in ("nnh", "webdataset"):  # the sidecar a job after the first finds
                from nnh_data.shards.reading import build_shard_index

                build_shard_index(shard_pattern(folder))
            open(f"{folder}/.done", "w").close()
            print(f"wrote {folder} in {time.perf_counter() - start:.1f} s", file=sys.stderr)


@functools.lru_cache
def shard_pattern(folder: str) -> str:
    """A brace pattern of the tar shards of ``folder`` (what a user passes nnh and WebDataset;
    a user types it, so :func:`run_first_batch` lists the folder before its clock starts)."""
    count = sum(1 for name in os.listdir(folder) if name.endswith(".tar"))
    return f"{folder}/s-{{000000..{count - 1:06d}}}.tar"


# ---------------------------------------------------------------- readers (one run, child side)


def _nnh_decode_jpeg(sample: dict) -> dict:
    return {"image": decode_jpeg(sample["jpg"]), "cls": int(sample["cls"])}


def _wds_decode_jpeg(sample: tuple) -> tuple:
    return decode_jpeg(sample[0]), int(sample[1])


def _mosaic_class(jpeg: bool):
    from streaming import StreamingDataset

    class Decoded(StreamingDataset):
        def __getitem__(self, i):
            sample = super().__getitem__(i)
            return {"image": decode_jpeg(sample["jpg"]), "cls": sample["cls"]}

    return Decoded if jpeg else StreamingDataset


def loader_of(system: str, folder: str, workers: int, jpeg: bool):
    """The loader a user of ``system`` writes for ``folder``: shuffled batches of ``BATCH``."""
    if system in ("nnh", "nnh_on_wds_tar"):
        from nnh_data import ShardedStreamingDataset, streaming_loader

        decode = _nnh_decode_jpeg if jpeg else None
        ds = ShardedStreamingDataset(shard_pattern(folder), decode=decode)
        return streaming_loader(ds, BATCH, num_workers=workers)
    if system == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset

        transform = (lambda s: {"image": decode_jpeg(s["jpg"]), "cls": s["cls"]}) if jpeg else None
        ds = StreamingDataset(folder, shuffle=True, transform=transform)
        return StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers)
    from torch.utils.data import DataLoader

    if system == "mosaic":
        stub_torchvision()
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        ds = _mosaic_class(jpeg)(local=folder, shuffle=True, batch_size=BATCH)
        return DataLoader(ds, batch_size=BATCH, num_workers=workers)
    import webdataset as wds

    field = "jpg" if jpeg else "bin"
    pipeline = wds.WebDataset(shard_pattern(folder), shardshuffle=True, empty_check=False)
    pipeline = pipeline.shuffle(1000).to_tuple(field, "cls")
    pipeline = pipeline.map(_wds_decode_jpeg if jpeg else lambda s: (s[0], int(s[1])))
    return DataLoader(pipeline, batch_size=BATCH, num_workers=workers)


def rows_of(batch) -> int:
    return len(batch["cls"] if isinstance(batch, dict) else batch[1])


def count_worker_messages():
    """Counters of the bytes and messages DataLoader workers pickle into their queues: a
    ``ForkingPickler`` that counts, installed before the workers fork (they inherit it and the
    shared counters)."""
    import multiprocessing
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


def run_epoch(system: str, folder: str, workers: int, jpeg: bool) -> dict:
    """One epoch: rows/s, CPU per row, the main process's CPU per batch and (with workers) the
    bytes the workers pickled per batch."""
    counts = count_worker_messages()
    loader = loader_of(system, folder, workers, jpeg)
    rows = batches = 0
    start, cpu = time.perf_counter(), time.process_time()
    for batch in loader:
        rows += rows_of(batch)
        batches += 1
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    del loader, batch  # the workers end and are waited for: their CPU time is counted
    gc.collect()
    workers_cpu = os.times().children_user + os.times().children_system
    out = {"rate": rows / seconds, "rows": rows, "main_cpu_ms_per_batch": 1e3 * cpu / batches,
           "cpu_us_per_row": 1e6 * (cpu + workers_cpu) / rows}  # fmt: skip
    if workers:
        out["pickled_bytes_per_batch"] = counts[0] / batches
    return out


def run_decode_only(count: int) -> dict:
    """:func:`decode_jpeg` alone on ``count`` images of the pool: the floor of the JPEG cases."""
    pool = jpeg_pool()
    cpu = time.process_time()
    for i in range(count):
        decode_jpeg(pool[i % len(pool)])
    return {"cpu_us_per_row": 1e6 * (time.process_time() - cpu) / count}


def run_first_batch(system: str, folder: str) -> dict:
    if FORMAT_OF[system] in ("nnh", "webdataset"):  # the tar readers take a brace pattern
        shard_pattern(folder)
    start, cpu = time.perf_counter(), time.process_time()
    next(iter(loader_of(system, folder, 0, False)))
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu}


def child(system: str, case: str, folder: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    if system == "mosaic":
        stub_torchvision()
        import streaming  # noqa: F401 - imported before the clock starts, like the others
    elif system == "litdata":
        import litdata  # noqa: F401
    elif system.startswith("webdataset"):
        import webdataset  # noqa: F401
    else:
        import nnh_data  # noqa: F401
    if case == "first_batch":
        out = run_first_batch(system, folder)
    elif case == "jpeg_decode":
        out = run_decode_only(int(folder))  # the image count, for this case
    else:
        out = run_epoch(system, folder, int(case[-1]), case.startswith("jpeg"))
    print(json.dumps(out))


# ---------------------------------------------------------------- rounds (parent side)


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


def run_child(system: str, case: str, folder: str, watch_pss: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", system, case, folder]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    if watch_pss:
        done = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not done.wait(PSS_POLL_S):
                peak = max(peak, tree_pss_kib(proc.pid))

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
    out, err = proc.communicate()
    if watch_pss:
        done.set()
        thread.join()
    if proc.returncode:
        raise RuntimeError(f"{system} {case} failed:\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    if watch_pss:
        result["peak_pss_mib"] = peak / 1024
    return result


def folder_of(data: str, system: str, case: str, args: argparse.Namespace) -> str:
    fmt = FORMAT_OF[system]
    if case == "first_batch":
        return f"{data}/many/{fmt}"
    if case.startswith("jpeg"):
        return f"{data}/jpeg-{args.images}/{fmt}"
    return f"{data}/small-{args.samples}/{fmt}"


def figures_of(case: str, result: dict) -> dict[str, tuple[float, bool]]:
    """The figures a run gives, each with whether higher is better."""
    if case == "jpeg_decode":
        return {"jpeg_decode_cpu_us_per_row": (result["cpu_us_per_row"], False)}
    if case == "first_batch":
        return {"first_batch_s": (result["seconds"], False),
                "first_batch_cpu_s": (result["cpu_seconds"], False)}  # fmt: skip
    out = {case: (result["rate"], True),
           f"{case}_cpu_us_per_row": (result["cpu_us_per_row"], False)}  # fmt: skip
    if "peak_pss_mib" in result:
        out["peak_pss_mib"] = (result["peak_pss_mib"], False)
    return out


def summary(results: dict, systems: list[str]) -> dict:
    """Per figure: each system's values per round and ``nnh_vs_<system>`` ranges."""
    figures: dict = {}
    for (name, system), runs in results.items():
        figures.setdefault(name, {})[system] = [round(v, 3 if v < 10 else 1) for v, _ in runs]
    ratios: dict = {}
    for name, entry in figures.items():
        if "nnh" not in entry:
            continue
        higher = results[(name, "nnh")][0][1]
        for system in systems:
            if system == "nnh" or system not in entry:
                continue
            pairs = zip(entry["nnh"], entry[system])
            per_round = [n / p if higher else p / n for n, p in pairs if n and p]
            ratios[f"{name}:nnh_vs_{system}"] = [round(min(per_round), 2),
                                                 round(max(per_round), 2)]  # fmt: skip
    floor = figures.get("jpeg_decode_cpu_us_per_row", {}).get("decode")
    for case in ("jpeg_w0", "jpeg_w2"):
        for system, cpu in figures.get(f"{case}_cpu_us_per_row", {}).items():
            if floor and system != "nnh":
                per_round = [c / f for c, f in zip(cpu, floor)]
                ratios[f"{case}_cpu_us_per_row:ceiling_vs_{system}"] = [
                    round(min(per_round), 2), round(max(per_round), 2)]  # fmt: skip
    return {"ratios": ratios, "figures": figures}


def run_rounds(data: str, args: argparse.Namespace) -> tuple[dict, dict]:
    """Every case for every system, systems taking turns within each round (the first system
    rotating); the figures by (figure, system) and the per-batch details."""
    cases = [c for case in args.cases for c in (
        (case,) if case == "first_batch" else (f"{case}_w0", f"{case}_w2"))]  # fmt: skip
    results: dict = {}
    details: dict = {}
    for r in range(args.rounds):
        turn = args.systems[r % len(args.systems) :] + args.systems[: r % len(args.systems)]
        if "jpeg" in args.cases:
            result = run_child("decode", "jpeg_decode", str(args.images), watch_pss=False)
            print(f"round {r} jpeg_decode: {result}", file=sys.stderr)
            for name, figure in figures_of("jpeg_decode", result).items():
                results.setdefault((name, "decode"), []).append(figure)
        for case in cases:
            for system in turn:
                if case.startswith("jpeg") and system.endswith("_tar"):
                    continue  # the cross-format readers are measured on small samples
                folder = folder_of(data, system, case, args)
                result = run_child(system, case, folder, watch_pss=case == "small_w2")
                print(f"round {r} {case} {system}: {result}", file=sys.stderr)
                for name, figure in figures_of(case, result).items():
                    results.setdefault((name, system), []).append(figure)
                for key in ("main_cpu_ms_per_batch", "pickled_bytes_per_batch"):
                    if key in result:
                        runs = details.setdefault(f"{case}:{key}", {}).setdefault(system, [])
                        runs.append(round(result[key], 2))
    return results, details


# ---------------------------------------------------------------- Hugging Face datasets (issue 33)


def hf_datasets_peer(data: str, args: argparse.Namespace) -> dict:
    """nnh against Hugging Face ``datasets``' own distributed streaming on the same Parquet
    shards, written by ``datasets`` (``to_parquet``, ``PER_SHARD`` rows each; the small samples:
    a ``__key__``, a 3 KiB ``bin`` and an int ``cls``). The peer is what its docs give for DDP:
    ``Dataset.from_parquet`` (converted once into its Arrow cache, not timed), then
    ``to_iterable_dataset(num_shards=<the shard count>)``, ``shuffle(seed, buffer_size=1000)``
    and ``split_dataset_by_node``, batched by a ``DataLoader``; nnh reads the Parquet files
    (``streaming_loader``, per-sample, shuffled). ``hf_w0`` / ``hf_w2``: samples/s of one epoch
    at 1 rank with 0 and 2 workers (fresh process per run, systems taking turns) and CPU per
    sample of all processes. ``exact``: at 2 and 3 ranks (20 shards: 3 does not divide them)
    and 0 / 2 workers, in one process (rank by rank), whether the ranks together give every
    sample once and whether each rank gets the same number of batches."""
    folder = f"{data}/hf-{args.samples}"
    if not os.path.exists(f"{folder}/.done"):
        shutil.rmtree(folder, ignore_errors=True)
        _hf_write(folder, args.samples)
        open(f"{folder}/.done", "w").close()
    _hf_child("hf", 0, folder)  # the Arrow cache of from_parquet, made once, outside the clock
    results: dict = {}
    for r in range(args.rounds):
        for workers in (0, 2):
            for system in ("nnh", "hf") if r % 2 == 0 else ("hf", "nnh"):
                out = _hf_child(system, workers, folder)
                print(f"round {r} hf_w{workers} {system}: {out}", file=sys.stderr)
                results.setdefault(f"hf_w{workers}", {}).setdefault(system, []).append(out)
    ratios = {}
    for case, runs in results.items():
        rate = [n["rate"] / p["rate"] for n, p in zip(runs["nnh"], runs["hf"])]
        cpu = [p["cpu_us_per_row"] / n["cpu_us_per_row"] for n, p in zip(runs["nnh"], runs["hf"])]
        ratios[f"{case}:nnh_vs_hf"] = [round(min(rate), 2), round(max(rate), 2)]
        ratios[f"{case}_cpu_us_per_row:nnh_vs_hf"] = [round(min(cpu), 2), round(max(cpu), 2)]
    exact = {f"{system}_world{world}_w{workers}": json.loads(subprocess.run(
        [sys.executable, __file__, "--hf-exact", system, str(world), str(workers), folder],
        capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        for system in ("nnh", "hf") for world in (2, 3) for workers in (0, 2)}  # fmt: skip
    figures = {case: {system: [{k: round(v, 2) for k, v in run.items()} for run in runs]
                      for system, runs in by_system.items()}
               for case, by_system in results.items()}  # fmt: skip
    return {"ratios": ratios, "figures": figures, "exact": exact}


def _hf_write(folder: str, count: int) -> None:
    import datasets

    datasets.disable_progress_bars()
    os.makedirs(folder)
    shards = -(-count // PER_SHARD)
    for k in range(shards):
        rows = list(small_samples(min(PER_SHARD, count - k * PER_SHARD), k * PER_SHARD))
        part = datasets.Dataset.from_dict({name: [row[name] for row in rows] for name in rows[0]})
        part.to_parquet(f"{folder}/train-{k:05d}-of-{shards:05d}.parquet")


def _hf_loader(system: str, folder: str, workers: int, rank: int = 0, world: int = 1):
    """The loader a user of ``system`` writes for rank ``rank`` of ``world``."""
    from torch.utils.data import DataLoader

    if system == "nnh":
        from nnh_data import ShardedStreamingDataset, streaming_loader

        ds = ShardedStreamingDataset(folder, rank=rank, world_size=world)
        return streaming_loader(ds, BATCH, num_workers=workers)
    import datasets
    from datasets.distributed import split_dataset_by_node

    files = sorted(f"{folder}/{name}" for name in os.listdir(folder) if name.endswith(".parquet"))
    table = datasets.Dataset.from_parquet(files, cache_dir=f"{folder}/.hf-cache")
    stream = table.to_iterable_dataset(num_shards=len(files)).shuffle(seed=0, buffer_size=1000)
    stream = split_dataset_by_node(stream, rank=rank, world_size=world)
    return DataLoader(stream, batch_size=BATCH, num_workers=workers)


def _hf_child(system: str, workers: int, folder: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--hf-run", system, str(workers), folder],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"{system} hf_w{workers} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _hf_run(system: str, workers: int, folder: str) -> dict:
    """One epoch at 1 rank: samples/s and CPU per sample (all processes); imports and the
    peer's cached table opened before the clock."""
    import warnings

    warnings.filterwarnings("ignore")
    import datasets  # noqa: F401

    import nnh_data  # noqa: F401

    loader = _hf_loader(system, folder, workers)
    rows = 0
    start, cpu = time.perf_counter(), time.process_time()
    for batch in loader:
        rows += len(batch["cls"])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    del loader
    gc.collect()
    children = os.times().children_user + os.times().children_system
    return {"rate": rows / seconds, "rows": rows, "cpu_us_per_row": 1e6 * (cpu + children) / rows}


def _hf_exact(system: str, world: int, workers: int, folder: str) -> dict:
    """Rank by rank: the keys each rank gets and its batch count; whether every sample came
    once, and whether the ranks got equal batch counts."""
    import warnings

    warnings.filterwarnings("ignore")
    seen: dict[str, int] = {}
    batches, samples = [], []
    for rank in range(world):
        batches.append(0)
        samples.append(0)
        for batch in _hf_loader(system, folder, workers, rank, world):
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

    return sum(pq.read_metadata(f"{folder}/{name}").num_rows for name in os.listdir(folder)
               if name.endswith(".parquet"))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--child", nargs=3, metavar=("SYSTEM", "CASE", "FOLDER"))
    parser.add_argument("--hf-run", nargs=3, metavar=("SYSTEM", "WORKERS", "FOLDER"))
    parser.add_argument("--hf-exact", nargs=4, metavar=("SYSTEM", "WORLD", "WORKERS", "FOLDER"))
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.hf_run or args.hf_exact:
        system, *numbers, folder = args.hf_run or args.hf_exact
        run = _hf_run if args.hf_run else _hf_exact
        print(json.dumps(run(system, *map(int, numbers), folder)))
        return
    args.cases, args.systems = args.cases.split(","), args.systems.split(",")
    data = args.data_dir or tempfile.mkdtemp(prefix="nnh-peers-")
    try:
        if args.cases == ["hf"]:  # the Hugging Face datasets peer, on its own Parquet shards
            load_before = os.getloadavg()
            out = hf_datasets_peer(data, args)
            out.update(samples=args.samples, rounds=args.rounds, load_before=load_before,
                       load_after=os.getloadavg())  # fmt: skip
            print(json.dumps(out))
            return
        prepare(data, args)
        load_before = os.getloadavg()
        results, details = run_rounds(data, args)
        out = summary(results, args.systems)
        out.update(samples=args.samples, images=args.images, rounds=args.rounds,
                   per_batch=details, load_before=[round(x, 2) for x in load_before],
                   load_after=[round(x, 2) for x in os.getloadavg()])  # fmt: skip
        print(json.dumps(out))
    finally:
        if args.data_dir is None:
            shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
