"""The cost of ``EpochAudit`` against a training step.

Two figures, one process on the CPU:

- ``audit_over_step``: ``examples/train_minimal.py``'s step (its CNN, AdamW, 32x32 images,
  batch 64) against the audit's work for the same batches: ``update`` of every batch of an
  epoch of 4,096 samples plus the epoch's ``verify`` (its plan computed from the shard index),
  spread over the steps. Both take the same decoded batches from memory.
- ``ns_per_sample``: the audit's work per sample on a large epoch, 1M samples in 1,000 shards
  (an index in memory: the plan reads no shard) in batches of 256: ``update`` of every batch,
  then ``verify``. Divide by a step's time per sample to get the share for any model.

Each figure is the best of ``REPEATS`` rounds. Prints one JSON object.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from nnh_data import ShardedStreamingDataset, ShardIndex, ShardInfo
from nnh_data.audit.epoch_audit import EpochAudit

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_minimal.py"
SAMPLES, BATCH, REPEATS = 4096, 64, 5
LARGE, LARGE_BATCH, LARGE_SHARDS = 1_000_000, 256, 1_000


def load_script():
    spec = importlib.util.spec_from_file_location("train_minimal", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step_seconds(tm, batches: list[dict]) -> float:
    """Best time per step of ``train_minimal``'s model and optimizer over ``batches``."""
    torch.manual_seed(0)
    model = tm.Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for batch in batches:
            optimizer.zero_grad()
            tm.loss_fn(model(batch), batch).backward()
            optimizer.step()
        best = min(best, (time.perf_counter() - start) / len(batches))
    return best


def audit_seconds(dataset: ShardedStreamingDataset, batches: list[dict]) -> float:
    """Best time of ``update`` over ``batches`` plus one ``verify``."""
    audit = EpochAudit(dataset)
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for batch in batches:
            audit.update(batch)
        audit.verify()
        best = min(best, time.perf_counter() - start)
    return best


def large_epoch() -> tuple[ShardedStreamingDataset, list[dict]]:
    """A dataset of ``LARGE`` samples (an index in memory) and its epoch's id batches."""
    size = LARGE // LARGE_SHARDS
    index = ShardIndex(tuple(ShardInfo(f"/none/{i:06d}.tar", "tar", size)
                             for i in range(LARGE_SHARDS)))  # fmt: skip
    dataset = ShardedStreamingDataset(index, seed=0)
    ids = np.concatenate([labels["__index__"] for labels in dataset.planned_labels()])
    ids = np.random.default_rng(0).permutation(ids)  # the loader's order does not matter
    chunks = np.array_split(ids, LARGE // LARGE_BATCH)
    return dataset, [{"__index__": torch.from_numpy(c), "__pad__": torch.zeros(len(c), dtype=bool)}
                     for c in chunks]  # fmt: skip


def main() -> None:
    tm = load_script()
    with tempfile.TemporaryDirectory() as folder:
        args = tm.parse_args(["--data-dir", folder, "--batch-size", str(BATCH),
                              "--train-samples", str(SAMPLES), "--val-samples", "64"])  # fmt: skip
        train_dir, val_dir = tm.prepare_data(args, 0)
        loader, _ = tm.make_loaders(args, train_dir, val_dir)
        batches = list(loader)
        step = step_seconds(tm, batches)
        audit = audit_seconds(loader.dataset, batches) / len(batches)
    dataset, large = large_epoch()
    per_sample = audit_seconds(dataset, large) / LARGE
    print(json.dumps({
        "batch_size": BATCH, "torch_threads": torch.get_num_threads(),
        "step_ms": round(step * 1e3, 2), "audit_us_per_step": round(audit * 1e6, 1),
        "audit_over_step": round(audit / step, 5),
        "large_epoch": LARGE, "large_batch": LARGE_BATCH,
        "ns_per_sample": round(per_sample * 1e9, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
