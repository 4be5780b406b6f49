"""Preemption: the signals that ask a run to save and stop, and how the process then ends.

Design. SIGUSR1 (Slurm's ``--signal``) and SIGTERM (Slurm, Kubernetes, ``kill``) only set a
flag: a handler that saved from inside itself would run at any point of a step, alone on its
rank, while the other ranks went on. The trainer exchanges the flag with the step's other
figures, so every rank learns at the same step boundary that some rank was signalled; then all
save the same checkpoint and exit with :data:`PREEMPTED_EXIT_CODE`. The handlers are installed
for the duration of training only, call the handlers they replace when those are Python
functions (a user's own SIGTERM handler keeps working), and the originals are restored after.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["PREEMPTED_EXIT_CODE", "PREEMPTION_SIGNALS", "SignalFlag", "catch_signals",
           "exit_now", "requeue"]  # fmt: skip

PREEMPTED_EXIT_CODE = 75
"""Exit status after a preemption save: ``EX_TEMPFAIL`` of sysexits.h, "try again later"."""
PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


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
