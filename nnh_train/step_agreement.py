"""The one collective of a training step: each rank's row of figures, and what every rank decides
from the rows gathered.

Design. Each optimizer step, every rank sends one float64 row (:func:`rank_row`): the loss
trained on, the loss and metrics over the step's real samples (pads left out), the count of
those samples, and a flag saying whether a preemption signal arrived. :func:`gather_rows` starts
the ``all_gather`` and returns the wait, so the handler starts it before the last backward and
waits before the optimizer step: the collective's latency hides behind the backward. Every rank
then holds the same rows in rank order, and :class:`StepRows` draws every decision from them the
same way on every rank: a non-finite loss on any rank stops all of them before the optimizer step
(:meth:`StepRows.non_finite_error`), a signal on any rank makes all of them save at this step
(:meth:`StepRows.signalled`), and the step's figures are summed in rank order
(:meth:`StepRows.sums`), so the epoch's history is bitwise the same on every rank. The trade-off
is one small collective per step even when nothing is wrong; a NaN check or a preemption flag
that ranks must agree on cannot be had for less.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["StepRows", "gather_rows", "rank_row", "weighted"]


def weighted(value: torch.Tensor, weight: float) -> torch.Tensor:
    """``value * weight``; ``value`` itself for a weight of 1 (a group of one batch), which saves
    the step an operation, and the backward a node, for nothing."""
    return value if weight == 1 else value * weight


def rank_row(
    trained: list[torch.Tensor], figures: list[tuple[torch.Tensor, int]], real: int,
    signalled: bool, width: int, device: torch.device,
) -> torch.Tensor:  # fmt: skip
    """This rank's row: [loss trained on, loss and metrics over the real samples, real sample
    count, signal flag], float64 on ``device``.

    Args:
        trained: each batch's loss (float64, shape (1,)) weighted by its share of the step.
        figures: for each batch with real samples, its loss and metrics over them (``width``
            values) and their count.
        real: the step's real samples (zeros stand for the figures when there are none).
        signalled: whether this rank received a preemption signal.

    Example:
        >>> rank_row([torch.tensor([2.0], dtype=torch.float64)], [], 0, True, 1, "cpu").tolist()
        [2.0, 0.0, 0.0, 1.0]
    """
    shares = [weighted(values, count / real) for values, count in figures]
    zeros = torch.zeros(width, dtype=torch.float64, device=device)
    means = sum(shares[1:], shares[0]) if shares else zeros
    tail = torch.tensor([real, bool(signalled)], dtype=torch.float64, device=device)
    return torch.cat([sum(trained[1:], trained[0]), means, tail])


def gather_rows(
    row: torch.Tensor, distributed: bool, world_size: int
) -> Callable[[], list[list[float]]]:
    """Start gathering every rank's ``row``; the function returned waits for them and gives
    them as lists, in rank order (the same list on every rank)."""
    if not distributed:
        return lambda: [row.tolist()]
    rows = [torch.empty_like(row) for _ in range(world_size)]
    work = dist.all_gather(rows, row, async_op=True)

    def wait() -> list[list[float]]:
        work.wait()
        return torch.stack(rows).tolist()

    return wait


@dataclass(frozen=True)
class StepRows:
    """The step's rows (see :func:`rank_row`), one per rank in rank order, and the decisions
    every rank draws from them.

    Example:
        >>> rows = StepRows([[1.0, 1.0, 4.0, 0.0], [3.0, 2.0, 4.0, 1.0]])
        >>> rows.sums(), rows.samples(), rows.signalled()
        ([12.0, 8.0], 8, [1])
    """

    rows: list[list[float]]

    def non_finite_error(self, where: str) -> FloatingPointError | None:
        """The error naming the ranks whose loss is NaN or infinite, and their values, at
        ``where`` (the step, epoch and batch); None when every loss is finite."""
        bad = {rank: row[0] for rank, row in enumerate(self.rows) if not math.isfinite(row[0])}
        if not bad:
            return None
        values = ", ".join(f"rank {rank}: {value}" for rank, value in bad.items())
        return FloatingPointError(f"non-finite loss at {where} on rank(s) {sorted(bad)} "
                                  f"({values}); no rank took this optimizer step")  # fmt: skip

    def signalled(self) -> list[int]:
        """The ranks that received a preemption signal before this step's gather."""
        return [rank for rank, row in enumerate(self.rows) if row[-1]]

    def samples(self) -> int:
        """The step's real samples over all ranks."""
        return int(sum(row[-2] for row in self.rows))

    def sums(self) -> list[float]:
        """[loss x count, count, metric x count...] over the ranks, added in rank order."""
        step = [0.0] * (len(self.rows[0]) - 2)
        for _, loss, *metrics, count, _ in self.rows:
            for k, value in enumerate([loss * count, count, *(m * count for m in metrics)]):
                step[k] += value
        return step
