"""Read-ahead: run an I/O function over a stream of items in a background thread, in order.

While the caller decodes item ``i``, the thread already fetches items ``i + 1 .. i + depth``.
The thread is a daemon and checks a stop flag between items and while waiting for room, so
closing the iterator (or the interpreter exiting) never waits on it for more than the fetch in
flight; an exception raised by ``fetch`` or by the item stream is re-raised to the caller at the
point where its result would have been consumed.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from nnh_data.checks import check_int

__all__ = ["read_ahead"]

T = TypeVar("T")
R = TypeVar("R")
_POLL_S = 0.1
_OK, _ERROR, _DONE = range(3)


def read_ahead(
    fetch: Callable[[T], R], items: Iterable[T], depth: int = 2
) -> Iterator[tuple[T, R]]:
    """Yield ``(item, fetch(item))`` in order, fetching up to ``depth`` items ahead in a thread.

    ``depth=0`` fetches in the caller's thread.

    Example:
        >>> [r for _, r in read_ahead(lambda x: x * x, range(4))]
        [0, 1, 4, 9]
    """
    check_int("depth", depth, low=0)
    if depth == 0:
        return ((item, fetch(item)) for item in items)
    return _consume(fetch, items, depth)


def _consume(fetch, items, depth):
    results: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    args = (fetch, items, results, stop)
    threading.Thread(target=_produce, args=args, name="nnh-read-ahead", daemon=True).start()
    try:
        while True:
            kind, item, value = results.get()
            if kind == _DONE:
                return
            if kind == _ERROR:
                raise value
            yield item, value
    finally:
        stop.set()


def _produce(fetch, items, results: queue.Queue, stop: threading.Event) -> None:
    try:
        for item in items:
            if stop.is_set() or not _put(results, (_OK, item, fetch(item)), stop):
                return
    except BaseException as exc:  # handed to the consumer, which raises it
        _put(results, (_ERROR, None, exc), stop)
        return
    _put(results, (_DONE, None, None), stop)


def _put(results: queue.Queue, message: tuple, stop: threading.Event) -> bool:
    """Put ``message`` unless the consumer stopped; False when it did."""
    while not stop.is_set():
        try:
            results.put(message, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False
