"""Scoring the model: a batch's loss and metrics, their sums over a loader, the model's outputs
for a dataset, and a function of the model run on rank 0.

Design. A :class:`Scorer` is the run's loss function and metrics at its precision; it gives
every figure as float64 on the device, which the step's row and the validation's sums take
without waiting for the device. Pads are left out of every figure (a padded batch keeps only its
real rows), so an epoch's figures equal those of one process over the same data, and predictions
hold each sample once. Validation (:meth:`Scorer.loader_sums`), prediction (:func:`predictions`)
and :func:`run_on_rank0` run in eval mode without gradients (:func:`eval_mode` restores the mode
the model had). The trade-off: metrics are batch means averaged over samples, so a metric that
is not a mean over samples (AUC, F1) comes out as the sample-weighted mean of its batch values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from nnh_train.batches import (
    batch_ids,
    counted,
    epoch_ids,
    iterate,
    pad_flags,
    select_rows,
    set_epoch,
    split_batch,
    to_device,
)
from nnh_train.ddp_decorators import on_rank

__all__ = ["Scorer", "eval_mode", "predictions", "run_on_rank0"]


@dataclass(frozen=True)
class Scorer:
    """The loss and metrics of batches, as float64 on ``device``, under ``autocast`` (a
    function that gives the context to compute them in: the run's precision)."""

    loss_fn: Callable[..., torch.Tensor]
    metrics: Mapping[str, Callable[..., Any]]
    device: torch.device
    autocast: Callable[[], AbstractContextManager]

    def metric_values(self, output: Any, target: Any) -> torch.Tensor:
        """Each metric of the batch as float64 on the device (no sync for tensor results)."""
        with torch.no_grad():
            values = [fn(_detached(output), target) for fn in self.metrics.values()]
        as_tensors = [torch.as_tensor(v, dtype=torch.float64, device=self.device).reshape(())
                      for v in values]  # fmt: skip
        return torch.stack(as_tensors) if as_tensors else self._zeros(0)

    def figures(
        self, value: torch.Tensor, output: Any, target: Any, pads: torch.Tensor | None
    ) -> torch.Tensor:
        """The batch's loss (``value``: float64, shape (1,)) and metrics over its real samples
        (pads left out, the loss computed again without them), as float64."""
        if pads is not None:
            output, target = select_rows(_detached(output), ~pads), select_rows(target, ~pads)
            with torch.no_grad(), self.autocast():
                value = self.loss_fn(output, target).detach().double().reshape(1)
        return torch.cat([value, self.metric_values(output, target)]) if self.metrics else value

    def loader_sums(self, module: nn.Module, loader: DataLoader, epoch: int) -> torch.Tensor:
        """This rank's [loss x count, count, metric x count...] over ``loader`` at ``epoch``,
        pads left out, in eval mode."""
        sums = self._zeros(2 + len(self.metrics))
        set_epoch(loader, epoch)
        with torch.no_grad(), eval_mode(module):
            for batch, size, pads in counted(iterate(loader), pad_flags(loader), 0):
                count = size if pads is None else size - int(pads.sum())
                if count == 0:
                    continue
                batch = batch if pads is None else select_rows(batch, ~pads)
                inputs, target = split_batch(to_device(batch, self.device))
                with self.autocast():
                    output = module(inputs)
                    loss = self.loss_fn(output, target)
                one = torch.ones((), dtype=torch.float64, device=self.device)
                head = torch.stack([loss.double(), one])
                sums += torch.cat([head, self.metric_values(output, target)]) * count
        return sums

    def _zeros(self, size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.float64, device=self.device)


def predictions(
    module: nn.Module, loader: DataLoader, device: torch.device,
    autocast: Callable[[], AbstractContextManager], distributed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(outputs as float32, their sample ids) for this rank's share of ``loader``, pads
    dropped, in eval mode (see :func:`~nnh_train.batches.batch_ids` for the ids)."""
    order, start = epoch_ids(loader), 0
    outputs, ids = [], []
    with torch.no_grad(), eval_mode(module):
        for batch, size, pads in counted(iterate(loader), pad_flags(loader), 0):
            keep = torch.ones(size, dtype=torch.bool) if pads is None else ~pads
            ids.append(batch_ids(batch, order, start, size, distributed)[keep])
            start += size
            inputs, _ = split_batch(to_device(select_rows(batch, keep), device))
            with autocast():
                outputs.append(module(inputs).float())
    return torch.cat(outputs), torch.cat(ids)


def run_on_rank0(
    module: nn.Module, fn: Callable[..., Any], args: tuple, kwargs: dict, distributed: bool
) -> Any:
    """``fn(module, *args, **kwargs)`` on rank 0, in eval mode without gradients; its result
    on every rank, an error there raised on every rank (call it on every rank)."""
    if not callable(fn):
        raise ValueError(f"fn must be a function of the module, got {fn!r} (the original "
                         "NNHandler's SDE sample(shape, steps) is not in nnh)")  # fmt: skip

    @functools.wraps(fn)
    def run() -> Any:
        with torch.no_grad(), eval_mode(module):
            return fn(module, *args, **kwargs)

    return on_rank(0)(run)() if distributed else run()


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode for the block, then in the mode it had."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def _detached(output: Any) -> Any:
    return output.detach() if isinstance(output, torch.Tensor) else output
