"""gather_for_metrics: alone (sort, repeats removed) and on 3 real gloo ranks with uneven counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nnh_data import gather_for_metrics
from tests.support import run_distributed

# rank 1 holds nothing; rank 2 repeats id 0 (a pad, with another value: the first one is kept)
IDS = {0: [4, 0, 8], 1: [], 2: [1, 2, 3, 5, 6, 7, 9, 0]}


def _values(ids: list[int], rank: int) -> torch.Tensor:
    """Per-sample (2, 3) int16 blocks holding the id; -1 for the repeat on rank 2."""
    marks = [-1 if rank == 2 and i == 0 else i for i in ids]
    return torch.tensor(marks, dtype=torch.int16).reshape(-1, 1, 1).expand(-1, 2, 3).contiguous()


def _gather_checks(rank: int, world_size: int) -> dict:
    ids = IDS[rank]
    values = _values(ids, rank)
    report = {
        "blocks": [t.tolist() for t in gather_for_metrics(values, torch.tensor(ids))],
        "bools": gather_for_metrics(torch.tensor([i % 2 for i in ids]).bool(), ids)[0].tolist(),
        "objects": gather_for_metrics([{"id": i, "rank": rank} for i in ids], np.array(ids)),
    }
    wrong = values.float() if rank == 1 else values
    try:
        gather_for_metrics(wrong, ids)
    except ValueError as exc:
        report["dtype_error"] = str(exc)
    return report


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_distributed(_gather_checks, 3, timeout=60)


@pytest.mark.timeout(90)
def test_tensors_every_id_once_in_order_on_every_rank(reports):
    for report in reports:
        values, ids = report["blocks"]
        assert ids == list(range(10))
        assert values == [[[i] * 3] * 2 for i in range(10)]  # id 0 from rank 0, not the repeat
        assert report["bools"] == [i % 2 == 1 for i in range(10)]


@pytest.mark.timeout(90)
def test_objects_every_id_once_in_order_on_every_rank(reports):
    first_rank = {i: r for r in (2, 1, 0) for i in IDS[r]}
    for report in reports:
        objects, ids = report["objects"]
        assert ids == list(range(10))
        assert objects == [{"id": i, "rank": first_rank[i]} for i in range(10)]


@pytest.mark.timeout(90)
def test_mismatched_dtypes_fail_on_every_rank(reports):
    for rank, report in enumerate(reports):
        message = report.get("dtype_error", "")
        assert "one dtype and trailing shape on every rank" in message, rank
    assert "ranks [1] have another" in reports[0]["dtype_error"]


def test_alone_sorts_and_removes_repeats():
    values, ids = gather_for_metrics(torch.tensor([[3.0], [1.0], [3.5]]), [3, 1, 3])
    assert values.tolist() == [[1.0], [3.0]] and ids.tolist() == [1, 3]
    assert ids.dtype == torch.int64
    objects, ids = gather_for_metrics(("c", "a", "b", "a2"), np.array([2, 0, 1, 0]))
    assert (objects, ids) == (["a", "b", "c"], [0, 1, 2])
    values, ids = gather_for_metrics(torch.empty(0, 4), [])
    assert values.shape == (0, 4) and ids.tolist() == []


@pytest.mark.parametrize(
    "values, indices, message",
    [
        (torch.zeros(3), [0, 1], "one id per value: got 2 indices for 3 values"),
        (torch.tensor(1.0), [0], "leading sample dimension, got a 0-d tensor"),
        (np.zeros(2), [0, 1], "got ndarray"),
        (["a"], [-1], "indices: sample_ids must be in"),
        (["a"], [[0]], "indices: sample_ids must be an integer or a 1-D array"),
    ],
)
def test_bad_arguments_are_named(values, indices, message):
    with pytest.raises(ValueError, match=message):
        gather_for_metrics(values, indices)
