"""Benchmark: global batches (``global_batch_size=G, partitions=P``) against today's split.

Prints one JSON object. The same tar shards (64 shards of 500 samples of 3 KiB, shuffled in
windows of 1,024) are read for one epoch by every rank of a world of ``W`` = 1, 2 and 8 ranks
(simulated one after another in one process), each through ``streaming_loader`` with 2
DataLoader workers and loader batches of ``G / W`` (``G`` = 512, ``P`` = 64), once with global
batches and once without:

- ``bytes_w{W}``: bytes read in the epoch over all ranks (``ds.stats()["bytes"]``), global over
  plain, from local disk;
- ``remote_bytes_w{W}`` and ``cached_bytes_w{W}``: the same shards in ``moto_server``, the body
  bytes an S3 proxy served for the epoch, read directly and through a node cache the ranks
  share (``cache_dir``), global over plain;
- ``rate`` and ``cpu``: samples/s of one rank (``W`` = 1, 2 workers) and its samples per CPU
  second (the main process and its workers), global over plain: the best of ``--rounds``
  rounds in which the two modes take turns, each epoch in a fresh process.

The absolute figures sit beside the ratios (``*_mb``, ``*_samples_per_s``).

    .venv/bin/python tools/bench/global_batches.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import s3fs
from cache import moto_server, s3_options  # tools/bench/cache.py

from nnh_data import ShardedStreamingDataset, streaming_loader
from nnh_data.shards.index import build_shard_index

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests/
from tests.support import S3Proxy, numbered_samples, write_tar  # noqa: E402

SHARDS, PER_SHARD, SAMPLE_BYTES = 64, 500, 3072
GLOBAL_BATCH, PARTITIONS, WORKERS = 512, 64, 2
WORLDS = (1, 2, 8)


def write_shards(folder: str) -> list[str]:
    """``SHARDS`` tar shards of ``PER_SHARD`` numbered samples in ``folder``."""
    paths = [f"{folder}/shard-{i:06d}.tar" for i in range(SHARDS)]
    for i, path in enumerate(paths):
        write_tar(path, numbered_samples(i * PER_SHARD, PER_SHARD, SAMPLE_BYTES), pax=False)
    return paths


def epoch(source: str, world: int, global_mode: bool, options: dict | None = None,
          cache_dir: str | None = None, ranks: list[int] | None = None) -> dict:  # fmt: skip
    """One epoch of every rank in ``ranks`` (default all) of ``world``: samples, bytes read,
    seconds and CPU seconds (this process and its workers)."""
    index = build_shard_index(source, storage_options=options)
    extra = {"global_batch_size": GLOBAL_BATCH, "partitions": PARTITIONS} if global_mode else {}
    samples = nbytes = 0
    start, cpu = time.perf_counter(), time.process_time()
    for rank in range(world) if ranks is None else ranks:
        ds = ShardedStreamingDataset(index, rank=rank, world_size=world, storage_options=options,
                                     cache_dir=cache_dir, **extra)  # fmt: skip
        loader = streaming_loader(ds, GLOBAL_BATCH // world, num_workers=WORKERS,
                                  persistent_workers=False)  # fmt: skip
        samples += sum(len(batch["__index__"]) for batch in loader)
        nbytes += ds.stats()["bytes"]
        del loader
    seconds = time.perf_counter() - start
    children = os.times().children_user + os.times().children_system
    return {"samples": samples, "bytes": nbytes, "s": seconds,
            "cpu_s": time.process_time() - cpu + children}  # fmt: skip


def in_process(**kwargs) -> dict:
    """:func:`epoch` in a fresh interpreter (its workers' CPU time counted when they end)."""
    code = f"import json, global_batches as g; print(json.dumps(g.epoch(**{kwargs!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent)  # fmt: skip
    return json.loads(out.stdout.splitlines()[-1])


def local_figures(folder: str, rounds: int) -> dict:
    """Bytes per epoch at each world size, and one rank's rate and CPU, global over plain."""
    out: dict = {}
    pattern = f"{folder}/shard-*.tar"
    for world in WORLDS:
        got = {mode: in_process(source=pattern, world=world, global_mode=mode)
               for mode in (True, False)}  # fmt: skip
        out[f"bytes_w{world}"] = round(got[True]["bytes"] / got[False]["bytes"], 4)
        out[f"bytes_w{world}_mb"] = [round(got[m]["bytes"] / 1e6, 2) for m in (True, False)]
    best: dict = {True: {"rate": 0.0, "cpu": 0.0}, False: {"rate": 0.0, "cpu": 0.0}}
    for _ in range(rounds):
        for mode in (True, False):
            got = in_process(source=pattern, world=1, global_mode=mode)
            best[mode]["rate"] = max(best[mode]["rate"], got["samples"] / got["s"])
            best[mode]["cpu"] = max(best[mode]["cpu"], got["samples"] / got["cpu_s"])
    for key in ("rate", "cpu"):
        out[key] = round(best[True][key] / best[False][key], 3)
        out[f"{key}_samples_per_s"] = [round(best[m][key]) for m in (True, False)]
    return out


def remote_figures(folder: str, tmp: str) -> dict:
    """Body bytes an S3 proxy served per epoch, read directly and through a node cache."""
    out: dict = {}
    with moto_server() as upstream, S3Proxy(upstream) as proxy:
        fs = s3fs.S3FileSystem(**s3_options(upstream), skip_instance_cache=True)
        fs.mkdir("bench")
        paths = sorted(Path(folder).glob("shard-*.tar"))
        fs.put([str(p) for p in paths], [f"bench/{p.name}" for p in paths])
        build_shard_index("s3://bench/shard-*.tar", storage_options=s3_options(upstream))
        options = proxy.storage_options  # the sidecar index above is read, not the shards
        for world in WORLDS:
            for name, cached in (("remote", False), ("cached", True)):
                served = {}
                for mode in (True, False):
                    cache_dir = tempfile.mkdtemp(dir=tmp) if cached else None
                    proxy.reset()
                    in_process(source="s3://bench/shard-*.tar", world=world, global_mode=mode,
                               options=options, cache_dir=cache_dir)  # fmt: skip
                    served[mode] = sum(proxy.get_bytes.values())
                out[f"{name}_bytes_w{world}"] = round(served[True] / served[False], 4)
                out[f"{name}_bytes_w{world}_mb"] = [round(served[m] / 1e6, 2) for m in served]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nnh-global-") as tmp:
        folder = f"{tmp}/shards"
        os.makedirs(folder)
        write_shards(folder)
        result = {"samples": SHARDS * PER_SHARD, "global_batch_size": GLOBAL_BATCH,
                  "partitions": PARTITIONS, "workers": WORKERS,
                  "load": open("/proc/loadavg").read().split()[:3]}  # fmt: skip
        result.update(local_figures(folder, args.rounds))
        result.update(remote_figures(folder, tmp))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
