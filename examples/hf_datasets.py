"""Train on a Hugging Face data set: ``to_parquet`` shards and a ``save_to_disk`` folder streamed
with ImageNet-style crops into NNHandler, the same script under python and torchrun.

    python examples/hf_datasets.py                                     # one process
    torchrun --standalone --nproc_per_node=2 examples/hf_datasets.py   # DDP on one machine (gloo)

Design. Rank 0 builds a small image data set with ``datasets`` once (40x40 JPEGs of a coloured
square on noise, as ``Image()`` values, and the square's colour as a ``ClassLabel``), from
Python values, offline, and writes it as a user of the Hub finds it: the training split as
``to_parquet`` shards (what the Hub serves), the validation split as a ``save_to_disk`` folder
of Arrow files; every rank waits for it. Each rank then streams its share with
``ShardedStreamingDataset``, the decoders chosen by column name (``{"image": "torchrgb8",
"label": "cls"}``): the training images are cut by each sample's random-resized crop and flip
(the ``imagenet`` preset) while they are decoded, in the DataLoader workers
(``SampleDecoder(..., crop_size=32)``, :func:`nnh_data.decode_crop`), so the augmentation is
the same whatever the rank count, worker count or resume point; the validation images are
decoded whole. ``NNHandler`` trains and keeps ranks in step; validation accuracy is computed
over every validation sample once (``gather_for_metrics`` drops the repeats that make ranks
equal). Needs ``pip install datasets`` (the ``dev`` extra has it).
"""

from __future__ import annotations

import argparse
import io
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch import nn

from nnh_data import (
    SampleDecoder,
    ShardedStreamingDataset,
    gather_for_metrics,
    get_preset,
    streaming_loader,
)
from nnh_train import NNHandler

SIDE, CROP, SEED = 40, 32, 0
CLASSES = ["red", "green", "blue", "yellow"]
COLOURS = np.array([[220, 40, 40], [40, 200, 40], [50, 60, 230], [230, 210, 40]], np.uint8)
DECODE = {"image": "torchrgb8", "label": "cls"}  # HF's column names carry no extension


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (every flag has a default that trains in about a minute on a CPU)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per process and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data-dir", default="data/hf_shapes")
    p.add_argument("--train-samples", type=int, default=1024)
    p.add_argument("--val-samples", type=int, default=256)
    p.add_argument("--num-workers", type=int, default=1, help="DataLoader workers per process")
    p.add_argument("--device", default=None, help="default: this rank's GPU, else the CPU")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data


def jpeg_of(index: int) -> tuple[bytes, int]:
    """Sample ``index``: a JPEG of a square of its class colour on noise, and the class."""
    rng = np.random.default_rng([SEED, index])
    label = index % len(CLASSES)
    image = rng.integers(0, 90, (SIDE, SIDE, 3), dtype=np.uint8)
    side = int(rng.integers(14, 25))
    top, left = rng.integers(0, SIDE - side + 1, 2)
    image[top : top + side, left : left + side] = COLOURS[label]
    out = io.BytesIO()
    Image.fromarray(image).save(out, "JPEG", quality=90)
    return out.getvalue(), label


def hf_dataset(first: int, count: int):
    """Samples ``first`` to ``first + count - 1`` as a ``datasets.Dataset`` (built offline)."""
    import datasets

    datasets.disable_progress_bars()
    pairs = [jpeg_of(i) for i in range(first, first + count)]
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)}
    )
    data = {"image": [{"bytes": jpeg, "path": None} for jpeg, _ in pairs],
            "label": [label for _, label in pairs]}  # fmt: skip
    return datasets.Dataset.from_dict(data, features=features)


def write_data(args: argparse.Namespace) -> tuple[str, str]:
    """The training split as 4 ``to_parquet`` shards, the validation split saved with
    ``save_to_disk`` in 3 Arrow files (both kept when there); their folders."""
    train, val = os.path.join(args.data_dir, "train"), os.path.join(args.data_dir, "val")
    if not os.path.exists(os.path.join(train, ".done")):
        os.makedirs(train, exist_ok=True)
        data = hf_dataset(0, args.train_samples)
        for k in range(4):
            data.shard(4, k, contiguous=True).to_parquet(f"{train}/train-{k:05d}-of-00004.parquet")
        open(os.path.join(train, ".done"), "w").close()
    if not os.path.exists(os.path.join(val, "state.json")):
        hf_dataset(args.train_samples, args.val_samples).save_to_disk(val, num_shards=3)
    return train, val


def prepare_data(args: argparse.Namespace, rank: int) -> tuple[str, str]:
    """Rank 0 writes both splits (once); every rank waits for them."""
    folders = write_data(args) if rank == 0 else None
    if dist.is_initialized():
        dist.barrier()
    if folders is None:
        folders = os.path.join(args.data_dir, "train"), os.path.join(args.data_dir, "val")
    return folders


def make_loaders(args: argparse.Namespace, train_dir: str, val_dir: str) -> tuple:
    """This rank's share: the Parquet shards cropped and flipped, the saved folder whole."""
    train = ShardedStreamingDataset(
        train_dir, seed=SEED, aug_config=get_preset("imagenet"),
        decode=SampleDecoder(DECODE, crop_size=CROP),
    )  # fmt: skip
    val = ShardedStreamingDataset(val_dir, shuffle=False, decode=DECODE)
    return (streaming_loader(train, args.batch_size, num_workers=args.num_workers),
            streaming_loader(val, 4 * args.batch_size, num_workers=args.num_workers))  # fmt: skip


# ----------------------------------------------------------------------------- model


class Net(nn.Module):
    """A small CNN over the batch dict's ``image`` (any size: pooled to one vector)."""

    def __init__(self, classes: int = len(CLASSES), width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )  # fmt: skip
        self.head = nn.Linear(2 * width, classes)

    def forward(self, batch: dict) -> torch.Tensor:
        x = batch["image"].float() / 127.5 - 1.0
        return self.head(self.features(x).flatten(1))


def loss_fn(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(logits.float(), batch["label"])


@torch.no_grad()
def exact_accuracy(handler: NNHandler, loader) -> tuple[float, int]:
    """Accuracy over every validation sample once (pads dropped, ranks gathered)."""
    handler.module.eval()
    hits, ids = zip(*(hits_of(handler, batch) for batch in loader))
    values, _ = gather_for_metrics(torch.cat(hits), torch.cat(ids))
    return values.mean().item(), len(values)


def hits_of(handler: NNHandler, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """1 where the model is right, 0 where wrong, and the sample ids, without the pads."""
    real = ~batch["__pad__"]
    logits = handler.module({"image": batch["image"][real].to(handler.device)})
    return (logits.argmax(1).cpu() == batch["label"][real]).float(), batch["__index__"][real]


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(SEED)  # the same initial weights on every rank
    handler = NNHandler(Net, device=args.device)  # starts DDP under torchrun
    train_dir, val_dir = prepare_data(args, handler.rank)
    train_loader, val_loader = make_loaders(args, train_dir, val_dir)
    handler.set_optimizer(torch.optim.AdamW, lr=args.lr)
    handler.set_loss_fn(loss_fn)
    handler.set_train_loader(train_loader)
    handler.train(args.epochs)
    acc, count = exact_accuracy(handler, val_loader)
    if handler.rank == 0:
        print(f"validation accuracy {acc:.4f} over {count} samples ({handler.world_size} "
              f"process(es), {handler.step} steps)", flush=True)  # fmt: skip
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
