"""Benchmark: time and memory to the first batch of a Parquet shard whose row group is large.

Prints one JSON object. Two files: ``big_row_group`` (10^7 rows of an int64 id and a short
text in ONE row group, 90 MB) and ``declares_512_mib`` (22 KB of zstd that declares 512 MiB of
strings: 512 rows of 1 MiB, one row group, one page). For each, a fresh process per reader
measures the wall seconds from opening to the first batch (256 rows; 8 of the 1 MiB ones) and
its peak RSS (VmHWM): nnh (``streaming_loader`` of ``ShardedStreamingDataset(shuffle=False)``,
0 workers) against pyarrow streaming the same rows (``ParquetFile.iter_batches``,
what a user would write by hand, and the floor: it decodes a page at a time) and reading the
whole table (``pq.read_table``). ``*_vs_iter_batches``: nnh's seconds and MiB over pyarrow's
(lower is better; 1.0 is pyarrow's floor). Imports are made before the clock starts; torch's
and nnh's are in every nnh memory figure (~350 MiB): ``baseline_mib`` is a process that
imports them and reads nothing. To compare two versions, run it with ``PYTHONPATH`` naming
each checkout in turn.

    .venv/bin/python tools/bench/parquet_slices.py [--rows 10000000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

_PEAK = "int(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))/1024"
# (imports, before the clock starts; what is timed)
READERS = {
    "baseline": ("import nnh_data, torch", "pass"),
    "nnh": (
        "import torch\nfrom nnh_data import ShardedStreamingDataset, streaming_loader",
        "ds = ShardedStreamingDataset([PATH], shuffle=False)\n"
        "next(iter(streaming_loader(ds, BATCH, collate_fn=lambda b: b)))",
    ),
    "iter_batches": (
        "import pyarrow.parquet as pq",
        "next(pq.ParquetFile(PATH).iter_batches(BATCH, use_threads=False)).to_pylist()",
    ),
    "read_table": (
        "import pyarrow.parquet as pq",
        "pq.read_table(PATH).slice(0, BATCH).to_pylist()",
    ),
}


def write_files(folder: Path, rows: int) -> dict[str, tuple[str, int]]:
    """The two files, each with its batch size."""
    big, bomb = folder / "big.parquet", folder / "bomb.parquet"
    text = pa.array([f"row {i}" for i in range(rows)])
    pq.write_table(pa.table({"id": np.arange(rows), "text": text}), big, row_group_size=rows)
    strings = pa.array(["a" * (1 << 20)] * 512)
    pq.write_table(pa.table({"text": strings}), bomb, compression="zstd", use_dictionary=False)
    return {"big_row_group": (str(big), 256), "declares_512_mib": (str(bomb), 8)}


def measure(reader: str, path: str, batch: int = 1) -> tuple[float, float]:
    """(seconds to the first batch, peak RSS MiB) of ``reader`` on ``path``, fresh process;
    the index sidecar is built before the clock starts (a job finds it on disk)."""
    imports, timed = READERS[reader]
    code = (f"import time\n{imports}\nPATH, BATCH = {path!r}, {batch}\n"
            f"started = time.perf_counter()\n{timed}\n"
            f"seconds = time.perf_counter() - started\nprint(seconds, {_PEAK})")
    # in the temporary folder: ``-c`` puts the working folder first on sys.path, and a checkout
    # there would shadow the nnh_data that PYTHONPATH names (to compare two versions)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=tempfile.gettempdir())  # fmt: skip
    seconds, mib = map(float, done.stdout.split())
    return seconds, mib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        files = write_files(Path(tmp), args.rows)
        out["baseline_mib"] = round(measure("baseline", "")[1], 1)
        for name, (path, batch) in files.items():
            measure("nnh", path, batch)  # builds the index sidecar
            best = {r: min(measure(r, path, batch) for _ in range(args.repeats)) for r in READERS
                    if r != "baseline"}  # fmt: skip
            for reader, (seconds, mib) in best.items():
                out[f"{name}_{reader}_s"], out[f"{name}_{reader}_mib"] = round(seconds, 2), mib
            floor = best["iter_batches"]
            out[f"{name}_s_vs_iter_batches"] = round(best["nnh"][0] / floor[0], 2)
            out[f"{name}_mib_vs_iter_batches"] = round(best["nnh"][1] / floor[1], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
