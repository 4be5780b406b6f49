"""Benchmark: ShardedStreamingDataset against webdataset, tarfile and raw pyarrow, one process.

Prints one JSON object. On the same shards of 3 KiB samples (written by ``write_shards``):
samples/s of nnh tar streaming, ``webdataset.WebDataset`` and ``tarfile`` (ratios
``tar_vs_webdataset``, ``tar_vs_tarfile``), and of the same shards as three mixed sources
(``Source`` each read once per epoch, interleaved) against one source (``mixed_vs_one_source``);
on the same rows as Parquet files (4 columns, every one read on both sides), nnh per-sample
dicts versus raw ``pyarrow`` ``iter_batches`` + ``to_pylist`` rows, both consumed by the same
loop (``parquet_vs_pyarrow``; ``parquet_vs_pyarrow_same_fields``: against those rows given
the fields an nnh sample also holds, its labels and ``__aug__`` dict), and nnh batches
(``batch_size=256``, columns) versus ``iter_batches(batch_size=256)`` + ``to_pydict``
(``parquet_batched_vs_pyarrow``, the same output shape on both sides). pyarrow reads the
files in order with its defaults (threads on); nnh runs with its defaults, so it shuffles
(``shuffle_window=1024``: shards in a new order and rows gathered within windows) and adds
its labels and ``__aug__`` parameters; the ``*_unshuffled_*`` figures are nnh with
``shuffle=False``, the order pyarrow reads. The ``*_cpu`` ratios compare process CPU time (all
threads) instead of wall time: on a shared machine a process with more threads gets a larger
share of the cores, which the wall ratio counts as speed. Then seconds to the first
sample with 10,000 indexed shards of 10 samples (index sidecar on disk); peak RSS of a process
streaming 1x and 10x the samples (``rss_growth`` = 10x / 1x - 1). Rates are the best of a few
rounds in which a figure and its baselines take turns.

    .venv/bin/python tools/bench/streaming.py [--samples 20000]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tarfile
import tempfile
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import webdataset as wds
from common import best_rates, in_fresh_process, rss_growth  # tools/bench/common.py

from nnh_data.augment.params import gen_augmentation_params_batch
from nnh_data.columns import rows_of
from nnh_data.order.mixing import Source
from nnh_data.shards.reading import build_shard_index
from nnh_data.shards.writer import write_shards
from nnh_data.streaming.dataset import ShardedStreamingDataset

SAMPLE_BYTES = 3072
PER_SHARD = 1000
SHARDS_MANY = 10_000
BATCH = 256  # rows per batch of the batched figures


def samples(count: int, first: int = 0):
    """``count`` samples of ~3 KiB: a payload, a class label and a short caption. Payloads
    differ from sample to sample (rotations of one random block), as real data does: Parquet
    then stores them plainly instead of as one dictionary entry."""
    payload = os.urandom(SAMPLE_BYTES)
    for g in range(first, first + count):
        k = g % SAMPLE_BYTES
        blob = payload[k:] + payload[:k]
        yield {"__key__": f"{g:09d}", "bin": blob, "cls": g % 1000, "txt": f"sample {g}"}


def write_parquet(folder: str, count: int) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    paths = []
    for i, first in enumerate(range(0, count, PER_SHARD * 4)):
        rows = list(samples(min(PER_SHARD * 4, count - first), first))
        table = pa.table({k: [r[k] for r in rows] for k in ("__key__", "bin", "cls", "txt")})
        paths.append(f"{folder}/part-{i:06d}.parquet")
        pq.write_table(table, paths[-1], row_group_size=1000)
    return paths


def thirds(urls: list[str]) -> list[list[str]]:
    """``urls`` cut into three sources of about 1/2, 1/3 and 1/6 of the shards."""
    a, b = max(1, len(urls) // 2), max(2, len(urls) * 5 // 6)
    return [urls[:a], urls[a:b], urls[b:]]


def tarfile_count(urls: list[str]) -> int:
    keys = 0
    for url in urls:
        with tarfile.open(url) as tar:
            previous = None
            for member in tar:
                tar.extractfile(member).read()
                key = member.name.split(".", 1)[0]
                keys += key != previous
                previous = key
    return keys


def pyarrow_rows(paths: list[str]):
    """Rows of ``paths`` as dicts, the way a plain pyarrow IterableDataset yields them."""
    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1000):
            yield from batch.to_pylist()


def pyarrow_labelled_rows(paths: list[str]):
    """The rows of :func:`pyarrow_rows` with what an nnh sample also holds, made as cheaply as
    plain Python allows: ``__shard__``, ``__index__``, ``__pad__`` and ``__aug__`` (the
    parameters of ``gen_augmentation_params_batch`` as one dict per row)."""
    first = 0
    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1000):
            rows, ids = batch.to_pylist(), np.arange(first, first + batch.num_rows)
            first += batch.num_rows
            params = gen_augmentation_params_batch(ids, base_seed=0, epoch=0, rank_aware=False)
            aug = rows_of(list(params), [column.tolist() for column in params.values()])
            for row, i, a in zip(rows, ids.tolist(), aug):
                row["__shard__"], row["__index__"] = path, i
                row["__pad__"], row["__aug__"] = False, a
            yield from rows


def pyarrow_columns(paths: list[str]) -> int:
    """Rows read as ``BATCH``-row dicts of Python lists; the row count."""
    rows = 0
    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH):
            rows += len(batch.to_pydict()["cls"])
    return rows


def nnh_batched(index, shuffle: bool = True) -> int:
    """Rows of ``ShardedStreamingDataset(index, batch_size=BATCH)``; the row count."""
    batches = ShardedStreamingDataset(index, batch_size=BATCH, shuffle=shuffle)
    return sum(len(b["__index__"]) for b in batches)


def nnh_samples(index, shuffle: bool = True) -> int:
    """Samples of ``ShardedStreamingDataset(index)``; their count."""
    return sum(1 for _ in ShardedStreamingDataset(index, shuffle=shuffle))


def cpu_timed(fns: dict[str, Callable[[], int]], best: dict[str, float]) -> dict:
    """``fns`` that also keep in ``best`` their highest items per second of process CPU time."""

    def timed(name: str, fn: Callable[[], int]) -> Callable[[], int]:
        def run() -> int:
            start = time.process_time()
            count = fn()
            best[name] = max(best.get(name, 0.0), count / (time.process_time() - start))
            return count

        return run

    return {name: timed(name, fn) for name, fn in fns.items()}


def first_sample_seconds(pattern: str) -> float:
    """Seconds from opening ``pattern`` (index sidecar on disk) to the first sample, measured in a
    fresh process after its imports."""
    return in_fresh_process(
        "import time\n"
        "from nnh_data.streaming.dataset import ShardedStreamingDataset\n"
        "t = time.perf_counter()\n"
        f"next(iter(ShardedStreamingDataset({pattern!r})))\n"
        "print(time.perf_counter() - t)"
    )


def stream_all(source: str) -> str:
    """Code that streams every sample of ``source`` once (for a fresh process)."""
    return (
        "from nnh_data.streaming.dataset import ShardedStreamingDataset\n"
        f"n = sum(1 for _ in ShardedStreamingDataset({source!r}))"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    args = parser.parse_args()
    n = args.samples
    with tempfile.TemporaryDirectory() as tmp:
        write_shards(samples(n), f"{tmp}/tar/train-%06d.tar", max_count=PER_SHARD)
        urls = sorted(glob.glob(f"{tmp}/tar/train-*.tar"))
        few = urls[: max(1, len(urls) // 4)]  # the slow baselines read a quarter
        index = build_shard_index(urls)
        mixed = [Source(build_shard_index(group)) for group in thirds(urls)]
        tar_cpu: dict[str, float] = {}
        nnh_tar = {
            "nnh": lambda: nnh_samples(index),
            "mixed": lambda: sum(1 for _ in ShardedStreamingDataset(mixed)),
        }
        tar = best_rates(
            cpu_timed(nnh_tar, tar_cpu)
            | {
                "webdataset": lambda: sum(1 for _ in wds.WebDataset(few, shardshuffle=False)),
                "tarfile": lambda: tarfile_count(few),
            },
            3,
        )
        paths = write_parquet(f"{tmp}/parquet", n)
        pq_index = build_shard_index(paths, index_path=f"{tmp}/parquet-index.json")
        cpu: dict[str, float] = {}
        parquet = best_rates(
            cpu_timed(
                {
                    "nnh": lambda: nnh_samples(pq_index),
                    "nnh_unshuffled": lambda: nnh_samples(pq_index, shuffle=False),
                    "pyarrow": lambda: sum(1 for _ in pyarrow_rows(paths)),
                    "pyarrow_labelled": lambda: sum(1 for _ in pyarrow_labelled_rows(paths)),
                    "nnh_batched": lambda: nnh_batched(pq_index),
                    "nnh_batched_unshuffled": lambda: nnh_batched(pq_index, shuffle=False),
                    "pyarrow_columns": lambda: pyarrow_columns(paths),
                },
                cpu,
            ),
            7,
        )

        write_shards(samples(SHARDS_MANY * 10), f"{tmp}/many/s-%06d.tar", max_count=10)
        build_shard_index(f"{tmp}/many/s-*.tar")  # the sidecar a training job finds on disk
        first = min(first_sample_seconds(f"{tmp}/many/s-*.tar") for _ in range(3))
        write_shards(samples(9 * n, n), f"{tmp}/tar/train-%06d.tar", start_shard=len(urls),
                     max_count=PER_SHARD)  # fmt: skip
        build_shard_index(f"{tmp}/tar/train-*.tar")
        rss = rss_growth(
            stream_all(f"{tmp}/tar/train-{{000000..{len(urls) - 1:06d}}}.tar"),
            stream_all(f"{tmp}/tar/train-*.tar"),
        )
    result = {
        "samples": n,
        "sample_bytes": SAMPLE_BYTES,
        "nnh_tar_samples_per_s": round(tar["nnh"]),
        "webdataset_samples_per_s": round(tar["webdataset"]),
        "tarfile_samples_per_s": round(tar["tarfile"]),
        "tar_vs_webdataset": round(tar["nnh"] / tar["webdataset"], 2),
        "tar_vs_tarfile": round(tar["nnh"] / tar["tarfile"], 2),
        "nnh_mixed_3_sources_samples_per_s": round(tar["mixed"]),
        "mixed_vs_one_source": round(tar["mixed"] / tar["nnh"], 2),
        "mixed_vs_one_source_cpu": round(tar_cpu["mixed"] / tar_cpu["nnh"], 2),
        "nnh_parquet_samples_per_s": round(parquet["nnh"]),
        "pyarrow_rows_per_s": round(parquet["pyarrow"]),
        "parquet_vs_pyarrow": round(parquet["nnh"] / parquet["pyarrow"], 2),
        "parquet_vs_pyarrow_cpu": round(cpu["nnh"] / cpu["pyarrow"], 2),
        "parquet_vs_pyarrow_same_fields": round(parquet["nnh"] / parquet["pyarrow_labelled"], 2),
        "parquet_vs_pyarrow_same_fields_cpu": round(cpu["nnh"] / cpu["pyarrow_labelled"], 2),
        "parquet_unshuffled_vs_pyarrow": round(parquet["nnh_unshuffled"] / parquet["pyarrow"], 2),
        "parquet_unshuffled_vs_pyarrow_cpu": round(cpu["nnh_unshuffled"] / cpu["pyarrow"], 2),
        "nnh_parquet_batched_rows_per_s": round(parquet["nnh_batched"]),
        "pyarrow_columns_rows_per_s": round(parquet["pyarrow_columns"]),
        "parquet_batched_vs_pyarrow": round(parquet["nnh_batched"] / parquet["pyarrow_columns"], 2),
        "parquet_batched_vs_pyarrow_cpu": round(cpu["nnh_batched"] / cpu["pyarrow_columns"], 2),
        "parquet_batched_unshuffled_vs_pyarrow": round(
            parquet["nnh_batched_unshuffled"] / parquet["pyarrow_columns"], 2
        ),
        "parquet_batched_unshuffled_vs_pyarrow_cpu": round(
            cpu["nnh_batched_unshuffled"] / cpu["pyarrow_columns"], 2
        ),
        "first_sample_s_10000_shards": round(first, 3),
        **rss,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
