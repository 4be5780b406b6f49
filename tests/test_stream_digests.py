"""Full streams pinned by digest: a refactor changes nothing a user sees.

Each case streams whole epochs (tar, Parquet, a mix of two sources, batch mode; 1 and 3 ranks;
0 and 2 DataLoader workers), takes a resume state mid-epoch and streams the rest from it. The
sample ids, keys, order, pad flags, sources, augmentation parameters and the resume states are
hashed and compared with ``tests/data/stream_digests.json``, recorded before the layout move.
Run with ``NNH_WRITE_DIGESTS=1`` to record them again (only when a change of the stream is meant).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nnh_data import PackedField, ShardedStreamingDataset, Source, get_preset, streaming_loader
from tests.support import numbered_samples, write_tar

pytestmark = pytest.mark.timeout(300)

GOLDEN = Path(__file__).parent / "data" / "stream_digests.json"
TAR_COUNTS = (13, 0, 29, 7, 21)
PARQUET_COUNTS = (17, 11, 25)
CASES = [
    (kind, world, workers)
    for kind in ("tar", "parquet", "mixed", "batches")
    for world in (1, 3)
    for workers in (0, 2)
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, list[str]]:
    root = tmp_path_factory.mktemp("digests")
    tars, first = [], 0
    for i, count in enumerate(TAR_COUNTS):
        path = root / f"shard-{i:06d}.tar"
        write_tar(path, numbered_samples(first, count, 24), pax=False)
        tars.append(str(path))
        first += count
    parquets, first = [], 0
    for i, count in enumerate(PARQUET_COUNTS):
        ids = list(range(first, first + count))
        table = pa.table({"id": pa.array(ids, pa.int64()), "text": [f"row {g}" for g in ids]})
        path = root / f"part-{i:06d}.parquet"
        pq.write_table(table, path, row_group_size=4)
        parquets.append(str(path))
        first += count
    return {"tar": tars, "parquet": parquets}


def _dataset(kind: str, data: dict, rank: int, world: int) -> ShardedStreamingDataset:
    common = {"seed": 7, "rank": rank, "world_size": world, "aug_config": get_preset("moderate"),
              "shuffle_window": 8}  # fmt: skip
    if kind == "mixed":
        tars = data["tar"]
        sources = [Source(tars[:3], name="a", weight=2.0), Source(tars[3:], name="b", weight=1.0)]
        return ShardedStreamingDataset(sources, epoch_size=90, **common)
    if kind == "batches":
        return ShardedStreamingDataset(data["tar"], batch_size=4, **common)
    return ShardedStreamingDataset(data[kind], **common)


def _plain(value: Any) -> Any:
    """A batch value as JSON: tensors and arrays as lists, packed fields as their values."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        value = value.tolist()
    if isinstance(value, PackedField):
        value = value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, float):
        return round(value, 6)
    return value


def _rows(batch: dict) -> list[dict]:
    """The samples of a collated batch, without their shard path (it names a temporary folder)."""
    batch = {k: v for k, v in batch.items() if k != "__shard__"}
    plain = _plain(batch)
    n = len(plain["__index__"])
    return [{k: {a: col[i] for a, col in v.items()} if k == "__aug__" else v[i]
             for k, v in plain.items()} for i in range(n)]  # fmt: skip


def _stream(kind: str, data: dict, world: int, workers: int) -> dict[str, str]:
    """Digests of each rank's epochs 0 and 1, and of epoch 1 resumed from a state taken after
    two batches (with the state itself)."""
    out = {}
    for rank in range(world):
        ds = _dataset(kind, data, rank, world)
        loader = streaming_loader(ds, batch_size=4, num_workers=workers)
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            rows = [r for batch in loader for r in _rows(batch)]
            out[f"rank{rank}/epoch{epoch}"] = _digest(rows)
        ds = _dataset(kind, data, rank, world)
        ds.set_epoch(1)
        loader = streaming_loader(ds, batch_size=4, num_workers=workers)
        it = iter(loader)
        head = [r for _ in range(2) for r in _rows(next(it))]
        state = loader.state_dict()
        del it
        again = _dataset(kind, data, rank, world)
        again.set_epoch(1)
        resumed = streaming_loader(again, batch_size=4, num_workers=workers)
        resumed.load_state_dict(state)
        rest = [r for batch in resumed for r in _rows(batch)]
        out[f"rank{rank}/resumed"] = _digest(head + rest)
        out[f"rank{rank}/state"] = _digest(_state_fields(state))
    return out


def _state_fields(state: dict) -> Any:
    """The dataset states inside a loader state (the loader's own bookkeeping varies by run)."""
    found = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "epoch" in node and "shards" in node:
                found.append(_plain(node))
                return
            for key in sorted(node, key=str):
                walk(node[key])
        elif isinstance(node, (list, tuple)):
            for item in node:
                walk(item)

    walk(state)
    assert found, f"no dataset state in {state}"
    return found


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:20]


@pytest.mark.parametrize(("kind", "world", "workers"), CASES)
def test_stream_digest_is_unchanged(data, kind, world, workers):
    got = _stream(kind, data, world, workers)
    name = f"{kind}/world{world}/workers{workers}"
    if os.environ.get("NNH_WRITE_DIGESTS"):
        golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        golden[name] = got
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        return
    assert got == json.loads(GOLDEN.read_text())[name]
