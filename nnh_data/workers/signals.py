"""DataLoader workers that die of no signal meant for their rank, and never outlive it.

Launchers signal more than the rank: torchrun's agent sends SIGTERM, SIGINT or (torch >= 2.9,
``--signals-to-handle``) SIGUSR1 to each rank's whole process group, and Slurm signals every
process of a job step; both reach the rank's DataLoader workers. A worker killed by SIGTERM makes
its rank fail with ``DataLoader worker ... killed by signal: Terminated`` before the rank can
save. So each worker of the loaders nnh builds ignores SIGINT and SIGUSR1 (its rank stops or
saves, then shuts its workers down), and SIGTERM while its rank handles SIGTERM itself (as
``NNHandler.train`` does): the rank then decides when to stop, and its workers go with it.
A rank that does not handle SIGTERM dies of it, and its workers too, as before; and a rank
ending its workers with SIGTERM (``multiprocessing`` does at interpreter exit, to the persistent
workers still alive) stops handling SIGTERM first (an exit hook), so that exit never waits for a
worker that ignored it. The same hook stops torch's SIGCHLD handler, which raises when a worker
it knows of dies of a signal: at exit it raised in ``multiprocessing``'s exit function, which
printed ``Exception ignored in atexit callback ... DataLoader worker (pid N) is killed by signal:
Terminated`` after half the clean runs (a worker's death during the run is still found, by the
loader's own checks and this handler, until the exit). A worker whose rank died ends within
seconds (torch's watchdog). The user's ``worker_init_fn`` runs after, with the worker's queue
guarded (:mod:`~nnh_data.workers.unsendable`): an exception of it that cannot be pickled is
raised in the rank, not lost.

A worker hands each batch's tensors to its rank as file descriptors, through ``multiprocessing``'s
resource sharer: a thread in the worker that the rank connects to, and that reports any error
with ``sys.excepthook``. A rank stopped by Ctrl-C while it receives a batch closes that
connection under the thread, which printed a ``ConnectionResetError`` (or ``BrokenPipeError``)
traceback into the rank's log beside the rank's one-line message. A shielded worker leaves out
exactly those: connection errors of the resource sharer, whose only peer is its rank, which
reports its own stop or failure.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing import resource_sharer
from types import FrameType, TracebackType
from typing import Any

from nnh_data.workers.unsendable import guard_worker_queue

__all__ = ["shield_worker", "shielded_worker_init"]

_IGNORED = (signal.SIGINT, signal.SIGUSR1)
_exit_hook = threading.Lock()
_exit_hook_set = False


def shielded_worker_init(fn: Callable[[int], Any] | None = None) -> Callable[[int], Any]:
    """A ``worker_init_fn`` that calls :func:`shield_worker` and guards the worker's queue
    (:func:`~nnh_data.workers.unsendable.guard_worker_queue`), then ``fn(worker_id)`` if given.

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
        guard_worker_queue()  # an exception of fn's that cannot be sent is raised, not lost
        if self.fn is not None:
            self.fn(worker_id)


def shield_worker() -> None:
    """In a loader worker: ignore the rank's signals, end with the rank, print nothing when the
    rank drops a batch it was receiving."""
    for number in _IGNORED:
        signal.signal(number, signal.SIG_IGN)
    parent = os.getppid()

    def on_term(signum: int, frame: FrameType | None) -> None:
        if os.getppid() == parent and _handles(parent, signal.SIGTERM):
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    _quiet_resource_sharer()


def _quiet_resource_sharer() -> None:
    """``sys.excepthook`` without the resource sharer's connection errors (see the module)."""
    previous = sys.excepthook
    if getattr(previous, "nnh_quiet_sharer", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        where = tb.tb_frame.f_globals.get("__name__") if tb is not None else None
        dropped = issubclass(kind, (ConnectionError, EOFError))
        if not (dropped and where == resource_sharer.__name__):
            previous(kind, exc, tb)

    hook.nnh_quiet_sharer = True
    sys.excepthook = hook


def _handles(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux's /proc; False elsewhere)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            caught = next(line for line in status if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


def _set_exit_hook() -> None:
    """Once per process: :func:`_quiet_exit` at exit, before ``multiprocessing`` terminates the
    workers (hooks run last-registered first, and it registered at import)."""
    global _exit_hook_set
    with _exit_hook:
        if not _exit_hook_set:
            atexit.register(_quiet_exit)
            _exit_hook_set = True


def _quiet_exit() -> None:
    """SIGTERM's and SIGCHLD's default actions again (see the module): the workers that
    ``multiprocessing`` terminates now end, and their deaths raise nothing."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
