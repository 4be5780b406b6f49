"""Process-group setup that works the same under ``python``, ``torchrun`` and ``srun``.

The launcher is read from the environment once, into a :class:`LaunchEnv`: torchrun's ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE`` win over Slurm's ``SLURM_PROCID``, ``SLURM_LOCALID`` and
``SLURM_NTASKS``, and values that contradict each other raise before any rank starts waiting for
peers that will never come. Under ``srun`` the rendezvous needs no wrapper script: ``MASTER_ADDR``
defaults to the step's first node and ``MASTER_PORT`` to a port derived from the job id. The
backend follows the device: nccl for CUDA, gloo otherwise. A group started here is destroyed
at interpreter exit, and the exit then waits (half a second at most) until no other
thread of the process is runnable: a gloo worker that is still freeing the tensors of the last
collective needs the GIL for it, and once the interpreter finalizes, a thread that asks for the
GIL is ended by ``pthread_exit``, which aborts the process (``terminate called without an active
exception``, SIGABRT, a failed job after a finished run; pytorch/pytorch#190489). Destroying the
group alone does not help, since DDP keeps the gloo backend and its threads alive. A rank
started by torchrun gets SIGTERM when its agent dies, so that it saves and stops (see
:mod:`nnh_train.preemption`) instead of training on, orphaned.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nnh_data.checks import check_int
from nnh_data.topology import dist_ready
from nnh_train.preemption import follow_launcher
from nnh_train.slurm import expand_slurm_nodelist, expand_tasks_per_node

__all__ = [
    "DEFAULT_TIMEOUT",
    "DistInfo",
    "LaunchEnv",
    "as_timedelta",
    "get_dist_info",
    "initialize_ddp",
    "master_port_for_job",
    "read_launch_env",
    "set_master_env",
]

DistInfo = tuple[bool, int, int, int, torch.device]
"""``(distributed, rank, local_rank, world_size, device)``."""

DEFAULT_TIMEOUT = timedelta(minutes=60)
_EXIT_SETTLE_S = 0.5  # the most a process with a group waits at exit for its other threads
# MASTER_PORT under Slurm: base + job id modulo span, below Linux's ephemeral ports (32768-60999)
# so that the kernel never hands the port to an outgoing connection first.
_PORT_BASE, _PORT_SPAN = 15000, 15000
_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
_NO_LAUNCHER = (
    "no launcher variables are set (RANK, LOCAL_RANK, WORLD_SIZE from torchrun, or SLURM_PROCID, "
    "SLURM_LOCALID, SLURM_NTASKS from srun): launch with `torchrun --nproc-per-node N script.py` "
    "or `srun -n N python script.py`"
)


@dataclass(frozen=True)
class LaunchEnv:
    """Who this process is according to its launcher: ``'torchrun'``, ``'slurm'`` or ``'none'``."""

    launcher: str = "none"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1


def initialize_ddp(
    timeout: timedelta | float | None = None,
    *,
    use_distributed: bool | None = None,
    device: torch.device | str | None = None,
) -> DistInfo | None:
    """Initialise the default process group when the launcher asks for one.

    Returns ``(distributed, rank, local_rank, world_size, device)``, or ``None`` when a process
    group already exists (then :func:`get_dist_info` gives the same fields).

    Args:
        timeout: collective timeout, a ``timedelta`` or seconds; default 60 minutes.
        use_distributed: True requires DDP, False never starts it, None (default) starts it when
            the launcher started more than one process.
        device: ``'cpu'``, ``'cuda'``, ``'cuda:N'``, ``'gpu'`` or a ``torch.device``; default the
            GPU of this local rank when CUDA is there, else the CPU.

    Example:
        >>> distributed, rank, local_rank, world_size, device = initialize_ddp()
    """
    if dist_ready():
        return None
    return _initialize_distributed(timeout, use_distributed=use_distributed, device=device)


def _initialize_distributed(
    timeout: timedelta | float | None = None,
    *,
    use_distributed: bool | None = None,
    device: torch.device | str | None = None,
) -> DistInfo:
    """The work of :func:`initialize_ddp`; :func:`get_dist_info` when already initialised."""
    if dist_ready():
        return get_dist_info()
    timeout = as_timedelta(timeout)
    if not _should_use_distributed(use_distributed):
        return False, 0, 0, 1, _choose_device(device, 0)
    launch = read_launch_env()
    chosen = _choose_device(device, launch.local_rank)
    if launch.launcher == "slurm":
        set_master_env(os.environ)
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    backend = "nccl" if chosen.type == "cuda" else "gloo"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        follow_launcher()
    dist.init_process_group(
        backend, rank=launch.rank, world_size=launch.world_size, timeout=timeout
    )
    atexit.unregister(_destroy_at_exit)  # once, however many groups this process starts
    atexit.register(_destroy_at_exit)
    if chosen.type == "cuda":
        dist.barrier(device_ids=[chosen.index])
    else:
        dist.barrier()
    return True, launch.rank, launch.local_rank, launch.world_size, chosen


def _destroy_at_exit() -> None:
    """The group destroyed (unless the script did), then the wait for gloo's threads, which
    DDP keeps alive either way (see the module)."""
    if dist_ready():
        dist.destroy_process_group()
    _settle_threads(_EXIT_SETTLE_S)


def _settle_threads(limit: float, poll: float = 0.01) -> None:
    """Sleep, the GIL released, until no thread of this process but the caller is runnable,
    at most ``limit`` seconds (one poll where there is no ``/proc``): a backend thread that
    needs the GIL to finish (a preempted gloo worker freeing a collective's tensors) gets it
    while the interpreter still hands it out."""
    deadline, me = time.monotonic() + limit, threading.get_native_id()
    while True:
        time.sleep(poll)
        if time.monotonic() >= deadline or not _others_runnable(me):
            return


def _others_runnable(me: int) -> bool:
    """Whether a thread of this process other than ``me`` is running or waiting for a CPU."""
    try:
        tasks = [int(task) for task in os.listdir("/proc/self/task")]
    except OSError:  # no /proc (macOS): nothing to look at
        return False
    for task in tasks:
        if task == me:
            continue
        try:
            with open(f"/proc/self/task/{task}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # the thread ended meanwhile
            continue
        if state == "R":
            return True
    return False


def get_dist_info() -> DistInfo:
    """``(distributed, rank, local_rank, world_size, device)`` of this process, at any time.

    Without a process group the process is alone: ``(False, 0, 0, 1, device)``.

    Example:
        >>> distributed, rank, local_rank, world_size, device = get_dist_info()
    """
    if not dist_ready():
        return False, 0, 0, 1, _pick_device(0)
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return True, rank, read_launch_env().local_rank, world_size, device


def _should_use_distributed(use_distributed_flag: bool | None) -> bool:
    """True = require DDP (raise when the environment cannot provide it), False = never,
    None = when the launcher started several processes and torch.distributed is available.
    (The keyword is the one the original NNHandler's DDP utilities document.)"""
    if use_distributed_flag is not None and not isinstance(use_distributed_flag, bool):
        raise ValueError(
            f"use_distributed must be True, False or None, got {use_distributed_flag!r}"
        )
    if use_distributed_flag is False:
        return False
    launch = read_launch_env()
    unlaunched = _slurm_without_srun(os.environ)
    problem = _distributed_problem(launch, unlaunched)
    if use_distributed_flag:
        if problem:
            raise RuntimeError(f"use_distributed=True but {problem}")
        return True
    if problem and (launch.world_size > 1 or unlaunched):
        warnings.warn(f"running without DDP: {problem}", RuntimeWarning, stacklevel=4)
    return problem is None and launch.world_size > 1


def _distributed_problem(launch: LaunchEnv, unlaunched: str | None) -> str | None:
    """Why DDP cannot start here, or None."""
    if not dist.is_available():
        return "torch.distributed is not available in this build of torch"
    if launch.launcher == "none":
        return unlaunched or _NO_LAUNCHER
    return None


def _is_env_distributed() -> bool:
    """True when the launcher started more than one process (torchrun's variables win)."""
    return read_launch_env().world_size > 1


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """This process's launch, from torchrun's variables, else from an srun step's."""
    env = os.environ if env is None else env
    torchrun, slurm = _torchrun_env(env), _slurm_env(env)
    if torchrun and slurm:
        _check_agreement(torchrun, slurm, env)
    return torchrun or slurm or LaunchEnv()


def _torchrun_env(env: Mapping[str, str]) -> LaunchEnv | None:
    present = [name for name in _TORCHRUN_VARS if name in env]
    if not present:
        return None
    if len(present) < len(_TORCHRUN_VARS):
        missing = sorted(set(_TORCHRUN_VARS) - set(present))
        raise RuntimeError(
            f"{', '.join(present)} set but {', '.join(missing)} not: set all of RANK, "
            "LOCAL_RANK and WORLD_SIZE (torchrun does) or none of them"
        )
    world = _env_int(env, "WORLD_SIZE", low=1)
    rank = _env_int(env, "RANK", high=world - 1)
    return LaunchEnv("torchrun", rank, _env_int(env, "LOCAL_RANK", high=world - 1), world)


def _slurm_env(env: Mapping[str, str]) -> LaunchEnv | None:
    """The srun step's view, or None outside a step (no SLURM_STEP_ID, as in a batch script)."""
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return None
    world = _env_int(env, "SLURM_NTASKS", low=1)
    rank = _env_int(env, "SLURM_PROCID", high=world - 1)
    local_rank = _env_int(env, "SLURM_LOCALID", high=_tasks_on_this_node(env, world) - 1)
    return LaunchEnv("slurm", rank, local_rank, world)


def _tasks_on_this_node(env: Mapping[str, str], world: int) -> int:
    if "SLURM_TASKS_PER_NODE" not in env:
        return world
    counts = expand_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
    node = _env_int(env, "SLURM_NODEID", high=len(counts) - 1) if "SLURM_NODEID" in env else 0
    return counts[node]


def _check_agreement(torchrun: LaunchEnv, slurm: LaunchEnv, env: Mapping[str, str]) -> None:
    """torchrun inside srun runs one agent per task and at least one worker per agent, so its
    world cannot be smaller; without a torchrun agent (no TORCHELASTIC_RUN_ID) and with equal
    worlds, the variables were copied from Slurm's and must match them. Anything else is usually
    a stale ``export WORLD_SIZE=...`` that srun passed on to every task."""
    pairs = [("WORLD_SIZE", "SLURM_NTASKS")] if torchrun.world_size < slurm.world_size else []
    if "TORCHELASTIC_RUN_ID" not in env and torchrun.world_size == slurm.world_size:
        pairs += [("RANK", "SLURM_PROCID")] if torchrun.rank != slurm.rank else []
        local_differs = torchrun.local_rank != slurm.local_rank
        pairs += [("LOCAL_RANK", "SLURM_LOCALID")] if local_differs else []
    if pairs:
        said = ", ".join(f"{a}={env[a]} but {b}={env[b]}" for a, b in pairs)
        raise RuntimeError(
            f"torchrun and Slurm variables disagree: {said}. torchrun's win, so the job would "
            "not be the srun step it runs in: unset RANK, LOCAL_RANK and WORLD_SIZE to use "
            "Slurm's, or start torchrun under srun"
        )


def _slurm_without_srun(env: Mapping[str, str]) -> str | None:
    """The hint for a batch script that runs ``python train.py`` itself in a several-task
    allocation: this is the only process, so DDP would wait forever for the others."""
    if "SLURM_STEP_ID" in env or any(name in env for name in _TORCHRUN_VARS):
        return None
    ntasks = env.get("SLURM_NTASKS", "1")
    if not ntasks.isdigit() or int(ntasks) <= 1:
        return None
    return (
        f"SLURM_NTASKS={ntasks} but this process was not started by srun (no SLURM_STEP_ID), so "
        f"it is alone: start it with `srun python ...` to use all {ntasks} tasks"
    )


def _env_int(env: Mapping[str, str], name: str, *, low: int = 0, high: int | None = None) -> int:
    value = env[name]
    if not value.strip().isdigit():
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return check_int(name, int(value), low=low, high=high)


def set_master_env(env: MutableMapping[str, str]) -> None:
    """Default MASTER_ADDR to the step's first node and MASTER_PORT to one derived from the job."""
    if "MASTER_ADDR" not in env:
        # The step's node list first: a step may run on a subset of the job's nodes.
        for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if name in env:
                env["MASTER_ADDR"] = _first_host_from_slurm_nodelist(env[name])
                break
        else:
            raise RuntimeError("MASTER_ADDR is unset and no SLURM_*NODELIST names the nodes")
    if "MASTER_PORT" not in env:
        if "SLURM_JOB_ID" not in env:
            raise RuntimeError("MASTER_PORT is unset and SLURM_JOB_ID is missing to derive it")
        env["MASTER_PORT"] = str(master_port_for_job(env["SLURM_JOB_ID"]))


def master_port_for_job(job_id: str) -> int:
    """A port in [15000, 30000) from the whole job id: jobs sharing a master node differ unless
    their ids are 15000 apart."""
    if not job_id.isdigit():
        raise ValueError(f"SLURM_JOB_ID must be a non-negative integer, got {job_id!r}")
    return _PORT_BASE + int(job_id) % _PORT_SPAN


def _first_host_from_slurm_nodelist(nodelist: str) -> str:
    """The first host of a Slurm node list, where rank 0 of a step runs."""
    return expand_slurm_nodelist(nodelist)[0]


def as_timedelta(timeout: timedelta | float | None) -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if not isinstance(timeout, timedelta):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ValueError(f"timeout must be a timedelta or seconds, got {timeout!r}")
        timeout = timedelta(seconds=timeout)
    if timeout <= timedelta(0):
        raise ValueError(f"timeout must be positive, got {timeout}")
    return timeout


def _choose_device(device: torch.device | str | None, local_rank: int) -> torch.device:
    chosen = None if device is None else _resolve_device(device)
    if chosen is None or (chosen.type == "cuda" and chosen.index is None):
        return _pick_device(local_rank)
    return chosen


def _resolve_device(device: torch.device | str) -> torch.device:
    """``'cpu'``, ``'cuda'``, ``'cuda:1'``, ``'gpu'`` (= ``'cuda'``) or a ``torch.device``; CPU
    with a warning when CUDA is asked for but missing."""
    if isinstance(device, str):
        device = device.strip().lower()
        device = "cuda" + device[3:] if device.startswith("gpu") else device
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        allowed = "'cpu', 'cuda', 'cuda:N', 'gpu' or a torch.device"
        raise ValueError(f"device must be {allowed}, got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        warnings.warn(f"device {str(device)!r} asked for but CUDA is not available: using the CPU",
                      RuntimeWarning, stacklevel=2)
        return torch.device("cpu")
    if resolved.type == "cuda" and resolved.index is not None:
        check_int("device index", resolved.index, high=torch.cuda.device_count() - 1)
    return resolved


def _pick_device(local_rank: int) -> torch.device:
    """GPU ``local_rank``; the only GPU when one is visible per task (Slurm's GPU binding sets
    CUDA_VISIBLE_DEVICES per task); the CPU without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    if local_rank >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise RuntimeError(
            f"local rank {local_rank} has no GPU of its own: {count} are visible "
            f"(CUDA_VISIBLE_DEVICES={visible!r}); start at most {count} processes per node"
        )
    return torch.device("cuda", local_rank)
