"""on_rank on real gloo groups: errors on chosen ranks reach every rank within seconds.
ParallelExecutor and the other names re-exported here are tested in test_parallel.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from nnh_train import RankError, on_rank
from tests.support import run_distributed

GROUP_TIMEOUT_S = 30.0  # run_distributed gives the group half of its timeout


class _Unrebuildable(Exception):
    """Pickles, but does not unpickle (its __init__ wants two arguments)."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"unrebuildable {a}/{b}")


@on_rank(1)
def _fail_on_rank_one() -> None:
    raise ValueError("boom on the chosen rank")


@on_rank([2, 0])
def _value_of_rank() -> int:
    return dist.get_rank() * 10


@on_rank(0, barrier=True)
def _dict_from_rank_zero() -> dict[str, int]:
    return {"a": 1}


@on_rank([0, 2])
def _fail_unrebuildable() -> None:
    raise _Unrebuildable(dist.get_rank(), 7)


@on_rank(0)
def _return_a_lock() -> threading.Lock:
    return threading.Lock()


@on_rank(5)
def _rank_out_of_range() -> None:
    raise AssertionError("never runs")


def _catch(func) -> dict:
    start = time.monotonic()
    try:
        func()
    except RankError as exc:
        cause = exc.__cause__
        return {"rank": exc.rank, "message": str(exc), "cause": repr(cause),
                "seconds": time.monotonic() - start}
    raise AssertionError(f"{func.__name__} did not raise")


def _on_rank_checks(rank: int, world_size: int) -> dict:
    report = {"fail": _catch(_fail_on_rank_one)}
    report["value"] = _value_of_rank()
    report["dict"] = _dict_from_rank_zero()
    report["unrebuildable"] = _catch(_fail_unrebuildable)
    report["lock"] = _catch(_return_a_lock)
    try:
        _rank_out_of_range()
    except ValueError as exc:
        report["out_of_range"] = str(exc)
    total = torch.ones(1)
    dist.all_reduce(total)  # the group is still in step after every error above
    report["after"] = total.item()
    return report


@pytest.mark.timeout(90)
def test_on_rank_errors_reach_every_rank_within_seconds():
    reports = run_distributed(_on_rank_checks, 3, timeout=60)
    for report in reports:
        fail = report["fail"]
        assert fail["rank"] == 1
        assert "boom on the chosen rank" in fail["message"]
        assert "_fail_on_rank_one failed on rank 1" in fail["message"]
        assert fail["cause"] == "ValueError('boom on the chosen rank')"
        assert fail["seconds"] < GROUP_TIMEOUT_S / 2  # a collective timeout would take 30 s
        assert report["value"] == 20  # the first listed rank (2) gives the value
        assert report["dict"] == {"a": 1}
        assert report["lock"]["rank"] == 0
        assert "cannot send a lock to other ranks" in report["lock"]["message"]
        assert "[0, 2]" in report["out_of_range"] and "[5]" in report["out_of_range"]
        assert report["after"] == 3.0
    for rank, report in enumerate(reports):
        unrebuildable = report["unrebuildable"]
        assert unrebuildable["rank"] == 0
        assert "(and on ranks [2])" in unrebuildable["message"]
        assert "_Unrebuildable: unrebuildable 0/7" in unrebuildable["message"]
        # only rank 0 holds the live exception; the copy could not be rebuilt elsewhere
        expected = "_Unrebuildable('unrebuildable 0/7')" if rank == 0 else "None"
        assert unrebuildable["cause"] == expected


def test_on_rank_without_group_just_runs():
    assert _dict_from_rank_zero() == {"a": 1}
    with pytest.raises(ValueError, match="boom"):
        _fail_on_rank_one()


@pytest.mark.parametrize("rank", [[], -1, True, [0, "1"]])
def test_on_rank_rejects_bad_ranks(rank):
    with pytest.raises(ValueError, match="rank"):
        on_rank(rank)
