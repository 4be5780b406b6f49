"""Started by tests/nnh_train/test_handler_preempt.py, one process per rank (by the test with
torchrun's variables, or by torchrun, nnh-torchrun or srun): train a small MLP with dropout for 3
epochs, checkpointing into FOLDER (``last.pt``, also the preemption save), and save the end state
to ``FOLDER/final.pt``.

    python handler_job.py FOLDER [--resume PATH] [--every N] [--slow SECONDS] [--requeue]
                                 [--workers N]

``--slow`` sleeps after each step and writes the step count to ``FOLDER/progress-RANK``, so that
the test can signal or kill a rank mid-epoch. ``--workers`` DataLoader workers (persistent).
The process ends through the interpreter's own exit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from nnh_train.callbacks import Callback, ModelCheckpoint  # noqa: E402
from nnh_train.handler import NNHandler  # noqa: E402
from tests.support import Net, data  # noqa: E402


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
    parser.add_argument("--resume")
    parser.add_argument("--every", type=int)
    parser.add_argument("--slow", type=float)
    parser.add_argument("--requeue", action="store_true")
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(0)
    handler = NNHandler(Net, device="cpu")
    torch.manual_seed(100 + handler.rank)  # each rank its own dropout masks
    handler.log_fn = lambda line: None
    handler.set_optimizer(torch.optim.Adam, lr=0.01)
    handler.set_loss_fn(nn.functional.mse_loss)
    handler.set_train_loader(data(96), batch_size=4, num_workers=args.workers)  # 12 steps/epoch
    handler.add_callback(ModelCheckpoint(args.folder, every_n_steps=args.every))
    if args.slow:
        handler.add_callback(Progress(args.folder, args.slow))
    handler.train(3, resume=args.resume, requeue=args.requeue)
    handler.save(os.path.join(args.folder, "final.pt"))


if __name__ == "__main__":
    main()
