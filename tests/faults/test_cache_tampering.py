"""Other writers in the node-local shard cache, read through ``ShardedStreamingDataset`` with
real DataLoader workers (persistent, as ``deliver`` makes them): a cached shard overwritten with
other bytes of its size between epochs, a cache folder that another user (a second uid: tests
run as root here) made with mode 0777 and in which that user then plants a shard, and the plan
of a reader killed with SIGKILL. No epoch delivers a byte that the remote did not serve."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import tempfile
import zlib
from pathlib import Path

import pytest

from nnh_data import ShardCache, ShardedStreamingDataset
from tests.faults.conftest import PER_SHARD
from tests.faults.test_cache_faults import _warnings_to_stderr

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:the shard cache in"),
    pytest.mark.filterwarnings("ignore:the cached copy of"),
]
OTHER_UID = 65534  # nobody
BOOT_ID = "/proc/sys/kernel/random/boot_id"
FORK = multiprocessing.get_context("fork")


def _dataset(remote, proxy, cache_dir) -> ShardedStreamingDataset:
    return ShardedStreamingDataset(remote.index, storage_options=proxy.storage_options, seed=5,
                                   shuffle_window=PER_SHARD, cache_dir=cache_dir)  # fmt: skip


def _copies(cache_dir) -> dict:
    """url -> the cache entry of each cached shard."""
    return {entry.url: entry for entry in ShardCache(cache_dir).entries()}


def test_a_cached_shard_overwritten_between_epochs_is_not_read(
    remote_tar, s3_proxy, deliver, tmp_path, capfd
):
    """Between epochs shard 0's cached copy gets shard 1's bytes (the same size, other samples)
    and its modification time back: epoch 1 delivers every sample once, shard 0 downloaded
    again, and a warning names it."""
    cache_dir = tmp_path / "cache"

    def overwrite(epoch: int) -> None:
        if epoch == 1:
            copies = _copies(cache_dir)
            victim, other = copies[remote_tar.url(0)], copies[remote_tar.url(1)]
            data, before = Path(other.path).read_bytes(), os.stat(victim.path)
            assert len(data) == before.st_size
            with open(victim.path, "r+b") as f:
                f.write(data)
            os.utime(victim.path, ns=(before.st_atime_ns, before.st_mtime_ns))

    ds = _dataset(remote_tar, s3_proxy, cache_dir)
    delivered = deliver(ds, epochs=(0, 1), before_epoch=overwrite,
                        worker_init_fn=_warnings_to_stderr)  # fmt: skip
    assert delivered == [remote_tar.expected] * 2
    assert [s3_proxy.gets[remote_tar.path(i)] for i in range(6)] == [2, 1, 1, 1, 1, 1]
    warned = [line for line in capfd.readouterr().err.splitlines() if "changed since" in line]
    assert len(warned) == 1 and remote_tar.url(0) in warned[0]


def _as_other_user(action, *args) -> None:
    """``action(*args)`` in a forked child running as uid and gid ``OTHER_UID``."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            action(*args)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"{action.__name__} failed as the other user"


def _make_shared(path: str) -> None:
    os.mkdir(path)
    os.chmod(path, 0o777)


def _plant(root: str, victim: str, record: str, data: bytes, meta: dict) -> None:
    """As the other user: put ``data`` at ``victim`` with a record ``meta`` that agrees with it
    (its CRC-32 and its file's signature): in place when the file can be written, else by moving
    aside the highest folder on its path that can be moved and making the path again."""
    try:
        with open(victim, "r+b") as f:
            f.write(data)
        return
    except OSError:
        pass
    inner = Path(victim).parent.relative_to(root).parts
    for depth in range(len(inner) + 1):
        folder = os.path.join(root, *inner[:depth])
        try:
            os.rename(folder, f"{folder}.moved")
        except OSError:
            continue
        os.makedirs(os.path.dirname(victim), mode=0o777)
        Path(victim).write_bytes(data)
        status = os.stat(victim)  # the signature nnh_data.cache.files.signature records
        checked = [Path(BOOT_ID).read_text().strip(), status.st_ino, status.st_size,
                   status.st_mtime_ns, status.st_ctime_ns]  # fmt: skip
        Path(record).write_text(json.dumps({**meta, "checked": checked}))
        return
    raise PermissionError(f"no folder on the way to {victim} can be moved")


def test_a_cache_folder_another_user_made_0777_is_not_theirs_to_fill(
    remote_tar, s3_proxy, deliver
):
    """Another user made the cache folder with mode 0777: the dataset warns and caches in its
    private subfolder; after epoch 0 that user puts shard 1's bytes in place of shard 0's copy,
    with a record that agrees with them, wherever they can: epoch 1 still delivers every sample
    once, none of theirs."""
    if os.geteuid() != 0:
        pytest.skip("acting as a second user needs root")
    top = tempfile.mkdtemp(prefix="nnh-shared-")
    try:
        os.chmod(top, 0o1777)  # as /tmp or a node's /local: anyone makes their folder there
        shared = os.path.join(top, "cache")
        _as_other_user(_make_shared, shared)
        with pytest.warns(UserWarning, match="can be written by other users"):
            ds = _dataset(remote_tar, s3_proxy, shared)
        used = os.path.join(shared, f"uid-{os.geteuid()}")

        def plant(epoch: int) -> None:
            if epoch == 1:
                copies = _copies(used)
                victim, other = copies[remote_tar.url(0)], copies[remote_tar.url(1)]
                record = os.path.join(os.path.dirname(victim.path), f"{victim.key}.json")
                data = Path(other.path).read_bytes()
                meta = {**json.loads(Path(record).read_text()), "crc32": zlib.crc32(data)}
                _as_other_user(_plant, used, victim.path, record, data, meta)

        assert deliver(ds, epochs=(0, 1), before_epoch=plant) == [remote_tar.expected] * 2
        moved = [name for _, folders, _ in os.walk(shared) for name in folders]
        assert any(name.endswith(".moved") for name in moved)  # they did plant their copy
    finally:
        shutil.rmtree(top)


def _hold_a_plan(cache_dir: str, remote, ready) -> None:
    with ShardCache(cache_dir).session(prefetch=0) as session:
        session.set_plan(list(remote.index.shards), range(len(remote.index.shards)))
        ready.set()
        signal.pause()


def test_the_plan_of_a_killed_reader_is_removed_by_the_next_pass(
    remote_tar, s3_proxy, deliver, tmp_path
):
    """A reader killed with SIGKILL leaves its plan file in ``procs/``; the next pass through
    the cache removes it (a plan its reader released stays a while for the next pass)."""
    cache_dir = str(tmp_path / "cache")
    ready = FORK.Event()
    reader = FORK.Process(target=_hold_a_plan, args=(cache_dir, remote_tar, ready))
    reader.start()
    assert ready.wait(30)
    plans = os.listdir(os.path.join(cache_dir, "procs"))
    assert [name.split(".")[0] for name in plans] == [str(reader.pid)]
    os.kill(reader.pid, signal.SIGKILL)
    reader.join()
    ds = _dataset(remote_tar, s3_proxy, cache_dir)
    assert deliver(ds) == [remote_tar.expected]
    left = {name.split(".")[0] for name in os.listdir(os.path.join(cache_dir, "procs"))}
    assert str(reader.pid) not in left
