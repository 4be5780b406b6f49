"""Run code on chosen ranks, with errors that reach every rank.

``on_rank`` runs a function on some ranks while the others wait in one ``all_gather_object`` of
the outcome (value or error, pickled beforehand so that pickling cannot fail inside the
collective): an exception on one rank is raised on every rank within a collective's latency,
not after the 60-minute timeout. One process per device lives in :mod:`nnh_train.parallel`;
its names are importable from here too, where the original NNHandler's DDP utilities document
puts them (``from nnh_train.ddp_decorators import ParallelExecutor, parallelize_on_gpus``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from nnh_data.checks import check_int
from nnh_data.topology import dist_ready
from nnh_train.outcome import Outcome, pack_error, pack_value
from nnh_train.parallel import ParallelExecutor, parallel_on_all_devices, parallelize_on_gpus

__all__ = ["ParallelExecutor", "on_rank", "parallel_on_all_devices", "parallelize_on_gpus"]

F = TypeVar("F", bound=Callable[..., Any])


def on_rank(rank: int | Sequence[int], barrier: bool = False) -> Callable[[F], F]:
    """Run the decorated function only on ``rank`` (an int or a list); the other ranks wait.

    Every rank returns the value of the first listed rank. When the function raises on a
    listed rank, every rank raises :class:`~nnh_train.RankError` naming that rank, with the
    original traceback and, when it can be pickled, the original exception as ``__cause__``.
    With ``barrier=True`` a barrier follows success. Outside a process group the function runs.

    Example:
        >>> @on_rank(0)
        ... def download():
        ...     return fetch_dataset("/data")
        >>> path = download()  # rank 0 downloads; every rank gets the path
    """
    ranks = _as_ranks(rank)

    def decorator(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not dist_ready():
                return func(*args, **kwargs)
            return _run_on_ranks(func, ranks, barrier, args, kwargs)

        return wrapper  # type: ignore[return-value]

    return decorator


def _as_ranks(rank: int | Sequence[int]) -> tuple[int, ...]:
    listed = [rank] if not isinstance(rank, Sequence) else list(rank)
    if not listed:
        raise ValueError("rank must be an int or a non-empty list of ints, got []")
    return tuple(dict.fromkeys(check_int("rank", r, low=0) for r in listed))


def _run_on_ranks(
    func: Callable[..., Any], ranks: tuple[int, ...], barrier: bool, args: Any, kwargs: Any
) -> Any:
    me, world = dist.get_rank(), dist.get_world_size()
    if max(ranks) >= world:  # the same check on every rank: they all raise, none waits
        raise ValueError(f"on_rank ranks must be in [0, {world - 1}], got {list(ranks)}")
    outcome, value, error = None, None, None
    if me in ranks:
        try:
            value = func(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - sent to every rank and re-raised there
            error, outcome = exc, pack_error(exc)
        else:
            outcome = pack_value(value if me == ranks[0] else None)
    outcomes: list[Outcome | None] = [None] * world
    dist.all_gather_object(outcomes, outcome)
    failed = [r for r in sorted(ranks) if not outcomes[r].ok]
    if failed:
        also = f" (and on ranks {failed[1:]})" if len(failed) > 1 else ""
        message = f"{func.__qualname__} failed on rank {failed[0]}{also} under on_rank"
        local = error if me == failed[0] else None
        outcomes[failed[0]].raise_on_failure(message, failed[0], local)
    if barrier:
        dist.barrier()
    return value if me == ranks[0] else outcomes[ranks[0]].value()
