"""One rank of two (real gloo processes, started as torchrun would start them) stops itself with
SIGSTOP after a chosen optimizer step and is sent SIGCONT by the test once the other rank said
who it waits for: with ``NNH_STALL_REPORT_S=2`` the waiting rank logs, within seconds, that the
stopped rank has not reached the next step, keeps waiting, says when every rank reached it, and
the run ends normally on both ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import ROOT, free_port

pytestmark = pytest.mark.timeout(120)
STOP_AFTER = 3  # the stopped rank stops after this many optimizer steps

RANK = """
import os, signal, sys, torch
from torch import nn
from nnh_train import Callback, NNHandler
from tests.support import Net, data

class StopOnce(Callback):  # the stopped rank: SIGSTOP to itself after step STOP_AFTER
    def on_batch_end(self, handler):
        if handler.rank == int(sys.argv[1]) and handler.step == int(sys.argv[2]):
            print("stopping", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)

h = NNHandler(Net, device="cpu")
h.log_fn = lambda line: None
h.set_optimizer(torch.optim.SGD, lr=0.01)
h.set_loss_fn(nn.functional.mse_loss)
h.set_train_loader(data(32), batch_size=4, num_workers=0)
h.add_callback(StopOnce())
h.train(2)
print(f"done {h.step}", flush=True)
"""


def _start(rank: int, stopped: int, port: int, folder: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1", "RANK": str(rank),
           "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "NNH_STALL_REPORT_S": "2"}  # fmt: skip
    with open(folder / f"out{rank}", "w") as out, open(folder / f"err{rank}", "w") as err:
        return subprocess.Popen([sys.executable, "-c", RANK, str(stopped), str(STOP_AFTER)],
                                env=env, stdout=out, stderr=err)  # fmt: skip


def _wait_for(path: Path, text: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while text not in path.read_text():
        assert time.monotonic() < deadline, f"{path.name} never said {text!r}: {path.read_text()}"
        time.sleep(0.1)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("stopped", [1, 0], ids=["rank-1-stopped", "rank-0-stopped"])
def test_a_stopped_rank_is_named_by_the_one_that_waits(tmp_path, stopped):
    """Rank 1 stopped: rank 0 names it and the step. Rank 0 stopped (it hosts the process
    group's store): rank 1 says it waits and that the store does not answer, naming rank 0 as
    its host."""
    port = free_port()
    ranks = [_start(rank, stopped, port, tmp_path) for rank in range(2)]
    waiter = 1 - stopped
    try:
        _wait_for(tmp_path / f"out{stopped}", "stopping")
        deadline = time.monotonic() + 30
        while _state(ranks[stopped].pid) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        said = "have not reached this step" if stopped else "does not answer"
        _wait_for(tmp_path / f"err{waiter}", said)
        os.kill(ranks[stopped].pid, signal.SIGCONT)
        codes = [rank.wait(timeout=60) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    err = (tmp_path / f"err{waiter}").read_text()
    assert codes == [0, 0], [(tmp_path / f"err{r}").read_text() for r in range(2)]
    assert all("done 8" in (tmp_path / f"out{r}").read_text() for r in range(2))
    step = f"rank {waiter}: step {STOP_AFTER} (epoch 0, batch {STOP_AFTER}): "
    if stopped:
        assert f"{step}rank(s) [1] have not reached this step after " in err
    else:
        assert f"{step}waiting " in err and "its host (rank 0, unless torchrun's agent" in err
    assert "waiting on until the process group's timeout" in err
    assert f"{step}every rank reached it after " in err
