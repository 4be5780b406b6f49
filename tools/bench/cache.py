"""Benchmark: the node-local shard cache's eviction policy and its cost per decision.

Prints one JSON object.

- Fetches on a demand trace. ``world_size`` ranks x ``num_workers`` DataLoader workers read 96
  equal shards for 4 epochs in the real order (:func:`nnh_data.shard_cache.read_schedule`);
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

    .venv/bin/python tools/bench/cache.py

``epoch_figures(result)`` is where end-to-end epoch times through the dataset are added.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from common import best_rate  # tools/bench/common.py

from nnh_data.order import worker_plan
from nnh_data.shard_cache import (
    Plan,
    ShardCache,
    choose_victims,
    next_uses,
    read_schedule,
    shard_key,
)
from nnh_data.shard_index import ShardInfo

SHARDS = 96
EPOCHS = 4
PER_SHARD = 1000
WINDOW = 1024  # the dataset's default shuffle window


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


def epoch_figures(result: dict) -> dict:
    """End-to-end epoch times through the dataset (moto behind a slow proxy): to be added when
    the cache is plugged into ``ShardedStreamingDataset``."""
    return result


def main() -> None:
    result = {**policy_figures(), **decision_figures()}
    print(json.dumps(epoch_figures(result)))


if __name__ == "__main__":
    main()
