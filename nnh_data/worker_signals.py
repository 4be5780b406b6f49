"""DataLoader workers that die of no signal meant for their rank, and never outlive it.

Launchers signal more than the rank: torchrun's agent sends SIGTERM, SIGINT or (torch >= 2.9,
``--signals-to-handle``) SIGUSR1 to each rank's whole process group, and Slurm signals every
process of a job step; both reach the rank's DataLoader workers. A worker killed by SIGTERM makes
its rank fail with ``DataLoader worker ... killed by signal: Terminated`` before the rank can
save. So each worker of the loaders nnh builds ignores SIGINT and SIGUSR1 (its rank stops or
saves, then shuts its workers down), and SIGTERM while its rank handles SIGTERM itself (as
``NNHandler.train`` does): the rank then decides when to stop, and its workers go with it.
A rank that does not handle SIGTERM dies of it, and its workers too, as before; and a rank
ending its workers with SIGTERM (``multiprocessing`` does at interpreter exit) stops handling
SIGTERM first (an exit hook), so that exit never waits for a worker that ignored it. A worker
whose rank died ends within seconds (torch's watchdog). The user's ``worker_init_fn`` runs after.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["shield_worker", "shielded_worker_init"]

_IGNORED = (signal.SIGINT, signal.SIGUSR1)
_exit_hook = threading.Lock()
_exit_hook_set = False


def shielded_worker_init(fn: Callable[[int], Any] | None = None) -> Callable[[int], Any]:
    """A ``worker_init_fn`` that calls :func:`shield_worker`, then ``fn(worker_id)`` if given.

    Call it in the rank: it also sets the rank's exit hook. Picklable (spawn workers) when
    ``fn`` is; shielding twice is the same as once.

    Example:
        >>> loader = DataLoader(ds, num_workers=4, worker_init_fn=shielded_worker_init(seed_fn))
    """
    _set_exit_hook()
    return fn if isinstance(fn, _ShieldedInit) else _ShieldedInit(fn)


class _ShieldedInit:
    def __init__(self, fn: Callable[[int], Any] | None) -> None:
        self.fn = fn

    def __call__(self, worker_id: int) -> None:
        shield_worker()
        if self.fn is not None:
            self.fn(worker_id)


def shield_worker() -> None:
    """In a loader worker: ignore the rank's signals, end with the rank."""
    for number in _IGNORED:
        signal.signal(number, signal.SIG_IGN)
    parent = os.getppid()

    def on_term(signum: int, frame: FrameType | None) -> None:
        if os.getppid() == parent and _handles(parent, signal.SIGTERM):
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)


def _handles(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux's /proc; False elsewhere)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            caught = next(line for line in status if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


def _set_exit_hook() -> None:
    """Once per process: at exit, SIGTERM's default action again, before ``multiprocessing``
    terminates the workers (hooks run last-registered first, and it registered at import)."""
    global _exit_hook_set
    with _exit_hook:
        if not _exit_hook_set:
            atexit.register(signal.signal, signal.SIGTERM, signal.SIG_DFL)
            _exit_hook_set = True
