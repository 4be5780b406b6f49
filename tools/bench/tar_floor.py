"""Benchmark: what part of a 0-worker epoch of small tar samples is the format's floor.

Prints one JSON object. On the peer benchmark's 3 KiB samples (``peers.py``, same data folder),
in one process, best of ``--rounds`` rounds in which the passes take turns, CPU time per sample:

- ``litdata_epoch``: LitData's ``StreamingDataLoader`` over its own chunks (shuffled, batches of
  256, 0 workers), as in ``peers.py``;
- ``nnh_epoch``: nnh's ``streaming_loader`` over its tar shards, the same;
- ``nnh_read``: only the reads an nnh epoch makes (every shard in 2 MiB blocks, the pieces
  ``split_shard_range`` cuts, through ``ShardReader``);
- ``nnh_read_parse``: those reads and each block's tar parse and checks
  (``decode_shard_columns``, values as Arrow views, as a batch pass reads them), nothing else.

``read_parse_over_litdata`` is the floor's share of LitData's whole epoch, and
``rest_budget_us`` what a 1.2x lead over LitData would leave for everything after the parse
(shuffle, parameters, labels, batching), against ``nnh_rest_us``, what that costs today.
``bytes_per_sample``: each format's bytes on disk per sample (a tar member has a 512-byte header
and is padded to 512 bytes; LitData stores an offset table and the values).

    .venv/bin/python tools/bench/tar_floor.py [--samples 100000] [--rounds 5] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time
from collections.abc import Callable

import peers  # tools/bench/peers.py: the data sets and the loaders

from nnh_data.shards.reading import (
    ShardReader,
    build_shard_index,
    decode_shard_columns,
    split_shard_range,
)

_BLOCK = 2 << 20  # source_reader's read size for local tar shards


def nnh_blocks(folder: str) -> list[tuple]:
    """Every (shard info, start, stop) block an nnh epoch reads from ``folder``."""
    index = build_shard_index(sorted(glob.glob(f"{folder}/*.tar")))
    return [(info, a, b) for info in index.shards
            for a, b in split_shard_range(info, 0, info.num_samples, max_bytes=_BLOCK)]  # fmt: skip


def read_pass(blocks: list[tuple], parse: bool) -> int:
    """Read (and with ``parse``, parse) every block; the sample count."""
    reader, count = ShardReader(), 0
    for info, a, b in blocks:
        payload = reader.fetch_block(info, a, b)
        if parse:
            decode_shard_columns(info, payload, a, b, views=True)  # as a batch pass reads
        count += b - a
    reader.close()
    return count


def epoch_pass(system: str, folder: str) -> int:
    loader = peers.SYSTEMS[system].loader(folder, 0, None)
    return sum(peers.rows_of(batch) for batch in loader)


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(f"{folder}/*") if os.path.isfile(p))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--data-dir", default="/tmp/peers-data")
    args = parser.parse_args()
    wanted = argparse.Namespace(
        samples=args.samples, images=0, cases=["small"], systems=["nnh", "litdata"]
    )
    peers.prepare(args.data_dir, wanted)
    folders = {s: f"{args.data_dir}/small-{args.samples}/{s}" for s in ("nnh", "litdata")}
    blocks = nnh_blocks(folders["nnh"])
    passes: dict[str, Callable[[], int]] = {
        "litdata_epoch": lambda: epoch_pass("litdata", folders["litdata"]),
        "nnh_epoch": lambda: epoch_pass("nnh", folders["nnh"]),
        "nnh_read": lambda: read_pass(blocks, parse=False),
        "nnh_read_parse": lambda: read_pass(blocks, parse=True),
    }
    best = dict.fromkeys(passes, float("inf"))
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for name, run in passes.items():
            start = time.process_time()
            count = run()
            best[name] = min(best[name], 1e6 * (time.process_time() - start) / count)
    load.append(os.getloadavg()[0])
    litdata, floor = best["litdata_epoch"], best["nnh_read_parse"]
    print(json.dumps({
        "cpu_us_per_sample": {k: round(v, 3) for k, v in best.items()},
        "nnh_vs_litdata": round(litdata / best["nnh_epoch"], 2),
        "read_parse_over_litdata": round(floor / litdata, 2),
        "rest_budget_us": round(litdata / 1.2 - floor, 3),
        "nnh_rest_us": round(best["nnh_epoch"] - floor, 3),
        "bytes_per_sample": {s: round(folder_bytes(f) / args.samples) for s, f in folders.items()},
        "load_average": load,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
