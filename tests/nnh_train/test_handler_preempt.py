"""Preemption, Ctrl-C and crashes of tests/scripts/handler_job.py (2 gloo ranks, a persistent
DataLoader worker each) under every launcher: python processes with torchrun's variables,
``torchrun``, ``nnh-torchrun`` (one agent and two with a c10d rendezvous) and ``srun``.

A signal to a rank, to each rank's process group (as torchrun's agent and Slurm send it: the
loader workers get it too) or to the launcher makes both ranks save at the same step and exit
75, and no process (agent, rank, worker) is left 30 s later; Ctrl-C stops each rank with one
line. A run interrupted under each launcher in turn, resumed each time from ``last.pt``, ends
with bitwise the weights of an uninterrupted run.
"""

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
from nnh_train.preemption import PREEMPTED_EXIT_CODE
from tests.nnh_data.precompute import test_slurm as test_precompute_slurm
from tests.support import SCRIPTS, free_port, processes_mentioning

SCRIPT = SCRIPTS / "handler_job.py"
WORLD = 2
TORCHRUN = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node=2"]
NNH_TORCHRUN = [sys.executable, "-m", "nnh_train.torchrun", "--standalone", "--nproc-per-node=2"]
SLOW = ("--slow", "0.05", "--workers", "1", "--every", "5")  # a step every 50 ms or more
cluster = test_precompute_slurm.cluster  # skips unless the loopback Slurm answers (or starts)
SAVED = r"rank (\d): signal received on rank\(s\) \[[\d, ]+\]; saving \S+ at step (\d+)"


def job_env(**extra: str) -> dict[str, str]:
    """This environment without the variables of an enclosing launcher."""
    prefixes = ("SLURM_", "TORCHELASTIC_", "PET_")
    base = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    return {**base, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1", **extra}


_STARTED: list[tuple[subprocess.Popen, Path]] = []


@pytest.fixture(autouse=True)
def no_job_left():
    """Kill what a test started and left running (one that failed waiting for a step): the
    job's process group, then every process that names its folder (ranks in process groups of
    their own, their loader workers), so nothing of it outlives the test."""
    yield
    while _STARTED:
        job, folder = _STARTED.pop()
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        named = str(folder).encode()
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and named in (entry / "cmdline").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:  # ended meanwhile
                continue


def start(folder: Path, name: str, command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """``command`` in its own session (a terminal's process group), stderr to ``folder/name``."""
    with open(folder / name, "w") as err:
        job = subprocess.Popen(command, env=env, stderr=err, stdout=subprocess.DEVNULL,
                               start_new_session=True)  # fmt: skip
    _STARTED.append((job, folder))
    return job


def python_ranks(folder: Path, tag: str, *args: str, env: dict | None = None) -> list:
    """One python process per rank, with the variables torchrun would set."""
    port = str(free_port())
    return [
        start(folder, f"{tag}-{rank}.err", [sys.executable, str(SCRIPT), str(folder), *args],
              job_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                      **(env or {})))
        for rank in range(WORLD)
    ]  # fmt: skip


def agents(folder: Path, tag: str, launcher: list[str], *args: str) -> list:
    return [start(folder, f"{tag}-0.err", [*launcher, str(SCRIPT), str(folder), *args],
                  job_env())]  # fmt: skip


def two_agents(folder: Path, tag: str, *args: str) -> list:
    """Two nnh-torchrun agents of one rank each, meeting at a c10d rendezvous."""
    rdzv = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={tag}"]  # fmt: skip
    command = [sys.executable, "-m", "nnh_train.torchrun", *rdzv, str(SCRIPT), str(folder), *args]
    return [start(folder, f"{tag}-{node}.err", command, job_env()) for node in range(2)]


def wait(processes: list, timeout: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def wait_for_step(folder: Path, step: int, timeout: float = 120) -> None:
    """Until rank 0 reports optimizer step ``step`` (``--slow`` writes ``progress-0``)."""
    path = folder / "progress-0"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text().strip() if path.exists() else ""  # "" while being rewritten
        if text and int(text) >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"rank 0 did not reach step {step} in {timeout} s")


def stderr(folder: Path, tag: str) -> str:
    return "\n".join(p.read_text() for p in sorted(folder.glob(f"{tag}-*.err")))


def assert_saved_together(folder: Path, tag: str, clean: bool = True) -> int:
    """Both ranks said they save at one step, last.pt holds it, nothing is left running;
    ``clean``: no traceback either (plain torchrun prints its own)."""
    assert processes_mentioning(str(folder)) == []
    text = stderr(folder, tag)
    said = re.findall(SAVED, text)
    assert sorted(rank for rank, _ in said) == ["0", "1"], text[-3000:]
    assert len({step for _, step in said}) == 1, text[-3000:]
    assert "killed by signal" not in text, text[-3000:]
    assert not clean or "Traceback" not in text, text[-3000:]
    saved = load_checkpoint(folder / "last.pt")
    assert saved["step"] == int(said[0][1]) and saved["batches_done"] > 0
    return saved["step"]


def next_step(folder: Path) -> int:
    """A step the resumed run has not reached yet: a few past what any rank reported."""
    return int((folder / "progress-0").read_text()) + 3


def resume(folder: Path) -> tuple[str, str]:
    return "--resume", str(folder / "last.pt")


def final_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(folder / "final.pt")["model"]


def assert_equal_weights(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def finish(folder: Path, uninterrupted: dict) -> None:
    """Resume to the end (python ranks) and compare with the uninterrupted run."""
    codes = wait(python_ranks(folder, "end", *resume(folder), "--workers", "1"))
    assert codes == [0, 0], stderr(folder, "end")
    assert "terminate called" not in stderr(folder, "end")
    assert_equal_weights(final_weights(folder), uninterrupted)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    folder = tmp_path_factory.mktemp("whole")
    assert wait(python_ranks(folder, "run", "--workers", "1")) == [0, 0], stderr(folder, "run")
    return final_weights(folder)


@pytest.mark.timeout(600)
def test_python_ranks_usr1_on_one_rank_sigterm_to_each_group_then_ctrl_c(tmp_path, uninterrupted):
    folder = tmp_path
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/requeued\n')
    scontrol.chmod(0o755)
    # SIGUSR1 to rank 1's process only: both save; rank 0 requeues the Slurm job.
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    ranks = python_ranks(folder, "usr1", *SLOW, "--requeue", env=env)
    wait_for_step(folder, 4)
    ranks[1].send_signal(signal.SIGUSR1)
    assert wait(ranks) == [PREEMPTED_EXIT_CODE] * WORLD, stderr(folder, "usr1")
    assert_saved_together(folder, "usr1")
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "4242"]
    # SIGTERM to every process of each rank, its loader worker included (as Slurm sends it).
    ranks = python_ranks(folder, "term", *SLOW, *resume(folder))
    wait_for_step(folder, next_step(folder))
    for rank in ranks:
        os.killpg(rank.pid, signal.SIGTERM)
    assert wait(ranks) == [PREEMPTED_EXIT_CODE] * WORLD, stderr(folder, "term")
    assert_saved_together(folder, "term")
    # Ctrl-C (SIGINT to each rank's process group): one line per rank, the last save loads.
    ranks = python_ranks(folder, "int", *SLOW, *resume(folder))
    wait_for_step(folder, next_step(folder))
    for rank in ranks:
        os.killpg(rank.pid, signal.SIGINT)
    assert wait(ranks, timeout=30) == [-signal.SIGINT] * WORLD, stderr(folder, "int")
    text = stderr(folder, "int")
    lines = re.findall(r"rank (\d): interrupted at step \d+ .*; last checkpoint \S+last.pt", text)
    printed = [line for line in text.splitlines() if line.strip()]
    assert sorted(lines) == ["0", "1"] and len(printed) == 2, text[-3000:]
    assert processes_mentioning(str(folder)) == []
    load_checkpoint(folder / "last.pt")
    finish(folder, uninterrupted)


@pytest.mark.timeout(600)
def test_torchrun_and_nnh_torchrun_signals_to_the_agent(tmp_path, uninterrupted):
    folder = tmp_path
    # torchrun passes SIGTERM on to the ranks' process groups; its own exit code is 1.
    job = agents(folder, "term", TORCHRUN, *SLOW)
    wait_for_step(folder, 4)
    job[0].send_signal(signal.SIGTERM)
    assert wait(job) == [1], stderr(folder, "term")
    assert_saved_together(folder, "term", clean=False)
    # nnh-torchrun passes SIGUSR1 on (any torch) and exits 75 after the save.
    job = agents(folder, "usr1", NNH_TORCHRUN, *SLOW, *resume(folder))
    wait_for_step(folder, next_step(folder))
    job[0].send_signal(signal.SIGUSR1)
    assert wait(job) == [PREEMPTED_EXIT_CODE], stderr(folder, "usr1")
    assert_saved_together(folder, "usr1")
    # Two agents: SIGUSR1 to one, both ranks save, both agents exit 75.
    job = two_agents(folder, "two", *SLOW, *resume(folder))
    wait_for_step(folder, next_step(folder))
    job[0].send_signal(signal.SIGUSR1)
    assert wait(job) == [PREEMPTED_EXIT_CODE] * 2, stderr(folder, "two")
    assert_saved_together(folder, "two")
    # torchrun without --signals-to-handle dies of SIGUSR1: its ranks get SIGTERM, and save.
    job = agents(folder, "orphan", TORCHRUN, *SLOW, *resume(folder))
    wait_for_step(folder, next_step(folder))
    job[0].send_signal(signal.SIGUSR1)
    assert wait(job) == [-signal.SIGUSR1]
    assert_saved_together(folder, "orphan")
    finish(folder, uninterrupted)


@pytest.mark.timeout(400)
def test_srun_sigusr1_to_the_job_step(cluster, tmp_path, uninterrupted):
    name = f"nnh-preempt-{os.getpid()}"
    command = ["srun", "-n", "2", f"--job-name={name}", "--time=5", sys.executable, str(SCRIPT),
               str(tmp_path), *SLOW]  # fmt: skip
    job = [start(tmp_path, "srun-0.err", command, job_env())]
    wait_for_step(tmp_path, 4)
    subprocess.run(["scancel", "--signal=USR1", f"--name={name}"], check=True, timeout=20)
    assert wait(job) == [PREEMPTED_EXIT_CODE], stderr(tmp_path, "srun")
    assert_saved_together(tmp_path, "srun")
    finish(tmp_path, uninterrupted)


@pytest.mark.timeout(300)
def test_sigkill_mid_epoch_then_resume_from_last_checkpoint(tmp_path, uninterrupted):
    ranks = python_ranks(tmp_path, "kill", *SLOW)
    wait_for_step(tmp_path, 17)
    ranks[0].kill()  # the rank that writes checkpoints, without warning
    wait(ranks, timeout=30)  # rank 1 fails in its next collective, or is killed
    saved = load_checkpoint(tmp_path / "last.pt")
    assert saved["step"] % 5 == 0 and saved["step"] >= 15 and saved["batches_done"] > 0
    assert processes_mentioning(str(tmp_path)) == []
    finish(tmp_path, uninterrupted)
