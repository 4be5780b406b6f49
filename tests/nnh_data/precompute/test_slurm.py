"""``nnh-precompute`` as a real Slurm job array: ``sbatch --array=0-7`` on the loopback cluster of
``../shared/slurm`` writes the table that one task writes, byte for byte."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest

from nnh_data.precompute.cli import main
from nnh_data.precompute.spec import MANIFEST_NAME
from nnh_data.precompute.verify import verify_precomputed_params
from tests.support import ROOT

START = ROOT.parent / "shared" / "slurm" / "start-local-slurm.sh"
ARGS = ["--num-samples", "40000", "--epochs", "2", "--preset", "moderate", "--seed", "4",
        "--rows-per-file", "5000", "--no-progress"]  # fmt: skip  # 16 files, 2 a task


def partition_up() -> bool:
    try:
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                                timeout=10).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(state in states for state in ("idle", "mix", "alloc"))


@pytest.fixture(scope="module")
def cluster() -> None:
    """Skip unless a Slurm partition answers, after trying to start the loopback one."""
    if not partition_up() and START.exists():
        subprocess.run(["bash", str(START)], capture_output=True, timeout=300)
    if shutil.which("sbatch") is None or not partition_up():
        pytest.skip(f"no Slurm partition answers `sinfo` and {START} could not start one "
                    "(it needs root and apt)")  # fmt: skip


@pytest.mark.timeout(400)
def test_an_eight_task_array_writes_the_one_task_table(cluster, tmp_path):
    one, array = tmp_path / "one", tmp_path / "array"
    assert main([*ARGS, "--out", str(one)]) == 0
    task = shlex.join([sys.executable, "-m", "nnh_data.precompute.cli", *ARGS, "--out", str(array)])
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(
        ["sbatch", "--wait", "--array=0-7", "--time=5", f"--chdir={ROOT}",
         f"--output={tmp_path}/task-%a.out", f"--wrap={task}"],
        capture_output=True, text=True, timeout=380, env=env,
    )  # fmt: skip
    logs = {p.name: p.read_text() for p in sorted(tmp_path.glob("task-*.out"))}
    assert done.returncode == 0, f"{done.stdout}{done.stderr}{logs}"
    assert all(f"task {i}/8: wrote 2 of 16 files" in logs[f"task-{i}.out"] for i in range(8))
    assert (array / MANIFEST_NAME).read_bytes() == (one / MANIFEST_NAME).read_bytes()  # sha256s
    assert verify_precomputed_params(array) == 80_000  # every file matches its listed sha256
