"""Started by tests/nnh_train/test_global_steps.py, one process per rank (by nnh-torchrun, or by
the test with torchrun's variables): train a float64 linear model on a stream of global batches
(``global_batch_size=16``) for 3 epochs, checkpointing into FOLDER (``last.pt``, also the
preemption save), and save the end state to ``FOLDER/final.pt``.

    python global_steps_job.py FOLDER SHARDS [--resume PATH] [--slow SECONDS] [--workers N]

``SHARDS`` is a glob of tar shards of numbered samples (``tests/conftest.py``'s ``tar_shards``).
``--slow`` sleeps after each step and writes the step count to ``FOLDER/progress-RANK``, so that
the test can signal a rank mid-epoch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from nnh_data import ShardedStreamingDataset  # noqa: E402
from nnh_train.callbacks import Callback, ModelCheckpoint  # noqa: E402
from nnh_train.handler import NNHandler  # noqa: E402
from tests.nnh_train.test_global_steps import GLOBAL, Regression, features, squared  # noqa: E402


class Progress(Callback):
    def __init__(self, folder: str, seconds: float) -> None:
        self.folder, self.seconds = folder, seconds

    def on_batch_end(self, handler: NNHandler) -> None:
        time.sleep(self.seconds)
        with open(os.path.join(self.folder, f"progress-{handler.rank}"), "w") as fh:
            fh.write(str(handler.step))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("shards")
    parser.add_argument("--resume")
    parser.add_argument("--slow", type=float)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(0)
    handler = NNHandler(Regression(torch.float64), device="cpu")
    handler.log_fn = lambda line: None
    handler.set_optimizer(torch.optim.SGD, lr=0.05)
    handler.set_loss_fn(squared)
    dataset = ShardedStreamingDataset(args.shards, decode=features, **GLOBAL)
    handler.set_train_loader(dataset, batch_size=2, num_workers=args.workers)
    handler.add_callback(ModelCheckpoint(args.folder))
    if args.slow:
        handler.add_callback(Progress(args.folder, args.slow))
    handler.train(3, resume=args.resume)
    handler.save(os.path.join(args.folder, "final.pt"))


if __name__ == "__main__":
    main()
