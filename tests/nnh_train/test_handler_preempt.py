"""Preemption and crashes on 2 real processes (tests/scripts/handler_job.py, torchrun's variables):
SIGUSR1 on one rank makes both save at the same step and exit with PREEMPTED_EXIT_CODE (rank 0
requeues through scontrol), SIGKILL mid-epoch leaves the last checkpoint readable, and a run
resumed from either ends with bitwise the weights of an uninterrupted run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nnh_train.checkpoint import load_checkpoint
from nnh_train.handler import PREEMPTED_EXIT_CODE
from tests.support import SCRIPTS, free_port

SCRIPT = SCRIPTS / "handler_job.py"
WORLD = 2


def launch(folder: Path, *args: str, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """One process per rank of handler_job.py, stderr to ``folder/stderr-RANK``."""
    port = str(free_port())
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    processes = []
    for rank in range(WORLD):
        rank_env = {
            **base,
            **(env or {}),
            **{name: str(rank) for name in ("RANK", "LOCAL_RANK")},
            **{name: str(WORLD) for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE")},
            **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TQDM_DISABLE": "1"},
        }
        with open(folder / f"stderr-{rank}", "w") as err:
            command = [sys.executable, str(SCRIPT), str(folder), *args]
            processes.append(subprocess.Popen(command, env=rank_env, stderr=err,
                                              stdout=subprocess.DEVNULL))  # fmt: skip
    return processes


def wait(processes: list[subprocess.Popen], timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()


def wait_for_step(folder: Path, rank: int, step: int, timeout: float = 60) -> None:
    path = folder / f"progress-{rank}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text().strip() if path.exists() else ""  # "" while being rewritten
        if text and int(text) >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"rank {rank} did not reach step {step} in {timeout} s")


def final_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(folder / "final.pt")["model"]


def resumed_weights(folder: Path) -> dict[str, torch.Tensor]:
    assert wait(launch(folder, "--resume", str(folder / "last.pt"))) == [0, 0], stderr(folder)
    return final_weights(folder)


def stderr(folder: Path) -> str:
    return "\n".join((folder / f"stderr-{r}").read_text() for r in range(WORLD))


def assert_equal_weights(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    folder = tmp_path_factory.mktemp("whole")
    assert wait(launch(folder)) == [0, 0], stderr(folder)
    return final_weights(folder)


@pytest.mark.timeout(180)
def test_sigusr1_on_one_rank_saves_both_at_one_step_and_resumes_exactly(tmp_path, uninterrupted):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/requeued\n')
    scontrol.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    processes = launch(tmp_path, "--slow", "0.05", "--requeue", env=env)
    wait_for_step(tmp_path, 1, 15)  # epoch 1 (12 steps per epoch)
    processes[1].send_signal(signal.SIGUSR1)
    assert wait(processes) == [PREEMPTED_EXIT_CODE] * WORLD, stderr(tmp_path)
    steps = {int(s) for s in re.findall(r"rank \d: signal received on rank\(s\) \[1\]; saving "
                                        r"\S+ at step (\d+)", stderr(tmp_path))}  # fmt: skip
    assert len(steps) == 1, stderr(tmp_path)  # both ranks said so, at the same step
    saved = load_checkpoint(tmp_path / "last.pt")
    assert saved["step"] == steps.pop() and saved["batches_done"] > 0
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "4242"]
    assert_equal_weights(resumed_weights(tmp_path), uninterrupted)


@pytest.mark.timeout(180)
def test_sigkill_mid_epoch_then_resume_from_last_checkpoint(tmp_path, uninterrupted):
    processes = launch(tmp_path, "--slow", "0.05", "--every", "5")
    wait_for_step(tmp_path, 0, 17)
    processes[0].kill()  # the rank that writes checkpoints, without warning
    wait(processes, timeout=20)  # rank 1 fails in its next collective, or is killed
    saved = load_checkpoint(tmp_path / "last.pt")
    assert saved["step"] % 5 == 0 and saved["step"] >= 15 and saved["batches_done"] > 0
    assert_equal_weights(resumed_weights(tmp_path), uninterrupted)
