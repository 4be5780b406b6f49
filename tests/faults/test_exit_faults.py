"""The end of a training script, run as a real process 8 times per case: after a full epoch
through ``streaming_loader`` or ``create_distributed_loader`` with persistent workers, and after
Ctrl-C (SIGINT to the whole process group, as a terminal sends it), a clean exit prints
nothing: no ``Exception ignored in atexit callback ... DataLoader worker (pid N) is killed by
signal: Terminated`` (it came in 2-5 of 8 runs: torch's SIGCHLD handler raised in
``multiprocessing``'s exit function)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.support import ROOT, SCRIPTS

pytestmark = pytest.mark.timeout(600)
SCRIPT = str(SCRIPTS / "exit_after_epoch.py")
RUNS = 8
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _start(kind: str, folder) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, SCRIPT, kind, str(folder)], env=ENV, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


def _finished(process: subprocess.Popen) -> tuple[str, str]:
    try:
        out, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail("the script did not exit within 120 s")
    assert process.returncode == 0, err
    return out, err


@pytest.mark.parametrize("kind", ["streaming", "distributed"])
def test_a_clean_exit_after_a_full_epoch_prints_nothing(kind, tmp_path):
    for _ in range(RUNS):
        out, err = _finished(_start(kind, tmp_path))
        assert out == "batches 25\n" and err == ""


def test_a_clean_exit_after_ctrl_c_prints_nothing(tmp_path):
    for _ in range(RUNS):
        process = _start("ctrl-c", tmp_path)
        while process.stdout.readline() != "batch\n":
            pass
        os.killpg(process.pid, signal.SIGINT)
        out, err = _finished(process)
        assert out.endswith("stopped\n") and err == ""
