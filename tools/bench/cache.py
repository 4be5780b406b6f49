"""Benchmark: the node-local shard cache's eviction policy and its cost per decision.

Prints one JSON object.

- Fetches on a demand trace. ``world_size`` ranks x ``num_workers`` DataLoader workers read 96
  equal shards for 4 epochs in the real order (:func:`nnh_data.cache.policy.read_schedule`);
  ranks advance in step and workers take turns, so worker ``k`` reads item ``t`` at global time
  ``t * num_workers + k``. A cache of 25% and 50% of the shards is simulated under LRU, under
  the cache's rule (Belady from the live plans: this epoch and the next, positions as read) and
  under the offline optimum (Belady on the whole future trace); the shard each worker reads is
  pinned. Fetches of epochs 1-3 (after a warm-up epoch) are reported with the ratios to LRU,
  and the share of what epoch 0 leaves cached that is among the first (2 x cache size) shards
  epoch 1 reads (``kept_for_next_epoch``; reads on demand only, no prefetch).
- One eviction decision (:func:`next_uses` + :func:`choose_victims`) with 10,000 cached shards
  and 64 plans, and the same decision made by the cache on a folder of 10,000 shards (listing
  and plan files included).
- Epochs through ``ShardedStreamingDataset`` (``epoch_figures``): 96 equal tar shards of ~2 MB
  in ``moto_server``, read through ``tests.support.S3Proxy`` adding 30 ms per request and
  capping the link at 50 MB/s (one rank, 2 DataLoader workers, batches of 32, window 64):
  epoch seconds, GETs and MB per epoch without a cache, with one that fits and with 25% and
  50% of the data's bytes (ratios ``*_vs_nocache``: epoch 0 to the uncached epoch 0, later
  epochs to the uncached epoch 1; shards fetched in epochs 1-3 beside the simulation's counts
  on the same schedule), and from local disk (the floor of a cached epoch); seconds to open a
  glob of 10,000 small shards (two listings, the index sidecar) and from ``iter()`` to the
  first sample, in a fresh process, through an empty cache, the cache that left, and none.
  ``mds``: MosaicML Streaming is only compared when installed (it is not in the venv).
- The content check (``check_figures``): CPU time of reading a whole cached shard of 2 MiB and of
  64 MiB through a session the first time after its download (its CRC-32 computed and its
  signature recorded) and later (the signature matches: no CRC), against reading the same file
  with ``open().read()``; page cache warm, best of 9 interleaved rounds.

    .venv/bin/python tools/bench/cache.py
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from subprocess import DEVNULL

import numpy as np
import s3fs
from common import best_rate  # tools/bench/common.py

from nnh_data import ShardedStreamingDataset, streaming_loader
from nnh_data.cache.files import record_path
from nnh_data.cache.policy import Plan, choose_victims, next_uses, read_schedule, shard_key
from nnh_data.cache.store import ShardCache
from nnh_data.order.epoch import worker_plan
from nnh_data.shards.index import ShardIndex, ShardInfo, build_shard_index

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests/
from tests.support import (  # noqa: E402
    S3Proxy,
    free_port,
    numbered_samples,
    sample_bytes,
    write_tar,
)

SHARDS = 96
EPOCHS = 4
PER_SHARD = 1000
WINDOW = 1024  # the dataset's default shuffle window

# End to end: equal tar shards behind a proxy as slow as the object store.
LATENCY_S, BYTES_PER_S = 0.03, 50e6
EPOCH_SHARDS, EPOCH_PER_SHARD, SAMPLE_BYTES = 96, 100, 20_000  # ~2 MB shards
EPOCH_WINDOW, BATCH, WORKERS = 64, 32, 2
MANY, MANY_PER_SHARD = 10_000, 16  # the first-sample figures' shards
UPLOAD_BUDGET_S = 120.0  # fewer shards when their upload takes longer
MOTO_SERVER = Path(sys.executable).with_name("moto_server")


@dataclass(frozen=True)
class Trace:
    """A demand trace: ``events`` are ``(global time, reader, shard, epoch)`` in time order;
    ``schedules[epoch][reader]`` the reader's ``(shard, t)`` reads of that epoch, ``t`` counted
    from its first epoch; ``num_workers`` readers of a rank take turns."""

    events: list[tuple[int, int, int, int]]
    schedules: list[list[list[tuple[int, int]]]]
    num_workers: int
    readers: int


def demand_trace(
    shards: int = SHARDS,
    epochs: int = EPOCHS,
    world_size: int = 4,
    num_workers: int = 2,
    per_shard: int = PER_SHARD,
    window: int = WINDOW,
    seed: int = 0,
) -> Trace:
    """The reads of every worker of every rank over ``epochs`` epochs, in global time order."""
    counts = [per_shard] * shards
    total = shards * per_shard
    length = worker_plan([(0, total)], world_size, 0, num_workers, 0, "pad").length
    events, schedules = [], []
    for epoch in range(epochs):
        per_reader = []
        for rank in range(world_size):
            for worker in range(num_workers):
                reads = read_schedule(
                    counts, seed=seed, epoch=epoch, window=window, world_size=world_size,
                    rank=rank, num_workers=num_workers, worker=worker,
                )  # fmt: skip
                reads = [(shard, epoch * length + t) for shard, t in reads]
                reader = rank * num_workers + worker
                events += [(t * num_workers + worker, reader, s, epoch) for s, t in reads]
                per_reader.append(reads)
        schedules.append(per_reader)
    events.sort()
    return Trace(events, schedules, num_workers, world_size * num_workers)


def _plans(trace: Trace, epoch: int, positions: list[int]) -> list[Plan]:
    """Every reader's plan at ``epoch`` (this epoch and the next) at its position."""
    plans = []
    for reader in range(trace.readers):
        reads = [r for e in (epoch, epoch + 1) if e < len(trace.schedules)
                 for r in trace.schedules[e][reader]]  # fmt: skip
        keys = [shard for shard, _ in reads]
        times = np.array([t for _, t in reads], dtype=np.int64)
        plans.append(Plan(keys, times, positions[reader], trace.num_workers))
    return plans


def count_fetches(trace: Trace, capacity: int, policy: str, from_epoch: int = 1) -> int:
    """Shard fetches of the epochs from ``from_epoch`` on, for a cache of ``capacity`` shards
    under ``policy``: "lru", "plans" (the cache's rule) or "optimum" (offline Belady)."""
    return sum(simulate(trace, capacity, policy)[0][from_epoch:])


def simulate(trace: Trace, capacity: int, policy: str) -> tuple[list[int], list[set[int]]]:
    """Fetches per epoch, and the cached shards when each epoch starts, for a cache of
    ``capacity`` shards under ``policy`` (see :func:`count_fetches`)."""
    cache: OrderedDict[int, None] = OrderedDict()
    current = [-1] * trace.readers
    future = _next_times(trace) if policy == "optimum" else None
    fetches, starts = [0] * len(trace.schedules), []
    for i, (g, reader, shard, epoch) in enumerate(trace.events):
        if epoch == len(starts):
            starts.append(set(cache))
        current[reader] = shard
        if shard in cache:
            cache.move_to_end(shard)
            continue
        fetches[epoch] += 1
        if len(cache) >= capacity:
            keys = list(cache)
            evictable = [k not in current for k in keys]
            if policy == "lru":
                victim = next((k for k, ok in zip(keys, evictable) if ok), None)
            else:
                uses = _uses(trace, policy, keys, g, epoch, future, i)
                chosen = choose_victims([1] * len(keys), uses, 1, 0.0, evictable.__getitem__)
                victim = keys[chosen[0]] if chosen else None
            if victim is None:
                continue  # read around the cache
            del cache[victim]
        cache[shard] = None
    return fetches, starts


def kept_share(trace: Trace, capacity: int, policy: str) -> float:
    """The share of what epoch 0 leaves cached that is among the first ``2 * capacity``
    shards epoch 1 reads."""
    left = simulate(trace, capacity, policy)[1][1]
    first = list(dict.fromkeys(shard for _, _, shard, epoch in trace.events if epoch == 1))
    return len(left & set(first[: 2 * capacity])) / len(left)


def _uses(trace, policy, keys, g, epoch, future, i) -> np.ndarray:
    if policy == "plans":
        workers = trace.num_workers
        positions = [-(-(g - r % workers) // workers) for r in range(trace.readers)]
        return next_uses(_plans(trace, epoch, positions), keys)
    return np.array([future[i].get(k, np.inf) - trace.events[i][0] for k in keys], dtype=float)


def _next_times(trace: Trace) -> list[dict[int, float]]:
    """Per event, each shard's next read time after it (the offline optimum's knowledge)."""
    out: list[dict[int, float]] = [{}] * len(trace.events)
    upcoming: dict[int, float] = {}
    for i in range(len(trace.events) - 1, -1, -1):
        out[i] = dict(upcoming)
        upcoming[trace.events[i][2]] = trace.events[i][0]
    return out


def policy_figures() -> dict:
    """Fetches of epochs 1-3 at 25% and 50% of the shards, per policy, and ratios to LRU."""
    trace = demand_trace()
    out = {}
    for share in (25, 50):
        capacity = SHARDS * share // 100
        counts = {p: count_fetches(trace, capacity, p) for p in ("lru", "plans", "optimum")}
        out[f"fetches_{share}pct"] = counts
        out[f"belady_vs_lru_{share}pct"] = round(counts["plans"] / counts["lru"], 3)
        out[f"optimum_vs_lru_{share}pct"] = round(counts["optimum"] / counts["lru"], 3)
        out[f"kept_for_next_epoch_{share}pct"] = round(kept_share(trace, capacity, "plans"), 3)
    return out


def decision_figures(shards: int = 10_000, plans: int = 64) -> dict:
    """Milliseconds of one eviction decision with ``shards`` cached and ``plans`` live plans,
    as pure functions and through the cache on disk."""
    rng = np.random.default_rng(0)
    keys = [f"{i:032x}" for i in range(shards)]
    live = []
    for _ in range(plans):
        reads = rng.choice(shards, 2 * shards // plans, replace=False)
        times = np.sort(rng.integers(0, 100_000, len(reads)))
        live.append(Plan([keys[i] for i in reads], times, 50_000, 8))
    sizes = [1 << 20] * shards

    def decide() -> None:
        choose_victims(sizes, next_uses(live, keys), 1 << 20, 0.0)

    return {"decision_ms_10000_shards_64_plans": round(1000 / best_rate(decide, 1, 5), 2),
            **_disk_decision(shards, plans)}  # fmt: skip


def _disk_decision(shards: int, plans: int) -> dict:
    """Milliseconds of a read on demand that must evict, through ``ShardCache`` on a folder of
    ``shards`` entries with ``plans`` live plans: listing, plan files, the decision, the
    eviction and the download of a 1 KiB local shard."""
    with tempfile.TemporaryDirectory() as folder:
        cache = ShardCache(f"{folder}/cache", limit=shards * 1024)
        cached = [_info(f"{folder}/gone-{i:06d}.tar") for i in range(shards)]
        for info in cached:
            _fake_entry(cache.cache_dir, info)
        time.sleep(0.3)  # folders changed this recently are listed again at every decision
        cache.stats()  # a long-running process has listed them once
        sessions = [cache.session(prefetch=0) for _ in range(plans)]
        rng = np.random.default_rng(0)
        for session in sessions:
            reads = rng.choice(shards, 2 * shards // plans, replace=False)
            times = np.sort(rng.integers(1, 10**5, len(reads)))
            session.set_plan([cached[i] for i in reads], times)
        misses = [_info(f"{folder}/new-{i}.tar", write=True) for i in range(5)]
        times = []
        for info in misses:
            started = time.perf_counter()
            assert sessions[0].open(info) is not None
            times.append(time.perf_counter() - started)
            sessions[0].release(info)
        for session in sessions:
            session.close()
    return {"miss_with_eviction_ms_10000_shards_64_plans": round(min(times) * 1000, 2)}


def _info(path: str, write: bool = False) -> ShardInfo:
    if write:
        with open(path, "wb") as f:
            f.write(b"x" * 1024)
    return ShardInfo(f"file://{path}", "tar", 1, size=1024, version="v")


def _fake_entry(cache_dir: str, info: ShardInfo) -> None:
    """A complete entry of ``info`` (zeros) in the documented layout, as a download leaves it."""
    key = shard_key(info.url, info.size, info.version)
    folder = os.path.join(cache_dir, "shards", key[:2])
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{key}-{info.url.rsplit('/', 1)[-1]}"), "wb") as f:
        f.truncate(info.size)
    with open(os.path.join(folder, f"{key}.json"), "w") as f:
        json.dump({"url": info.url, "size": info.size, "version": info.version}, f)


@contextmanager
def moto_server() -> Iterator[str]:
    """A ``moto_server`` on a free loopback port for the block; its endpoint."""
    port = free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    command = [str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(port)]
    process = subprocess.Popen(command, stdout=DEVNULL, stderr=DEVNULL, env=env)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start at {endpoint}") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        process.terminate()
        process.wait(10)


def s3_options(endpoint: str) -> dict:
    """fsspec storage options for the S3 endpoint ``endpoint`` (moto's credentials)."""
    return {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": endpoint}}


def upload_shards(upstream: str, bucket: str, folder: str) -> ShardIndex:
    """``EPOCH_SHARDS`` equal tar shards written to ``folder``, put in ``bucket`` and indexed
    (straight at moto: the proxy only sees the reads)."""
    os.makedirs(folder)
    paths = [f"{folder}/shard-{i:06d}.tar" for i in range(EPOCH_SHARDS)]
    for i, path in enumerate(paths):
        first = i * EPOCH_PER_SHARD
        write_tar(path, numbered_samples(first, EPOCH_PER_SHARD, SAMPLE_BYTES), pax=False)
    fs = s3fs.S3FileSystem(**s3_options(upstream), skip_instance_cache=True)
    fs.mkdir(bucket)
    fs.put(paths, [f"{bucket}/{os.path.basename(p)}" for p in paths])
    return build_shard_index(f"{bucket}/shard-*.tar", storage_options=s3_options(upstream))


def run_epochs(
    index: ShardIndex, proxy: S3Proxy | None, epochs: int, cache_dir: str | None = None,
    limit: int | None = None,
) -> list[dict]:  # fmt: skip
    """Per epoch (one rank, ``WORKERS`` DataLoader workers, batches of ``BATCH``): seconds,
    GETs and MB the proxy served, and the cache's downloads, hits and reads around it.
    ``proxy=None``: ``index`` is local."""
    ds = ShardedStreamingDataset(
        index, rank=0, world_size=1, shuffle_window=EPOCH_WINDOW, batch_size=BATCH,
        storage_options=proxy and proxy.storage_options, cache_dir=cache_dir, cache_limit=limit,
    )  # fmt: skip
    loader = streaming_loader(ds, BATCH, num_workers=WORKERS)
    before = dict.fromkeys(("downloads", "hits", "around"), 0)
    out = []
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        if proxy is not None:
            proxy.reset()
        started = time.perf_counter()
        samples = sum(len(batch["__index__"]) for batch in loader)
        figures = {"s": round(time.perf_counter() - started, 2)}
        assert samples == index.total_samples, (samples, index.total_samples)
        if proxy is not None:
            figures["gets"] = sum(proxy.gets.values())
            figures["get_mb"] = round(sum(proxy.get_bytes.values()) / 1e6, 1)
        if cache_dir is not None:
            stats = ShardCache(cache_dir).stats()
            figures.update({k: stats[k] - before[k] for k in before})
            before = {k: stats[k] for k in before}
        out.append(figures)
    del loader  # its persistent workers stop
    return out


def _epoch_results(index: ShardIndex, local: ShardIndex, proxy: S3Proxy, tmp: str) -> dict:
    """Epochs without a cache, with one that fits and with 25% and 50% of the data's bytes;
    ratios of epoch times to the uncached epoch (epoch 0 to epoch 0, later ones to epoch 1).
    The same shards read from local disk (``local``) give the floor of a cached epoch."""
    data = sum(info.size for info in index.shards)
    runs = {"local": run_epochs(local, None, 2), "nocache": run_epochs(index, proxy, 2),
            "fits": run_epochs(index, proxy, 2, f"{tmp}/fits", 2 * data)}  # fmt: skip
    for share in (25, 50):
        runs[f"p{share}"] = run_epochs(index, proxy, 4, f"{tmp}/p{share}", data * share // 100)
    base = [epoch["s"] for epoch in runs["nocache"]]

    def ratios(name: str) -> list[float]:
        return [round(e["s"] / base[min(i, 1)], 3) for i, e in enumerate(runs[name])]

    out = {"epoch_shards": EPOCH_SHARDS, "epoch_mb": round(data / 1e6, 1),
           "proxy": f"{LATENCY_S * 1000:g} ms per request, {BYTES_PER_S / 1e6:g} MB/s",
           "epochs": runs, "fits_epoch0_vs_nocache": ratios("fits")[0],
           "fits_epoch1_vs_nocache": ratios("fits")[1],
           "local_epoch1_vs_nocache": ratios("local")[1]}  # fmt: skip
    trace = demand_trace(EPOCH_SHARDS, 4, 1, WORKERS, EPOCH_PER_SHARD, EPOCH_WINDOW)
    shard_bytes = data / EPOCH_SHARDS
    for share in (25, 50):
        name, capacity = f"p{share}", EPOCH_SHARDS * share // 100
        out[f"{name}_vs_nocache"] = ratios(name)
        measured = sum(e["get_mb"] for e in runs[name][1:]) * 1e6 / shard_bytes
        out[f"{name}_shards_fetched_epochs_1_3"] = {
            "measured": round(measured, 1),
            **{p: count_fetches(trace, capacity, p) for p in ("lru", "plans", "optimum")},
        }
    return out


def upload_many(upstream: str, bucket: str, count: int, budget_s: float) -> tuple[int, float]:
    """Up to ``count`` small tar shards (``MANY_PER_SHARD`` samples of one 16-byte field) put
    in ``bucket`` in batches, stopping when ``budget_s`` is spent; how many were put and the
    seconds it took."""
    fs = s3fs.S3FileSystem(**s3_options(upstream), skip_instance_cache=True)
    fs.mkdir(bucket)
    started, done = time.perf_counter(), 0
    with tempfile.TemporaryDirectory() as folder:
        while done < count and time.perf_counter() - started < budget_s:
            batch = range(done, min(count, done + 500))
            fs.pipe({f"{bucket}/s-{i:06d}.tar": _small_tar(f"{folder}/s.tar", i) for i in batch})
            done = batch.stop
    return done, time.perf_counter() - started


def _small_tar(path: str, i: int) -> bytes:
    first = i * MANY_PER_SHARD
    write_tar(Path(path), [{"__key__": f"{g:08d}", "bin": sample_bytes(g, 16)}
                           for g in range(first, first + MANY_PER_SHARD)], pax=False)  # fmt: skip
    with open(path, "rb") as f:
        return f.read()


def first_sample_figures(upstream: str, proxy: S3Proxy, tmp: str) -> dict:
    """Seconds to open ``s3://.../s-*.tar`` with 10,000 shards (listing, index sidecar in the
    bucket) and from ``iter()`` to its first sample, in a fresh process after its imports:
    through an empty cache (cold), through the cache that left (warm), and without a cache."""
    count, upload_s = upload_many(upstream, "s3://bench-many", MANY, UPLOAD_BUDGET_S)
    started = time.perf_counter()
    build_shard_index("s3://bench-many/s-*.tar", storage_options=s3_options(upstream))
    out = {"first_sample_shards": count, "first_sample_window": EPOCH_WINDOW,
           "upload_s": round(upload_s, 1),
           "index_build_s": round(time.perf_counter() - started, 1)}  # fmt: skip
    key = "first_sample_10k" if count == MANY else f"first_sample_{count}"
    for name, folder in (("cold", f"{tmp}/cache"), ("warm", f"{tmp}/cache"), ("nocache", None)):
        seconds = _first_sample("s3://bench-many/s-*.tar", proxy.storage_options, folder)
        out[f"{key}_{name}_s"] = round(sum(seconds.values()), 3)
        out[f"{key}_{name}"] = {k: round(v, 3) for k, v in seconds.items()}
    return out


def _first_sample(pattern: str, options: dict, cache_dir: str | None) -> dict[str, float]:
    """``open_s`` (the dataset built from ``pattern``) and ``first_s`` (``iter()`` to the first
    sample) in a fresh interpreter."""
    code = (
        "import json, time\n"
        "from nnh_data import ShardedStreamingDataset\n"
        "t = time.perf_counter()\n"
        f"ds = ShardedStreamingDataset({pattern!r}, storage_options={options!r}, "
        f"cache_dir={cache_dir!r}, shuffle_window={EPOCH_WINDOW}, rank=0, world_size=1)\n"
        "opened = time.perf_counter()\n"
        "next(iter(ds))\n"
        "print(json.dumps({'open_s': opened - t, 'first_s': time.perf_counter() - opened}))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(run.stdout)


def _has_mds() -> bool:
    """Whether ``mosaicml-streaming`` is installed (its module name, ``streaming``, is also
    this folder's bench script)."""
    try:
        importlib.metadata.distribution("mosaicml-streaming")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def check_figures(sizes: tuple[int, ...] = (2 << 20, 64 << 20), rounds: int = 9) -> dict:
    """CPU seconds of reading a cached shard of each size the first time after its download
    (the CRC-32 check) and later (its signature matches), as ratios to a plain read."""
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for size in sizes:
            path = f"{folder}/s-{size}.tar"
            with open(path, "wb") as f:
                f.write(np.random.default_rng(size).bytes(size))
            info = ShardInfo(f"file://{path}", "tar", 1, size=size, version="v")
            cache = ShardCache(f"{folder}/cache-{size}")
            cache.warm([info])
            record = record_path(cache.cache_dir, shard_key(info.url, size, info.version))
            downloaded = Path(record).read_bytes()  # the record a download leaves: no signature
            time.sleep(0.3)  # a signature is recorded once the file's change time is this old

            def first(cache=cache, info=info, record=record, downloaded=downloaded) -> None:
                Path(record).write_bytes(downloaded)
                _read_through(cache, info)

            def plain(path=path) -> None:
                with open(path, "rb") as f:
                    f.read()

            reads = {"first": first, "later": functools.partial(_read_through, cache, info),
                     "plain": plain}  # fmt: skip
            best = _best_cpu(reads, rounds)
            mib = size >> 20
            out[f"first_read_vs_plain_{mib}mib"] = round(best["first"] / best["plain"], 2)
            out[f"later_read_vs_plain_{mib}mib"] = round(best["later"] / best["plain"], 2)
            out[f"first_read_ms_{mib}mib"] = round(best["first"] * 1000, 2)
            out[f"plain_read_ms_{mib}mib"] = round(best["plain"] * 1000, 2)
    return out


def _read_through(cache: ShardCache, info: ShardInfo) -> None:
    with cache.session(prefetch=0) as session:
        f = session.open(info)
        f.seek(0)
        f.read()
        session.release(info)


def _best_cpu(fns: dict, rounds: int) -> dict[str, float]:
    """The least CPU seconds of each ``fn()`` over ``rounds`` rounds in which they take turns."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            started = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - started)
    return best


def epoch_figures(result: dict) -> dict:
    """``result`` plus epoch times and GETs through the dataset (moto behind a slow proxy)
    without a cache, with one that fits and at 25% and 50% of the data; seconds to the first
    sample with 10,000 indexed shards, cold and warm; MDS figures when installed."""
    with moto_server() as upstream, S3Proxy(upstream, latency_s=LATENCY_S,
                                            bytes_per_s=BYTES_PER_S) as proxy:  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            index = upload_shards(upstream, "s3://bench-epochs", f"{tmp}/shards")
            local = build_shard_index(f"{tmp}/shards/shard-*.tar")
            result.update(_epoch_results(index, local, proxy, tmp))
        with tempfile.TemporaryDirectory() as tmp:
            result.update(first_sample_figures(upstream, proxy, tmp))
    result["mds"] = "installed: not measured" if _has_mds() else "not installed"
    return result


def main() -> None:
    result = {**policy_figures(), **decision_figures(), **check_figures()}
    print(json.dumps(epoch_figures(result)))


if __name__ == "__main__":
    main()
