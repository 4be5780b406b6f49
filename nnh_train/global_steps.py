"""Training on global batches: one optimizer step per global batch, at any world size.

Design. A ``ShardedStreamingDataset(..., global_batch_size=G)`` hands every rank its share of
the same global batches at every world size that fits (``docs/global_batches.md``), in loader
batches of ``b`` samples. :func:`global_steps` makes one optimizer step of each global batch:
``G / (W * b)`` loader batches accumulated per rank, so one process with small loader batches
takes the optimizer steps of ``W`` processes. The step's loss is the mean over the global
batch's real samples (pads weighted zero): each loader batch's loss over its real rows, weighted
by ``real * W / N`` (``N``: the global batch's real samples, known from the dataset's arithmetic
without a collective; DDP's mean over the ranks divides the ``W`` out), so the gradient is the
same at every world size, to the order of floating-point sums. The trade-off: a model with
batch statistics (batch norm) sees loader batches of another size at another world size, and
its steps differ.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import DataLoader

from nnh_data.checks import check_int
from nnh_data.order.global_batches import GlobalBatches
from nnh_data.streaming import streaming_dataset_of

__all__ = ["GlobalSteps", "global_steps"]


@dataclass(frozen=True)
class GlobalSteps:
    """The optimizer steps of a dataset of global batches: ``accumulation`` loader batches of
    this rank per step."""

    batches: GlobalBatches
    accumulation: int

    def samples(self, batches_done: int) -> int:
        """The real samples (over all ranks) of the step that starts after this rank's
        ``batches_done`` loader batches of the epoch."""
        return self.batches.real(batches_done // self.accumulation)


def global_steps(
    loader: DataLoader, global_batch_size: int | None, world_size: int, accumulation: int
) -> GlobalSteps | None:
    """The steps of training on ``loader`` with ``global_batch_size`` (None: the dataset's,
    when it has global batches; else no global steps). ``accumulation``, the batches per step
    the user asked for, must then be 1 or the number that makes a global batch.

    Example:
        >>> global_steps(loader, 512, world_size=8, accumulation=1).accumulation  # doctest: +SKIP
        4
    """
    dataset = streaming_dataset_of(loader)
    batches = None if dataset is None else dataset.global_batches
    if global_batch_size is None and batches is None:
        return None
    size = None if global_batch_size is None else check_int("global_batch_size",
                                                             global_batch_size, low=1)
    if batches is None or size not in (None, batches.global_batch_size):
        have = "a dataset without global batches" if batches is None else \
            f"a dataset of global_batch_size={batches.global_batch_size}"  # fmt: skip
        raise ValueError(
            f"global_batch_size={size} needs a training set of those global batches, got {have}: "
            f"train on ShardedStreamingDataset(..., global_batch_size={size})"
        )
    loader_batch = dataset.batch_size or loader.batch_size
    share = batches.global_batch_size // world_size
    if not loader_batch or share % loader_batch:
        raise ValueError(f"loader batches of {loader_batch} must divide a rank's share of a "
                         f"global batch, {share}: pass a batch_size that does")  # fmt: skip
    if accumulation not in (1, share // loader_batch):
        raise ValueError(
            f"gradient_accumulation_steps={accumulation} with global_batch_size="
            f"{batches.global_batch_size}, world_size={world_size} and loader batches of "
            f"{loader_batch}: a global batch is {share // loader_batch} loader batches per "
            "rank; leave gradient_accumulation_steps at 1 (it follows)"
        )
    return GlobalSteps(batches, share // loader_batch)
