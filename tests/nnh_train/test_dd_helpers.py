"""aggregate_metrics / aggregate_loss / broadcast / gather on a real 3-rank gloo group."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from nnh_train import (
    RankError,
    aggregate_loss,
    aggregate_metrics,
    broadcast_data,
    broadcast_if_ddp,
    gather_to_rank0,
)
from tests.support import run_distributed

CPU = torch.device("cpu")


def _all_checks(rank: int, world_size: int) -> dict:
    """Everything in one 3-rank run: spawning the processes is what costs time."""
    return {
        "metrics": _metrics(rank, world_size),
        "objects": _objects(rank, world_size),
        "errors": _bad_arguments(rank, world_size),
    }


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_distributed(_all_checks, 3, timeout=80)


def _metrics(rank: int, world_size: int) -> dict:
    # each rank lists its keys in a different order; NaN on rank 1 for "acc", NaN everywhere
    # for "empty"; the values come as float, 0-d tensor and numpy scalar
    items = [
        ("loss", float(rank)),
        ("acc", math.nan if rank == 1 else 0.5 + rank),
        ("empty", torch.tensor(math.nan)),
        ("count", np.int64(10 * rank)),
    ]
    mine = dict(items[rank:] + items[:rank])
    return {
        "plain": aggregate_metrics(mine, world_size, CPU),
        "weighted": aggregate_metrics({"loss": float(rank)}, world_size, CPU, weights=rank + 1),
        "loss": aggregate_loss(torch.tensor(2.0 * rank), world_size, CPU),
        "order": list(aggregate_metrics(mine, world_size, "cpu")),
        "mine_order": list(mine),
    }


@pytest.mark.timeout(90)
def test_aggregate_metrics_one_collective_nan_and_weights(reports):
    for report in (r["metrics"] for r in reports):
        plain = report["plain"]
        assert plain["loss"] == pytest.approx(1.0)
        assert plain["acc"] == pytest.approx((0.5 + 2.5) / 2)  # rank 1's NaN left out
        assert math.isnan(plain["empty"])
        assert plain["count"] == pytest.approx(10.0)
        # weights 1, 2, 3 for losses 0, 1, 2: (0 + 2 + 6) / 6
        assert report["weighted"]["loss"] == pytest.approx(8 / 6)
        assert report["loss"] == pytest.approx(2.0)
        assert report["order"] == report["mine_order"]


def _objects(rank: int, world_size: int) -> dict:
    report = {
        "broadcast": broadcast_data({"vocab": ["a", "b"], "from": rank}, src=1),
        "if_ddp": broadcast_if_ddp(rank * 3, src=2),
        "gathered": gather_to_rank0(("rank", rank)),
    }
    try:
        broadcast_data(threading.Lock() if rank == 0 else None)
    except RankError as exc:
        report["bad_broadcast"] = (exc.rank, str(exc))
    try:
        report["bad_gather"] = gather_to_rank0(threading.Lock() if rank == 1 else rank)
    except RankError as exc:
        report["bad_gather"] = (exc.rank, str(exc))
    return report


@pytest.mark.timeout(90)
def test_broadcast_and_gather_objects_and_their_pickling_errors(reports):
    reports = [r["objects"] for r in reports]
    for rank, report in enumerate(reports):
        assert report["broadcast"] == {"vocab": ["a", "b"], "from": 1}
        assert report["if_ddp"] == 6
        everyone = [("rank", 0), ("rank", 1), ("rank", 2)]
        assert report["gathered"] == (everyone if rank == 0 else None)
        failed_rank, message = report["bad_broadcast"]
        assert failed_rank == 0 and "broadcast_data: rank 0 could not send" in message
        assert "cannot send a lock" in message
    # the rank that cannot send and rank 0 raise; rank 2 has nothing to receive
    assert reports[0]["bad_gather"][0] == reports[1]["bad_gather"][0] == 1
    assert "gather_to_rank0: rank 1 could not send" in reports[0]["bad_gather"][1]
    assert reports[2]["bad_gather"] is None


def test_without_group_inputs_come_back_unchanged():
    metrics = {"loss": torch.tensor(1.5)}
    assert aggregate_metrics(metrics, 1, CPU) is metrics
    loss = torch.tensor(0.25)
    assert aggregate_loss(loss, 1, CPU) is loss
    assert broadcast_if_ddp("x") == "x"
    assert gather_to_rank0(7) == [7]
    with pytest.raises(RuntimeError, match="broadcast_if_ddp"):
        broadcast_data("x")


def _bad_arguments(rank: int, world_size: int) -> list[str]:
    errors = []
    for call in (
        lambda: aggregate_metrics({"a": 1.0}, 2, CPU),
        lambda: aggregate_metrics({"a": "high"}, world_size, CPU),
        lambda: aggregate_metrics({"a": 1.0}, world_size, CPU, weights=-1),
        lambda: broadcast_data(1, src=3),
    ):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.timeout(90)
def test_bad_arguments_raise_value_error_naming_them(reports):
    for errors in (r["errors"] for r in reports):
        assert "world_size must be in [3, 3], got 2" in errors[0]
        assert "metrics_dict['a'] must be a number, got str 'high'" in errors[1]
        assert "weights must be a finite number >= 0, got -1" in errors[2]
        assert "src must be in [0, 2], got 3" in errors[3]
