"""Where this process sits: its rank, the world size and its DataLoader worker, found in one place.

Every stage that depends on the layout asks here, in one order of precedence: explicit
arguments, then an initialised ``torch.distributed`` group, then the launcher's environment
(``RANK``/``WORLD_SIZE``; ``WORKER``/``NUM_WORKERS`` override the DataLoader worker, as in
WebDataset), then a process alone. Environment values are checked, so a typo such as
``WORLD_SIZE=two`` is an error naming the variable instead of a silent world of one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch.distributed as dist
from torch.utils.data import get_worker_info

from nnh_data.checks import check_int

__all__ = [
    "built_on_rank0",
    "dist_info",
    "dist_ready",
    "env_int",
    "group_size",
    "in_worker_process",
    "worker_info",
]


def dist_ready() -> bool:
    """True when a default ``torch.distributed`` process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """The number of processes in ``group`` (the default group when None); 1 outside a process
    group, so a single process is the group of one and needs no case of its own.

    Example:
        >>> group_size()  # no process group here
        1
    """
    return dist.get_world_size(group) if dist_ready() else 1


def env_int(name: str, *, low: int = 0, env: Mapping[str, str] | None = None) -> int | None:
    """The integer in environment variable ``name`` (``None`` when unset); a ``ValueError``
    naming the variable when it is not an integer ``>= low``."""
    text = (os.environ if env is None else env).get(name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {text!r}") from None
    if value < low:
        raise ValueError(f"environment variable {name} must be >= {low}, got {value}")
    return value


def dist_info(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: the arguments when given, else torch.distributed when
    initialised, else ``RANK``/``WORLD_SIZE`` from the environment, else ``(0, 1)``.

    Example:
        >>> dist_info(rank=1, world_size=4)
        (1, 4)
    """
    if world_size is None:
        world_size = dist.get_world_size() if dist_ready() else env_int("WORLD_SIZE", low=1) or 1
    if rank is None:
        rank = dist.get_rank() if dist_ready() else _env_rank(world_size)
    world_size = check_int("world_size", world_size, low=1)
    return check_int("rank", rank, low=0, high=world_size - 1), world_size


def _env_rank(world_size: int) -> int:
    rank = env_int("RANK")
    if rank is None and world_size > 1:
        raise ValueError(
            f"environment variable WORLD_SIZE is {world_size} but RANK is not set: set both (as "
            "torchrun does) or pass rank= and world_size="
        )
    if rank is not None and rank >= world_size:
        raise ValueError(
            f"environment variable RANK must be below WORLD_SIZE={world_size}, got {rank}"
        )
    return rank or 0


def worker_info() -> tuple[int, int]:
    """``(worker id, number of workers)`` of the DataLoader worker running this code: from
    ``WORKER``/``NUM_WORKERS`` in the environment when both are set, else from torch, else
    ``(0, 1)`` in the main process."""
    num_workers = env_int("NUM_WORKERS", low=1)
    worker = env_int("WORKER")
    if num_workers is not None and worker is not None:
        return check_int("environment variable WORKER", worker, high=num_workers - 1), num_workers
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def in_worker_process() -> bool:
    """True inside a DataLoader worker process (whatever ``WORKER`` says)."""
    return get_worker_info() is not None


T = TypeVar("T")


def built_on_rank0(build: Callable[[], T]) -> T:
    """``build()`` on rank 0 of the process group, its result sent to every rank; an error
    there is raised on every rank. Every rank must call it (it is one broadcast): the shard
    index of a data set on object storage is then scanned once, not once per rank."""
    if group_size() == 1:
        return build()
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (True, build())
        except Exception as exc:  # sent to every rank, raised on every rank below
            box[0] = (False, exc)
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value
