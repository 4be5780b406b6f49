"""Remote faults injected by request count through ``tests.support.S3Proxy``: transient ones
(HTTP 500, a burst of 503 SlowDown, a connection reset mid-body, a truncated body, a stall
past the read timeout) cost retries, never a sample; a shard that always fails is named after
exactly ``ATTEMPTS`` attempts, with and without the cache (the bound the README states: the
attempts are counted at the proxy, the waits between them in
``tests/nnh_data/shards/test_retries.py``; no test here asserts wall seconds). Throttling has
a budget of its own: a burst of SlowDown longer than the failures' bound costs no sample, and
one past the throttling budget is named as throttling."""

from __future__ import annotations

import os
import re
import time

import pytest

from nnh_data import ShardCache, ShardedStreamingDataset, ShardError
from nnh_data.shards import retries
from nnh_data.shards.retries import ATTEMPTS, BACKOFF_S
from tests.faults.conftest import PER_SHARD
from tests.support import Fault

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:skipping unreadable samples"),
]
CACHED = pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "cache"])
WAITS = BACKOFF_S * (2 ** (ATTEMPTS - 1) - 1)  # the longest waits between the attempts: 7.5 s

# (what, shard, the numbers of its GETs that get it): all at once, one shard each
TRANSIENT = [
    (Fault.reset(after=700), 0, [1]),
    (Fault.error(500), 1, [1]),
    (Fault.slow_down(), 2, [1, 2, 3]),  # a burst of SlowDown
    (Fault.error(503), 3, [1, 2]),
    (Fault.truncate(after=700), 4, [1, 2]),
    (Fault.stall(2.5, after=700), 5, [1]),  # past the read timeout of 1 s
]


def _dataset(remote, proxy, cache_dir=None, window=PER_SHARD, **kwargs) -> ShardedStreamingDataset:
    """Windows of one shard by default, so each worker reads three whole shards; reads time
    out after 1 s without a byte."""
    options = {**proxy.storage_options, "config_kwargs": {"read_timeout": 1}}
    return ShardedStreamingDataset(remote.index, storage_options=options, seed=5,
                                   shuffle_window=window, cache_dir=cache_dir,
                                   **kwargs)  # fmt: skip


def _gets(proxy, path: str) -> list[str]:
    return [kind for method, p, kind in proxy.log if method == "GET" and p == path]


def _check_cache(cache_dir, downloads: int) -> None:
    stats = ShardCache(cache_dir).stats()
    assert (stats["downloads"], stats["around"], stats["in_flight"]) == (downloads, 0, 0)
    assert os.listdir(os.path.join(cache_dir, "tmp")) == []  # no partial download left


@CACHED
def test_transient_faults_cost_no_sample(cached, remote, s3_proxy, deliver, tmp_path):
    """A reset, a 500, a SlowDown burst, 503s, truncated bodies and a stall, one shard each:
    every sample exactly once; each shard read again after its faults."""
    for what, shard, requests in TRANSIENT:
        s3_proxy.inject(what, path=remote.path(shard), requests=requests)
    cache_dir = tmp_path / "cache" if cached else None
    assert deliver(_dataset(remote, s3_proxy, cache_dir)) == [remote.expected]
    for what, shard, requests in TRANSIENT:
        gets = _gets(s3_proxy, remote.path(shard))
        assert gets[: len(requests) + 1] == [what.kind] * len(requests) + ["ok"], shard
    if cached:
        _check_cache(cache_dir, downloads=6)


def _named_after_the_attempts(error: str, remote, started: float) -> None:
    """The error names shard 3, its ``ATTEMPTS`` attempts and their seconds: at least the
    shortest waits between them (random, half of ``WAITS`` at least), and no more than the
    test took (what the message says is measured, not made up)."""
    pattern = (rf"{re.escape(remote.url(3))}: unreadable \(.*\); gave up after {ATTEMPTS} "
               r"attempts over (\d+\.\d) s \(at (?:sample 0, )?byte 0\)")  # fmt: skip
    seconds = float(re.search(pattern, error)[1])
    assert WAITS / 2 <= seconds <= time.monotonic() - started


@CACHED
def test_a_shard_that_always_fails_is_named_within_the_bound(
    cached, remote_tar, s3_proxy, deliver, tmp_path
):
    """One reader reads shard 3: named after exactly ``ATTEMPTS`` GETs (through the cache too:
    its prefetch's failed download is not tried again by its read on demand)."""
    remote = remote_tar
    s3_proxy.inject(Fault.error(500), path=remote.path(3))
    started = time.monotonic()
    with pytest.raises(ShardError) as raised:
        deliver(_dataset(remote, s3_proxy, tmp_path / "cache" if cached else None))
    _named_after_the_attempts(str(raised.value), remote, started)
    assert _gets(s3_proxy, remote.path(3)) == ["error"] * ATTEMPTS


@pytest.mark.parametrize("prefetch", [1, 2])
def test_a_failing_shard_read_by_two_workers_through_the_cache_is_named_once_tried(
    remote_tar, s3_proxy, deliver, tmp_path, prefetch
):
    """Windows of 2 samples, so both workers read blocks of shard 3 and one may wait on the
    other's download: the error still names it after one reader's ``ATTEMPTS`` attempts, and
    no reader tries it more than that (at most ``ATTEMPTS`` GETs per worker)."""
    remote = remote_tar
    s3_proxy.inject(Fault.error(500), path=remote.path(3))
    ds = _dataset(remote, s3_proxy, tmp_path / "cache", window=2, cache_prefetch=prefetch)
    started = time.monotonic()
    with pytest.raises(ShardError) as raised:
        deliver(ds, workers=2)
    _named_after_the_attempts(str(raised.value), remote, started)
    assert ATTEMPTS <= len(_gets(s3_proxy, remote.path(3))) <= 2 * ATTEMPTS


@CACHED
def test_skip_leaves_out_a_failing_shard_and_counts_it(
    cached, remote_tar, s3_proxy, deliver, tmp_path
):
    """``on_error="skip"``: the other shards' samples exactly once, the failing shard's 8
    counted, after one bounded round of attempts (not one per block)."""
    remote = remote_tar
    s3_proxy.inject(Fault.error(500), path=remote.path(3))
    cache_dir = tmp_path / "cache" if cached else None
    ds = _dataset(remote, s3_proxy, cache_dir, on_error="skip")
    (delivered,) = deliver(ds, workers=1)
    lost = {f"{g:08d}" for g in range(3 * PER_SHARD, 4 * PER_SHARD)}
    assert delivered == {key: 1 for key in remote.expected if key not in lost}
    assert ds.error_counts == {remote.url(3): PER_SHARD}
    assert _gets(s3_proxy, remote.path(3)) == ["error"] * ATTEMPTS
    if cached:
        _check_cache(cache_dir, downloads=5)


@CACHED
def test_a_slow_down_burst_past_the_failure_bound_costs_no_sample(
    cached, remote_tar, s3_proxy, deliver, tmp_path
):
    """Every GET answered 503 SlowDown for 12 s (longer than the ~8 s in which 5 failures
    give up): throttling has its own budget, so every sample comes once."""
    remote = remote_tar
    s3_proxy.inject(Fault.slow_down(), seconds=12)
    cache_dir = tmp_path / "cache" if cached else None
    assert deliver(_dataset(remote, s3_proxy, cache_dir)) == [remote.expected]
    assert any("error" in _gets(s3_proxy, remote.path(i)) for i in range(6))


def test_throttled_answers_are_not_counted_as_failures(remote_tar, s3_proxy, deliver,
                                                       monkeypatch):  # fmt: skip
    """Twice ``ATTEMPTS`` SlowDowns, then a 500 and the read: each shard's read goes on
    (waits made short here; the workers are forked with them)."""
    monkeypatch.setattr(retries, "THROTTLE_CAP_S", 0.05)
    remote = remote_tar
    answers = [Fault.slow_down()] * (2 * ATTEMPTS) + [Fault.error(500)]
    for i in range(6):
        for n, fault in enumerate(answers, 1):
            s3_proxy.inject(fault, path=remote.path(i), requests=[n])
    assert deliver(_dataset(remote, s3_proxy)) == [remote.expected]
    for i in range(6):
        assert _gets(s3_proxy, remote.path(i))[: len(answers) + 1] == ["error"] * len(answers) + [
            "ok"]


def test_throttling_past_its_budget_is_named_as_throttling(remote_tar, s3_proxy, deliver,
                                                           monkeypatch):  # fmt: skip
    """A store that never stops throttling shard 3: named once the throttling budget (here
    made 2 s; the worker is forked with it) is spent, as throttling, not as a failure."""
    monkeypatch.setattr(retries, "THROTTLE_BUDGET_S", 2.0)
    monkeypatch.setattr(retries, "THROTTLE_CAP_S", 0.5)
    remote = remote_tar
    s3_proxy.inject(Fault.slow_down(), path=remote.path(3))
    with pytest.raises(ShardError, match=rf"{re.escape(remote.url(3))}: unreadable \(.*\); "
                       r"throttled by the store \(asked to slow down\) in (\d+) of \1 "
                       r"attempts over [\d.]+ s, past the 2 s"):  # fmt: skip
        deliver(_dataset(remote, s3_proxy), workers=1)
    assert len(_gets(s3_proxy, remote.path(3))) > ATTEMPTS
