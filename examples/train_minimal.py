"""Train a small CNN on sharded streaming images: the same script under python, torchrun and srun.

    python examples/train_minimal.py                                   # one process
    torchrun --standalone --nproc_per_node=2 examples/train_minimal.py # DDP on one machine
    srun -n 2 python examples/train_minimal.py                         # DDP under Slurm

Design. Rank 0 writes a synthetic data set once (``write_shards``: 32x32 RGB raw uint8 images of
a coloured square on a noisy background, the class is the square's colour; a train and a
validation split) and every rank waits for it. Each rank streams its share of the shards
(``ShardedStreamingDataset`` through ``streaming_loader``), decodes bytes to tensors in the
DataLoader workers, and applies each sample's deterministic ``__aug__`` parameters with
``AugmentModule`` on the training device, inside the model's forward (training mode only), so
the augmentation is the same whatever the rank count, worker count or resume point.
``NNHandler`` trains, keeps ranks in step, checkpoints (``last.pt`` every ``--save-every`` steps
and every epoch, ``best.pt`` on the best validation accuracy) and, on SIGUSR1/SIGTERM, saves and
exits with code 75 so that Slurm can requeue the job; ``--resume auto`` continues from
``last.pt`` exactly. Validation accuracy is computed over every validation sample once
(``gather_for_metrics`` drops the repeats that make ranks equal).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nnh_data import (
    AugmentModule,
    ShardedStreamingDataset,
    gather_for_metrics,
    get_preset,
    streaming_loader,
    write_shards,
)
from nnh_train import CSVLogger, ModelCheckpoint, NNHandler

SIZE, CLASSES, SEED = 32, 4, 0
COLOURS = np.array([[220, 40, 40], [40, 200, 40], [50, 60, 230], [230, 210, 40]], np.uint8)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (every flag has a default that trains in about a minute on a CPU)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="per process and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data-dir", default="data/shapes")
    p.add_argument("--run-dir", default="runs/train_minimal")
    p.add_argument("--train-samples", type=int, default=2048)
    p.add_argument("--val-samples", type=int, default=512)
    p.add_argument("--num-workers", type=int, default=1, help="DataLoader workers per process")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", default=None, help="default: this rank's GPU, else the CPU")
    p.add_argument("--resume", default=None, help="a checkpoint, or 'auto': RUN_DIR/last.pt if any")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--save-every", type=int, default=20, help="steps between last.pt saves")
    p.add_argument("--precomputed", default=None, help="an nnh-precompute table of parameters")
    p.add_argument("--requeue", action="store_true", help="scontrol requeue after a preemption")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data


def synthetic_sample(index: int) -> dict:
    """Sample ``index`` of the synthetic set: a square of the class colour on noise."""
    rng = np.random.default_rng([SEED, index])
    label = index % CLASSES
    image = rng.integers(0, 90, (SIZE, SIZE, 3), dtype=np.uint8)
    side = int(rng.integers(8, 17))
    top, left = rng.integers(0, SIZE - side + 1, 2)
    jitter = rng.integers(-25, 26, 3)
    colour = np.clip(COLOURS[label].astype(int) + jitter, 0, 255).astype(np.uint8)
    image[top : top + side, left : left + side] = colour
    chw = np.ascontiguousarray(image.transpose(2, 0, 1))
    return {"__key__": f"{index:08d}", "rgb": chw.tobytes(), "cls": label}


def write_split(folder: str, first: int, count: int) -> None:
    """Write ``count`` samples from id ``first`` as shards of 256 in ``folder`` (kept if there)."""
    if os.path.exists(os.path.join(folder, "nnh-index.json")):
        return
    os.makedirs(folder, exist_ok=True)
    samples = (synthetic_sample(i) for i in range(first, first + count))
    write_shards(samples, os.path.join(folder, "shard-%06d.tar"), max_count=256)


def prepare_data(args: argparse.Namespace, rank: int) -> tuple[str, str]:
    """Rank 0 writes both splits (once); every rank waits for them. Returns their folders."""
    train, val = os.path.join(args.data_dir, "train"), os.path.join(args.data_dir, "val")
    if rank == 0:
        write_split(train, 0, args.train_samples)
        write_split(val, args.train_samples, args.val_samples)
    if dist.is_initialized():
        dist.barrier()
    return train, val


def decode(sample: dict) -> dict:
    """Bytes to tensors, in the DataLoader workers: ``image`` (3, 32, 32) uint8 and ``label``."""
    image = torch.frombuffer(bytearray(sample["rgb"]), dtype=torch.uint8).view(3, SIZE, SIZE)
    return {"image": image, "label": int(sample["cls"]), "__index__": sample["__index__"],
            "__pad__": sample["__pad__"], "__aug__": sample["__aug__"]}  # fmt: skip


def make_loaders(args: argparse.Namespace, train_dir: str, val_dir: str) -> tuple:
    """Streaming loaders of this rank's share: shuffled and augmented, and in order."""
    train = ShardedStreamingDataset(
        f"{train_dir}/shard-*.tar", seed=SEED, aug_config=get_preset("moderate"),
        decode=decode, precomputed=args.precomputed,
    )  # fmt: skip
    val = ShardedStreamingDataset(f"{val_dir}/shard-*.tar", shuffle=False, decode=decode)
    return (streaming_loader(train, args.batch_size, num_workers=args.num_workers),
            streaming_loader(val, 4 * args.batch_size, num_workers=args.num_workers))  # fmt: skip


# ----------------------------------------------------------------------------- model


class Net(nn.Module):
    """A small CNN over the batch dict; augments ``image`` with ``__aug__`` when training."""

    def __init__(self, classes: int = CLASSES, width: int = 16) -> None:
        super().__init__()
        self.augment = AugmentModule(padding_mode="border")
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )  # fmt: skip
        self.head = nn.Linear(2 * width, classes)

    def forward(self, batch: dict) -> torch.Tensor:
        images = batch["image"]
        if self.training:
            images = self.augment(images, batch["__aug__"])
        x = images.float() / 127.5 - 1.0
        return self.head(self.features(x).flatten(1))


def loss_fn(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(logits.float(), batch["label"])


def accuracy(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    return (logits.argmax(1) == batch["label"]).float().mean()


@torch.no_grad()
def exact_accuracy(handler: NNHandler, loader) -> tuple[float, int]:
    """Accuracy over every validation sample once (pads dropped, ranks gathered)."""
    handler.module.eval()
    hits, ids = [], []
    for batch in loader:
        keep = ~batch["__pad__"]
        logits = handler.module({"image": batch["image"][keep].to(handler.device)})
        hits.append((logits.argmax(1).cpu() == batch["label"][keep]).float())
        ids.append(batch["__index__"][keep])
    values, _ = gather_for_metrics(torch.cat(hits), torch.cat(ids))
    return values.mean().item(), len(values)


# ----------------------------------------------------------------------------- main


def resume_path(resume: str | None, run_dir: str) -> str | None:
    """``--resume``: None, a path, or ``auto``: ``RUN_DIR/last.pt`` when it exists."""
    if resume != "auto":
        return resume
    last = os.path.join(run_dir, "last.pt")
    return last if os.path.exists(last) else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(SEED)  # the same initial weights on every rank and in every run
    handler = NNHandler(Net, device=args.device)  # starts DDP under torchrun / srun
    train_dir, val_dir = prepare_data(args, handler.rank)
    train_loader, val_loader = make_loaders(args, train_dir, val_dir)
    handler.set_optimizer(torch.optim.AdamW, lr=args.lr)
    handler.set_loss_fn(loss_fn)
    handler.add_metric("acc", accuracy)
    handler.set_train_loader(train_loader)
    handler.set_val_loader(val_loader)
    handler.add_callback(ModelCheckpoint(args.run_dir, monitor="val_acc", mode="max",
                                         every_n_steps=args.save_every))  # fmt: skip
    handler.add_callback(CSVLogger(os.path.join(args.run_dir, "metrics.csv")))
    resume = resume_path(args.resume, args.run_dir)
    if resume and handler.rank == 0:
        print(f"resuming from {resume}", flush=True)
    handler.train(args.epochs, precision=args.precision, max_steps=args.max_steps,
                  resume=resume, requeue=args.requeue)  # fmt: skip
    acc, count = exact_accuracy(handler, val_loader)
    handler.plot_losses(os.path.join(args.run_dir, "loss.png"))
    handler.plot_metrics(os.path.join(args.run_dir, "accuracy.png"))
    if handler.rank == 0:
        print(f"validation accuracy {acc:.4f} over {count} samples ({handler.world_size} "
              f"process(es), {handler.step} steps)\nrun folder {args.run_dir}: last.pt, best.pt, "
              "metrics.csv, loss.png, accuracy.png", flush=True)  # fmt: skip
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
