"""End-to-end runs of ``examples/train_minimal.py``: under torchrun (2 processes), two torchrun
agents with a c10d rendezvous, and ``srun -n 2``; exact resume after SIGKILL; a clear error for a
corrupt checkpoint. Every run is tiny (2,048 32x32 images, 2 epochs, CPU) and has a hard timeout.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support import ROOT

SCRIPT = ROOT / "examples" / "train_minimal.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
RUN_TIMEOUT = 150
ARGS = ["--device", "cpu", "--epochs", "2", "--batch-size", "32", "--save-every", "4"]
FILES = ("last.pt", "best.pt", "metrics.csv", "loss.png", "accuracy.png")


def env(progress: bool = False) -> dict[str, str]:
    """The runs' environment; without ``progress``, no progress lines (``TQDM_DISABLE``)."""
    base = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    quiet = {} if progress else {"TQDM_DISABLE": "1"}
    return {**base, **quiet, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def torchrun(*args: str) -> list[str]:
    return [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(SCRIPT), *args]


def run(
    command: list[str], timeout: float = RUN_TIMEOUT, progress: bool = False
) -> subprocess.CompletedProcess:
    done = subprocess.run(command, env=env(progress), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


def assert_same_weights(a: Path, b: Path) -> None:
    left, right = weights(a), weights(b)
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), f"{name} differs between {a} and {b}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The synthetic data set, written once for every run of this module."""
    spec = importlib.util.spec_from_file_location("train_minimal", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = tmp_path_factory.mktemp("shapes")
    module.write_split(str(folder / "train"), 0, 2048)
    module.write_split(str(folder / "val"), 2048, 512)
    return str(folder)


@pytest.fixture(scope="module")
def reference(
    data_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, subprocess.CompletedProcess]:
    """An uninterrupted torchrun run with 2 processes, as `make demo` runs it, its output piped:
    (run folder, the finished process)."""
    run_dir = tmp_path_factory.mktemp("reference")
    command = torchrun(*ARGS, "--data-dir", data_dir, "--run-dir", str(run_dir))
    return run_dir, run(command, progress=True)


@pytest.mark.timeout(200)
def test_torchrun_two_processes_converge_and_write_the_run_folder(reference):
    run_dir, done = reference
    stdout = done.stdout
    line = next(line for line in stdout.splitlines() if line.startswith("validation accuracy"))
    accuracy, count = float(line.split()[2]), int(line.split()[4])
    assert count == 512  # every validation sample once, pads dropped
    assert accuracy >= 0.8, stdout
    for name in FILES:
        assert (run_dir / name).stat().st_size > 0, name
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[0].startswith("epoch,step,train_loss")
    losses = [float(row.split(",")[2]) for row in rows[1:]]
    assert losses[1] < losses[0]
    # stderr is a pipe: rank 0's plain progress lines, no tqdm carriage returns
    assert "\r" not in done.stderr
    assert re.findall(r"^epoch 2/2 batch (\d+)/32 loss ", done.stderr, re.M)[-1] == "32"


@pytest.mark.timeout(400)
def test_sigkill_mid_epoch_then_resume_auto_gives_the_same_weights(reference, data_dir, tmp_path):
    where = ["--data-dir", data_dir, "--run-dir", str(tmp_path), "--resume", "auto"]
    command = torchrun(*ARGS, *where)
    proc = subprocess.Popen(command, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + RUN_TIMEOUT
    while not (tmp_path / "last.pt").exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the agent, its ranks and their loader workers
    proc.wait(timeout=30)
    killed_at = torch.load(tmp_path / "last.pt", weights_only=True)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it was killed"
    assert (killed_at["epoch"], killed_at["batches_done"]) != (2, 0)
    done = run(command)
    assert "resuming from" in done.stdout
    assert_same_weights(reference[0] / "last.pt", tmp_path / "last.pt")


@pytest.mark.timeout(120)
def test_corrupt_checkpoint_gives_a_clear_error(data_dir, tmp_path):
    (tmp_path / "last.pt").write_bytes(b"not a checkpoint")
    command = [sys.executable, str(SCRIPT), *ARGS, "--data-dir", data_dir,
               "--run-dir", str(tmp_path), "--resume", "auto"]  # fmt: skip
    done = subprocess.run(command, env=env(), capture_output=True, text=True, timeout=90)
    assert done.returncode != 0
    assert "CheckpointError" in done.stderr and "last.pt" in done.stderr, done.stderr[-2000:]
    assert "truncated or corrupt" in done.stderr


@pytest.mark.timeout(120)
def test_max_steps_before_the_first_checkpoint_still_writes_the_plots(data_dir, tmp_path):
    run_dir = tmp_path / "new" / "run"  # the run folder exists only after a save
    run([sys.executable, str(SCRIPT), *ARGS, "--max-steps", "2", "--data-dir", data_dir,
         "--run-dir", str(run_dir)], timeout=90)  # fmt: skip
    assert (run_dir / "loss.png").exists() and (run_dir / "accuracy.png").exists()
    assert not (run_dir / "last.pt").exists()


@pytest.mark.timeout(300)
def test_two_torchrun_agents_with_a_c10d_rendezvous_train_like_one(reference, data_dir, tmp_path):
    port = free_port()
    agents = [
        subprocess.Popen(
            [str(TORCHRUN), "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}",
             "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=e2e",
             str(SCRIPT), *ARGS, "--data-dir", data_dir, "--run-dir", str(tmp_path)],
            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    try:
        outputs = [agent.communicate(timeout=2 * RUN_TIMEOUT) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    for agent, (_, stderr) in zip(agents, outputs):
        assert agent.returncode == 0, stderr[-4000:]
    assert "validation accuracy" in outputs[0][0] + outputs[1][0]
    assert_same_weights(reference[0] / "last.pt", tmp_path / "last.pt")  # same ranks, same data


@pytest.mark.timeout(200)
def test_precomputed_parameters_give_the_same_weights(reference, data_dir, tmp_path):
    table = tmp_path / "params"
    subprocess.run([str(Path(sys.executable).with_name("nnh-precompute")), "--num-samples",
                    "2048", "--preset", "moderate", "--seed", "0", "--epochs", "2",
                    "--out", str(table), "--no-progress"],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    run(torchrun(*ARGS, "--data-dir", data_dir, "--run-dir", str(tmp_path / "run"),
                 "--precomputed", str(table)))  # fmt: skip
    assert_same_weights(reference[0] / "last.pt", tmp_path / "run" / "last.pt")
