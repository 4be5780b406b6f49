"""A real 2-process gloo run under torchrun: equal batch counts, every sample once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "streaming_ddp_count.py"


@pytest.mark.timeout(180)
def test_torchrun_two_ranks_count_equal_batches(tar_shards, tmp_path):
    urls = tar_shards([9, 0, 14, 6])  # 29 samples: one rank pads
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(SCRIPT), urls[0].replace("000000", "*")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(line["rank"] for line in lines) == [0, 1]
    assert all(line["ok"] and line["world"] == 2 for line in lines), lines
    assert {line["batches"] for line in lines} == {4}  # 15 samples per rank in batches of 4
