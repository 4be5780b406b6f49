"""One optimizer step: forward and backward over a group of batches at the run's precision,
the step's rows gathered behind the last backward, then the optimizer step.

Design. A :class:`TrainStep` owns what makes the model's step, as opposed to the run: the
precision (autocast, and for fp16 a ``GradScaler`` kept across ``train`` calls, whose state
checkpoints hold) and the compiled forward (compiled once, kept). A group of
``gradient_accumulation_steps`` batches is one step: each batch's loss is weighted by its share
of the group's samples, so the group equals one batch of its samples, and under DDP the
gradients are synchronised on the last batch only (``no_sync`` before). A step of global batches
weights each batch by its real samples' share of the global batch instead
(:mod:`~nnh_train.global_steps`). This rank's row of
figures (:func:`~nnh_train.step_agreement.rank_row`) is sent before the last backward and
:meth:`TrainStep.forward_backward` returns the wait, so the handler checks the rows of every
rank before :meth:`TrainStep.optimizer_step`: a non-finite loss anywhere means no rank steps.
The trade-off: the figures of a batch with pads are computed again over its real rows, an extra
forward of the loss (not of the model) for the batches that carry pads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from nnh_train.batches import Counted, select_rows, split_batch, to_device
from nnh_train.evaluation import Scorer
from nnh_train.preemption import SignalFlag
from nnh_train.step_agreement import gather_rows, rank_row, weighted

__all__ = ["PRECISIONS", "TrainStep"]

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class TrainStep:
    """The optimizer steps of ``model`` (as trained: wrapped in DDP under DDP) on ``device``.

    Attributes:
        autocast: a function giving the context the forward runs in (the precision's).
        scaler: the fp16 ``GradScaler`` (None at other precisions).
    """

    def __init__(
        self, model: nn.Module, device: torch.device, distributed: bool, world_size: int
    ) -> None:
        self.model, self.device = model, device
        self.distributed, self.world_size = distributed, world_size
        self.autocast: Callable[[], AbstractContextManager] = nullcontext
        self.scaler: torch.amp.GradScaler | None = None
        self._compiled: Callable[..., Any] | None = None
        self._forward: Callable[..., Any] = model

    def configure(self, precision: str, compile: bool | str) -> None:
        """Train at ``precision`` (one of :data:`PRECISIONS`), through ``torch.compile`` when
        ``compile`` is True (inductor) or a backend name."""
        dtype = _DTYPES[precision]
        device_type = self.device.type
        self.autocast = (
            nullcontext if dtype is None
            else functools.partial(torch.autocast, device_type, dtype=dtype)
        )  # fmt: skip
        if precision != "fp16":
            self.scaler = None
        elif self.scaler is None:
            self.scaler = torch.amp.GradScaler(device_type)
        if compile and self._compiled is None:
            backend = "inductor" if compile is True else compile
            self._compiled = torch.compile(self.model, backend=backend)
        self._forward = self._compiled if compile else self.model

    def forward_backward(
        self, group: list[Counted], scorer: Scorer, signal: SignalFlag,
        global_samples: int | None = None,
    ) -> Callable[[], list[list[float]]]:  # fmt: skip
        """Forward and backward over the group's batches, each weighted by its share of the
        group's samples; with ``global_samples`` (a step of global batches,
        :mod:`~nnh_train.global_steps`), each batch's loss over its real samples, weighted by
        their share of the global batch's ``global_samples`` real ones. The rows (see
        :func:`~nnh_train.step_agreement.rank_row`, with ``signal`` as it is then) are exchanged
        while the last backward runs, so the collective's latency hides behind it; the function
        returned waits for them."""
        total = sum(size for _, size, _ in group)
        trained, figures, real = [], [], 0
        for i, (batch, size, pads) in enumerate(group):
            inputs, target = split_batch(to_device(batch, self.device))
            last = i == len(group) - 1
            count = size if pads is None else size - int(pads.sum())
            with nullcontext() if last or not self.distributed else self.model.no_sync():
                with self.autocast():
                    output = self._forward(inputs)
                    if global_samples is None:
                        loss, weight = scorer.loss_fn(output, target), size / total
                    else:
                        loss = _real_loss(scorer, output, target, pads, count)
                        weight = count * self.world_size / global_samples
                value = loss.detach().double().reshape(1)
                trained.append(weighted(value, weight))
                if count:
                    figures.append((scorer.figures(value, output, target, pads), count))
                real += count
                if last:
                    row = rank_row(trained, figures, real, bool(signal),
                                   1 + len(scorer.metrics), self.device)  # fmt: skip
                    rows = gather_rows(row, self.distributed, self.world_size)
                self._backward(weighted(loss, weight))
        return rows

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        """Step ``optimizer`` (through the scaler at fp16) and zero its gradients, then step
        ``scheduler`` (None: none steps every optimizer step)."""
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()

    def _backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()


def _real_loss(
    scorer: Scorer, output: Any, target: Any, pads: torch.Tensor | None, count: int
) -> torch.Tensor:
    """The loss over a batch's real rows (``count`` of them, ``pads`` the others); a batch of
    pads only gives zero, through the graph (under DDP every rank runs every backward)."""
    if pads is None:
        return scorer.loss_fn(output, target)
    if not count:
        return scorer.loss_fn(output, target) * 0.0
    return scorer.loss_fn(select_rows(output, ~pads), select_rows(target, ~pads))
