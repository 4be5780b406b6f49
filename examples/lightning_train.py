"""The main job (``examples/train_minimal.py``'s model and data) trained with Lightning.

    python examples/lightning_train.py --devices 2                 # DDP, 2 CPU processes
    python examples/lightning_train.py --devices 2 --resume auto   # continue RUN_DIR/last.ckpt

Design. A ``LightningDataModule`` builds the streaming dataset in ``setup`` (after Lightning
started the process group, so each rank gets its own share) and returns nnh's loader as is:
``streaming_loader`` (a ``StatefulDataLoader``, so Lightning's checkpoints hold its position
and a run restarted mid-epoch gets exactly the rest of the epoch), or with ``--loader cached``
the map-style rank-cached loader, which splits the data itself: the trainer must then not add
its own ``DistributedSampler`` (``use_distributed_sampler=False``; with it, nnh stops at the
first batch with the fix). Lightning never calls ``set_epoch`` on an iterable dataset, so a
``Callback`` does, and runs an ``EpochAudit``: at each epoch's end every rank checks, in one
collective, that the ranks trained on every sample of the epoch exactly once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

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
    p.add_argument("--devices", type=int, default=2, help="CPU processes (DDP when > 1)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="per process and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data-dir", default="data/shapes")
    p.add_argument("--run-dir", default="runs/lightning_train")
    p.add_argument("--train-samples", type=int, default=2048)
    p.add_argument("--num-workers", type=int, default=1, help="DataLoader workers per process")
    p.add_argument("--loader", choices=["streaming", "cached"], default="streaming")
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps")
    p.add_argument("--save-every", type=int, default=0, help="steps between last.ckpt saves")
    p.add_argument("--resume", default=None, help="a checkpoint, or 'auto': RUN_DIR/last.ckpt")
    p.add_argument("--record-ids", default=None, help="a folder: each rank writes its ids")
    return p.parse_args(argv)


class ShapesData(L.LightningDataModule):
    """The synthetic shapes of the main job, streamed from tar shards."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.train_dir = os.path.join(args.data_dir, "train")

    def prepare_data(self) -> None:  # one process per node, before setup
        tm.write_split(self.train_dir, 0, self.args.train_samples)

    def setup(self, stage: str) -> None:  # every process, after the process group starts
        self.train_set = ShardedStreamingDataset(
            f"{self.train_dir}/shard-*.tar", seed=tm.SEED, aug_config=get_preset("moderate"),
            decode=tm.decode,
        )  # fmt: skip

    def train_dataloader(self):
        a = self.args
        if a.loader == "cached":  # map-style: this rank's share read once, served from memory
            kwargs = {"batch_size": a.batch_size, "num_workers": a.num_workers}
            return create_rank_cached_dataloader(self.train_set, kwargs, "cpu", log_fn=len)[0]
        return streaming_loader(self.train_set, a.batch_size, num_workers=a.num_workers)


class ExactlyOnce(L.Callback):
    """Sets the dataset's epoch and audits every epoch: ``ExactlyOnceError`` on every rank
    when a sample was missed or repeated."""

    def __init__(self, record_ids: str | None = None) -> None:
        self.record_ids = record_ids

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        loader = trainer.train_dataloader
        self.audit = EpochAudit(loader)
        if hasattr(loader, "state_dict"):  # where a restarted run resumes (or the epoch start)
            self.audit.resume(loader.state_dict())
        self.ids: list[int] = []

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        trainer.datamodule.train_set.set_epoch(trainer.current_epoch)
        for sampler in (getattr(trainer.train_dataloader, "sampler", None),):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(trainer.current_epoch)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.audit.update(batch)
        self.ids += batch["__index__"][~batch["__pad__"]].tolist()
        self.epoch = trainer.current_epoch

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return  # stopped inside the epoch (max_steps): the rest comes after a restart
        report = self.audit.verify()
        if trainer.is_global_zero:
            print(report, flush=True)
        self._record(trainer)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.ids:  # the part of an epoch trained before a stop
            self._record(trainer)

    def _record(self, trainer: L.Trainer) -> None:
        """Append this rank's ids of the epoch (or of its part) to RECORD_IDS/rank<r>.jsonl:
        a record of what was trained on, apart from the audit."""
        if self.record_ids:
            os.makedirs(self.record_ids, exist_ok=True)
            path = os.path.join(self.record_ids, f"rank{trainer.global_rank}.jsonl")
            with open(path, "a") as fh:
                fh.write(json.dumps({"epoch": self.epoch, "ids": self.ids,
                                     "step": trainer.global_step}) + "\n")  # fmt: skip
        self.ids = []


class LitNet(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net, self.lr = tm.Net(), lr

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = tm.loss_fn(self.net(batch), batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def resume_path(resume: str | None, run_dir: str) -> str | None:
    if resume != "auto":
        return resume
    last = os.path.join(run_dir, "last.ckpt")
    return last if os.path.exists(last) else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    L.seed_everything(tm.SEED, verbose=False)  # the same initial weights on every rank
    checkpoint = ModelCheckpoint(args.run_dir, save_last=True, save_top_k=0,
                                 every_n_train_steps=args.save_every or None)  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs, max_steps=args.max_steps, callbacks=[ExactlyOnce(args.record_ids),
        checkpoint], use_distributed_sampler=args.loader != "cached", logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=args.run_dir,
    )  # fmt: skip
    trainer.fit(LitNet(args.lr), ShapesData(args), ckpt_path=resume_path(args.resume, args.run_dir))
    if trainer.is_global_zero:
        torch.save(trainer.lightning_module.net.state_dict(), os.path.join(args.run_dir, "net.pt"))
        print(f"trained {trainer.global_step} steps on {trainer.world_size} process(es)")


if __name__ == "__main__":
    main()
