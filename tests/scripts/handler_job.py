"""Started by tests/nnh_train/test_handler_preempt.py, one process per rank (torchrun's
variables set): train a small MLP with dropout for 3 epochs, checkpointing into FOLDER
(``last.pt``, also the preemption save), and save the end state to ``FOLDER/final.pt``.

    python handler_job.py FOLDER [--resume PATH] [--every N] [--slow SECONDS] [--requeue]

``--slow`` sleeps after each step and writes the step count to ``FOLDER/progress-RANK``, so that
the test can signal or kill a rank mid-epoch.
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
    args = parser.parse_args()
    torch.manual_seed(0)
    handler = NNHandler(Net, device="cpu")
    torch.manual_seed(100 + handler.rank)  # each rank its own dropout masks
    handler.log_fn = lambda line: None
    handler.set_optimizer(torch.optim.Adam, lr=0.01)
    handler.set_loss_fn(nn.functional.mse_loss)
    handler.set_train_loader(data(96), batch_size=4, num_workers=0)  # 12 steps per epoch
    handler.add_callback(ModelCheckpoint(args.folder, every_n_steps=args.every))
    if args.slow:
        handler.add_callback(Progress(args.folder, args.slow))
    handler.train(3, resume=args.resume, requeue=args.requeue)
    handler.save(os.path.join(args.folder, "final.pt"))
    # No interpreter shutdown right after a gloo collective: gloo's worker thread may still
    # release a tensor then, and Python stops it mid-release, which aborts the process.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
