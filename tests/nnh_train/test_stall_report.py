"""nnh_train/stall_report.py: the stated time read from NNH_STALL_REPORT_S, and StallWatch on 2
real gloo processes (its store is the group's): a rank in a step for longer than the stated time
names the rank that has not reached it, or says that every rank is in it, then that the step
completed. A rank stopped with SIGSTOP under NNHandler is in tests/faults/test_stalled_rank.py."""

from __future__ import annotations

import logging
import time

import pytest
import torch.distributed as dist

from nnh_train.stall_report import DEFAULT_STALL_S, STALL_ENV, StallWatch, stall_seconds
from tests.support import run_distributed


@pytest.mark.parametrize(
    ("text", "seconds"), [(None, DEFAULT_STALL_S), ("0", 0.0), ("2", 2.0), ("600", 600.0)]
)
def test_the_stated_time_comes_from_the_environment(text, seconds):
    assert stall_seconds({} if text is None else {STALL_ENV: text}) == seconds


@pytest.mark.parametrize("text", ["", "-1", "nan", "2.5", "5 min"])
def test_a_bad_stated_time_is_refused_naming_the_variable(text):
    with pytest.raises(ValueError, match=f"environment variable {STALL_ENV} must be"):
        stall_seconds({STALL_ENV: text})


def _watched(rank: int, world_size: int, late: bool) -> list[str]:
    """Rank 0 in step 5 for 3 s (stated time 1 s); rank 1 in it too, or (``late``) outside it
    until rank 0 is done; the lines each rank logged."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("nnh_train.stall_report").addHandler(handler)
    watch = StallWatch(rank, world_size, 1.0)
    dist.barrier()
    if rank == 0 or not late:
        with watch.in_step(5, "step 5 (epoch 0, batch 5)"):
            time.sleep(3.5)
    dist.barrier()
    if late:
        time.sleep(4)
    return lines


@pytest.mark.timeout(120)
@pytest.mark.parametrize("late", [True, False], ids=["rank-1-late", "both-in-the-step"])
def test_a_long_step_names_the_ranks_not_in_it(late):
    lines = run_distributed(_watched, 2, late, timeout=90)
    where = "rank 0: step 5 (epoch 0, batch 5): "
    said = "rank(s) [1] have not reached this step after " if late else "as every rank says it is"
    assert any(line.startswith(where) and said in line for line in lines[0]), lines[0]
    assert any(line.startswith(f"{where}every rank reached it after ") for line in lines[0])
    assert lines[1] == [] if late else any("as every rank says" in line for line in lines[1])
