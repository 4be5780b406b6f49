"""Retries of remote reads: how long a shard that always fails takes to be named, on purpose.

Every read of a remote shard (a block of samples, or a download into the node-local cache) is
tried at most ``ATTEMPTS`` times when it fails. Before try ``k + 2`` it waits between half and
all of ``BACKOFF_S * 2**k`` seconds (random, so that the workers of a job do not retry in
step): at most 0.5 + 1 + 2 + 4 = 7.5 s of waits in all. Only transient failures are tried again
(I/O and network errors: HTTP 5xx, connection resets, truncated bodies, timeouts); a missing or
forbidden object, a stale index or bad bytes fail at once. The error then names the shard, the
attempts and the seconds they took.

Throttling is not a failure: the store asks the client to slow down (S3's 503 ``SlowDown``,
HTTP 429, ``Throttling``, ``RequestLimitExceeded``), and a burst of it passes when the clients
back off. So throttled answers have a budget of their own, counted apart from the failures:
they are tried again for up to ``THROTTLE_BUDGET_S`` (60 s) from the first one, each wait drawn
at random between 0 and ``min(THROTTLE_CAP_S, THROTTLE_BACKOFF_S * 2**k)`` seconds ("full
jitter", AWS's advice for many clients: they spread out instead of coming back together), so a
burst of about 30 s is ridden out, and a store that throttles for longer is named after about
60 s plus one wait of at most 8 s.

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

__all__ = [
    "ATTEMPTS",
    "BACKOFF_S",
    "THROTTLE_BACKOFF_S",
    "THROTTLE_BUDGET_S",
    "THROTTLE_CAP_S",
    "is_throttled",
    "is_transient",
    "remote_fs",
    "retrying",
]

ATTEMPTS = 5  # tries of one remote read before its shard is named as failed
BACKOFF_S = 0.5  # the wait before the second try; doubled before each next one
THROTTLE_BUDGET_S = 60.0  # how long throttled answers are tried again, from the first one
THROTTLE_BACKOFF_S = 0.5  # the longest first wait after a throttled answer; doubled each time
THROTTLE_CAP_S = 8.0  # ... up to this
# S3's and other stores' throttling codes, and the HTTP statuses that mean "slow down"
_THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests",
                             "RequestLimitExceeded", "RequestThrottled", "503"})  # fmt: skip
_THROTTLE_STATUSES = frozenset({429, 503})
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
    for cause in _chain(exc):
        if isinstance(cause, _PERMANENT):
            return False
        if isinstance(cause, OSError) or _NETWORK_ERRORS.intersection(
            c.__name__ for c in type(cause).__mro__
        ):
            return True
    return False


def is_throttled(exc: BaseException) -> bool:
    """True when ``exc``, or what it was raised from or while handling, is the store asking
    to slow down: an S3 error code such as ``SlowDown`` (s3fs raises it as an ``OSError``
    from botocore's error, which holds the code), or HTTP status 429 or 503.

    Example:
        >>> is_throttled(OSError(16, "Please reduce your request rate")), is_throttled(
        ...     type("ClientResponseError", (Exception,), {"status": 429})())
        (False, True)
    """
    for cause in _chain(exc):
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code in _THROTTLE_CODES or status in _THROTTLE_STATUSES:
                return True
        if getattr(cause, "status", None) in _THROTTLE_STATUSES:  # aiohttp, gcsfs
            return True
    return False


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc``, what it was raised from, and so on (or what it was raised while handling,
    unless that was suppressed)."""
    seen: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and all(cause is not s for s in seen):
        seen.append(cause)
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return seen


def retrying(read: Callable[[], T], url: str, position: str) -> T:
    """``read()``, tried again on transient errors and throttled answers, each under its own
    bound (see the module docstring); a failure raised as a :class:`ShardError` naming ``url``
    and ``position``, and, after several tries, how many over how long."""
    started = time.monotonic()
    failures = throttled = 0
    throttled_since = None
    while True:
        try:
            return read()
        except Exception as exc:
            now = time.monotonic()
            if is_throttled(exc):
                throttled += 1
                throttled_since = now if throttled_since is None else throttled_since
                if now - throttled_since < THROTTLE_BUDGET_S:
                    cap = min(THROTTLE_CAP_S, THROTTLE_BACKOFF_S * 2 ** (throttled - 1))
                    time.sleep(random.uniform(0, cap))
                    continue
            else:
                failures += 1
                if failures < ATTEMPTS and is_transient(exc):
                    time.sleep(BACKOFF_S * 2 ** (failures - 1) * random.uniform(0.5, 1.0))
                    continue
            named = _named(exc, url, position, failures, throttled, now - started)
            if named is exc:
                raise
            raise named from exc


def _named(
    exc: Exception, url: str, position: str, failures: int, throttled: int, seconds: float
) -> Exception:
    """``exc`` as a ShardError of ``url`` (a ShardError keeps its class and position)."""
    attempts = failures + throttled
    if isinstance(exc, ShardError):
        if attempts == 1:
            return exc
        kind, reason, position = type(exc), exc.reason, exc.position or position
    else:
        kind, reason = ShardError, f"unreadable ({exc or type(exc).__name__})"
    if throttled and not failures or is_throttled(exc):
        reason += (f"; throttled by the store (asked to slow down) in {throttled} of "
                   f"{attempts} attempts over {seconds:.1f} s, past the {THROTTLE_BUDGET_S:g} s "
                   "that throttling is waited out")  # fmt: skip
    elif attempts > 1:
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
