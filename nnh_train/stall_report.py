"""Saying, on the ranks that wait, which rank has not reached a step.

Design. Each optimizer step holds collectives (DDP's gradient all-reduce in the backward, then
:mod:`~nnh_train.step_agreement`'s gather); when a rank stops (SIGSTOP, a debugger, a data
loader that hangs, a node that froze) the others wait in them without a word until the process
group's timeout (60 minutes by default). A daemon thread watches the steps: the handler marks
the step it is in (two attribute writes per step, nothing sent), and when one has lasted the
stated time (:data:`STALL_ENV`, default :data:`DEFAULT_STALL_S`; 0 turns it off) the thread
writes "this rank is in step s" into the process group's key-value store, reads what the other
ranks wrote after a short grace, and logs (``logging``, WARNING) which ranks have not reached
step s; again every stated time while the step lasts, and once when it completes. The wait
itself goes on until the group's timeout.
The store is reached through a connection of its own with a short timeout, opened while all is
well, so that a store hosted by the stopped rank (rank 0, unless torchrun's agent hosts it) gives
a line saying so rather than a second hang. The trade-off: names come from what the waiting ranks
say, so a rank that reaches the step just after the grace is named once; the next line, or the
one saying every rank reached the step, corrects it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from torch.distributed import distributed_c10d

from nnh_data.topology import env_int

__all__ = ["DEFAULT_STALL_S", "STALL_ENV", "StallWatch", "stall_seconds"]

logger = logging.getLogger(__name__)

STALL_ENV = "NNH_STALL_REPORT_S"
DEFAULT_STALL_S = 300.0
_STORE_TIMEOUT = timedelta(seconds=10)  # a store that does not answer in this is stopped
_WATCHES = itertools.count()  # the same on every rank: handlers are made in the same order


def stall_seconds(env: Mapping[str, str] | None = None) -> float:
    """The stated time from :data:`STALL_ENV` (whole seconds; 0: no report), default
    :data:`DEFAULT_STALL_S`; ValueError naming the variable for anything else."""
    seconds = env_int(STALL_ENV, low=0, env=env)
    return DEFAULT_STALL_S if seconds is None else float(seconds)


class StallWatch:
    """The watch of one handler's step waits on rank ``rank`` of ``world_size``, reporting a
    wait longer than ``seconds``; start it under a process group (the store is the group's)."""

    def __init__(self, rank: int, world_size: int, seconds: float) -> None:
        self.rank, self.world_size, self.seconds = rank, world_size, seconds
        self._poll = min(seconds / 4, 5.0)
        self._grace = 2 * self._poll + 0.5  # for every watch that is in the step to write
        self._prefix = f"nnh-stall/{next(_WATCHES)}/"
        self._store = _own_store()
        self._waiting: tuple[int, str, float] | None = None  # (step, where, since)
        self._reported: float | None = None  # the "since" of the wait last reported
        self._asking: threading.Thread | None = None  # the store's answer awaited
        self._last = 0.0  # when the last report was made
        threading.Thread(target=_watch, args=(weakref.ref(self), self._poll), daemon=True,
                         name="nnh-stall-watch").start()  # fmt: skip

    @contextmanager
    def in_step(self, step: int, where: str) -> Iterator[None]:
        """The block is optimizer step ``step`` (``where``: the step, epoch and batch, as the
        lines say it), collectives included."""
        since = time.monotonic()
        self._waiting = (step, where, since)
        try:
            yield
        finally:
            self._waiting = None
        if self._reported == since:
            logger.warning("rank %d: %s: every rank reached it after %.0f s; training goes on",
                           self.rank, where, time.monotonic() - since)  # fmt: skip

    def _check(self) -> None:
        """Report the step in progress when it has lasted the stated time, and again every
        stated time after that."""
        waiting = self._waiting
        if waiting is None:
            return
        step, where, since = waiting
        now = time.monotonic()
        due = self._reported != since or now - self._last >= self.seconds
        if now - since >= self.seconds and due:
            self._reported, self._last = since, now
            self._report(step, where, since)

    def _report(self, step: int, where: str, since: float) -> None:
        behind = self._behind(step)
        if self._waiting is None or self._waiting[0] != step:
            return  # the step completed meanwhile
        waited = time.monotonic() - since
        until = "until the process group's timeout (initialize_ddp's, 60 minutes by default)"
        if behind == []:
            logger.warning("rank %d: %s: in this step for %.0f s, as every rank says it is (one "
                           "may be stuck inside it); waiting on %s", self.rank, where, waited,
                           until)  # fmt: skip
            return
        if behind is None:
            logger.warning(
                "rank %d: %s: waiting %.0f s for the other ranks, and the process group's store "
                "does not answer, so which of them is unknown: its host (rank 0, unless "
                "torchrun's agent holds it) may be the one stopped; waiting on %s",
                self.rank, where, waited, until,
            )  # fmt: skip
            return
        logger.warning("rank %d: %s: rank(s) %s have not reached this step after %.0f s; "
                       "waiting on %s", self.rank, where, behind, waited, until)  # fmt: skip

    def _behind(self, step: int) -> list[int] | None:
        """The ranks that did not say they are in ``step`` within the grace; None when the
        store cannot be asked or does not answer (the question waits in a thread of its own,
        which stays until the store answers)."""
        if self._store is None or (self._asking is not None and self._asking.is_alive()):
            return None
        answer: list[list[int]] = []
        self._asking = threading.Thread(target=self._ask, args=(step, answer), daemon=True,
                                        name="nnh-stall-store")  # fmt: skip
        self._asking.start()
        self._asking.join(self._grace + _STORE_TIMEOUT.total_seconds())
        return answer[0] if answer else None

    def _ask(self, step: int, answer: list[list[int]]) -> None:
        keys = [f"{self._prefix}{rank}" for rank in range(self.world_size)]
        try:
            self._store.set(keys[self.rank], str(step))
            time.sleep(self._grace)  # every rank's watch that is in the step has written by now
            said = [self._store.get(key) if self._store.check([key]) else b"" for key in keys]
        except RuntimeError:  # DistStoreError: the store failed
            return
        answer.append([rank for rank, value in enumerate(said) if value != str(step).encode()])


def _watch(watch: weakref.ref[StallWatch], poll: float) -> None:
    """The watch's thread: checks it every ``poll`` seconds, and ends with it (its handler)."""
    while True:
        time.sleep(poll)
        current = watch()
        if current is None:
            return
        current._check()
        del current


def _own_store() -> Any:
    """A connection of this process's own to the default group's store, with a short timeout
    (torch has no public way to reach that store); None without one."""
    try:
        store = distributed_c10d._get_default_store().clone()
        store.set_timeout(_STORE_TIMEOUT)
    except (AttributeError, RuntimeError, ValueError):
        return None
    return store
