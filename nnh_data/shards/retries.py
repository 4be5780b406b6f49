"""Retries of remote reads: how long a shard that always fails takes to be named, on purpose.

Every read of a remote shard (a block of samples, or a download into the node-local cache) is
tried at most ``ATTEMPTS`` times. Before try ``k + 2`` it waits between half and all of
``BACKOFF_S * 2**k`` seconds (random, so that the workers of a job do not retry in step): at
most 0.5 + 1 + 2 + 4 = 7.5 s of waits in all. Only transient failures are tried again (I/O and
network errors: HTTP 5xx and throttling, connection resets, truncated bodies, timeouts); a
missing or forbidden object, a stale index or bad bytes fail at once. The error then names the
shard, the attempts and the seconds they took.

The filesystem's own retries would multiply that bound: s3fs tries a throttled request 5 times
and botocore 5 times within each (25 requests over ~45 s before nnh sees an error), and a 500
took botocore 5 requests over up to 15 s. So :func:`remote_fs` opens ``s3://`` with both turned
off, unless ``storage_options`` sets ``config_kwargs={"retries": ...}`` (then the caller's
policy runs inside each of these attempts). Other filesystems keep their own retries inside
each attempt. Each attempt is bounded by the filesystem's timeouts (s3fs: 5 s to connect, 15 s
without a byte), so a stalled request counts as one failed attempt.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from fsspec import AbstractFileSystem
from fsspec.asyn import AsyncFileSystem
from fsspec.core import url_to_fs
from fsspec.utils import get_protocol, tokenize

from nnh_data.errors import ShardError, StaleIndexError

__all__ = ["ATTEMPTS", "BACKOFF_S", "is_transient", "remote_fs", "retrying"]

ATTEMPTS = 5  # tries of one remote read before its shard is named as failed
BACKOFF_S = 0.5  # the wait before the second try; doubled before each next one
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
              StaleIndexError)  # fmt: skip
# Network errors of the HTTP stacks under fsspec that are not OSErrors (matched by class name,
# so that none of them has to be imported): aiohttp, botocore, http.client, urllib3.
_NETWORK_ERRORS = frozenset({
    "ClientPayloadError", "ClientConnectionError", "ServerTimeoutError", "HTTPClientError",
    "ResponseParserError", "HTTPException", "IncompleteRead", "ProtocolError",
})  # fmt: skip
_NO_RETRIES = {"total_max_attempts": 1}
T = TypeVar("T")


def is_transient(exc: BaseException) -> bool:
    """True when trying again may succeed: ``exc``, what it was raised from or while handling
    (a library's error about a timeout, say) is an I/O or network error, not a missing or
    forbidden object, a stale index or bad bytes.

    Example:
        >>> is_transient(ConnectionResetError()), is_transient(FileNotFoundError("x"))
        (True, False)
    """
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, _PERMANENT):
            return False
        if isinstance(cause, OSError) or _NETWORK_ERRORS.intersection(
            c.__name__ for c in type(cause).__mro__
        ):
            return True
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return False


def retrying(read: Callable[[], T], url: str, position: str) -> T:
    """``read()``, tried again on transient errors (see the module docstring); a failure
    raised as a :class:`ShardError` naming ``url`` and ``position``, and, after several
    tries, how many over how long."""
    started = time.monotonic()
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return read()
        except Exception as exc:
            if attempt == ATTEMPTS or not is_transient(exc):
                named = _named(exc, url, position, attempt, time.monotonic() - started)
                if named is exc:
                    raise
                raise named from exc
        time.sleep(BACKOFF_S * 2 ** (attempt - 1) * random.uniform(0.5, 1.0))
    raise AssertionError("unreachable")


def _named(exc: Exception, url: str, position: str, attempts: int, seconds: float) -> Exception:
    """``exc`` as a ShardError of ``url`` (a ShardError keeps its class and position)."""
    if isinstance(exc, ShardError):
        if attempts == 1:
            return exc
        kind, reason, position = type(exc), exc.reason, exc.position or position
    else:
        kind, reason = ShardError, f"unreadable ({exc or type(exc).__name__})"
    if attempts > 1:
        reason += f"; gave up after {attempts} attempts over {seconds:.1f} s"
    return kind(url, position, reason)


def remote_fs(url: str, storage_options: dict[str, Any] | None) -> tuple[AbstractFileSystem, str]:
    """``url_to_fs(url, **storage_options)`` for reading shards under :func:`retrying`:
    ``s3://`` without s3fs's and botocore's own retries unless the options set them.

    An async filesystem (s3, gcs, http: its calls run on fsspec's one IO loop) is opened once per
    process and shared by its threads; fsspec's own cache keeps one per thread, and opening one
    (a new botocore session for s3) cost 0.1-0.4 s of a reader's first sample per thread."""
    options = dict(storage_options or {})
    ours = get_protocol(url) in ("s3", "s3a") and "retries" not in options.get("config_kwargs", {})
    if ours:
        retries = dict(_NO_RETRIES)  # a copy: botocore adds "mode" to the dict it is given
        options["config_kwargs"] = {**options.get("config_kwargs", {}), "retries": retries}
    if "::" in url:  # a chain: fsspec's own cache
        return _opened(url, options, ours)
    key = (os.getpid(), get_protocol(url), tokenize(options))
    with _SHARED_LOCK:  # threads starting together open one
        fs = _SHARED.get(key)
        if fs is None:
            fs, path = _opened(url, options, ours)
            if not isinstance(fs, AsyncFileSystem):
                return fs, path
            _SHARED[key] = fs
    return fs, fs._strip_protocol(url)


def _opened(url: str, options: dict[str, Any], ours: bool) -> tuple[AbstractFileSystem, str]:
    fs, path = url_to_fs(url, **options)
    if ours:
        fs.retries = 1  # s3fs's own loop; this instance is only ever opened with these options
    return fs, path


_SHARED: dict[tuple[int, str, str], AbstractFileSystem] = {}  # (pid, protocol, options) -> fs
_SHARED_LOCK = threading.Lock()
