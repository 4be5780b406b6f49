"""Preemption: the signals that ask a run to save and stop, and how the process then ends.

Design. SIGUSR1 (Slurm's ``--signal``) and SIGTERM (Slurm, Kubernetes, ``kill``) only set a
flag: a handler that saved from inside itself would run at any point of a step, alone on its
rank, while the other ranks went on. The trainer exchanges the flag with the step's other
figures, so every rank learns at the same step boundary that some rank was signalled; then all
save the same checkpoint and exit with :data:`PREEMPTED_EXIT_CODE`. The handlers are installed
for the duration of training only, call the handlers they replace when those are Python
functions (a user's own SIGTERM handler keeps working), and the originals are restored after.

Around that: a rank of a torchrun agent gets SIGTERM when its agent dies (the agent may be
killed outright: SIGUSR1 does on torch < 2.9), so it saves instead of training on, orphaned;
each preempted rank records itself where ``nnh-torchrun`` (:mod:`nnh_train.torchrun`) looks,
so that the launcher's exit code says preempted too; and Ctrl-C (SIGINT, which torchrun and
srun pass to every rank) stops a rank at once with one line saying where it stopped and what
checkpoint is on disk, instead of a traceback per process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "PREEMPTED_RECORD_ENV",
    "PREEMPTION_SIGNALS",
    "Preemption",
    "SignalFlag",
    "catch_signals",
    "exit_now",
    "exit_preempted",
    "follow_launcher",
    "reported_interrupt",
    "requeue",
]

PREEMPTED_EXIT_CODE = 75
"""Exit status after a preemption save: ``EX_TEMPFAIL`` of sysexits.h, "try again later"."""
PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
PREEMPTED_RECORD_ENV = "NNH_PREEMPTED_RECORD"
"""Names the file where each rank exiting with :data:`PREEMPTED_EXIT_CODE` appends its rank
(set by ``nnh-torchrun`` for its ranks)."""
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class SignalFlag:
    """The preemption signal this process received (``None`` until one arrives)."""

    def __init__(self) -> None:
        self.received: int | None = None

    def __bool__(self) -> bool:
        return self.received is not None


@contextmanager
def catch_signals(enabled: bool = True) -> Iterator[SignalFlag]:
    """While inside, SIGUSR1 and SIGTERM set the yielded flag instead of ending the process.

    Outside the main thread (where Python cannot install handlers) or with ``enabled=False``
    the flag stays unset and the signals keep their usual effect.

    Example:
        >>> with catch_signals() as flag:
        ...     for batch in loader:
        ...         step(batch)
        ...         if flag:
        ...             break
    """
    flag = SignalFlag()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = {number: signal.getsignal(number) for number in PREEMPTION_SIGNALS}

    def note(signum: int, frame: FrameType | None) -> None:
        flag.received = signum
        earlier = previous[signum]
        if callable(earlier):
            earlier(signum, frame)

    for number in PREEMPTION_SIGNALS:
        signal.signal(number, note)
    try:
        yield flag
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


class Preemption:
    """A run's answer to a preemption signal: every rank saves ``path`` at the same step, rank 0
    requeues the Slurm job with ``requeue``, then every rank exits with
    :data:`PREEMPTED_EXIT_CODE`; without a ``path`` signals keep their usual effect.

    Attributes:
        flag: set by SIGUSR1 or SIGTERM while :meth:`signals_caught` is active.
    """

    def __init__(self, path: str | None = None, requeue: bool = False) -> None:
        self.path, self.requeue = path, requeue
        self.flag = SignalFlag()

    @contextmanager
    def signals_caught(self) -> Iterator[None]:
        """While inside, SIGUSR1 and SIGTERM only set :attr:`flag` (when there is a path)."""
        with catch_signals(enabled=self.path is not None) as self.flag:
            yield

    def stop(self, rank: int, step: int, ranks: list[int], save: Callable[[str], None]) -> None:
        """Say so, ``save(path)`` (call it on every rank: a checkpoint is a collective),
        requeue from rank 0, and exit; ``ranks`` are those signalled."""
        print(f"rank {rank}: signal received on rank(s) {ranks}; saving {self.path} at step "
              f"{step} and exiting with code {PREEMPTED_EXIT_CODE}", file=sys.stderr,
              flush=True)  # fmt: skip
        save(self.path)
        if self.requeue and rank == 0:
            requeue()
        exit_preempted(rank)

    def interrupted(self, rank: int, step: int, epoch: int, batch: int) -> str:
        """Where a Ctrl-C stopped this rank (``epoch`` counted from 0), and the checkpoint
        that a run resumes from."""
        path = self.path
        saved = f"last checkpoint {path}" if path and os.path.exists(path) else "no checkpoint"
        return (f"rank {rank}: interrupted at step {step} (epoch {epoch + 1}, batch {batch}); "
                f"{saved}")  # fmt: skip


def follow_launcher() -> None:
    """Ask for SIGTERM when this process's parent (torchrun's agent) dies; Linux only."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


@contextmanager
def reported_interrupt(where: Callable[[], str]) -> Iterator[None]:
    """A KeyboardInterrupt inside prints ``where()`` on stderr and ends the program (if nothing
    catches it) without a traceback, with the status of a process stopped by SIGINT.

    Example:
        >>> with reported_interrupt(lambda: f"rank {rank}: interrupted at step {step}"):
        ...     train()
    """
    try:
        yield
    except KeyboardInterrupt as exc:
        print(where(), file=sys.stderr, flush=True)
        exc.nnh_reported = True
        _install_quiet_excepthook()
        raise


def _install_quiet_excepthook() -> None:
    if getattr(sys.excepthook, "nnh_quiet", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not getattr(exc, "nnh_reported", False):
            previous(kind, exc, tb)

    hook.nnh_quiet = True
    sys.excepthook = hook


def exit_preempted(rank: int) -> None:
    """Record ``rank`` where :data:`PREEMPTED_RECORD_ENV` says, then :func:`exit_now` with
    :data:`PREEMPTED_EXIT_CODE`."""
    record = os.environ.get(PREEMPTED_RECORD_ENV)
    if record:
        with open(record, "a") as fh:
            fh.write(f"{rank}\n")
    exit_now(PREEMPTED_EXIT_CODE)


def exit_now(code: int) -> None:
    """End the process with ``code`` without interpreter shutdown. Right after a collective,
    gloo's worker thread may still drop the last reference to a Python-owned tensor; during
    shutdown that thread is stopped with a forced unwind and the process aborts (SIGABRT)
    instead of exiting with ``code``, which a scheduler then misreads."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def requeue() -> None:
    """``scontrol requeue $SLURM_JOB_ID``; a warning when it cannot run or fails."""
    job = os.environ.get("SLURM_JOB_ID")
    if job is None:
        warnings.warn("requeue=True but SLURM_JOB_ID is not set: not requeued", stacklevel=3)
        return
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    except OSError as exc:
        warnings.warn(f"scontrol requeue {job} could not run: {exc}", stacklevel=3)
        return
    if done.returncode:
        warnings.warn(f"scontrol requeue {job} failed: {done.stderr.strip()}", stacklevel=3)
