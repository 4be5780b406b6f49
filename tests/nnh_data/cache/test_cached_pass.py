"""nnh_data.cache.cached_pass: a pass's blocks read through the node-local shard cache, against the
same blocks read from the remote (a real S3 API: moto on loopback, behind ``S3Proxy`` to count
GETs). The cache never changes what a block holds: a copy is read when there is one, the
remote when the cache has no room or the copy is damaged."""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest

from nnh_data.cache.cached_pass import CachedPass
from nnh_data.cache.store import ShardCache
from nnh_data.errors import ShardError
from nnh_data.shards.index import ShardInfo
from nnh_data.shards.reading import ShardReader, decode_shard_range
from tests.nnh_data.cache.helpers import damage
from tests.support import numbered_samples, write_tar

pytestmark = pytest.mark.timeout(60)
# shard 0 in two blocks, then shard 1 whole: (shard, start, stop, concat start)
BLOCKS = [(0, 0, 3, 0), (0, 3, 6, 3), (1, 0, 6, 6)]


@pytest.fixture(scope="module")
def remote_tar(moto_s3, tmp_path_factory) -> list[ShardInfo]:
    """Two tar shards of 6 samples (keys 0-11) in a bucket; the tests damage cached copies
    only, never these."""
    folder = tmp_path_factory.mktemp("cached-pass")
    paths = [str(folder / f"shard-{i:06d}.tar") for i in range(2)]
    for i, path in enumerate(paths):
        write_tar(path, numbered_samples(6 * i, 6, 16), pax=False)
    return list(moto_s3.upload(paths, "cached-pass-tar").shards)


def _same(a, b) -> bool:
    """Two payloads equal: bytes (tar), or columns of numpy arrays and lists (Parquet)."""
    if isinstance(a, bytes):
        return a == b
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _pass(cache, infos, proxy, blocks=BLOCKS, following=()) -> CachedPass:
    reader = ShardReader(proxy.storage_options)
    return CachedPass(cache, reader, infos, blocks, following, prefetch=1, num_workers=1)


def _read_all(cached: CachedPass, infos) -> list[tuple[object, bool]]:
    """Each block's payload and whether it came from a local copy."""
    out = []
    for shard, start, stop, _ in cached.blocks():
        out.append((cached.fetch(infos[shard], start, stop), cached.local))
    return out


def _remote(infos, proxy) -> list:
    reader = ShardReader(proxy.storage_options)
    return [reader.fetch(infos[shard], start, stop) for shard, start, stop, _ in BLOCKS]


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_blocks_come_from_local_copies_with_the_remote_bytes(
    fmt, moto_s3, s3_proxy, tar_shards, parquet_shards, tmp_path
):
    """The first pass downloads each shard once and reads its blocks from the copy; the second
    pass reads the copies only (no GET); every block equals what the remote read gives."""
    paths = tar_shards([6, 6]) if fmt == "tar" else parquet_shards([6, 6])
    infos = list(moto_s3.upload(paths, f"cached-pass-{fmt}").shards)
    expected = _remote(infos, s3_proxy)
    s3_proxy.reset()
    cache = ShardCache(tmp_path / "cache")
    for downloads in (2, 2):
        got = _read_all(_pass(cache, infos, s3_proxy), infos)
        assert all(_same(payload, want) for (payload, _), want in zip(got, expected, strict=True))
        assert [local for _, local in got] == [True] * len(BLOCKS)
        assert cache.stats()["downloads"] == downloads
        assert sum(s3_proxy.gets.values()) == 2  # one GET per shard, in the first pass only
    assert sorted(entry.url for entry in cache.entries()) == [info.url for info in infos]


def test_a_shard_stays_pinned_while_its_run_is_read_and_is_released_after(
    remote_tar, s3_proxy, tmp_path
):
    """A shard cannot be evicted between the blocks of its run; once the pass moved to the
    next shard, or its blocks were dropped half read, nothing of it is pinned."""
    cache = ShardCache(tmp_path / "cache")
    cached = _pass(cache, remote_tar, s3_proxy)
    blocks = cached.blocks()
    shard, start, stop, _ = next(blocks)
    cached.fetch(remote_tar[shard], start, stop)
    assert not cache.evict(remote_tar[0].url)  # pinned for the second block of its run
    shard, start, stop, _ = next(blocks)
    cached.fetch(remote_tar[shard], start, stop)
    shard, start, stop, _ = next(blocks)
    cached.fetch(remote_tar[shard], start, stop)  # shard 1: shard 0 is let go
    assert cache.evict(remote_tar[0].url)
    assert not cache.evict(remote_tar[1].url)
    blocks.close()  # dropped before the end: the session closes
    assert cache.evict(remote_tar[1].url)
    assert cache.stats()["in_flight"] == 0


def test_a_cache_without_room_reads_the_remote_and_warns(remote_tar, s3_proxy, tmp_path):
    expected = _remote(remote_tar, s3_proxy)
    cache = ShardCache(tmp_path / "cache", limit=remote_tar[0].size - 1)  # no shard fits
    with pytest.warns(UserWarning, match="smaller than what its readers need at once"):
        got = _read_all(_pass(cache, remote_tar, s3_proxy), remote_tar)
    assert [payload for payload, _ in got] == expected
    assert [local for _, local in got] == [False] * len(BLOCKS)
    assert cache.stats()["files"] == 0 and cache.stats()["around"] > 0


def test_a_copy_that_fails_to_decode_is_removed_and_the_block_read_from_the_remote(
    remote_tar, s3_proxy, tmp_path
):
    """``copy_failed`` says whether a block came from a copy: then ``fetch_remote`` gives the
    remote's bytes, the copy is removed before the next block, and a later pass downloads it
    again. A block read from the remote is the shard's own error (False)."""
    cache = ShardCache(tmp_path / "cache")
    _read_all(_pass(cache, remote_tar, s3_proxy), remote_tar)
    damage(cache, remote_tar[0].url, 0, b"\xff" * 512)  # its first tar header
    cached = _pass(cache, remote_tar, s3_proxy)
    blocks = cached.blocks()
    shard, start, stop, _ = next(blocks)
    info = remote_tar[shard]
    with pytest.raises(ShardError):
        list(decode_shard_range(info, cached.fetch(info, start, stop), start, stop))
    assert cached.copy_failed(info)
    good = cached.fetch_remote(info, start, stop)
    assert good == ShardReader(s3_proxy.storage_options).fetch(info, start, stop)
    assert [s["__key__"] for s in decode_shard_range(info, good, start, stop)] == [
        f"{g:08d}" for g in range(3)
    ]
    shard, start, stop, _ = next(blocks)
    assert cached.fetch(remote_tar[shard], start, stop) is not None
    assert not cached.local  # the rest of the run reads the remote
    assert [e.url for e in cache.entries()] == [remote_tar[1].url]
    blocks.close()
    s3_proxy.reset()
    got = _read_all(_pass(cache, remote_tar, s3_proxy), remote_tar)
    assert got[0] == (_remote(remote_tar, s3_proxy)[0], True)  # downloaded again, whole


def test_a_parquet_copy_that_fails_to_read_is_removed_and_the_remote_read(
    moto_s3, s3_proxy, parquet_shards, tmp_path
):
    infos = list(moto_s3.upload(parquet_shards([6, 6]), "cached-pass-damaged").shards)
    expected = _remote(infos, s3_proxy)
    cache = ShardCache(tmp_path / "cache")
    _read_all(_pass(cache, infos, s3_proxy), infos)
    (entry,) = [e for e in cache.entries() if e.url == infos[0].url]
    page = pq.read_metadata(entry.path).row_group(0).column(0).data_page_offset
    damage(cache, infos[0].url, page, b"\xff" * 16)  # row group 0's first page header
    got = _read_all(_pass(cache, infos, s3_proxy), infos)
    assert all(_same(payload, want) for (payload, _), want in zip(got, expected, strict=True))
    assert [local for _, local in got] == [False, False, True]  # shard 0's run from the remote
    assert [e.url for e in cache.entries()] == [infos[1].url]


def test_copy_failed_is_false_for_a_block_read_from_the_remote(remote_tar, s3_proxy, tmp_path):
    cache = ShardCache(tmp_path / "cache", limit=remote_tar[0].size - 1)
    cached = _pass(cache, remote_tar, s3_proxy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cache has no room: said in the test above
        for shard, start, stop, _ in cached.blocks():
            cached.fetch(remote_tar[shard], start, stop)
            assert not cached.copy_failed(remote_tar[shard])


def test_bad_ranges_are_refused_naming_the_argument(remote_tar, s3_proxy, tmp_path):
    cached = _pass(ShardCache(tmp_path / "cache"), remote_tar, s3_proxy)
    blocks = cached.blocks()
    next(blocks)
    with pytest.raises(ValueError, match=r"stop must be in \[0, 6\], got 9"):
        cached.fetch(remote_tar[0], 0, 9)
    blocks.close()
