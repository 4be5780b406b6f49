"""A training script's end, as users write it: one full epoch through an nnh loader with
persistent workers, the loader still held (a module's global, a trainer's attribute), then the
interpreter exits, and ``multiprocessing`` terminates the workers left. ``ctrl-c`` loops until
SIGINT, catches the KeyboardInterrupt and exits cleanly. A clean exit prints nothing on stderr.

    python tests/scripts/exit_after_epoch.py streaming|distributed|ctrl-c DATA_DIR
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from nnh_data import ShardedStreamingDataset, create_distributed_loader, streaming_loader
from tests.support import numbered_samples, write_tar


def shards(folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    urls = []
    for i in range(4):
        path = folder / f"s-{i:06d}.tar"
        if not path.exists():
            write_tar(path, numbered_samples(i * 50, 50, 64), pax=False)
        urls.append(str(path))
    return urls


def main(kind: str, folder: Path) -> Iterable:
    """The loader, after its epoch (held by the caller until the interpreter exits)."""
    if kind == "distributed":
        data = TensorDataset(torch.arange(200.0))
        loader, _ = create_distributed_loader(data, {"batch_size": 8, "num_workers": 2}, "cpu",
                                              log_fn=lambda line: None)  # fmt: skip
        print("batches", sum(1 for _ in loader))
        return loader
    ds = ShardedStreamingDataset(shards(folder), seed=0)
    loader = streaming_loader(ds, 8, num_workers=2)
    if kind == "streaming":
        ds.set_epoch(0)
        print("batches", sum(1 for _ in loader))
        return loader
    try:
        for epoch in range(1000):
            ds.set_epoch(epoch)
            for _ in loader:
                print("batch", flush=True)
                time.sleep(0.05)
    except KeyboardInterrupt:
        print("stopped", flush=True)
    return loader


if __name__ == "__main__":
    LOADER = main(sys.argv[1], Path(sys.argv[2]))
