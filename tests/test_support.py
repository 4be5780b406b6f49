"""The test helpers that are more than a few lines: the counting S3 proxy."""

from __future__ import annotations

import time

import pytest
import s3fs

from tests.support import S3Proxy


def _fs(options: dict) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(**options, skip_instance_cache=True)


def _slow_counts(proxy: S3Proxy) -> None:
    """The proxy's server thread counts slowly: what a loaded machine does at random."""
    count = proxy._count

    def slowly(*args) -> None:
        time.sleep(0.2)
        count(*args)

    proxy._count = slowly


@pytest.mark.parametrize("slow", [False, True], ids=["plain", "slow-counts"])
def test_s3_proxy_forwards_and_counts_gets_and_bytes(moto_s3, s3_proxy, slow):
    """The counts are exact as soon as the client has its bytes."""
    if slow:
        _slow_counts(s3_proxy)
    bucket = moto_s3.bucket("proxy")[len("s3://") :]
    fs = _fs(s3_proxy.storage_options)
    data = bytes(range(256)) * 40
    fs.pipe(f"{bucket}/a.bin", data)  # PUT through the proxy
    assert _fs(moto_s3.storage_options).cat_file(f"{bucket}/a.bin") == data
    assert fs.info(f"{bucket}/a.bin")["size"] == len(data)  # HEAD, not counted
    s3_proxy.reset()
    assert fs.cat_file(f"{bucket}/a.bin") == data
    assert fs.cat_file(f"{bucket}/a.bin", start=100, end=1100) == data[100:1100]  # Range
    path = f"/{bucket}/a.bin"
    assert (s3_proxy.gets[path], s3_proxy.get_bytes[path]) == (2, len(data) + 1000)
    fs.rm(f"{bucket}/a.bin")  # DELETE
    assert not _fs(moto_s3.storage_options).exists(f"{bucket}/a.bin")
    s3_proxy.reset()
    assert dict(s3_proxy.gets) == {} and dict(s3_proxy.get_bytes) == {}


@pytest.mark.parametrize(("slow", "seconds"), [({"latency_s": 0.3}, 0.3),
                                                ({"bytes_per_s": 50_000}, 0.4)])  # fmt: skip
def test_s3_proxy_is_slow_when_asked(moto_s3, slow, seconds):
    """Lower bounds only: the proxy sleeps at least this long (20 kB at 50 kB/s: 0.4 s)."""
    bucket = moto_s3.bucket("slow")[len("s3://") :]
    _fs(moto_s3.storage_options).pipe(f"{bucket}/b.bin", b"x" * 20_000)
    with S3Proxy(moto_s3.endpoint, **slow) as proxy:
        fs = _fs(proxy.storage_options)
        started = time.monotonic()
        assert fs.cat_file(f"{bucket}/b.bin") == b"x" * 20_000
        assert time.monotonic() - started >= seconds
        assert proxy.gets[f"/{bucket}/b.bin"] == 1
