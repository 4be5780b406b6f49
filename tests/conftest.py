"""Shared pytest fixtures: small shard sets and a real S3 API on loopback.

- ``tar_shards(counts, *, pax=True, size=16, name="shard") -> list[str]``: writes one tar shard
  per item of ``counts`` into ``tmp_path`` (``{name}-000000.tar``, ...) and returns their paths.
  Samples are numbered globally in shard order: sample g has ``__key__`` ``f"{g:08d}"``,
  ``cls`` = ``str(g).encode()`` and ``bin`` = ``sample_bytes(g, size)``. ``pax=True`` writes
  what ``webdataset.ShardWriter`` writes by default (a PAX header per member, fractional
  mtime); ``pax=False`` plain ustar. A count of 0 writes an empty (but valid) tar.
- ``parquet_shards(counts, *, row_group_size=4, name="part") -> list[str]``: one Parquet file
  per item of ``counts``; row g has columns ``id`` (int g) and ``text`` (``f"row {g}"``).
- ``shards(format, counts) -> list[str]``: tar or Parquet (3 rows per row group) shards.
- ``moto_s3``: a session-wide ``moto_server`` on a free 127.0.0.1 port; yields an ``S3Server``
  with ``endpoint``, ``storage_options`` (for fsspec/s3fs) and ``bucket(name)`` -> a new, empty
  bucket's URL ("s3://name-N", unique within the session, so tests never share a bucket),
  ``upload(paths, name)`` -> the ``ShardIndex`` of local shards copied to such a bucket. The
  server process is stopped at the end.
- ``s3_proxy``: an ``S3Proxy`` (``tests/support.py``) in front of ``moto_s3`` for one test: point
  a dataset's ``storage_options`` at ``s3_proxy.storage_options`` and read ``s3_proxy.gets`` /
  ``s3_proxy.get_bytes`` (GETs and body bytes per "/bucket/key"; ``reset()`` zeroes them).

The plain functions and classes behind them (``sample_bytes``, ``numbered_samples``,
``write_tar``, ``S3Proxy``) are in ``tests/support.py``.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import settings

from nnh_data import ShardIndex, build_shard_index
from tests.support import S3Proxy, free_port, numbered_samples, write_tar

# Tests assert behaviour, never timings: no per-example deadline on a shared, loaded machine.
settings.register_profile("nnh", deadline=None)
settings.load_profile("nnh")

# A suite started in the background by a shell without job control (`(make test &)`) inherits
# SIGINT ignored, and so would every process it starts: their Ctrl-C handling, which the tests
# check, would never run. A Python handler is not inherited across exec, so they get the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

MOTO_SERVER = Path(sys.executable).with_name("moto_server")
_BUCKET_NUMBERS = itertools.count()


@pytest.fixture
def tar_shards(tmp_path: Path) -> Callable[..., list[str]]:
    def make(counts, *, pax: bool = True, size: int = 16, name: str = "shard") -> list[str]:
        paths, first = [], 0
        for i, count in enumerate(counts):
            path = tmp_path / f"{name}-{i:06d}.tar"
            write_tar(path, numbered_samples(first, count, size), pax=pax)
            paths.append(str(path))
            first += count
        return paths

    return make


@pytest.fixture
def parquet_shards(tmp_path: Path) -> Callable[..., list[str]]:
    def make(counts, *, row_group_size: int = 4, name: str = "part") -> list[str]:
        paths, first = [], 0
        for i, count in enumerate(counts):
            ids = list(range(first, first + count))
            table = pa.table({"id": pa.array(ids, pa.int64()), "text": [f"row {g}" for g in ids]})
            path = tmp_path / f"{name}-{i:06d}.parquet"
            pq.write_table(table, path, row_group_size=row_group_size)
            paths.append(str(path))
            first += count
        return paths

    return make


@dataclass(frozen=True)
class S3Server:
    endpoint: str

    @property
    def storage_options(self) -> dict:
        return {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": self.endpoint}}

    def bucket(self, name: str) -> str:
        """Create a new empty bucket named ``name-N`` (unique in the session); returns its URL."""
        import s3fs

        fs = s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True)
        unique = f"{name}-{next(_BUCKET_NUMBERS)}"
        fs.mkdir(unique)
        return f"s3://{unique}"

    def upload(self, paths: list[str], name: str) -> ShardIndex:
        """Local shards (one format) copied to a new bucket ``name-N``; their index there."""
        import s3fs

        bucket = self.bucket(name)
        fs = s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True)
        for path in paths:
            fs.put_file(path, f"{bucket}/{os.path.basename(path)}")
        extension = paths[0].rsplit(".", 1)[-1]
        return build_shard_index(f"{bucket}/*.{extension}", storage_options=self.storage_options)


def _wait_until_up(endpoint: str, process: subprocess.Popen, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto_server exited with code {process.returncode}")
        try:
            urllib.request.urlopen(endpoint, timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto_server did not answer at {endpoint} within {seconds} s")


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[S3Server]:
    port = free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    process = subprocess.Popen(
        [str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(endpoint, process)
        yield S3Server(endpoint)
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def s3_proxy(moto_s3: S3Server) -> Iterator[S3Proxy]:
    with S3Proxy(moto_s3.endpoint) as proxy:
        yield proxy


@pytest.fixture
def shards(tar_shards, parquet_shards) -> Callable[[str, list[int]], list[str]]:
    """``shards(format, counts) -> urls``: ``tar_shards(counts)``, ``parquet_shards(counts,
    row_group_size=3)`` (several row groups per file), or for ``"arrow"`` those Parquet files'
    rows as Arrow IPC files of record batches of 3 rows."""

    def make(fmt: str, counts: list[int]) -> list[str]:
        if fmt == "tar":
            return tar_shards(counts)
        urls = parquet_shards(counts, row_group_size=3)
        if fmt == "parquet":
            return urls
        arrow = [url.replace(".parquet", ".arrow") for url in urls]
        for url, path in zip(urls, arrow):
            table = pq.read_table(url)
            with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                for batch in table.to_batches(3):
                    writer.write_batch(batch)
            os.remove(url)
        return arrow

    return make
