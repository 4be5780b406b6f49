"""The main job (``examples/train_minimal.py``'s model and data) trained with Accelerate.

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --cpu
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --cpu --resume auto

(``--multi_gpu`` starts the processes through torchrun; ``--cpu`` keeps them on the CPU.)

Design. What to prepare and what not: ``accelerator.prepare()`` takes the model and the
optimizer, never nnh's loaders. They give each rank its own share of the epoch already, and
``prepare()`` would split them again (``IterableDatasetShard`` keeps 1/N of each rank's share;
the dispatcher, Accelerate's default for an iterable dataset, reads rank 0's share only): nnh
stops either at once with the fix. Each rank iterates its own loader and moves the batches to
``accelerator.device``. The streaming loader is a ``StatefulDataLoader`` (what Accelerate's
``use_stateful_dataloader`` makes of a prepared loader), registered for checkpointing with
the training progress, so ``save_state``/``load_state`` continue a run stopped mid-epoch with
exactly the rest of the epoch. An ``EpochAudit`` checks at each epoch's end, in one collective,
that the ranks trained on every sample of the epoch exactly once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_minimal as tm  # noqa: E402  (the main job's data and model)

from nnh_data import (  # noqa: E402
    EpochAudit,
    ShardedStreamingDataset,
    create_rank_cached_dataloader,
    get_preset,
    streaming_loader,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="per process and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data-dir", default="data/shapes")
    p.add_argument("--run-dir", default="runs/accelerate_train")
    p.add_argument("--train-samples", type=int, default=2048)
    p.add_argument("--num-workers", type=int, default=1, help="DataLoader workers per process")
    p.add_argument("--loader", choices=["streaming", "cached"], default="streaming")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--resume", default=None, help="a save_state folder, or 'auto': RUN_DIR/last")
    p.add_argument("--record-ids", default=None, help="a folder: each rank writes its ids")
    return p.parse_args(argv)


class Progress:
    """The epoch and step reached, saved and restored with the rest by ``save_state``."""

    def __init__(self) -> None:
        self.epoch = self.step = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = state["epoch"], state["step"]


def make_loader(args: argparse.Namespace, dataset: ShardedStreamingDataset, device):
    """nnh's loader of this rank's share, not prepared: streaming, or map-style rank-cached."""
    if args.loader == "cached":
        kwargs = {"batch_size": args.batch_size, "num_workers": args.num_workers}
        return create_rank_cached_dataloader(dataset, kwargs, device, log_fn=len)[0]
    return streaming_loader(dataset, args.batch_size, num_workers=args.num_workers)


def record(args: argparse.Namespace, rank: int, epoch: int, ids: list[int], step: int) -> None:
    """Append this rank's ids of an epoch (or of its part) to RECORD_IDS/rank<r>.jsonl."""
    if args.record_ids:
        os.makedirs(args.record_ids, exist_ok=True)
        with open(os.path.join(args.record_ids, f"rank{rank}.jsonl"), "a") as fh:
            fh.write(json.dumps({"epoch": epoch, "ids": ids, "step": step}) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    accelerator = Accelerator(cpu=args.cpu)
    torch.manual_seed(tm.SEED)  # the same initial weights on every rank and in every run
    train_dir = os.path.join(args.data_dir, "train")
    if accelerator.is_main_process:
        tm.write_split(train_dir, 0, args.train_samples)
    accelerator.wait_for_everyone()
    dataset = ShardedStreamingDataset(f"{train_dir}/shard-*.tar", seed=tm.SEED,
                                      aug_config=get_preset("moderate"), decode=tm.decode)
    loader = make_loader(args, dataset, accelerator.device)
    model = tm.Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)  # not the loader
    progress = Progress()
    stateful = hasattr(loader, "state_dict")
    accelerator.register_for_checkpointing(progress, *([loader] if stateful else []))
    audit = EpochAudit(loader)
    last = os.path.join(args.run_dir, "last")
    resume = last if args.resume == "auto" and os.path.isdir(last) else args.resume
    if resume not in (None, "auto"):
        accelerator.load_state(resume)
        if stateful:
            audit.resume(loader.state_dict())  # the rest of the epoch is what is planned
    stopped = False
    while progress.epoch < args.epochs and not stopped:
        dataset.set_epoch(progress.epoch)
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(progress.epoch)
        ids = []
        model.train()
        for batch in loader:
            batch = send_to_device(batch, accelerator.device)
            audit.update(batch)
            ids += batch["__index__"][~batch["__pad__"]].tolist()
            loss = tm.loss_fn(model(batch), batch)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            progress.step += 1
            if progress.step == args.max_steps:
                stopped = True
                break
        if not stopped:
            report = audit.verify()  # ExactlyOnceError on every rank on a mismatch
            accelerator.print(report)
        record(args, accelerator.process_index, progress.epoch, ids, progress.step)
        progress.epoch += not stopped
    accelerator.save_state(last)
    if accelerator.is_main_process:
        net = accelerator.unwrap_model(model).state_dict()
        torch.save(net, os.path.join(args.run_dir, "net.pt"))
        print(f"trained {progress.step} steps on {accelerator.num_processes} process(es)")
    accelerator.end_training()


if __name__ == "__main__":
    main()
