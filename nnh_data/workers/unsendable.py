"""What a DataLoader worker cannot send reaches the main process as an error, never a hang.

A worker puts each batch (or the exception it raised, which torch wraps with its type) on a
multiprocessing queue whose feeder thread pickles it. An object that does not pickle there (a
value of a type pickle refuses, an exception of a class local to a function) is printed by that
thread and dropped: the main process then waits for it forever, or, when it was the worker's
last batch, ends the epoch without it and without a word. :func:`guard_worker_queue`, called in
a worker, has the feeder put in its place an error that the main process raises
(:class:`~nnh_data.errors.UnsendableError`) naming the worker, the shard and the sample: the
first field, and in it the first row, that does not pickle, looked for only then. It costs
nothing per batch, since multiprocessing calls the hook only on a failure. The hook is the queue
class's ``_on_queue_feeder_error`` (private to multiprocessing, kept for ``concurrent.futures``
since Python 3.8), set in the worker process only; anything that is not a DataLoader item goes to
the original. The error goes ahead of the items queued after the one it replaces, so the main
process gets it in the same place. The guard starts in nnh's ``worker_init_fn``
(:func:`~nnh_data.workers.signals.shielded_worker_init`, which every loader nnh builds uses), so
an exception of the user's own ``worker_init_fn`` is covered too (torchdata sends it in the
worker's first answer); under a plain DataLoader given nnh's dataset alone, it starts with the
dataset's first iteration, after the user's ``worker_init_fn``.
"""

from __future__ import annotations

import dataclasses
import multiprocessing.queues
import sys
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import get_worker_info

from nnh_data.errors import UnsendableError
from nnh_data.packed import PackedField

__all__ = ["guard_worker_queue"]

_original = multiprocessing.queues.Queue._on_queue_feeder_error  # a staticmethod's function


def guard_worker_queue() -> None:
    """In a DataLoader worker: a batch or exception that the worker's queue cannot pickle is
    sent as an :class:`UnsendableError` the main process raises (see the module docstring).
    Calling it again, or outside a worker, does nothing more."""
    if get_worker_info() is not None:
        multiprocessing.queues.Queue._on_queue_feeder_error = _on_feeder_error


def _on_feeder_error(queue: multiprocessing.queues.Queue, error: Exception, item: Any) -> None:
    """The feeder's hook: ``item`` could not be pickled; send an error in its place."""
    info = get_worker_info()
    replacement = None if info is None else _replacement(info.id, error, item)
    if replacement is None:
        return _original(error, item)
    _put_first(queue, replacement)


def _replacement(worker: int, error: Exception, item: Any) -> tuple | None:
    """``item`` with an :class:`UnsendableError` in place of what did not pickle; None for an
    item that is not the loader's, or that is such a replacement already (no loop).

    Items are ``(idx, data)``; torchdata's StatefulDataLoader sends ``(idx, (data, worker_id,
    state))``, and first ``(request, ack)``, whose ``initial_state`` is the worker's state or
    the exception its ``worker_init_fn`` raised."""
    if type(item) is not tuple or len(item) != 2:
        return None
    idx, payload = item
    if type(payload).__name__ == "_AckStartup" and dataclasses.is_dataclass(payload):
        data = payload.initial_state
        if _is_replacement(data):
            return None
        if isinstance(data, ExceptionWrapper):
            message = _message(worker, error, data)
        else:
            message = f"DataLoader worker {worker} could not send its starting state ({error!r})"
        return idx, dataclasses.replace(payload, initial_state=_wrapped(message, error, worker))
    if type(idx) is not int:
        return None
    stateful = _in_torchdata_loop()
    data = payload[0] if stateful else payload
    if _is_replacement(data):
        return None
    wrapped = _wrapped(_message(worker, error, data), error, worker)
    return idx, ((wrapped, worker, None) if stateful else wrapped)


def _is_replacement(data: Any) -> bool:
    return isinstance(data, ExceptionWrapper) and data.exc_type is UnsendableError


def _put_first(queue: multiprocessing.queues.Queue, item: Any) -> None:
    """Put ``item`` ahead of the items waiting for the feeder: the one it replaces was ahead of
    them, and the main process must get it first (after the worker's end of the epoch, it
    would drop the item as belonging to a finished worker). ``put``'s own steps otherwise."""
    if queue._closed:  # the worker is shutting down
        return
    queue._sem.acquire()  # the feeder gave back the failed item's
    with queue._notempty:
        queue._buffer.appendleft(item)
        queue._notempty.notify()


def _in_torchdata_loop() -> bool:
    """Whether this worker runs torchdata's worker loop (StatefulDataLoader), whose items
    carry the worker's state, rather than torch's."""
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_name == "_worker_loop":
                return frame.f_globals.get("__name__", "").startswith("torchdata")
            frame = frame.f_back
    return False


def _wrapped(message: str, error: Exception, worker: int) -> ExceptionWrapper:
    """An :class:`UnsendableError` of ``message`` caused by ``error``, as torch sends errors
    (the main process raises it, with this traceback and the cause's)."""
    try:
        raise UnsendableError(message) from error
    except UnsendableError:
        return ExceptionWrapper(where=f"in DataLoader worker process {worker}")


def _message(worker: int, error: Exception, data: Any) -> str:
    head = f"DataLoader worker {worker} could not send"
    if isinstance(data, ExceptionWrapper):
        return (f"{head} the {data.exc_type.__name__} it raised ({error!r}); it said:\n"
                f"{data.exc_msg}")  # fmt: skip
    return f"{head} a batch to the main process ({error!r}): {_where(data)}"


def _where(data: Any) -> str:
    """Where in ``data`` (a sample or batch dict, or a list of samples) is what does not
    pickle: the field, the sample's key and shard, as far as they can be told."""
    if isinstance(data, (list, tuple)):
        row = _first_unsendable(range(len(data)), data.__getitem__)
        return "the batch does not pickle" if row is None else _sample(data[row], None)
    if not isinstance(data, dict):
        return f"a {type(data).__name__} that does not pickle"
    for name, value in data.items():
        if _sendable(value):
            continue
        rows = _rows(value)
        row = None if rows is None else _first_unsendable(range(len(rows)), rows.__getitem__)
        return f"field {name!r} of {_sample(data, row)} does not pickle"
    return "the batch does not pickle"


def _sample(data: Any, row: int | None) -> str:
    """``data``'s sample ``row`` (a batch's) or the sample ``data`` is, by key and shard."""
    if not isinstance(data, dict) or "__key__" not in data:
        return "a sample"
    key, shard = data["__key__"], data.get("__shard__")
    if isinstance(key, str):
        return f"sample {key!r} of shard {shard!r}"
    if row is None:
        return f"the batch of samples {list(key)!r} of shards {sorted(set(shard or []))!r}"
    return f"sample {key[row]!r} of shard {None if shard is None else shard[row]!r}"


def _rows(value: Any) -> Any:
    """The rows of a column, each as it would be sent (a packed field's as one-row fields);
    None for anything else."""
    if isinstance(value, PackedField):
        return [value[i : i + 1] for i in range(len(value))]
    return value if isinstance(value, (list, tuple)) else None


def _first_unsendable(rows: range, value_of: Any) -> int | None:
    return next((i for i in rows if not _sendable(value_of(i))), None)


def _sendable(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, np.ndarray, str, bytes, int, float)):
        return True  # these pickle (and pickling a tensor would move it to shared memory)
    try:
        ForkingPickler.dumps(value)
    except Exception:
        return False
    return True
