"""The cost of the data-path stats (``ds.stats()``) on ``tools/bench/streaming.py``'s data.

20,000 samples of 3 KiB as tar shards of 1,000 and as Parquet files; one process, no workers:
tar per-sample, three tar sources mixed, Parquet per-sample, Parquet batches of 256. Two
figures per kind:

- ``accounted``: the stats' share of an epoch's CPU time, from counts: each counting call the
  epoch makes (calls counted in one epoch) times its cost (timed alone), over the epoch's time.
  Exact in what it counts, free of the machine's noise.
- ``ab``: the epoch's CPU time with the counting calls made no-ops over with them (best of
  ``ROUNDS`` interleaved rounds): the same comparison measured, within the machine's noise.

Prints one JSON object.
"""

from __future__ import annotations

import glob
import json
import tempfile
import time
import timeit
from contextlib import contextmanager

from streaming import PER_SHARD, samples, thirds, write_parquet  # tools/bench/streaming.py

from nnh_data import ShardedStreamingDataset, Source
from nnh_data.shards.writer import write_shards
from nnh_data.streaming.stats import Meter

COUNT, ROUNDS = 20_000, 7
_CALLS = ("read", "part", "add", "decoded")


@contextmanager
def patched(replace):
    """``Meter``'s counting methods replaced by ``replace(name, method)`` for the block."""
    saved = {name: Meter.__dict__[name] for name in _CALLS}
    try:
        for name, method in saved.items():
            setattr(Meter, name, replace(name, method))
        yield
    finally:
        for name, method in saved.items():
            setattr(Meter, name, method)


def counting(calls: dict[str, int]):
    def replace(name, method):
        inner = method.__func__ if isinstance(method, staticmethod) else method

        def counted(*args):
            calls[name] += 1
            return inner(*args)

        return staticmethod(counted) if isinstance(method, staticmethod) else counted

    return replace


def nothing(name, method):
    noop = lambda *args: None  # noqa: E731
    return staticmethod(noop) if isinstance(method, staticmethod) else noop


def epoch_seconds(make) -> float:
    """CPU seconds of one epoch of a new dataset."""
    dataset = make()
    start = time.process_time()
    for _ in dataset:
        pass
    return time.process_time() - start


def call_costs() -> dict[str, float]:
    """Seconds per counting call, and per clock read around a timed block."""
    meter = Meter.alone()
    reads = meter.reads()
    calls = {"read": lambda: Meter.read(reads, 1000, 3_000_000, 12_345, False),
             "part": lambda: meter.part(1024), "add": lambda: meter.add(6, 100),
             "decoded": lambda: meter.decoded(100, 1), "clock": time.perf_counter_ns}  # fmt: skip
    return {name: min(timeit.repeat(fn, number=2000, repeat=5)) / 2000
            for name, fn in calls.items()}  # fmt: skip


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        write_shards(samples(COUNT), f"{folder}/tar/shard-%06d.tar", max_count=PER_SHARD)
        urls = sorted(glob.glob(f"{folder}/tar/shard-*.tar"))
        parquet = write_parquet(f"{folder}/parquet", COUNT)
        kinds = {
            "tar": lambda: ShardedStreamingDataset(urls, seed=0),
            "mixed": lambda: ShardedStreamingDataset([Source(u) for u in thirds(urls)], seed=0),
            "parquet": lambda: ShardedStreamingDataset(parquet, seed=0),
            "parquet_batches": lambda: ShardedStreamingDataset(parquet, seed=0, batch_size=256),
        }
        costs, out = call_costs(), {}
        for kind, make in kinds.items():
            calls = dict.fromkeys(_CALLS, 0)
            with patched(counting(calls)):
                epoch_seconds(make)
            counted = {"on": [], "off": []}
            for _ in range(ROUNDS):
                counted["on"].append(epoch_seconds(make))
                with patched(nothing):
                    counted["off"].append(epoch_seconds(make))
            spent = sum(n * costs[name] for name, n in calls.items())
            spent += 2 * (calls["read"] + calls["part"]) * costs["clock"]  # the timed blocks
            out[kind] = {"calls": calls, "epoch_ms": round(min(counted["on"]) * 1e3, 1),
                         "accounted": round(spent / min(counted["on"]), 5),
                         "ab": round(min(counted["on"]) / min(counted["off"]), 4)}  # fmt: skip
    print(json.dumps({"samples": COUNT, "call_ns": {k: round(v * 1e9) for k, v in costs.items()},
                      **out}))  # fmt: skip


if __name__ == "__main__":
    main()
