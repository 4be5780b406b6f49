"""End to end: training samples/s of ``examples/train_minimal.py``'s data path (tar shards,
streaming loader, decoding in a worker, ``AugmentModule`` in the forward, the ``NNHandler`` step)
against the same model and handler fed the same batches from in-memory tensors.

One process on the CPU, 4,096 32x32 images, batch 64; the first epoch of each is a warm-up and
the next ``EPOCHS`` are timed. Prints one JSON object.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from nnh_train import NNHandler

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_minimal.py"
SAMPLES, BATCH, EPOCHS = 4096, 64, 3


def load_script():
    spec = importlib.util.spec_from_file_location("train_minimal", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def samples_per_s(tm, loader) -> float:
    """Samples/s of ``EPOCHS`` epochs after one warm-up epoch, fed by ``loader``."""
    torch.manual_seed(0)
    handler = NNHandler(tm.Net, device="cpu", use_distributed=False)
    handler.log_fn = lambda line: None
    handler.set_optimizer(torch.optim.AdamW, lr=3e-3)
    handler.set_loss_fn(tm.loss_fn)
    handler.add_metric("acc", tm.accuracy)
    handler.set_train_loader(loader)
    handler.train(1)
    start = time.perf_counter()
    handler.train(1 + EPOCHS)
    return EPOCHS * SAMPLES / (time.perf_counter() - start)


def main() -> None:
    tm = load_script()
    with tempfile.TemporaryDirectory() as folder:
        args = tm.parse_args(["--data-dir", folder, "--batch-size", str(BATCH),
                              "--train-samples", str(SAMPLES), "--val-samples", "64"])  # fmt: skip
        train_dir, val_dir = tm.prepare_data(args, 0)
        loader, _ = tm.make_loaders(args, train_dir, val_dir)
        streamed = samples_per_s(tm, loader)
        batches = list(loader)  # the same decoded batches, held in memory
    in_memory = samples_per_s(tm, DataLoader(batches, batch_size=None))
    print(json.dumps({
        "samples": SAMPLES, "batch_size": BATCH, "timed_epochs": EPOCHS,
        "num_workers": args.num_workers, "torch_threads": torch.get_num_threads(),
        "streaming_samples_per_s": round(streamed), "in_memory_samples_per_s": round(in_memory),
        "streaming_over_in_memory": round(streamed / in_memory, 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
