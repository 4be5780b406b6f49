"""Run a test function on N real gloo processes, with a hard timeout and the failing rank named.

    from dist_harness import run_distributed

    def check_sum(rank, world_size, scale):      # module level: the processes import it by name
        t = torch.tensor([rank * scale]); dist.all_reduce(t); return t.item()

    assert run_distributed(check_sum, 3, 2.0) == [6.0, 6.0, 6.0]

Each process gets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` on a free port) and no ``SLURM_*`` ones, so code that reads the launch
environment behaves as under ``torchrun``. With ``init_group=True`` (default) a gloo group is
ready when the function starts; with ``False`` the function initialises it itself.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DistributedRunError", "free_port", "run_distributed"]


class DistributedRunError(AssertionError):
    """A rank raised or died (its rank and traceback are in the message), or the ranks hung."""


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    init_group: bool = True,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; results by rank.

    Args:
        timeout: seconds for the whole run; the group's collective timeout is half of it, so a
            stuck collective fails inside its rank (with a named error) before the run is killed.
        init_group: start a gloo group (env://) before calling ``fn``.
        env: extra environment variables for every process.

    Raises:
        DistributedRunError: a rank raised or died, or some ranks were still running at timeout.
    """
    setup = (fn, world_size, args, free_port(), init_group, timeout / 2, dict(env or {}))
    with tempfile.TemporaryDirectory(prefix="nnh-dist-") as folder:
        context = mp.start_processes(
            _rank_main, args=(*setup, folder), nprocs=world_size, join=False, start_method="spawn"
        )
        try:
            _join(context, timeout)
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [_load(folder, rank) for rank in range(world_size)]


def _join(context: mp.ProcessContext, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic()), grace_period=5):
            if time.monotonic() >= deadline:
                alive = [r for r, p in enumerate(context.processes) if p.is_alive()]
                raise DistributedRunError(f"ranks {alive} still running after {timeout} s (hang?)")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        raise DistributedRunError(f"rank {exc.error_index} failed: {exc}") from None


def _rank_main(
    rank: int, fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], port: int,
    init_group: bool, group_timeout: float, env: dict[str, str], folder: str,
) -> None:
    for name in [n for n in os.environ if n.startswith(("SLURM_", "TORCHELASTIC_"))]:
        del os.environ[name]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.update(env)
    if init_group:
        dist.init_process_group("gloo", timeout=timedelta(seconds=group_timeout))
    try:
        result = fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(folder, f"{rank}.pkl"), "wb") as fh:
        pickle.dump(result, fh)


def _load(folder: str, rank: int) -> Any:
    path = os.path.join(folder, f"{rank}.pkl")
    if not os.path.exists(path):
        raise DistributedRunError(f"rank {rank} exited without a result (os._exit or sys.exit?)")
    with open(path, "rb") as fh:
        return pickle.load(fh)
