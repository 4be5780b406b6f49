"""Retries of remote reads: which errors are tried again, how many times, how long the waits
are, what the final error says, and the s3 options that turn the library's own retries off."""

from __future__ import annotations

import errno
import threading

import pytest

from nnh_data.errors import ShardError, StaleIndexError
from nnh_data.shards import retries
from nnh_data.shards.retries import (
    ATTEMPTS,
    BACKOFF_S,
    THROTTLE_BACKOFF_S,
    THROTTLE_BUDGET_S,
    THROTTLE_CAP_S,
    is_throttled,
    is_transient,
    remote_fs,
    retrying,
)


class ClientPayloadError(Exception):
    """Named as aiohttp's, which is not an OSError."""


def _raised_from(cause: BaseException) -> ShardError:
    try:
        raise ShardError("s3://b/x.tar", "sample 0", "unreadable") from cause
    except ShardError as exc:
        return exc


def _raised_while_handling(first: BaseException, suppress: bool) -> IndexError:
    try:
        try:
            raise first
        except type(first):
            if suppress:
                raise IndexError("tuple index out of range") from None
            raise IndexError("tuple index out of range")  # noqa: B904 (as pyarrow does)
    except IndexError as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (ConnectionResetError(104, "reset"), True),
        (OSError(errno.EREMOTEIO, "500 InternalError"), True),
        (OSError(errno.EBUSY, "503 SlowDown"), True),
        (TimeoutError(), True),
        (ClientPayloadError("Response payload is not completed"), True),
        (_raised_from(OSError(errno.EIO, "x")), True),
        (_raised_while_handling(TimeoutError(), suppress=False), True),
        (_raised_while_handling(TimeoutError(), suppress=True), False),
        (FileNotFoundError("gone"), False),
        (PermissionError("403"), False),
        (StaleIndexError("s3://b/x.tar", "footer", "rewritten"), False),
        (_raised_from(FileNotFoundError("gone")), False),
        (ShardError("s3://b/x.tar", "sample 3", "truncated tar"), False),
        (ValueError("bad bytes"), False),
    ],
)
def test_is_transient(exc, transient):
    assert is_transient(exc) is transient


class ClientError(Exception):
    """Shaped as botocore's: the S3 error code and HTTP status in ``response``."""

    def __init__(self, code: str, status: int) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


def _s3fs_error(code: str, status: int) -> OSError:
    """What s3fs raises for an S3 error: an OSError from botocore's ClientError."""
    try:
        raise OSError(errno.EBUSY, "Please reduce your request rate.") from ClientError(
            code, status
        )
    except OSError as exc:
        return exc


class Status(Exception):
    """Shaped as aiohttp's ClientResponseError: the HTTP status in ``status``."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


@pytest.mark.parametrize(
    ("exc", "throttled"),
    [
        (_s3fs_error("SlowDown", 503), True),
        (_s3fs_error("ServiceUnavailable", 503), True),
        (_s3fs_error("Throttling", 400), True),
        (_s3fs_error("InternalError", 500), False),
        (_raised_from(_s3fs_error("SlowDown", 503)), True),
        (Status(429), True),
        (Status(500), False),
        (OSError(errno.EBUSY, "busy"), False),
        (ConnectionResetError(), False),
    ],
)
def test_is_throttled(exc, throttled):
    assert is_throttled(exc) is throttled and is_transient(exc) is not isinstance(exc, Status)


class Clock:
    """``time`` for retries: ``sleep`` records each wait and moves ``monotonic`` on."""

    def __init__(self) -> None:
        self.now, self.slept = 1000.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(retries, "time", clock)
    return clock


@pytest.fixture
def waits(clock) -> list[float]:
    return clock.slept


def _failing(errors: list[BaseException], value=b"data"):
    calls = []

    def read():
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return value

    return read, calls


def test_a_transient_failure_is_tried_again(waits):
    read, calls = _failing([ConnectionResetError(), TimeoutError()])
    assert retrying(read, "s3://b/x.tar", "sample 0") == b"data"
    assert len(calls) == 3 and len(waits) == 2


def test_a_failure_that_lasts_gives_up_after_the_attempts_within_the_waits(waits):
    read, calls = _failing([OSError(errno.EREMOTEIO, "500 InternalError")] * 10)
    with pytest.raises(ShardError) as raised:
        retrying(read, "s3://b/x.tar", "sample 8")
    assert len(calls) == ATTEMPTS
    for k, wait in enumerate(waits):  # between half and all of the doubled backoff
        assert BACKOFF_S * 2**k / 2 <= wait <= BACKOFF_S * 2**k
    assert sum(waits) <= BACKOFF_S * (2 ** (ATTEMPTS - 1) - 1) == 7.5
    error = raised.value
    assert (error.url, error.position) == ("s3://b/x.tar", "sample 8")
    assert error.reason.startswith("unreadable ([Errno 121] 500 InternalError); gave up after "
                                   f"{ATTEMPTS} attempts over ")  # fmt: skip
    assert isinstance(error.__cause__, OSError)


def test_a_permanent_failure_is_not_tried_again(waits):
    read, calls = _failing([FileNotFoundError("s3://b/x.tar")])
    message = r"s3://b/x.tar: unreadable \(s3://b/x.tar\) \(at sample 0\)"
    with pytest.raises(ShardError, match=message):
        retrying(read, "s3://b/x.tar", "sample 0")
    assert len(calls) == 1 and waits == []
    stale = StaleIndexError("s3://b/x.tar", "footer", "rewritten")
    read, calls = _failing([stale])
    with pytest.raises(StaleIndexError) as raised:
        retrying(read, "s3://b/x.tar", "sample 0")
    assert raised.value is stale and len(calls) == 1


def test_a_shard_error_keeps_its_class_and_position(waits):
    errors = [_raised_from(ConnectionResetError()) for _ in range(ATTEMPTS)]
    read, _ = _failing(errors)
    with pytest.raises(ShardError) as raised:
        retrying(read, "s3://b/x.tar", "download")
    assert raised.value.position == "sample 0"
    assert raised.value.reason.startswith(f"unreadable; gave up after {ATTEMPTS} attempts")


def test_remote_fs_turns_off_the_s3_library_retries_unless_set():
    options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    fs, path = remote_fs("s3://bucket/a.tar", options)
    assert path == "bucket/a.tar" and fs.retries == 1
    assert fs.config_kwargs["retries"] == {"total_max_attempts": 1}
    own = {**options, "config_kwargs": {"retries": {"max_attempts": 9}, "read_timeout": 3}}
    fs, _ = remote_fs("s3://bucket/a.tar", own)
    assert fs.retries == 5 and fs.config_kwargs == own["config_kwargs"]
    assert "config_kwargs" not in options and "retries" not in own  # the caller's untouched
    fs, path = remote_fs("memory://a/b.tar", None)
    assert path == "/a/b.tar" and not hasattr(fs, "config_kwargs")


def test_remote_fs_opens_one_s3_filesystem_per_process_for_all_its_threads(moto_s3):
    """Opening one is a botocore session (0.1-0.4 s of a first sample); fsspec keeps one per
    thread, and botocore adds "mode" to the retries dict it is given, which changed the options'
    token after the first read."""
    bucket = moto_s3.bucket("fs")
    fs, path = remote_fs(f"{bucket}/a.tar", moto_s3.storage_options)
    fs.pipe_file(path, b"abc")
    assert fs.cat_file(path) == b"abc"  # the client exists: botocore has seen the options
    others: list = []
    thread = threading.Thread(target=lambda: others.append(remote_fs(f"{bucket}/b.tar",
                                                                     moto_s3.storage_options)))
    thread.start()
    thread.join()
    (other, other_path), (again, _) = others[0], remote_fs(f"{bucket}/a.tar",
                                                           moto_s3.storage_options)
    assert other is fs and again is fs and other_path == path[:-5] + "b.tar"
    local, _ = remote_fs("memory://a/b.tar", None)  # not async: fsspec's own cache
    assert local is not fs


def test_a_burst_of_throttling_is_waited_out_apart_from_the_failures(clock):
    """Throttled answers do not count against ``ATTEMPTS``: 10 of them (at most 55.5 s of
    waits, within the budget), then 4 failures, then the read succeeds. Each throttled wait is
    drawn from 0 to the doubled backoff, capped."""
    slow = _s3fs_error("SlowDown", 503)
    errors = [slow] * 10 + [OSError(errno.EREMOTEIO, "500")] * (ATTEMPTS - 1)
    read, calls = _failing(errors)
    assert retrying(read, "s3://b/x.tar", "sample 0") == b"data"
    assert len(calls) == len(errors) + 1
    for k, wait in enumerate(clock.slept[:10]):
        assert 0 <= wait <= min(THROTTLE_CAP_S, THROTTLE_BACKOFF_S * 2**k)


def test_throttling_that_lasts_is_named_past_its_budget(clock):
    read, calls = _failing([_s3fs_error("SlowDown", 503)] * 10_000)
    with pytest.raises(ShardError) as raised:
        retrying(read, "s3://b/x.tar", "sample 2")
    waited = sum(clock.slept)
    assert THROTTLE_BUDGET_S <= waited <= THROTTLE_BUDGET_S + THROTTLE_CAP_S
    assert raised.value.reason.endswith(
        f"; throttled by the store (asked to slow down) in {len(calls)} of {len(calls)} "
        f"attempts over {waited:.1f} s, past the {THROTTLE_BUDGET_S:g} s that throttling is "
        "waited out"
    )
