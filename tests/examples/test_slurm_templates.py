"""``examples/slurm/*.sbatch`` and ``train_minimal.py`` under Slurm: the templates are valid bash
and use the variables ``initialize_ddp`` reads; on the loopback cluster of ``../shared/slurm``,
``srun -n 2`` trains like torchrun, and ``scancel --signal=USR1`` of the CPU form of each
template (its own launch line: srun, or srun of nnh-torchrun with one agent or a c10d
rendezvous) makes it save, exit 75, requeue itself and finish with the weights of an
uninterrupted run."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tests.examples.test_train_minimal as e2e
from tests.examples.test_train_minimal import ARGS, SCRIPT, assert_same_weights, env
from tests.nnh_data.precompute import test_slurm as test_precompute_slurm
from tests.support import ROOT, free_port

data_dir, reference = e2e.data_dir, e2e.reference  # its module-scoped fixtures, used here too
cluster = test_precompute_slurm.cluster  # skips unless the loopback Slurm answers (or starts)

TEMPLATES = sorted((ROOT / "examples" / "slurm").glob("*.sbatch"))
DDP_INIT = (ROOT / "nnh_train" / "ddp_init.py").read_text()
# What a batch script may expand itself: set by sbatch for the job, not read by initialize_ddp.
JOB_VARIABLES = {"SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_GPUS_ON_NODE", "SLURM_JOB_ID"}
LAUNCH_VARIABLES = r"\b(SLURM_[A-Z_]+|MASTER_ADDR|MASTER_PORT|LOCAL_RANK|WORLD_SIZE|RANK)\b"


def slurm_env() -> dict[str, str]:
    """This process's environment without the SLURM_* variables of an enclosing job."""
    return {k: v for k, v in env().items() if not k.startswith("SLURM_")}


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_template_is_valid_bash_with_the_preemption_settings(template):
    assert subprocess.run(["bash", "-n", str(template)], timeout=10).returncode == 0
    text = template.read_text()
    for line in ("#SBATCH --signal=USR1@90", "#SBATCH --requeue", "#SBATCH --open-mode=append"):
        assert line in text, line
    assert "--resume auto" in text and "--requeue" in text


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_template_variables_are_the_ones_initialize_ddp_reads(template):
    text = template.read_text()
    lines = text.splitlines()
    comments = "\n".join(s for s in lines if s.startswith("#") and "#SBATCH" not in s)
    code = "\n".join(s.split("  #")[0] for s in lines if not s.startswith("#"))
    for name in set(re.findall(LAUNCH_VARIABLES, comments)):
        assert re.search(rf"\b{name}\b", DDP_INIT), f"{name} is named but not read by ddp_init"
    expanded = set(re.findall(r"\$\{?(SLURM_[A-Z_]+)", code))
    assert expanded <= JOB_VARIABLES, expanded - JOB_VARIABLES
    exported = set(re.findall(r"export (\w+)=", code))
    assert not exported & {"RANK", "LOCAL_RANK", "WORLD_SIZE"}  # the launcher's to set


@pytest.mark.timeout(300)
def test_srun_two_tasks_train_like_torchrun(cluster, reference, data_dir, tmp_path):
    command = ["srun", "-n", "2", "--time=5", sys.executable, str(SCRIPT), *ARGS,
               "--data-dir", data_dir, "--run-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, env=slurm_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "validation accuracy" in done.stdout
    assert_same_weights(reference[0] / "last.pt", tmp_path / "last.pt")


def job_fields(job: str) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                           text=True, timeout=20).stdout  # fmt: skip
    return dict(re.findall(r"(\w+)=(\S*)", shown))


def wait_for_job(job: str, timeout: float) -> dict[str, str]:
    """Poll until the job ends; a requeued job is made eligible at once (not in ~2 minutes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = job_fields(job)
        state = fields.get("JobState", "")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return fields
        if state == "PENDING" and fields.get("Restarts", "0") != "0":
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                           capture_output=True, timeout=20)  # fmt: skip
        time.sleep(1)
    subprocess.run(["scancel", job], timeout=20)
    raise AssertionError(f"job {job} did not end in {timeout} s: {job_fields(job)}")


def cpu_form(template: Path, folder: Path) -> Path:
    """The template without its GPU request (the loopback node has none)."""
    path = folder / template.name
    path.write_text("".join(line for line in template.read_text().splitlines(keepends=True)
                            if not line.startswith("#SBATCH --gpus")))  # fmt: skip
    return path


# sbatch options making each template a job of 2 ranks on the one loopback node.
TWO_RANKS = {
    "multi_node_one_gpu.sbatch": ["--ntasks-per-node=2"],  # one rank per srun task
    "one_node_multi_gpu.sbatch": ["--ntasks-per-node=1"],  # torchrun starts GPUS=2 ranks
    "multi_node_multi_gpu.sbatch": ["--ntasks-per-node=1"],
}


def submit(template: Path, folder: Path, data_dir: str) -> tuple[str, Path, Path]:
    """The CPU form of ``template`` as a 2-rank job: (job id, run folder, log)."""
    folder.mkdir()
    script = cpu_form(template, folder)
    run_dir, log = folder / "run", folder / "job.out"
    command = ["sbatch", "--parsable", "--nodes=1", *TWO_RANKS[template.name],
               "--cpus-per-task=1", "--time=10", f"--chdir={ROOT}", f"--output={log}",
               str(script), *ARGS, "--data-dir", data_dir, "--run-dir", str(run_dir)]  # fmt: skip
    env = {**slurm_env(), "PYTHON": sys.executable, "GPUS": "2", "RDZV_PORT": str(free_port())}
    done = subprocess.run(command, env=env, check=True, capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    return done.stdout.strip().split(";")[0], run_dir, log


@pytest.mark.timeout(600)
def test_usr1_to_each_template_saves_exits_75_requeues_and_ends_with_the_same_weights(
    cluster, reference, data_dir, tmp_path
):
    jobs = {t.name: submit(t, tmp_path / t.stem, data_dir) for t in TEMPLATES}  # all at once
    waiting, deadline = dict(jobs), time.monotonic() + 300
    while waiting:  # signal each job once it has a checkpoint to resume from
        for name, (job, run_dir, _) in list(waiting.items()):
            if (run_dir / "last.pt").exists():
                subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=20)
                del waiting[name]
        assert time.monotonic() < deadline, [job_fields(job) for job, *_ in waiting.values()]
        time.sleep(0.05)
    for name, (job, run_dir, log) in jobs.items():
        fields, text = wait_for_job(job, 500), log.read_text()
        assert fields["JobState"] == "COMPLETED", (name, fields, text[-4000:])
        assert fields["Restarts"] == "1", (name, text[-4000:])  # saved, requeued, run again
        assert "exiting with code 75" in text and "resuming from" in text, (name, text[-4000:])
        if "nnh_train.torchrun" in template_text(name):
            assert "nnh-torchrun: the ranks saved after a preemption signal; exit code 75" in text
        assert "validation accuracy" in text and "Traceback" not in text, (name, text[-4000:])
        assert_same_weights(reference[0] / "last.pt", run_dir / "last.pt")


def template_text(name: str) -> str:
    return (ROOT / "examples" / "slurm" / name).read_text()
