"""Reused buffers for the large tensors of batches (decoded images): shared memory in a
DataLoader worker, plain memory in the main process.

A collated batch of decoded images (256 x 224x224x3 uint8: 38.5 MB) is made, torch's way, in
a new shared-memory segment per batch, and the kernel zero-fills and maps every page of it on
first write: on the development machine stacking 256 such images into a new segment took
140-150 us per image, into memory written before 20 us. Here a worker keeps up to
:data:`BUFFERS` segments and stacks each batch into a free one (:func:`batch_tensor`); the
message carries the buffer's number (and, the first time, the segment itself); the receiving
process maps each segment once, hands the batch out as a tensor over it with no copy
(:func:`rebuild`), and gives the buffer back when the last tensor over it is freed: a finalizer
writes its number to a pipe the worker reads before it picks a buffer. So a batch the training
loop keeps is never written over, and with no free buffer (the loop holds them all) the worker
falls back to a new segment, as torch does. A tensor made in a buffer that leaves the worker
some other way (pickled by torch, inside a structure the hand-off does not walk), or that is
not sent as made (another view of it made since, laid out anew in place) retires its buffer:
the worker never writes that segment again. Nor does it write a buffer given back while a
tensor in the worker (a batch its code kept) is still over it. The receiving process lets go
of an ended worker's buffers when a give-back finds it gone or another worker's first batch
arrives.

Without workers the same holds in one process (:class:`LocalBuffers`): a new batch of 38.5 MB
is a new mapping, zero-filled by the kernel page by page, so a batch is stacked into a buffer
that the batch handed out before it has let go of.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import weakref
from multiprocessing import util
from multiprocessing.reduction import DupFd

import numpy as np
import torch

from nnh_data.workers.shm_ring import process_alive, when_released

__all__ = ["BUFFERS", "MIN_BYTES", "LocalBuffers", "Pool", "batch_tensor", "placed", "rebuild"]

BUFFERS = 4  # per worker: the loader's prefetch (2 by default) and batches the loop holds
MIN_BYTES = 1 << 20  # smaller tensors travel in the ring or the message (nnh_data.workers.handoff)
_serial = itertools.count()
# in the receiving process, by pool token: (pipe to the worker, flags, {number: buffer})
_received: dict[tuple[int, int], tuple[_Returns, np.ndarray, dict[int, torch.Tensor]]] = {}


class Pool:
    """A worker's buffers (see the module docstring). ``flags`` is shared with the receiver:
    byte 0 is 1 once it holds the pipe, byte ``1 + i`` once it has mapped buffer ``i``."""

    def __init__(self) -> None:
        self.token = (os.getpid(), next(_serial))
        self.flags = torch.zeros(1 + BUFFERS, dtype=torch.uint8).share_memory_()
        self.buffers: list[torch.Tensor | None] = []  # None: retired (see _lost)
        self._alone: list[int] = []  # users of each buffer's memory with no tensor over it
        self._freed, self._returns = os.pipe()
        os.set_blocking(self._freed, False)
        self._free: list[int] = []
        self._retired: list[int] = []  # by _lost, on any thread; handled by _take_back
        self._serials = itertools.count()
        util.Finalize(self, self._let_go, exitpriority=-10)  # after the queue's feeder ends
        self._serial_of: dict[int, int] = {}  # id of a tensor made and not sent: its serial
        # serial of a tensor made and not sent: its buffer, the users of its memory then
        self._unsent: dict[int, tuple[int, int]] = {}

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised tensor of ``shape`` and ``dtype`` in a free buffer (a new one while
        there are fewer than :data:`BUFFERS`); None when every buffer is in use."""
        nbytes = _nbytes(shape, dtype)
        self._take_back()
        sizes = [0 if b is None else b.numel() for b in self.buffers]
        number = _pick(self._unheld(), sizes, nbytes)
        if number is None:
            return None
        if number == len(sizes) or not _fits(sizes[number], nbytes):
            self._new_buffer(number, nbytes)
        self._free.remove(number)
        tensor = self.buffers[number][:nbytes].view(dtype).view(shape)
        serial = next(self._serials)
        self._serial_of[id(tensor)], self._unsent[serial] = serial, (number, _users(tensor))
        weakref.finalize(tensor, self._lost, id(tensor), serial).atexit = False
        return tensor

    def _new_buffer(self, number: int, nbytes: int) -> None:
        storage = torch.UntypedStorage._new_shared(nbytes, device="cpu")
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
        if number == len(self.buffers):
            self.buffers.append(buffer)
            self._alone.append(0)
            self._free.append(number)
        else:
            self.buffers[number] = buffer
        self._alone[number] = _users(buffer)
        self.flags[1 + number] = 0  # the receiver maps the new segment with the next message

    def placed(self, tensor: torch.Tensor) -> tuple | None:
        """The arguments of :func:`rebuild` for a tensor :meth:`tensor` made (then sent: its
        buffer stays in use until the receiver gives it back); None for any other tensor, for
        one laid out anew in place (the message gives only a shape), and for one with a view
        made since (a channel-first view beside it in the batch): torch would send that view
        over the same segment and the receiver keep it after giving the buffer back. The
        buffer of a tensor not placed is retired when the tensor is freed."""
        made = self._unsent.get(self._serial_of.get(id(tensor), -1))
        if made is None or _users(tensor) > made[1] or not _as_made(tensor):
            return None
        number = self._unsent.pop(self._serial_of.pop(id(tensor)))[0]
        pipe = None if self.flags[0] else (self.flags, DupFd(self._returns))
        buffer = None if self.flags[1 + number] else self.buffers[number]
        dtype = str(tensor.dtype).removeprefix("torch.")
        return self.token, pipe, number, buffer, dtype, tuple(tensor.shape)

    def _lost(self, ident: int, serial: int) -> None:
        """A tensor :meth:`tensor` made was freed without :meth:`placed`: its buffer is retired
        (its number gets a new one when next needed), never written again, since whatever
        pickled the tensor instead (torch, sharing its segment) may have sent it on. A
        finalizer, run on any thread (the queue's feeder) at any point of :meth:`tensor`: it
        only notes the number, :meth:`_take_back` retires it."""
        if self._serial_of.get(ident) == serial:
            del self._serial_of[ident]
        made = self._unsent.pop(serial, None)
        if made is not None:
            self._retired.append(made[0])

    def _unheld(self) -> list[int]:
        """The free buffers no tensor in this process is over: one a worker's code kept after
        sending it (a collate_fn mixing in the last batch) is not written until it lets go."""
        return [
            i
            for i in self._free
            if self.buffers[i] is None or _users(self.buffers[i]) <= self._alone[i]
        ]

    def _let_go(self) -> None:
        """At the worker's exit (``os._exit`` follows, which frees nothing): drop the segments,
        which under torch's ``file_system`` sharing strategy stay in /dev/shm until every
        process that holds them lets go (a non-persistent worker's 4 buffers every epoch)."""
        self.buffers[:] = [None] * len(self.buffers)
        self.flags = torch.ones_like(self.flags)  # nothing more to send (a late feeder)

    def _take_back(self) -> None:
        """Mark free the buffers the receiver has written back, and those retired."""
        while self._retired:
            number = self._retired.pop()
            self.buffers[number] = None
            self._free.append(number)
        try:
            self._free += os.read(self._freed, 4096)
        except BlockingIOError:
            pass


class LocalBuffers:
    """The main process's buffers (no workers): a tensor handed out over a buffer gives it back
    when it and its views are freed. Loaders in several threads share them: one picks at a
    time (the give-back, a finalizer, only appends)."""

    def __init__(self) -> None:
        self.buffers: list[np.ndarray] = []
        self._free: list[int] = []
        self._picking = threading.Lock()

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised tensor of ``shape`` and ``dtype`` over a free buffer; None when
        every buffer is in use."""
        nbytes = _nbytes(shape, dtype)
        with self._picking:
            number = self._take(nbytes)
        if number is None:
            return None
        numpy_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        array = self.buffers[number][:nbytes].view(numpy_dtype).reshape(shape)
        weakref.finalize(array, self._free.append, number).atexit = False
        return torch.from_numpy(array)

    def _take(self, nbytes: int) -> int | None:
        """The number of a free buffer of ``nbytes`` to twice it, now in use; None if none."""
        sizes = [b.nbytes for b in self.buffers]
        number = _pick(self._free, sizes, nbytes)
        if number is None:
            return None
        if number == len(self.buffers):
            self.buffers.append(np.empty(nbytes, np.uint8))
            self._free.append(number)
        elif not _fits(sizes[number], nbytes):
            self.buffers[number] = np.empty(nbytes, np.uint8)
        self._free.remove(number)
        return number


def _pick(free: list[int], sizes: list[int], nbytes: int) -> int | None:
    """The buffer for ``nbytes``: a free one of that size to twice it, else a new one (a free
    one to be made to measure, or one more while there are fewer than :data:`BUFFERS`); None
    when every buffer is in use."""
    fits = [i for i in free if _fits(sizes[i], nbytes)]
    if fits:
        return fits[0]
    if free:
        return free[0]
    return len(sizes) if len(sizes) < BUFFERS else None


def _fits(size: int, nbytes: int) -> bool:
    """Whether a buffer of ``size`` bytes is reused for ``nbytes`` (not more than twice them)."""
    return nbytes <= size <= 2 * nbytes


def _as_made(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is still as :meth:`Pool.tensor` made it (the message gives only its
    dtype and shape): not transposed or cut in place (``transpose_``, ``set_``), no
    ``requires_grad_()``."""
    return tensor.is_contiguous() and tensor.storage_offset() == 0 and not tensor.requires_grad


def _users(tensor: torch.Tensor) -> int:
    """How many tensors and storages hold ``tensor``'s memory (each view counts)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


_pool: Pool | None = None
_local: LocalBuffers | None = None


def batch_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialised tensor for a batch of ``shape`` and ``dtype`` (numpy's dtypes) in one
    of this process's buffers: a DataLoader worker's pool, else the main process's buffers;
    None below :data:`MIN_BYTES` or when every buffer is in use (the caller makes a new
    tensor then, in shared memory in a worker)."""
    global _pool, _local
    if _nbytes(shape, dtype) < MIN_BYTES:
        return None
    if torch.utils.data.get_worker_info() is None:
        _local = _local or LocalBuffers()
        return _local.tensor(shape, dtype)
    if not hasattr(torch._C, "_storage_Use_Count"):  # a torch that cannot count views: its path
        return None
    if _pool is None or _pool.token[0] != os.getpid():
        _pool = Pool()
    return _pool.tensor(shape, dtype)


def placed(tensor: torch.Tensor) -> tuple | None:
    """The arguments of :func:`rebuild` for ``tensor`` when :func:`batch_tensor` made it in
    this worker; else None."""
    return None if _pool is None else _pool.placed(tensor)


def rebuild(
    token: tuple[int, int],
    pipe: tuple[torch.Tensor, DupFd] | None,
    number: int,
    buffer: torch.Tensor | None,
    dtype: str,
    shape: tuple[int, ...],
) -> torch.Tensor:
    """In the receiving process: the tensor :meth:`Pool.placed` sent, over the worker's buffer
    (no copy); the buffer goes back to the worker when the tensor and its views are freed."""
    if pipe is not None:
        _register(token, *pipe)
    try:
        returns, flags, buffers = _received[token]
    except KeyError:
        raise RuntimeError(f"a DataLoader worker's batch is in shared memory {token} that "
                           "this process never received") from None  # fmt: skip
    if buffer is not None:
        buffers[number] = buffer
        flags[1 + number] = 1
    elif number not in buffers:
        raise RuntimeError(f"buffer {number} of a DataLoader worker's pool {token} never reached "
                           "this process")  # fmt: skip
    array = buffers[number].numpy()[: math.prod(shape) * np.dtype(dtype).itemsize]
    array = array.view(dtype).reshape(shape)
    weakref.finalize(array, _give_back, token, number).atexit = False
    return torch.from_numpy(array)


class _Returns:
    """The pipe back to a worker's pool, closed once nothing holds it: a give-back on another
    thread may be about to write when the worker is let go of, and a closed number is the
    next file's the process opens."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __del__(self) -> None:
        os.close(self.fd)


def _register(token: tuple[int, int], flags: torch.Tensor, returns: DupFd) -> None:
    """Keep the pipe to a worker's pool and its flags; let go of ended workers' pools."""
    fd = returns.detach()
    if token in _received:
        os.close(fd)
        return
    # a copy of the keys: a finalizer on another thread may let go of one meanwhile
    for old in [t for t in list(_received) if t[0] != token[0] and not process_alive(t[0])]:
        _forget(old)
    os.set_blocking(fd, False)
    array = flags.numpy()
    _received[token] = _Returns(fd), array, {}
    array[0] = 1
    when_released(token[0], _forget, token)


def _give_back(token: tuple[int, int], number: int) -> None:
    entry = _received.get(token)  # gone: the worker ended and its pipe is closed
    if entry is None:
        return
    try:
        os.write(entry[0].fd, bytes([number]))
    except BrokenPipeError:  # the worker has ended: its buffers are no longer needed here
        _forget(token)
    except BlockingIOError:  # the worker stopped reading (it is ending)
        pass


def _forget(token: tuple[int, int]) -> None:
    """Let go of an ended worker's pipe and buffers (tensors handed out keep theirs)."""
    _received.pop(token, None)  # a finalizer in another thread may have been first
