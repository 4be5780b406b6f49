"""Benchmark: global batches (``global_batch_size=G, partitions=P``) against today's split.

Prints one JSON object. ``G`` = 512, ``P`` = 64 (the default), 2 DataLoader workers per rank
through ``streaming_loader``, loader batches of ``G / W`` at ``W`` ranks (simulated one after
another in one process), shuffled in windows of 1,024; each figure is global over plain:

- ``bytes_w{W}`` (``W`` = 1, 2, 8): bytes read in an epoch over all ranks
  (``ds.stats()["bytes"]``), from local disk, on 262,144 samples of 256 bytes in 256 tar
  shards (enough for every lane to hold whole windows);
- ``remote_bytes_w{W}`` and ``cached_bytes_w{W}``: the body bytes an S3 proxy served for an
  epoch over all ranks, reading the shards from ``moto_server`` directly and through a node
  cache the ranks share (``cache_dir``), on a smaller set (64 shards of 500 samples of 3 KiB);
- ``rate_w{W}`` and ``cpu_w{W}`` (``W`` = 1, 8): rank 0's samples/s and samples per CPU second
  (the main process and its persistent workers, read from ``/proc``) in the epochs after a
  first one, on the large set: the best of ``--rounds`` rounds in which the two modes take
  turns, each in a fresh process.

The absolute figures sit beside the ratios (``*_mb``, ``*_samples_per_s``: global, plain).

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
from typing import Any

import s3fs
from cache import moto_server, s3_options  # tools/bench/cache.py

from nnh_data import ShardedStreamingDataset, streaming_loader
from nnh_data.shards.index import build_shard_index

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests/
from tests.support import S3Proxy, numbered_samples, write_tar  # noqa: E402

LARGE = (256, 1024, 256)  # shards, samples per shard, bytes per sample
SMALL = (64, 500, 3072)
GLOBAL_BATCH, PARTITIONS, WORKERS = 512, 64, 2
WORLDS, RATE_WORLDS, EPOCHS = (1, 2, 8), (1, 8), 3


def write_shards(folder: str, shape: tuple[int, int, int]) -> None:
    """Tar shards of numbered samples in ``folder``: ``shape`` = (shards, samples, bytes)."""
    os.makedirs(folder)
    shards, per_shard, size = shape
    for i in range(shards):
        write_tar(f"{folder}/shard-{i:06d}.tar", numbered_samples(i * per_shard, per_shard, size),
                  pax=False)  # fmt: skip


def _dataset(source: str, world: int, rank: int, global_mode: bool, **kwargs: Any):
    extra = {"global_batch_size": GLOBAL_BATCH, "partitions": PARTITIONS} if global_mode else {}
    index = build_shard_index(source, storage_options=kwargs.get("storage_options"))
    return ShardedStreamingDataset(index, rank=rank, world_size=world, **extra, **kwargs)


def epoch_bytes(source: str, world: int, global_mode: bool, options: dict | None = None,
                cache_dir: str | None = None) -> int:  # fmt: skip
    """Bytes every rank of ``world`` read in one epoch, summed."""
    nbytes = 0
    for rank in range(world):
        ds = _dataset(source, world, rank, global_mode, storage_options=options,
                      cache_dir=cache_dir)  # fmt: skip
        loader = streaming_loader(ds, GLOBAL_BATCH // world, num_workers=WORKERS,
                                  persistent_workers=False)  # fmt: skip
        assert sum(len(batch["__index__"]) for batch in loader) == len(ds)
        nbytes += int(ds.stats()["bytes"])
        del loader
    return nbytes


def epoch_rates(source: str, world: int, global_mode: bool) -> dict:
    """Rank 0's samples/s and samples per CPU second (main process and persistent workers)
    over the epochs after the first."""
    ds = _dataset(source, world, 0, global_mode)
    loader = streaming_loader(ds, GLOBAL_BATCH // world, num_workers=WORKERS)
    samples = seconds = cpu = 0.0
    for epoch in range(EPOCHS):
        ds.set_epoch(epoch)
        batches = iter(loader)
        pids = [worker.pid for worker in batches._workers]
        start, own, workers = time.perf_counter(), time.process_time(), _cpu(pids)
        count = sum(len(batch["__index__"]) for batch in batches)
        if epoch:  # the first starts the workers and warms their memory
            samples += count
            seconds += time.perf_counter() - start
            cpu += time.process_time() - own + _cpu(pids) - workers
    del loader
    return {"rate": samples / seconds, "cpu": samples / cpu}


def _cpu(pids: list[int]) -> float:
    """CPU seconds (user and system) of the processes ``pids`` so far."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def in_process(function: str, **kwargs: Any) -> Any:
    """``function(**kwargs)`` of this module in a fresh interpreter."""
    code = f"import json, global_batches as g; print(json.dumps(g.{function}(**{kwargs!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent)  # fmt: skip
    return json.loads(out.stdout.splitlines()[-1])


def local_figures(folder: str, rounds: int) -> dict:
    """Bytes per epoch at each world size, and rank 0's rate and CPU, global over plain."""
    out: dict = {}
    pattern = f"{folder}/shard-*.tar"
    for world in WORLDS:
        got = {mode: in_process("epoch_bytes", source=pattern, world=world, global_mode=mode)
               for mode in (True, False)}  # fmt: skip
        out[f"bytes_w{world}"] = round(got[True] / got[False], 4)
        out[f"bytes_w{world}_mb"] = [round(got[m] / 1e6, 2) for m in (True, False)]
    for world in RATE_WORLDS:
        best = {mode: {"rate": 0.0, "cpu": 0.0} for mode in (True, False)}
        for _ in range(rounds):
            for mode in (True, False):
                got = in_process("epoch_rates", source=pattern, world=world, global_mode=mode)
                best[mode] = {k: max(best[mode][k], got[k]) for k in got}
        for key in ("rate", "cpu"):
            out[f"{key}_w{world}"] = round(best[True][key] / best[False][key], 3)
            out[f"{key}_w{world}_samples_per_s"] = [round(best[m][key]) for m in (True, False)]
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
                    in_process("epoch_bytes", source="s3://bench/shard-*.tar", world=world,
                               global_mode=mode, options=options, cache_dir=cache_dir)  # fmt: skip
                    served[mode] = sum(proxy.get_bytes.values())
                out[f"{name}_bytes_w{world}"] = round(served[True] / served[False], 4)
                out[f"{name}_bytes_w{world}_mb"] = [round(served[m] / 1e6, 2) for m in served]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    result: dict = {"global_batch_size": GLOBAL_BATCH, "partitions": PARTITIONS,
                    "workers": WORKERS}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="nnh-global-") as tmp:
        result["load_before"] = open("/proc/loadavg").read().split()[:3]
        write_shards(f"{tmp}/large", LARGE)
        result.update(local_figures(f"{tmp}/large", args.rounds))
        write_shards(f"{tmp}/small", SMALL)
        result.update(remote_figures(f"{tmp}/small", tmp))
        result["load_after"] = open("/proc/loadavg").read().split()[:3]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
