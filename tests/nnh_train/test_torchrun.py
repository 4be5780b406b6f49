"""nnh-torchrun (``python -m nnh_train.torchrun``) with one real rank: SIGUSR1 to the launcher
reaches the rank on every torch and, when the rank saves and exits as preempted, the launcher
exits 75 with one line; Ctrl-C (SIGINT) gives 130; a failing rank fails as under torchrun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nnh_train.preemption import PREEMPTED_EXIT_CODE

RANK = textwrap.dedent("""
    import os, signal, sys, time

    folder, mode = sys.argv[1], sys.argv[2]
    if mode == "fail":
        sys.exit(3)
    from nnh_train.preemption import exit_preempted
    signal.signal(signal.SIGUSR1, lambda *a: exit_preempted(int(os.environ["RANK"])))
    open(os.path.join(folder, "ready"), "w").close()
    try:
        time.sleep(120)
    except KeyboardInterrupt:
        os._exit(130)
""")


def launch(folder: Path, mode: str) -> subprocess.Popen:
    (folder / "rank.py").write_text(RANK)
    command = [sys.executable, "-m", "nnh_train.torchrun", "--standalone", "--nproc-per-node=1",
               str(folder / "rank.py"), str(folder), mode]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    return subprocess.Popen(command, env={**env, "OMP_NUM_THREADS": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip


def signalled(folder: Path, number: int) -> tuple[int, str]:
    """The launcher's exit code and stderr after ``number`` reaches it once its rank is up."""
    launcher = launch(folder, "wait")
    try:
        deadline = time.monotonic() + 60
        while not (folder / "ready").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr.read()
            time.sleep(0.05)
        launcher.send_signal(number)
        _, err = launcher.communicate(timeout=60)
        return launcher.returncode, err
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


@pytest.mark.timeout(120)
def test_sigusr1_reaches_the_rank_and_a_preemption_save_exits_75(tmp_path):
    code, err = signalled(tmp_path, signal.SIGUSR1)
    assert code == PREEMPTED_EXIT_CODE, err
    assert f"the ranks saved after a preemption signal; exit code {PREEMPTED_EXIT_CODE}" in err
    assert "Traceback" not in err, err


@pytest.mark.timeout(120)
def test_ctrl_c_exits_130(tmp_path):
    code, err = signalled(tmp_path, signal.SIGINT)
    assert code == 128 + signal.SIGINT, err
    assert "nnh-torchrun: stopped by SIGINT" in err


@pytest.mark.timeout(120)
def test_a_failing_rank_fails_as_under_torchrun(tmp_path):
    launcher = launch(tmp_path, "fail")
    _, err = launcher.communicate(timeout=100)
    assert launcher.returncode == 1, err
    assert "ChildFailedError" in err and "exitcode  : 3" in err
