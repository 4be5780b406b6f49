"""Launch-environment reading, devices and initialisation: tables for the pure parts, and real
launches (spawned gloo processes, ``torchrun --standalone``, ``srun -n 2``, ``sbatch``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from nnh_train.ddp_init import (
    LaunchEnv,
    _first_host_from_slurm_nodelist,
    _initialize_distributed,
    _is_env_distributed,
    _pick_device,
    _resolve_device,
    _settle_threads,
    _should_use_distributed,
    as_timedelta,
    get_dist_info,
    initialize_ddp,
    master_port_for_job,
    read_launch_env,
    set_master_env,
)
from tests.support import ROOT, SCRIPTS, run_distributed

JOB = str(SCRIPTS / "ddp_job.py")
CPU = torch.device("cpu")
TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
SRUN = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
        "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1"}
LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE")


@pytest.fixture
def launch_env(monkeypatch):
    """A process with no launcher variables; call it with a dict to set some."""
    for name in [n for n in os.environ if n.startswith(LAUNCH_PREFIXES)]:
        monkeypatch.delenv(name)

    def set_env(values: dict[str, str]) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_env


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, LaunchEnv()),
        (TORCHRUN, LaunchEnv("torchrun", 1, 1, 2)),
        (SRUN, LaunchEnv("slurm", 3, 1, 4)),
        # torchrun under srun: one agent per task, several workers each; torchrun's values win
        ({**SRUN, "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "x"},
         LaunchEnv("torchrun", 5, 1, 8)),
        # the same numbers copied from Slurm's by a wrapper script
        ({**SRUN, "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"},
         LaunchEnv("torchrun", 3, 1, 4)),
        # a batch script (no SLURM_STEP_ID) is not a launch of several processes
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}, LaunchEnv()),
    ],
)
def test_read_launch_env(env, expected):
    assert read_launch_env(env) == expected


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({**SRUN, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"},
         "WORLD_SIZE=1 but SLURM_NTASKS=4"),
        ({**SRUN, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4"},
         "RANK=0 but SLURM_PROCID=3, LOCAL_RANK=0 but SLURM_LOCALID=1"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "RANK, WORLD_SIZE set but LOCAL_RANK not"),
    ],
)
def test_contradicting_launch_variables_raise_naming_them(env, message):
    with pytest.raises(RuntimeError, match=message):
        read_launch_env(env)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, r"RANK must be in \[0, 1\], got 2"),
        ({"RANK": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "RANK must be a non-negative int"),
        ({**SRUN, "SLURM_LOCALID": "2"}, r"SLURM_LOCALID must be in \[0, 1\], got 2"),
        ({**SRUN, "SLURM_TASKS_PER_NODE": "2x2"}, "SLURM_TASKS_PER_NODE must be a comma list"),
    ],
)
def test_bad_launch_values_raise_value_error(env, message):
    with pytest.raises(ValueError, match=message):
        read_launch_env(env)


def test_should_use_distributed_flags(launch_env):
    assert _should_use_distributed(None) is False and _is_env_distributed() is False
    with pytest.raises(RuntimeError, match="use_distributed=True but no launcher variables"):
        _should_use_distributed(True)
    with pytest.raises(ValueError, match="use_distributed must be True, False or None"):
        _should_use_distributed("yes")
    launch_env({**TORCHRUN, "WORLD_SIZE": "2"})
    assert _should_use_distributed(None) is True and _is_env_distributed() is True
    assert _should_use_distributed(False) is False
    launch_env({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    assert _should_use_distributed(None) is False
    assert _should_use_distributed(True) is True  # a group of one, when asked for


def test_batch_script_without_srun_is_detected_with_a_hint(launch_env):
    launch_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"})
    with pytest.warns(RuntimeWarning, match=r"SLURM_NTASKS=4 but .* not started by srun"):
        assert _should_use_distributed(None) is False
    with pytest.raises(RuntimeError, match=r"start it with `srun python \.\.\.`"):
        _should_use_distributed(True)


def test_master_address_and_port_from_slurm():
    env = {"SLURM_JOB_NODELIST": "gpu-a[07-09],gpu-b1", "SLURM_JOB_ID": "1234"}
    set_master_env(env)
    assert env["MASTER_ADDR"] == "gpu-a07" and env["MASTER_PORT"] == "16234"
    # the step's nodes first; values already set are kept
    env = {"SLURM_STEP_NODELIST": "n[3-4]", "SLURM_NODELIST": "n[1-4]", "MASTER_PORT": "29500",
           "SLURM_JOB_ID": "1"}
    set_master_env(env)
    assert env["MASTER_ADDR"] == "n3" and env["MASTER_PORT"] == "29500"
    with pytest.raises(RuntimeError, match="MASTER_ADDR is unset"):
        set_master_env({"SLURM_JOB_ID": "1"})
    assert _first_host_from_slurm_nodelist("node[001-004,007]") == "node001"


@given(st.integers(0, 10**9))
def test_master_port_uses_the_whole_job_id_outside_ephemeral_ports(job_id):
    port = master_port_for_job(str(job_id))
    assert 15000 <= port < 30000 < 32768  # Linux's ephemeral ports start at 32768
    assert master_port_for_job(str(job_id + 10_000)) != port  # not just the last digits


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback without CUDA")
def test_resolve_device_without_cuda():
    assert _resolve_device("cpu") == CPU and _resolve_device(CPU) == CPU
    for name in ("cuda", "gpu", "cuda:1", "GPU:0"):
        with pytest.warns(RuntimeWarning, match="CUDA is not available"):
            assert _resolve_device(name) == CPU
    for bad in ("tpu", "cuda:x", "mps", 3):
        with pytest.raises(ValueError, match="device must be"):
            _resolve_device(bad)


@pytest.mark.parametrize(("count", "local_rank", "expected"),
                         [(0, 3, "cpu"), (1, 3, "cuda:0"), (4, 2, "cuda:2")])
def test_pick_device(monkeypatch, count, local_rank, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert _pick_device(local_rank) == torch.device(expected)


def test_pick_device_refuses_to_share_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(RuntimeError, match="local rank 4 has no GPU of its own: 4 are visible"):
        _pick_device(4)


def test_timeout_values():
    assert as_timedelta(None) == timedelta(minutes=60)
    assert as_timedelta(30) == timedelta(seconds=30)
    assert as_timedelta(timedelta(minutes=2)) == timedelta(minutes=2)
    for bad in (0, -1, "60", True):
        with pytest.raises(ValueError, match="timeout must be"):
            as_timedelta(bad)


def _spin(until: threading.Event, seconds: float = float("inf")) -> None:
    end = time.monotonic() + seconds
    while not until.is_set() and time.monotonic() < end:
        pass
    until.set()


def test_the_exit_waits_while_another_thread_still_runs():
    # what a gloo worker freeing the last collective's tensors needs: the GIL, before the
    # interpreter finalizes (pytorch/pytorch#190489)
    done = threading.Event()
    worker = threading.Thread(target=_spin, args=(done, 0.2))
    worker.start()
    _settle_threads(120)
    assert done.is_set()
    worker.join()


def test_the_exit_wait_ends_at_its_limit():
    stop = threading.Event()
    worker = threading.Thread(target=_spin, args=(stop,))
    worker.start()
    try:
        _settle_threads(0.1)
        assert worker.is_alive()
    finally:
        stop.set()
        worker.join()


def test_single_process_without_launcher(launch_env):
    assert initialize_ddp() == (False, 0, 0, 1, _pick_device(0))
    assert get_dist_info() == (False, 0, 0, 1, _pick_device(0))
    assert not dist.is_initialized()


def _init_twice(rank: int, world_size: int) -> dict:
    first = initialize_ddp(timeout=30, device="cpu")
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {"first": first, "again": initialize_ddp(), "info": get_dist_info(),
            "direct": _initialize_distributed(), "backend": dist.get_backend(),
            "sum": total.item()}


@pytest.mark.timeout(90)
def test_initialize_ddp_from_torchrun_variables_on_real_processes():
    for rank, report in enumerate(run_distributed(_init_twice, 2, init_group=False)):
        assert report["first"] == (True, rank, rank, 2, CPU)
        assert report["again"] is None  # a group exists: the documented contract
        assert report["info"] == report["direct"] == report["first"]
        assert report["backend"] == "gloo" and report["sum"] == 3.0


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_PREFIXES)}


def _reports(stdout: str) -> list[dict]:
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return sorted(lines, key=lambda r: r["rank"])


def _assert_two_rank_job(reports: list[dict]) -> None:
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["distributed"] and report["world_size"] == 2
        assert report["sum"] == 3.0 and report["mean_rank"] == 0.5
        assert report["again_is_none"] and report["error_rank"] == 1
        assert report["local_rank"] == report["rank"] and report["device"] == "cpu"


@pytest.mark.timeout(120)
def test_torchrun_standalone_two_ranks():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", JOB, "cpu"]
    done = subprocess.run(command, env=_clean_env(), capture_output=True, text=True,
                          timeout=100, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_two_rank_job(_reports(done.stdout))


def _sinfo_answers() -> bool:
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and any(s in done.stdout for s in ("idle", "mix", "alloc"))


@pytest.fixture(scope="module")
def slurm() -> None:
    """A local Slurm cluster, started by ../shared/slurm/start-local-slurm.sh when needed."""
    script = ROOT.parent / "shared" / "slurm" / "start-local-slurm.sh"
    if not _sinfo_answers() and script.exists():
        subprocess.run(["bash", str(script)], capture_output=True, timeout=300)
    if not _sinfo_answers():
        pytest.skip(f"no Slurm cluster answers `sinfo` and {script} could not start one "
                    "(it needs root and apt)")


@pytest.mark.timeout(150)
def test_srun_two_tasks_initialise_from_slurm_variables(slurm):
    command = ["srun", "-n", "2", "--kill-on-bad-exit=1", "--time=2", sys.executable, JOB, "cpu"]
    done = subprocess.run(command, env=_clean_env(), capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = _reports(done.stdout)
    _assert_two_rank_job(reports)
    job_id, nodelist = reports[0]["job"]
    expected = [_first_host_from_slurm_nodelist(nodelist), str(master_port_for_job(job_id))]
    assert all(r["master"] == expected for r in reports)


@pytest.mark.timeout(150)
def test_batch_script_without_srun_runs_alone_with_a_hint(slurm, tmp_path):
    out = tmp_path / "job.out"
    command = ["sbatch", "--wait", "-n", "2", "--time=2", f"--output={out}",
               f"--wrap={sys.executable} {JOB} cpu"]
    done = subprocess.run(command, env=_clean_env(), capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:] + out.read_text()
    [report] = _reports(out.read_text())
    assert not report["distributed"] and report["world_size"] == 1
    assert any("SLURM_NTASKS=2 but this process was not started by srun" in w
               for w in report["warnings"])
