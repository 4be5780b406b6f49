"""The step's agreement row (nnh_train/step_agreement.py): the row a rank sends, the decisions
drawn from the rows, and the gather on 2 real gloo processes."""

from __future__ import annotations

import math

import pytest
import torch

from nnh_train.step_agreement import StepRows, gather_rows, rank_row, weighted
from tests.support import run_distributed


def f64(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("trained, figures, real, signalled, width, expected", [
    # one batch, no pads: its loss is both the trained loss and the figure
    ([f64(2.0)], [(f64(2.0, 0.5), 4)], 4, False, 2, [2.0, 2.0, 0.5, 4.0, 0.0]),
    # two batches (3 and 1 real samples): figures weighted by their real share
    ([f64(1.5), f64(0.5)], [(f64(2.0), 3), (f64(6.0), 1)], 4, False, 1, [2.0, 3.0, 4.0, 0.0]),
    # only pads: zeros for the figures, the signal flag set
    ([f64(2.0)], [], 0, True, 2, [2.0, 0.0, 0.0, 0.0, 1.0]),
])  # fmt: skip
def test_rank_row(trained, figures, real, signalled, width, expected):
    row = rank_row(trained, figures, real, signalled, width, torch.device("cpu"))
    assert row.dtype == torch.float64 and row.tolist() == expected


def test_weighted_by_one_is_the_value_itself():
    value = f64(3.0)
    assert weighted(value, 1) is value and weighted(value, 0.5).item() == 1.5


ROWS = [[1.0, 1.0, 0.5, 4.0, 0.0], [3.0, 2.0, 1.0, 2.0, 1.0], [2.0, 9.0, 9.0, 0.0, 1.0]]


@pytest.mark.parametrize("rows, sums, samples, signalled", [
    (ROWS, [8.0, 6.0, 4.0], 6, [1, 2]),  # the third rank had only pads: it adds nothing
    (ROWS[:1], [4.0, 4.0, 2.0], 4, []),
])  # fmt: skip
def test_step_rows_decisions(rows, sums, samples, signalled):
    step = StepRows(rows)
    assert (step.sums(), step.samples(), step.signalled()) == (sums, samples, signalled)
    assert step.non_finite_error("step 1") is None


def test_a_non_finite_loss_names_the_ranks_and_values():
    rows = StepRows([[1.0, 1.0, 1.0, 0.0], [math.nan, 1.0, 1.0, 0.0], [math.inf, 1.0, 1.0, 0.0]])
    error = rows.non_finite_error("step 3 (epoch 0, batch 3)")
    assert str(error) == ("non-finite loss at step 3 (epoch 0, batch 3) on rank(s) [1, 2] "
                          "(rank 1: nan, rank 2: inf); no rank took this optimizer step")


def test_one_process_gathers_its_own_row():
    assert gather_rows(f64(1.0, 2.0), False, 1)() == [[1.0, 2.0]]


def _gathered(rank: int, world_size: int) -> list[list[float]]:
    wait = gather_rows(f64(rank, 10.0 * rank), True, world_size)
    return wait()


@pytest.mark.timeout(60)
def test_every_rank_gets_every_row_in_rank_order():
    assert run_distributed(_gathered, 2, timeout=45) == [[[0.0, 0.0], [1.0, 10.0]]] * 2
