"""What the Lightning and Accelerate example tests share: running an example with 2 CPU
processes, reading the ids each rank recorded, and comparing final weights."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import torch

from tests.support import ROOT

TIMEOUT = 240
SAMPLES, BATCH = 512, 32  # 8 steps per epoch on each of 2 ranks


def common_args(data: Path, run: Path, ids: Path) -> list[str]:
    return ["--epochs", "2", "--batch-size", str(BATCH), "--train-samples", str(SAMPLES),
            "--num-workers", "1", "--data-dir", str(data), "--run-dir", str(run),
            "--record-ids", str(ids)]  # fmt: skip


def run(command: list[str]) -> str:
    """Run ``command`` from the repository; its stdout (an error names its stderr's tail)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stderr[-5000:]}"
    return done.stdout


def recorded(ids: Path) -> dict[int, list[dict]]:
    """Per rank, what it recorded: one line per epoch (or part of one) with its ids."""
    return {rank: [json.loads(line) for line in (ids / f"rank{rank}.jsonl").open()]
            for rank in (0, 1)}  # fmt: skip


def assert_each_sample_once(ids: Path, epochs: int = 2) -> None:
    """Every epoch's recorded ids, over both ranks and all runs, hold each sample once."""
    lines = recorded(ids)
    for epoch in range(epochs):
        seen = Counter(i for rank in (0, 1) for line in lines[rank] if line["epoch"] == epoch
                       for i in line["ids"])  # fmt: skip
        everything = Counter(range(SAMPLES))
        assert seen == everything, f"epoch {epoch}: {+(seen - everything)} {+(everything - seen)}"
    steps = [[line["step"] for line in lines[rank]] for rank in (0, 1)]
    assert steps[0] == steps[1], steps  # equal step counts on both ranks


def assert_same_weights(a: Path, b: Path) -> None:
    left, right = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), f"{name} differs between {a} and {b}"


def audit_lines(stdout: str) -> list[str]:
    """The first line of each audit report rank 0 printed."""
    return [line for line in stdout.splitlines() if line.startswith("epoch ")]
