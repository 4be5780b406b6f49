"""Local faults of the node-local shard cache, read through ``ShardedStreamingDataset`` with
real DataLoader workers: a disk smaller than ``cache_limit`` (a tmpfs), a disk that fills up
while a shard downloads, the cache folder deleted between epochs and during a download, and the
limit sampled under the node lock while workers prefetch. Each keeps every sample exactly once
and raises nothing; the cache falls back to reading the remote, warning once per process."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest

from nnh_data import ShardCache, ShardedStreamingDataset
from nnh_data.cache.files import node_lock
from tests.faults.conftest import PER_SHARD
from tests.support import Fault

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:the shard cache in"),
]
LAYOUT = {"lock", "procs", "shards", "stats", "tmp"}


def _dataset(remote, proxy, cache_dir, **kwargs) -> ShardedStreamingDataset:
    return ShardedStreamingDataset(remote.index, storage_options=proxy.storage_options, seed=5,
                                   shuffle_window=PER_SHARD, cache_dir=cache_dir,
                                   **kwargs)  # fmt: skip


def _print_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"{category.__name__}: {message}", file=os.sys.stderr, flush=True)


def _warnings_to_stderr(worker: int) -> None:
    """A worker's warnings printed (a fork inherits the test's warning capture)."""
    warnings.simplefilter("always")
    warnings.showwarning = _print_warning


def _when_stalled(proxy, action) -> threading.Thread:
    """Run ``action()`` in a thread as soon as a request of ``proxy`` stalls."""

    def wait() -> None:
        deadline = time.monotonic() + 60
        while not any(kind == "stall" for _, _, kind in list(proxy.log)):
            assert time.monotonic() < deadline, "no request stalled"
            time.sleep(0.01)
        action()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def _fill(folder: Path) -> Path:
    """A file taking every free byte of ``folder``'s disk."""
    path = folder / "ballast"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        for block in (b"\0" * (1 << 16), b"\0" * 4096):
            try:
                while os.write(fd, block):
                    pass
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return path


def _parts(cache_dir: Path) -> list[str]:
    return os.listdir(cache_dir / "tmp")


def test_a_cache_limit_larger_than_the_disk_is_capped_by_it(
    remote_large, s3_proxy, deliver, tmpfs
):
    """A 256 KiB disk under ``cache_limit="1GB"`` (the shards are 430 kB): no "No space left
    on device", every sample once in each of two epochs, the cache within the disk."""
    disk = tmpfs(256 << 10)
    cache_dir = disk / "cache"
    ds = _dataset(remote_large, s3_proxy, cache_dir, cache_limit="1GB")
    assert deliver(ds, epochs=(0, 1)) == [remote_large.expected] * 2
    stats = ShardCache(cache_dir).stats()
    assert stats["limit"] < 256 << 10 and 0 < stats["bytes"] <= stats["limit"]
    assert _parts(cache_dir) == []


def test_a_disk_full_mid_download_reads_the_remote_and_warns_once(
    remote_large, s3_proxy, deliver, tmpfs, capfd
):
    """The disk fills while the third download stalls: that shard is read from the remote,
    one warning says why, no partial file is left; the next epoch reads through the cache."""
    disk = tmpfs(1 << 20)
    cache_dir = disk / "cache"
    s3_proxy.inject(Fault.stall(1.5, after=1000), requests=[3])
    filler = _when_stalled(s3_proxy, lambda: _fill(disk))
    ds = _dataset(remote_large, s3_proxy, cache_dir, cache_limit="1GB")
    delivered = deliver(ds, workers=1, worker_init_fn=_warnings_to_stderr)
    filler.join()
    assert delivered == [remote_large.expected]
    assert _parts(cache_dir) == []
    assert capfd.readouterr().err.count("No space left on device") == 1
    (disk / "ballast").unlink()
    s3_proxy.reset()
    assert deliver(ds, epochs=(1,), workers=1) == [remote_large.expected]
    assert ShardCache(cache_dir).stats()["files"] > 0


def test_the_cache_folder_deleted_between_epochs_is_laid_out_again(
    remote_tar, s3_proxy, deliver, tmp_path
):
    """Persistent workers keep their cache: the next epoch lays the folder out again and
    downloads every shard again."""
    cache_dir = tmp_path / "cache"

    def delete(epoch: int) -> None:
        if epoch == 1:  # gone at once: a persistent worker may still be writing its stats in it
            gone = tmp_path / "deleted"  # (rmtree then meets a file made after it listed the
            cache_dir.rename(gone)  # folder: "Directory not empty")
            shutil.rmtree(gone, ignore_errors=True)

    ds = _dataset(remote_tar, s3_proxy, cache_dir)
    assert deliver(ds, epochs=(0, 1), before_epoch=delete) == [remote_tar.expected] * 2
    assert LAYOUT <= set(os.listdir(cache_dir))
    assert [s3_proxy.gets[remote_tar.path(i)] for i in range(6)] == [2] * 6
    assert len(ShardCache(cache_dir).entries()) == 6


def test_the_cache_folder_deleted_during_a_download(remote_large, s3_proxy, deliver, tmp_path):
    """The folder goes while the third download stalls: that shard is read from the remote
    (one warning), the others through the folder laid out again; nothing is raised."""
    cache_dir = tmp_path / "cache"
    s3_proxy.inject(Fault.stall(1.5, after=1000), requests=[3])
    # ignore_errors: the worker may add a file while the tree goes (it lays the folder out again)
    remover = _when_stalled(s3_proxy, lambda: shutil.rmtree(cache_dir, ignore_errors=True))
    ds = _dataset(remote_large, s3_proxy, cache_dir)
    assert deliver(ds, epochs=(0, 1), workers=1) == [remote_large.expected] * 2
    remover.join()
    assert LAYOUT <= set(os.listdir(cache_dir)) and _parts(cache_dir) == []


@pytest.mark.parametrize(
    ("shards", "prefetch"),
    [(2.5, 2), (4, 2)],
    ids=["2.5-shards-read-around", "4-shards-filled"],
)
def test_the_folder_never_holds_more_than_the_limit(
    remote_large, s3_proxy, deliver, tmp_path, shards, prefetch
):
    """Two workers prefetching through a cache of a few shards, three epochs: the bytes on
    disk of the complete shards and of the downloads in flight (``tmp/*.part`` as written so
    far), summed under the node lock (so that no rename or eviction is seen half done) every
    few milliseconds, never exceed the limit. With 2.5 shards some reads go around the cache;
    with 4 the limit can be filled exactly, so a part counted late would show as bytes over it.
    Either way shards are evicted to make room."""
    cache_dir = tmp_path / "cache"
    size = max(info.size for info in remote_large.index.shards)
    limit = int(shards * size)
    cache = ShardCache(cache_dir, limit)
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.003):
            with node_lock(cache.cache_dir):
                peak[0] = max(peak[0], _bytes_held(cache_dir))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        ds = _dataset(remote_large, s3_proxy, cache_dir, cache_limit=limit,
                      cache_prefetch=prefetch)  # fmt: skip
        assert deliver(ds, epochs=(0, 1, 2)) == [remote_large.expected] * 3
    finally:
        stop.set()
        sampler.join()
    assert size < peak[0] <= limit
    stats = cache.stats()
    assert stats["evictions"] > 0
    assert stats["evictions"] == stats["downloads"] - stats["files"]  # kept or evicted


def _bytes_held(cache_dir: Path) -> int:
    """The bytes of the complete shards and the downloads in flight."""
    total = 0
    for folder in ("shards", "tmp"):
        for root, _, names in os.walk(cache_dir / folder):
            for name in names:
                if not name.endswith(".json") and not name.startswith("."):
                    total += _size(os.path.join(root, name))
    return total


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0
