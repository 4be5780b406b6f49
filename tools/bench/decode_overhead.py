"""Benchmark: what nnh's per-sample ``decode=`` costs over its raw path, against a plain loop.

Prints one JSON object. On ``--samples`` samples of a 3 KiB payload and an int label in nnh tar
shards, the CPU time per sample of the main process and every DataLoader worker (waited for),
each run a fresh process, the three taking turns in each round:

- ``raw``: ``streaming_loader(ShardedStreamingDataset(...))``, no decode (packed batches);
- ``fn``: the same with ``decode=per_sample`` (the payload kept, the label as an int);
- ``loop``: ``per_sample`` called in a plain Python loop on the same samples, built before
  the clock: what the function itself costs.

``overhead_us``: ``fn - raw - loop`` per round (0 and 2 workers): what nnh adds to hand a user's
function its samples and collate what it returns (the issue's target: at most ~1 us);
``fn_vs_raw_plus_loop``: ``fn / (raw + loop)``.

    .venv/bin/python tools/bench/decode_overhead.py [--samples 100000] [--rounds 3]
        [--workers 0,2] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

SAMPLE_BYTES = 3072
BATCH = 256
PER_SHARD = 5000


def per_sample(sample: dict) -> dict:
    """The user's function: the payload as it is, the label (text in the tar) as an int."""
    return {"bin": sample["bin"], "cls": int(sample["cls"])}


def write(folder: str, count: int) -> None:
    from nnh_data.shards.reading import build_shard_index
    from nnh_data.shards.writer import write_shards

    payload = np.random.default_rng(0).bytes(SAMPLE_BYTES)
    samples = ({"__key__": f"{g:09d}", "bin": payload[g % SAMPLE_BYTES :] +
                payload[: g % SAMPLE_BYTES], "cls": g % 1000} for g in range(count))  # fmt: skip
    write_shards(samples, f"{folder}/s-%06d.tar", max_count=PER_SHARD)
    build_shard_index(pattern(folder))


def pattern(folder: str) -> str:
    count = sum(1 for name in os.listdir(folder) if name.endswith(".tar"))
    return f"{folder}/s-{{000000..{count - 1:06d}}}.tar"


def cpu_seconds() -> float:
    """CPU time of this process and of its children waited for."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def run(mode: str, workers: int, folder: str) -> float:
    """CPU microseconds per sample of one ``mode`` run (see the module docstring)."""
    import torch  # noqa: F401 - imported before the clock, as in every mode

    from nnh_data import ShardedStreamingDataset, streaming_loader

    if mode == "loop":
        samples = list(ShardedStreamingDataset(pattern(folder)))
        start = cpu_seconds()
        for sample in samples:
            per_sample(sample)
        return 1e6 * (cpu_seconds() - start) / len(samples)
    start = cpu_seconds()
    ds = ShardedStreamingDataset(pattern(folder), decode=per_sample if mode == "fn" else None)
    loader = streaming_loader(ds, BATCH, num_workers=workers)
    rows = sum(len(batch["cls"]) for batch in loader)
    del loader
    gc.collect()
    for process in multiprocessing.active_children():
        process.join()  # waited for: their CPU time is counted
    return 1e6 * (cpu_seconds() - start) / rows


def child(mode: str, workers: int, folder: str) -> float:
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(workers), folder],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.splitlines()[-1])


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2),
            "range": [round(min(values), 2), round(max(values), 2)]}  # fmt: skip


def rounds(folder: str, args: argparse.Namespace) -> dict:
    """Every mode at every worker count, taking turns (the first rotating) in each round."""
    modes = ["raw", "fn", "loop"]
    figures: dict = {}
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for mode in modes[r % 3 :] + modes[: r % 3]:
            for workers in [0] if mode == "loop" else args.workers:
                figures.setdefault(f"{mode}_w{workers}", []).append(child(mode, workers, folder))
    out: dict = {"figures": {k: [round(v, 2) for v in vs] for k, vs in figures.items()}}
    for w in args.workers:
        raw, fn, loop = figures[f"raw_w{w}"], figures[f"fn_w{w}"], figures["loop_w0"]
        out[f"overhead_us_w{w}"] = spread([f - r - p for f, r, p in zip(fn, raw, loop)])
        out[f"fn_vs_raw_plus_loop_w{w}"] = spread([f / (r + p) for f, r, p in zip(fn, raw, loop)])
    out["loads"] = [round(x, 2) for x in loads]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--child", nargs=3, metavar=("MODE", "WORKERS", "FOLDER"))
    args = parser.parse_args()
    if args.child:
        mode, workers, folder = args.child
        print(json.dumps(run(mode, int(workers), folder)))
        return
    args.workers = [int(w) for w in args.workers.split(",")]
    data = args.data_dir or tempfile.mkdtemp(prefix="nnh-decode-")
    folder = f"{data}/small-{args.samples}"
    try:
        if not os.path.exists(f"{folder}/.done"):
            shutil.rmtree(folder, ignore_errors=True)
            write(folder, args.samples)
            open(f"{folder}/.done", "w").close()
        print(json.dumps(rounds(folder, args)))
    finally:
        if args.data_dir is None:
            shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
