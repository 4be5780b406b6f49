"""nnh_data.cache.session: one reader's plan, pins and prefetch; failures of the remote (not tried
again) and of the local folder (read around, one warning); forks."""

from __future__ import annotations

import errno
import os
import shutil
import time
import warnings

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from nnh_data.cache import download as cache_download
from nnh_data.cache import session as cache_session
from nnh_data.cache import store as cache_store
from nnh_data.cache.store import ShardCache
from nnh_data.errors import ShardError
from nnh_data.shards import retries
from nnh_data.shards.index import ShardInfo
from tests.nnh_data.cache.helpers import (
    FORK,
    part_names,
    random_file,
    read_shard,
    slow_info,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- pins and prefetch


def test_a_discarded_copy_is_downloaded_again(tmp_path):
    """After a read error on the cached copy, discard() removes it, even while another
    reader still holds it open, and the next open() reads the remote once more."""
    data = random_file(tmp_path / "s.tar", 3000)
    info = slow_info(tmp_path / "s.tar")
    cache = ShardCache(tmp_path / "cache")
    with cache.session() as other, cache.session() as session:
        held = other.open(info)
        session.open(info)
        session.discard(info)
        assert cache.entries() == []
        assert held.read() == data  # the other reader's open file is intact
        assert read_shard(session, info) == data
    assert cache.stats()["downloads"] == 2 and len(cache.entries()) == 1


def test_prefetch_downloads_the_next_shard_under_its_cap(tmp_path):
    data = [random_file(tmp_path / f"s{i}.tar", 1000) for i in range(3)]
    infos = [slow_info(tmp_path / f"s{i}.tar") for i in range(3)]
    cache = ShardCache(tmp_path / "cache", limit=8000)  # a quarter holds 2 shards
    with cache.session(prefetch=1) as session:
        session.set_plan(infos, [0, 10, 20])
        assert read_shard(session, infos[0]) == data[0]
        wait_until(lambda: len(cache.entries()) == 2)
        session.advance(10)
        assert read_shard(session, infos[1]) == data[1]
        wait_until(lambda: len(cache.entries()) == 3)
    assert cache.stats()["hits"] == 1 and cache.stats()["downloads"] == 3
    small = ShardCache(tmp_path / "small", limit=3000)  # a quarter holds no shard
    with small.session(prefetch=1) as session:
        session.set_plan(infos, [0, 10, 20])
        assert read_shard(session, infos[0]) == data[0]
        time.sleep(0.5)
    assert len(small.entries()) == 1


def test_a_released_plan_lives_for_the_grace_period(tmp_path, monkeypatch):
    cache = ShardCache(tmp_path / "cache")
    random_file(tmp_path / "s.tar", 10)
    session = cache.session(prefetch=0)
    session.set_plan([slow_info(tmp_path / "s.tar")], [0])
    session.close()
    procs = os.path.join(cache.cache_dir, "procs")
    plans = os.listdir(procs)
    assert len(plans) == 1 and cache.verify() == [] and len(os.listdir(procs))
    monkeypatch.setattr(cache_store, "PLAN_GRACE_SECONDS", 0.0)
    time.sleep(0.05)
    cache.verify()
    assert os.listdir(procs) == []


def _plan_and_exit(cache_dir, info, release: bool) -> None:
    session = ShardCache(cache_dir).session(prefetch=0)
    session.set_plan([info], [0])
    if release:
        session.close()
    os._exit(0)  # no close at exit: a process that dies holding its plan


def test_a_new_plan_removes_the_plans_of_dead_processes_and_expired_ones(tmp_path, monkeypatch):
    """Publishing a plan scans the others (also when every read is a hit, so no claim does):
    the plan of a process that died holding it goes at once; a released one stays for the
    grace period (the next pass's to take over), then goes."""
    cache = ShardCache(tmp_path / "cache")
    random_file(tmp_path / "s.tar", 10)
    info = slow_info(tmp_path / "s.tar")
    procs = os.path.join(cache.cache_dir, "procs")
    for release in (True, False):  # (a plan published removes the dead ones)
        child = FORK.Process(target=_plan_and_exit, args=(cache.cache_dir, info, release))
        child.start()
        child.join(30)
    assert len(os.listdir(procs)) == 2
    with cache.session(prefetch=0) as session:
        session.set_plan([info], [0])
        assert len(os.listdir(procs)) == 2  # the released plan and this one
    monkeypatch.setattr(cache_store, "PLAN_GRACE_SECONDS", 0.0)
    time.sleep(0.05)
    with cache.session(prefetch=0) as session:
        session.set_plan([info], [0])
        assert os.listdir(procs) == [os.path.basename(session._plan_path)]


# ---------------------------------------------------------------- failures


class FailingFileSystem(LocalFileSystem):
    """Local files under ``failfile://`` whose reads always fail with a connection reset,
    counted in ``reads`` (a transient error: tried again)."""

    protocol = ("failfile",)
    reads = 0

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        return super()._strip_protocol(path.removeprefix("failfile://"))

    def cat_file(self, path, start=None, end=None, **kwargs):
        FailingFileSystem.reads += 1
        raise ConnectionResetError(104, "reset by the test")


fsspec.register_implementation("failfile", FailingFileSystem, clobber=True)


@pytest.fixture
def failing(tmp_path, monkeypatch) -> list[ShardInfo]:
    """Three shards whose downloads always fail, with retries that do not wait."""
    monkeypatch.setattr(retries, "BACKOFF_S", 0.001)
    FailingFileSystem.reads = 0
    out = []
    for i in range(3):
        random_file(tmp_path / f"f{i}.tar", 1000)
        out.append(ShardInfo(f"failfile://{tmp_path}/f{i}.tar", "tar", 1, size=1000, version="v"))
    return out


def test_a_failed_download_is_not_tried_again_by_its_session(failing, tmp_path):
    """Its prefetch and then the read on demand: one round of attempts, one error."""
    cache = ShardCache(tmp_path / "cache")
    with cache.session(prefetch=1) as session:
        session.set_plan(failing, [0, 5, 9])
        wait_until(lambda: FailingFileSystem.reads == retries.ATTEMPTS)  # s1, ahead
        time.sleep(0.1)
        session.advance(5)
        for _ in range(2):
            with pytest.raises(ShardError, match="reset by the test.*gave up after 5 attempts"):
                session.open(failing[1])
    assert FailingFileSystem.reads == retries.ATTEMPTS
    assert part_names(cache.cache_dir) == [] and cache.entries() == []


def test_a_local_failure_reads_around_with_one_warning(tmp_path, monkeypatch):
    """A disk full while a shard downloads: no error, the shard is read from the remote, the
    part is gone, one warning per process names the cause."""
    infos = []
    for i in range(2):
        random_file(tmp_path / f"s{i}.tar", 1000)
        infos.append(slow_info(tmp_path / f"s{i}.tar"))

    def disk_full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache_download, "write_all", disk_full)
    monkeypatch.setattr(cache_session, "_WARNED", set())
    cache = ShardCache(tmp_path / "cache")
    with cache.session() as session:
        with pytest.warns(UserWarning, match=r"failed on this node \(\[Errno 28\] No space"):
            assert session.open(infos[0]) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert session.open(infos[1]) is None  # no second warning
    assert cache.stats()["around"] == 2 and part_names(cache.cache_dir) == []


def test_a_deleted_folder_is_laid_out_again(tmp_path):
    data = random_file(tmp_path / "s.tar", 1000)
    info = slow_info(tmp_path / "s.tar")
    cache = ShardCache(tmp_path / "cache")
    with cache.session() as session:
        assert read_shard(session, info) == data
    shutil.rmtree(cache.cache_dir)
    with cache.session() as session:
        session.set_plan([info], [0])
        assert read_shard(session, info) == data
    assert {"lock", "procs", "shards", "stats", "tmp"} <= set(os.listdir(cache.cache_dir))
    assert [e.url for e in cache.entries()] == [info.url]


# ---------------------------------------------------------------- forks


def _started_then_sleep(started, seconds: float) -> None:
    started.set()
    time.sleep(seconds)


def test_a_forked_child_lets_go_of_the_parents_pins(tmp_path):
    """A DataLoader worker forked while the main process reads through the cache does not
    keep the main process's shards pinned."""
    data = random_file(tmp_path / "s.tar", 1000)
    info = slow_info(tmp_path / "s.tar")
    cache = ShardCache(tmp_path / "cache")
    with cache.session() as session:
        assert session.open(info) is not None
        started = FORK.Event()
        child = FORK.Process(target=_started_then_sleep, args=(started, 30))
        child.start()
        try:
            assert started.wait(20)
            session.release(info)
            assert cache.evict(info.url)
        finally:
            child.kill()
            child.join()
    assert cache.entries() == [] and len(data) == 1000
