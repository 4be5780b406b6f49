"""What the modules' docstring examples may assume, as MosaicML Streaming's doctests have a
fixtures file: the public names of both packages, the usual imports, and a few local files.

:func:`doctest_globals` writes, in the folder the examples run in (a fresh temporary one per
module, see ``tests/test_doctests.py``), ten tar shards ``data/train-000000.tar`` ...
``data/train-000009.tar`` of 8 samples each (``__key__`` ``"000000"``, ``"000001"``, ... in
shard order; fields ``txt`` and ``cls``) with their index, and returns the globals the examples
read: ``index`` (the first four shards' index), ``ds`` (a ``ShardedStreamingDataset`` over the
ten), ``loader`` (``streaming_loader(ds, 4)``, no workers), ``seed_fn`` (a ``worker_init_fn``),
``np``, ``torch``, ``nn``, ``DataLoader``, ``TensorDataset`` and every name of ``nnh_data`` and
``nnh_train``. A module's own names win over these (the examples of
``nnh_data.loaders.distributed`` see its own ``create_distributed_loader``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nnh_data
import nnh_train

SHARDS = 10
SAMPLES_PER_SHARD = 8
PATTERN = "data/train-{000000..000009}.tar"


def write_data(folder: Path) -> None:
    """The ten shards under ``folder / "data"``, with their index sidecar."""
    samples = ({"__key__": f"{i:06d}", "txt": f"sample {i}", "cls": i % 4}
               for i in range(SHARDS * SAMPLES_PER_SHARD))  # fmt: skip
    nnh_data.write_shards(samples, str(folder / "data" / "train-%06d.tar"),
                          max_count=SAMPLES_PER_SHARD)  # fmt: skip


def seed_fn(worker_id: int) -> None:
    """A user's ``worker_init_fn``."""
    np.random.seed(worker_id)


def doctest_globals(folder: Path) -> dict[str, Any]:
    """The examples' globals, the files they read written under ``folder`` (the working
    folder the examples run in: their paths are relative)."""
    write_data(folder)
    names = {name: getattr(nnh_data, name) for name in nnh_data.__all__}
    names.update({name: getattr(nnh_train, name) for name in nnh_train.__all__
                  if name not in names})  # fmt: skip
    ds = nnh_data.ShardedStreamingDataset(str(folder / PATTERN), seed=0)
    return {
        **names,
        "np": np, "torch": torch, "nn": nn, "DataLoader": DataLoader,
        "TensorDataset": TensorDataset, "seed_fn": seed_fn,
        "index": nnh_data.build_shard_index(str(folder / "data/train-{000000..000003}.tar")),
        "ds": ds, "loader": nnh_data.streaming_loader(ds, 4),
    }  # fmt: skip
