"""The cost of finding keys that two shards share (``nnh_data.streaming.duplicate_keys``).

One process, no workers: CPU seconds (``time.process_time``) of epochs over local tar shards of
small samples (200 shards of 500 samples of 256 bytes and a label, shuffled in windows of 4,096,
per sample and in batches of 256), with the check as it runs against the same epochs with
``DuplicateKeys.count`` replaced by one returning 0, rounds alternating. Prints one JSON object:
``*_with_over_without``, the ratio of the CPU per epoch (best of each, and the range over
rounds: each round's with over its without, which goes first alternating; on a loaded machine
the rounds' spread is wider than the check), ``*_count_share``, the CPU inside ``count`` over
the epoch's (the direct figure, best round; each epoch a new dataset, so every sample is read
for the first time), and ``count_ns_per_key``, the check's own time per key on shards of
sorted keys (disjoint ranges): read first, read again, and copies (every key found).

    .venv/bin/python tools/bench/duplicate_keys.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests/
from nnh_data import ShardedStreamingDataset, streaming_loader
from nnh_data.streaming.duplicate_keys import DuplicateKeys
from tests.support import numbered_samples, write_tar

SHARDS, PER_SHARD, PAYLOAD, WINDOW, BATCH = 200, 500, 256, 4096, 256


def write_shards(folder: Path) -> list[str]:
    urls = []
    for i in range(SHARDS):
        urls.append(str(folder / f"s-{i:04d}.tar"))
        write_tar(Path(urls[-1]), numbered_samples(i * PER_SHARD, PER_SHARD, PAYLOAD), pax=False)
    return urls


def epoch_cpu(urls: list[str], mode: str, epoch: int) -> float:
    ds = ShardedStreamingDataset(urls, shuffle_window=WINDOW, seed=epoch)
    started = time.process_time()
    if mode == "samples":
        for _ in ds:
            pass
    else:
        for _ in streaming_loader(ds, BATCH, collate_fn=lambda b: b):
            pass
    return time.process_time() - started


def count_ns(second: str) -> float:
    """``count``'s CPU per key: 1,000 blocks of 700 sorted keys in 100 shards, read once, then
    ``second``: again (``again``), or the same keys as other shards (``copies``, every key
    found), or other keys (``first``); ``hashed``: as ``first`` with hash-like keys (random hex,
    so that every shard's key range overlaps every other's)."""
    keys, size, block = DuplicateKeys(), 7000, 700
    names = [[f"{i:08d}" for i in range(b * block, (b + 1) * block)] for b in range(2000)]
    if second == "hashed":
        rng = np.random.default_rng(0)
        names = [[f"{k:016x}" for k in rng.integers(0, 2**63, block)] for _ in range(2000)]
    rows = [slice(b % 10 * block, (b % 10 + 1) * block) for b in range(1000)]
    for b in range(1000):
        REAL_COUNT(keys, f"s{b // 10}", size, rows[b], names[b])
    started = time.process_time()
    for b in range(1000):
        url = {"again": "s", "copies": "copy", "first": "t", "hashed": "t"}[second] + str(b // 10)
        REAL_COUNT(keys, url, size, rows[b], names[b + 1000 if url[0] == "t" else b])
    return (time.process_time() - started) / (block * 1000) * 1e9


def timed(keys: DuplicateKeys, inside: list[float], *args) -> int:
    started = time.process_time()
    found = REAL_COUNT(keys, *args)
    inside[0] += time.process_time() - started
    return found


REAL_COUNT = DuplicateKeys.count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        urls = write_shards(Path(tmp))
        for mode in ("samples", "batches"):
            epoch_cpu(urls, mode, 0)  # warm: the index sidecar, the page cache
            with_, without, shares = [], [], []
            for r in range(args.rounds):  # ABBA: which goes first alternates
                for check in (False, True) if r % 2 == 0 else (True, False):
                    inside = [0.0]
                    DuplicateKeys.count = (functools.partialmethod(timed, inside) if check
                                           else lambda self, *args: 0)  # fmt: skip
                    (with_ if check else without).append(epoch_cpu(urls, mode, r))
                    if check:
                        shares.append(inside[0] / with_[-1])
            ratios = [w / o for w, o in zip(with_, without)]
            out[f"{mode}_with_over_without"] = round(min(with_) / min(without), 3)
            out[f"{mode}_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
            out[f"{mode}_count_share"] = round(min(shares), 4)
            per_sample = min(without) / (SHARDS * PER_SHARD)
            out[f"{mode}_us_per_sample_without"] = round(per_sample * 1e6, 2)
    cases = ("first", "again", "copies", "hashed")
    out["count_ns_per_key"] = {case: round(count_ns(case), 1) for case in cases}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
