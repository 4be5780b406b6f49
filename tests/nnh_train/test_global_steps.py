"""NNHandler on global batches: one process accumulating its loader batches takes the optimizer
steps of 2 and 4 gloo processes (per-step losses within 1e-6 relative in float64), and a
4-process run preempted by SIGUSR1 mid-epoch, resumed on 2 processes, ends with the weights of
the uninterrupted 4-process run."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from nnh_data import ShardedStreamingDataset
from nnh_data.shards.reading import build_shard_index
from nnh_train.callbacks import Callback
from nnh_train.checkpoint import load_checkpoint
from nnh_train.handler import NNHandler
from nnh_train.preemption import PREEMPTED_EXIT_CODE
from tests.support import SCRIPTS, processes_mentioning, run_distributed

GLOBAL = {"global_batch_size": 16, "partitions": 4, "seed": 2, "shuffle_window": 8}
COUNTS = [13, 0, 21, 8, 30]  # 72 samples: 5 global batches an epoch, the last with 8 pads
JOB = SCRIPTS / "global_steps_job.py"
NNH_TORCHRUN = [sys.executable, "-m", "nnh_train.torchrun", "--standalone"]


class Regression(nn.Module):
    """A linear model (no batch statistics) on the ``x`` field of dict batches."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 1, dtype=dtype)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.linear(batch["x"].to(self.linear.weight.dtype))


def features(sample: dict) -> dict:
    """A sample's 16 payload bytes as features in [0, 1], its id modulo 7 as the target."""
    x = np.frombuffer(sample["bin"], dtype=np.uint8).astype(np.float64) / 255
    return {**sample, "x": torch.from_numpy(x), "y": float(sample["__index__"] % 7)}


def squared(output: torch.Tensor, batch: dict) -> torch.Tensor:
    return (output.squeeze(1) - batch["y"].to(output.dtype)).pow(2).mean()


class StepLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_batch_end(self, handler: NNHandler) -> None:
        self.losses.append(handler.step_loss)


def trained(urls: list[str], dtype: torch.dtype, batch_size: int, **train: object) -> dict:
    """Two epochs of the regression on global batches: per-step losses, weights, steps."""
    torch.manual_seed(0)
    handler = NNHandler(Regression(dtype), device="cpu")
    handler.log_fn = lambda line: None
    handler.set_optimizer(torch.optim.SGD, lr=0.05)
    handler.set_loss_fn(squared)
    handler.set_train_loader(ShardedStreamingDataset(urls, decode=features, **GLOBAL),
                             batch_size=batch_size, num_workers=0)  # fmt: skip
    losses = StepLosses()
    handler.add_callback(losses)
    handler.train(2, **train)
    weights = {k: v.clone() for k, v in handler.module.state_dict().items()}
    return {"losses": losses.losses, "weights": weights, "step": handler.step}


def _ranks_trained(rank: int, world: int, urls: list[str], dtype: torch.dtype) -> dict:
    return trained(urls, dtype, batch_size=2)


def relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b, strict=True))


def test_one_process_accumulates_a_global_batch_per_step(tar_shards):
    urls = tar_shards(COUNTS)
    one = trained(urls, torch.float64, batch_size=2)  # 8 loader batches a step
    assert one["step"] == 10 and len(one["losses"]) == 10
    assert all(math.isfinite(loss) for loss in one["losses"])
    with pytest.raises(ValueError, match="a global batch is 4 loader batches per rank"):
        trained(urls, torch.float64, batch_size=4, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="global_batch_size=32 needs a training set of those"):
        trained(urls, torch.float64, batch_size=4, global_batch_size=32)


@pytest.mark.timeout(600)
def test_one_two_and_four_processes_take_the_same_steps(tar_shards):
    urls = tar_shards(COUNTS)
    build_shard_index(urls)  # the index sidecar, once
    for dtype, tolerance, worlds in ((torch.float64, 1e-6, (2, 4)), (torch.float32, 1e-3, (4,))):
        one = trained(urls, dtype, batch_size=2)
        runs = {w: run_distributed(_ranks_trained, w, urls, dtype, timeout=280)[0]
                for w in worlds}  # fmt: skip
        for world, run in runs.items():
            difference = relative(run["losses"], one["losses"])
            print(f"{dtype} {world} processes: per-step losses within {difference:.2e} relative")
            assert difference < tolerance, (dtype, world, difference)
            for name, weight in run["weights"].items():
                assert torch.allclose(weight, one["weights"][name], rtol=tolerance, atol=0)


def _job(folder: Path, urls: list[str], *args: str, nproc: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    command = [*NNH_TORCHRUN, f"--nproc-per-node={nproc}", str(JOB), str(folder),
               urls[0].replace("000000", "*"), *args]  # fmt: skip
    with open(folder / f"job-{nproc}-{len(args)}.err", "w") as err:
        return subprocess.Popen(command, env={**env, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"},
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


def _wait(job: subprocess.Popen, timeout: float = 400) -> int:
    try:
        return job.wait(timeout=timeout)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


@pytest.mark.timeout(1200)
def test_four_ranks_preempted_mid_epoch_resume_on_two_with_the_same_weights(tar_shards, tmp_path):
    urls = tar_shards(COUNTS)
    build_shard_index(urls)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir()
    cut.mkdir()
    assert _wait(_job(whole, urls, nproc=4)) == 0, (whole / "job-4-0.err").read_text()[-3000:]
    job = _job(cut, urls, "--slow", "0.5", "--workers", "1", nproc=4)
    progress, deadline = cut / "progress-0", time.monotonic() + 300
    while not (progress.exists() and progress.read_text().strip() and
               int(progress.read_text()) >= 6):  # step 6 of 15: epoch 2, batch 1 of 5
        # (4 steps of 0.5 s to the epoch's end: the stop lands mid-epoch on a loaded machine)
        assert job.poll() is None and time.monotonic() < deadline, (
            (cut / "job-4-4.err").read_text()[-3000:])  # fmt: skip
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)  # to the agent, which passes it on to the ranks
    assert _wait(job) == PREEMPTED_EXIT_CODE, (cut / "job-4-4.err").read_text()[-3000:]
    saved = load_checkpoint(cut / "last.pt")
    assert saved["world_size"] == 4 and saved["batches_done"] > 0  # mid-epoch
    resumed = _job(cut, urls, "--resume", str(cut / "last.pt"), "--workers", "1", nproc=2)
    assert _wait(resumed) == 0, (cut / "job-2-4.err").read_text()[-3000:]
    assert processes_mentioning(str(tmp_path)) == []
    final = load_checkpoint(cut / "final.pt")["model"]
    expected = load_checkpoint(whole / "final.pt")["model"]
    for name, weight in expected.items():
        assert torch.allclose(final[name], weight, rtol=1e-9, atol=0), name
