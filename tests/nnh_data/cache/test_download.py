"""nnh_data.cache.download: a shard's bytes into a part, checked against the index (byte count,
version), a stalled read aborted."""

from __future__ import annotations

import os
import threading
import zlib

import fsspec
import pytest

from nnh_data.cache import download as cache_download
from nnh_data.cache.store import ShardCache
from nnh_data.errors import ShardError, StaleIndexError
from nnh_data.shards.reading import build_shard_index
from tests.nnh_data.cache.helpers import (
    part_names,
    random_file,
    read_shard,
    s3_shards,
    slow_info,
)
from tests.support import sample_bytes

pytestmark = pytest.mark.timeout(120)


def test_download_writes_the_bytes_and_returns_their_crc(tmp_path, monkeypatch):
    """In chunks of ``CHUNK_BYTES``: the file holds the shard's bytes, the CRC-32 is theirs."""
    monkeypatch.setattr(cache_download, "CHUNK_BYTES", 1000)
    data = random_file(tmp_path / "s.tar", 4500)
    fd = os.open(tmp_path / "part", os.O_RDWR | os.O_CREAT)
    try:
        crc = cache_download.download(slow_info(tmp_path / "s.tar"), fd, {}, threading.Event())
        assert crc == zlib.crc32(data) and os.pread(fd, 10_000, 0) == data
    finally:
        os.close(fd)


def test_a_stopped_download_raises(tmp_path):
    random_file(tmp_path / "s.tar", 100)
    stop = threading.Event()
    stop.set()
    info = slow_info(tmp_path / "s.tar")
    with open(tmp_path / "part", "wb") as f, pytest.raises(ShardError, match="stopped"):
        cache_download.download(info, f.fileno(), {}, stop)


def test_wrong_byte_count_raises_naming_the_url_and_leaves_nothing(tmp_path):
    random_file(tmp_path / "s.tar", 1000)
    info = slow_info(tmp_path / "s.tar", size=999)
    cache = ShardCache(tmp_path / "cache")
    with cache.session() as session, pytest.raises(ShardError, match="indexed 999") as caught:
        session.open(info)
    assert caught.value.url == info.url
    assert part_names(cache.cache_dir) == [] and cache.entries() == []


def test_a_stalled_download_is_aborted(tmp_path, monkeypatch):
    random_file(tmp_path / "s.tar", 1000)
    monkeypatch.setenv("NNH_TEST_READ_DELAY", "30")
    monkeypatch.setattr(cache_download, "STALL_SECONDS", 0.3)
    cache = ShardCache(tmp_path / "cache")
    info = slow_info(tmp_path / "s.tar")
    with cache.session() as session, pytest.raises(ShardError, match="no progress") as caught:
        session.open(info)
    assert caught.value.url == info.url
    assert part_names(cache.cache_dir) == [] and cache.entries() == []


def test_a_shard_rewritten_with_the_same_size_is_read_anew(moto_s3, tar_shards, tmp_path):
    (path,) = tar_shards([4], size=600)
    options = moto_s3.storage_options
    (old,) = s3_shards(moto_s3, [path], "rewritten")
    before = open(path, "rb").read()
    after = before.replace(sample_bytes(1, 600), sample_bytes(7, 600))  # a payload, not a header
    assert len(after) == len(before) and after != before
    fsspec.filesystem("s3", **options, skip_instance_cache=True).pipe(old.url, after)
    (new,) = build_shard_index(old.url, storage_options=options).shards
    assert new.size == old.size and new.version != old.version
    cache = ShardCache(tmp_path / "cache")
    with cache.session(storage_options=options) as session:
        assert read_shard(session, new, options) == after
        with pytest.raises(StaleIndexError) as caught:  # the old index must not get new bytes
            session.open(old)
    assert caught.value.url == old.url
    assert [e.version for e in cache.entries()] == [new.version]
