"""A shared-memory ring per DataLoader worker, for the arrays of the batches it hands out.

Torch sends each tensor of a worker's batch through a new shared-memory segment whose file
descriptor the main process fetches over a socket, with an authentication handshake: about
1.5 ms of worker and 0.6 ms of main-process CPU for one 768 KiB tensor on the development
machine, more than pickling its bytes through the pipe (0.4 + 0.4 ms). Here a worker maps one
segment once and copies a batch's arrays into one of its :data:`SLOTS` slots; the message
carries only the slot and the arrays' places (about 0.1 + 0.1 ms). The receiving process maps
the segment the first time (its handle travels with each message until the receiver marks the
segment as mapped), copies each array out of the slot into memory of its own (a batch the
training loop keeps never pins a slot) and gives the slot back by writing its number to a pipe
the worker reads before it picks a slot. The pipe is also what orders the two processes' memory
accesses: the receiver's copy is done before its write, and the worker's reuse starts after its
read. With no free slot (the receiver has not taken those batches yet), or arrays larger than a
slot, :meth:`Ring.put` returns None and the caller pickles the arrays by value; arrays larger
than the slots also make the next ring bigger, up to :data:`MAX_SLOT_BYTES`.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import weakref
from collections.abc import Callable, Sequence
from multiprocessing import util
from multiprocessing.reduction import DupFd
from typing import Any

import numpy as np
import torch

__all__ = [
    "MAX_SLOT_BYTES",
    "SLOTS",
    "Ring",
    "footprint",
    "process_alive",
    "rebuild",
    "when_released",
    "worker_ring",
]

SLOTS = 6  # batches of one worker in flight: the loader's prefetch (2 by default) and more
MAX_SLOT_BYTES = 4 << 20
_MIN_SLOT_BYTES = 64 << 10
_HEADER = 64  # byte 0: 1 once the receiving process has mapped the ring
_ALIGN = 64
_serial = itertools.count()
_received: dict[tuple[int, int], tuple[np.ndarray, int]] = {}  # token: (ring, pipe to worker)


def footprint(arrays: Sequence[np.ndarray]) -> int:
    """The bytes ``arrays`` take in a slot."""
    return sum(-(-a.nbytes // _ALIGN) * _ALIGN for a in arrays)


class Ring:
    """Slots of shared memory a worker copies batches' arrays into (see the module docstring)."""

    def __init__(self, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.tensor = torch.zeros(_HEADER + SLOTS * slot_bytes, dtype=torch.uint8).share_memory_()
        self.array = self.tensor.numpy()
        self.token = (os.getpid(), next(_serial))
        self._freed, self._returns = os.pipe()
        os.set_blocking(self._freed, False)
        self._free = list(range(SLOTS))
        util.Finalize(self, self._let_go, exitpriority=-10)  # after the queue's feeder ends

    def put(self, arrays: Sequence[np.ndarray]) -> tuple | None:
        """Copy ``arrays`` into a free slot: the arguments of :func:`rebuild` for them, or None
        when no slot is free or they do not fit."""
        if footprint(arrays) > self.slot_bytes or self.array is None:
            return None
        self._take_back()
        if not self._free:
            return None
        slot = self._free.pop(0)
        base, places = _HEADER + slot * self.slot_bytes, []
        offset = base
        for array in arrays:
            self.array[offset : offset + array.nbytes] = array.reshape(-1).view(np.uint8)
            places.append((offset, array.dtype.str, array.shape))
            offset += -(-array.nbytes // _ALIGN) * _ALIGN
        sent = None if self.array[0] else (self.tensor, DupFd(self._returns))
        return self.token, sent, slot, places

    def _let_go(self) -> None:
        """At the worker's exit (``os._exit`` follows, which frees nothing): drop the segment,
        which under torch's ``file_system`` sharing strategy stays in /dev/shm until every
        process that holds it lets go (a non-persistent worker's ring every epoch)."""
        self.tensor = self.array = None

    def _take_back(self) -> None:
        """Mark free the slots the receiver has written back."""
        try:
            self._free += os.read(self._freed, 4096)
        except BlockingIOError:
            pass


def rebuild(token: tuple[int, int], sent: tuple | None, slot: int, places: list) -> list:
    """In the receiving process: the arrays :meth:`Ring.put` copied, copied out; the slot is
    given back."""
    if sent is not None:
        _register(token, *sent)
    try:
        ring, returns = _received[token]
    except KeyError:
        raise RuntimeError(f"a DataLoader worker's batch is in shared memory {token} that "
                           "this process never received") from None  # fmt: skip
    arrays = []
    for offset, dtype, shape in places:
        count = math.prod(shape)
        arrays.append(np.frombuffer(ring, dtype, count, offset).reshape(shape).copy())
    try:
        os.write(returns, bytes([slot]))
    except (BrokenPipeError, BlockingIOError):  # the worker has ended, or stopped reading
        pass
    return arrays


def _register(token: tuple[int, int], tensor: torch.Tensor, returns: DupFd) -> None:
    """Keep the ring and the pipe to its worker; let go of that worker's older rings and of
    ended workers' rings. A ring already held keeps its pipe (this one is closed)."""
    fd = returns.detach()
    if token in _received:
        os.close(fd)
        return
    pid, serial = token
    for old in list(_received):
        if old[0] == pid and old[1] < serial or old[0] != pid and not process_alive(old[0]):
            os.close(_received.pop(old)[1])
    os.set_blocking(fd, False)
    ring = tensor.numpy()
    _received[token] = ring, fd
    ring[0] = 1
    when_released(pid, _forget, token)


def _forget(token: tuple[int, int]) -> None:
    entry = _received.pop(token, None)
    if entry is not None:
        os.close(entry[1])


def when_released(pid: int, forget: Callable[..., None], *args: Any) -> None:
    """Call ``forget(*args)`` once this process has let go of its child ``pid`` (the loader
    that started that worker is gone and the worker has been reaped), so that an ended
    worker's shared memory and pipe are not held until the next worker sends some; nothing
    when ``pid`` is not a child of this process."""
    child = next((p for p in multiprocessing.active_children() if p.pid == pid), None)
    if child is not None:
        weakref.finalize(child, forget, *args).atexit = False


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a worker that sent shared memory this process holds)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_ring: Ring | None = None


def worker_ring(payload_bytes: int) -> Ring | None:
    """This process's ring, made (or made bigger) for arrays of ``payload_bytes`` (their
    :func:`footprint`); None when that is more than :data:`MAX_SLOT_BYTES`."""
    global _ring
    if payload_bytes > MAX_SLOT_BYTES:
        return None
    ring = _ring
    if ring is None or ring.token[0] != os.getpid() or payload_bytes > ring.slot_bytes:
        wanted = max(_MIN_SLOT_BYTES, payload_bytes + payload_bytes // 2)
        slot_bytes = min(MAX_SLOT_BYTES, -(-wanted // _MIN_SLOT_BYTES) * _MIN_SLOT_BYTES)
        ring = _ring = Ring(slot_bytes)
    return ring
