"""Downloading one shard: its bytes from the remote into an open file, with a stall detector.

:func:`download` writes the shard's indexed size to a file descriptor (a claimed part of the
cache folder) and returns the CRC-32 of what it wrote. The remote is read in ranged requests of
``CHUNK_BYTES`` (each tried again on transient errors, :mod:`nnh_data.shards.retries`) in a
daemon thread, which hands the chunks over through a small queue: a read that makes no progress
for ``STALL_SECONDS`` is abandoned in that thread and the download fails here, so a stalled
connection never holds a reader or its prefetch. The object's details (its version) are asked
for in parallel with the first read, and nothing is published before they matched the index.
Every remote failure is a :class:`~nnh_data.errors.ShardError` naming the URL (a
:class:`~nnh_data.errors.StaleIndexError` when the object changed); a failure of the local
write is an ``OSError``.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from nnh_data.cache.files import CHUNK_BYTES, write_all
from nnh_data.errors import ShardError, StaleIndexError
from nnh_data.shards.index import ShardInfo
from nnh_data.shards.retries import remote_fs, retrying

__all__ = ["STALL_SECONDS", "download"]

STALL_SECONDS = 120.0  # a download without progress for this long is aborted
_POLL_S = 0.2


def download(info: ShardInfo, fd: int, options: dict, stop: threading.Event) -> int:
    """Write ``info``'s bytes to ``fd``; returns their CRC-32. ShardError when the remote
    fails, the count differs from the index's or no byte comes for ``STALL_SECONDS``; OSError
    when the local write fails."""
    crc, count = 0, 0
    for chunk in _remote_chunks(info, options, stop):
        write_all(fd, chunk)
        crc = zlib.crc32(chunk, crc)
        count += len(chunk)
        if count > info.size:
            break
    if count != info.size:
        raise ShardError(info.url, f"byte {count}", f"read {count} bytes, indexed {info.size}")
    return crc


def _remote_chunks(info: ShardInfo, options: dict, stop: threading.Event) -> Iterator[bytes]:
    """The remote file's bytes in chunks, read in a daemon thread so that a stalled read is
    detected (and abandoned) here."""
    chunks: queue.Queue = queue.Queue(maxsize=2)
    abort = threading.Event()
    reader = threading.Thread(
        target=_read_remote, args=(info, options, chunks, abort), daemon=True,
        name="nnh-cache-download",
    )  # fmt: skip
    reader.start()
    try:
        deadline = time.monotonic() + STALL_SECONDS
        while True:
            if stop.is_set():
                raise ShardError(info.url, "download", "stopped")
            try:
                item = chunks.get(timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise ShardError(
                        info.url, "download", f"no progress for {STALL_SECONDS} s"
                    ) from None
                continue
            if isinstance(item, BaseException):
                raise item
            if not item:
                return
            deadline = time.monotonic() + STALL_SECONDS
            yield item
    finally:
        abort.set()


def _read_remote(
    info: ShardInfo, options: dict, chunks: queue.Queue, abort: threading.Event
) -> None:
    """Ranged reads of the indexed size, one request each (tried again on transient errors,
    :mod:`nnh_data.shards.retries`), while the object's details (its version) are asked for in
    parallel: ``fs.open`` would wait for them before its first read, a second round trip per
    shard. Nothing is published before the version matched. Errors go to the consumer as
    ShardError."""
    try:
        fs, path = remote_fs(info.url, options)
        details = _in_background(functools.partial(
            retrying, functools.partial(fs.info, path), info.url, "open"))  # fmt: skip
        for start in range(0, info.size, CHUNK_BYTES):
            if abort.is_set():
                return
            end = min(info.size, start + CHUNK_BYTES)
            read = functools.partial(fs.cat_file, path, start=start, end=end)
            _put(chunks, retrying(read, info.url, f"byte {start}"), abort)
        _check_version(info, details.result())
        _put(chunks, b"", abort)
    except BaseException as exc:  # handed to the consumer, which raises it
        if not isinstance(exc, ShardError):
            error = ShardError(info.url, "download", f"{type(exc).__name__}: {exc}")
            error.__cause__, exc = exc, error
        _put(chunks, exc, abort)


def _in_background(call: Callable[[], Any]) -> Future:
    """``call()`` in a daemon thread, which never holds up its process's exit (an executor's
    thread does, for as long as a remote call takes)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as exc:  # handed to the caller of result()
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="nnh-cache-details").start()
    return future


def _put(chunks: queue.Queue, item: object, abort: threading.Event) -> None:
    while not abort.is_set():
        try:
            chunks.put(item, timeout=_POLL_S)
            return
        except queue.Full:
            continue


def _check_version(info: ShardInfo, details: dict | None) -> None:
    """StaleIndexError when the object's size or version field differs from the index's."""
    name, _, value = info.version.partition("=")
    if details and name in details and str(details[name]) != value:
        raise StaleIndexError(info.url, "open", f"{name} is {details[name]!s}, indexed {value}")
    if details and details.get("size") not in (None, info.size):
        raise StaleIndexError(info.url, "open", f"size is {details['size']}, indexed {info.size}")
