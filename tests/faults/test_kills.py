"""SIGKILL of a DataLoader worker and of the training process, then a resume from the last
saved state: what was delivered up to that state plus what the resumed run delivers is every
sample exactly once, with and without the cache; a killed worker's partial download is gone."""

from __future__ import annotations

import gc
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from nnh_data import ShardCache, ShardedStreamingDataset, streaming_loader
from tests.faults.conftest import PER_SHARD, keys_of
from tests.support import SCRIPTS, Fault

pytestmark = pytest.mark.timeout(120)
CACHED = pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "cache"])
DIED = r"DataLoader worker \(pid\(?s?\)? ?\d+\)? (is killed by signal|exited unexpectedly)"


def _loader(remote, proxy, cache_dir):
    ds = ShardedStreamingDataset(remote.index, storage_options=proxy.storage_options, seed=5,
                                 shuffle_window=PER_SHARD, cache_dir=cache_dir)  # fmt: skip
    return streaming_loader(ds, 4, 2, collate_fn=keys_of)


def _workers() -> list[int]:
    """This process's children that are DataLoader workers (forked: their command is ours)."""
    me, out = str(os.getpid()), []
    with open("/proc/self/cmdline", "rb") as f:
        ours = f.read()  # not multiprocessing's resource tracker, a spawned child
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z" and command == ours:
            out.append(int(pid))
    return sorted(out)


@CACHED
def test_a_killed_worker_resumes_from_the_last_state(cached, remote_tar, s3_proxy, tmp_path):
    """Worker 0 is SIGKILLed while a read of a later shard stalls (mid-download, with the
    cache): the loader raises; a new loader from the state taken before delivers the rest."""
    cache_dir = tmp_path / "cache" if cached else None
    s3_proxy.inject(Fault.stall(2.0, after=500), requests=[3])
    loader = _loader(remote_tar, s3_proxy, cache_dir)
    batches, before = iter(loader), []
    for _ in range(2):
        before += next(batches)
    state = loader.state_dict()
    deadline = time.monotonic() + 30
    while not any(kind == "stall" for _, _, kind in list(s3_proxy.log)):
        assert time.monotonic() < deadline, "no read stalled"
        time.sleep(0.01)
    os.kill(_workers()[0], signal.SIGKILL)
    with pytest.raises(RuntimeError, match=DIED):
        for _ in batches:
            pass
    del loader, batches
    gc.collect()
    resumed = _loader(remote_tar, s3_proxy, cache_dir)
    resumed.load_state_dict(state)
    after = [key for batch in resumed for key in batch]
    del resumed
    assert Counter(before) + Counter(after) == remote_tar.expected
    if cached:
        assert os.listdir(cache_dir / "tmp") == []  # the dead worker's part was removed
        assert ShardCache(cache_dir).stats()["in_flight"] == 0


def _consumer(args: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPTS / "fault_consumer.py"), json.dumps(args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip


def _saved(path) -> dict | None:
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (FileNotFoundError, EOFError):
        return None


@CACHED
def test_a_killed_training_process_resumes_from_the_last_state(
    cached, remote_tar, s3_proxy, tmp_path
):
    """The training process is SIGKILLed after its third batch: its workers exit on their own,
    and a new process from the last saved state delivers the rest."""
    out = tmp_path / "progress.pkl"
    args = {"source": remote_tar.index.shards[0].url.rsplit("/", 1)[0] + "/*.tar",
            "storage_options": s3_proxy.storage_options, "out": str(out), "resume": False,
            "cache_dir": str(tmp_path / "cache") if cached else None, "pause": 0.3}  # fmt: skip
    first = _consumer(args)
    deadline = time.monotonic() + 60
    while (saved := _saved(out)) is None or len(saved["keys"]) < 12:
        assert first.poll() is None, first.stdout.read().decode()
        assert time.monotonic() < deadline, "no progress saved"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    first.stdout.close()
    workers = [int(name) for name in os.listdir(f"{out}.pids")]
    assert len(workers) == 2
    deadline = time.monotonic() + 20  # a worker sees its parent gone within 5 s
    while any(os.path.exists(f"/proc/{pid}") for pid in workers):
        assert time.monotonic() < deadline, "the killed process's workers are still running"
        time.sleep(0.1)
    before = Counter(_saved(out)["keys"])
    second = _consumer({**args, "resume": True, "pause": 0.0})
    output = second.communicate(timeout=90)[0].decode()
    assert second.returncode == 0, output
    saved = _saved(out)
    assert saved["done"] and Counter(saved["keys"]) == remote_tar.expected
    assert sum(before.values()) >= 12
