"""``examples/hf_datasets.py`` end to end: a data set built with ``datasets``, written as
``to_parquet`` shards and a ``save_to_disk`` folder, trained on by NNHandler under torchrun with
2 CPU processes (gloo), cropped in the workers. Tiny (512 images, 2 epochs), with a hard
timeout; skipped where ``datasets`` is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

pytest.importorskip("datasets", reason="examples/hf_datasets.py needs the datasets package "
                    "(pip install datasets, or the dev extra)")  # fmt: skip

SCRIPT = ROOT / "examples" / "hf_datasets.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.timeout(240)
def test_two_processes_stream_parquet_and_saved_folders_and_learn(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    command = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(SCRIPT), "--device",
               "cpu", "--epochs", "2", "--train-samples", "512", "--val-samples", "128",
               "--data-dir", str(tmp_path / "data")]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("validation"))
    accuracy, count = float(line.split()[2]), int(line.split()[4])
    assert count == 128  # every validation sample once, the ranks' pads dropped
    assert accuracy >= 0.7, done.stdout
    assert "(2 process(es), 16 steps)" in line  # 512 / (2 ranks x 32) x 2 epochs
    parquet = sorted(p.name for p in (tmp_path / "data" / "train").glob("*.parquet"))
    arrow = sorted(p.name for p in (tmp_path / "data" / "val").glob("*.arrow"))
    assert len(parquet) == 4 and len(arrow) == 3
