"""Fixtures of the fault-injection suite.

- ``remote``: six shards of 8 samples (256-byte payloads) in a moto bucket, once as tar and once
  as Parquet (two row groups each), built once per module: ``remote.index`` (their index, read
  straight from moto), ``remote.expected`` (the Counter of the 48 sample keys an epoch
  delivers), ``remote.url(i)``, ``remote.path(i)`` (the "/bucket/key" of shard ``i``, as
  ``S3Proxy`` counts it). ``remote_tar``: the tar ones alone; ``remote_large``: tar shards of
  about 72 kB.
- ``deliver(ds, epochs=(0,), workers=2, before_epoch=None, **loader_kwargs) -> list[Counter]``:
  the keys each epoch delivers through ``streaming_loader`` (batches of 4, persistent workers)
  with real DataLoader workers (pads left out), calling ``before_epoch(epoch)`` first; the
  loader and its workers are gone when it returns.
- ``no_leaks`` (every test here): after the test, no child process, no file descriptor other
  than a socket, and no ``/dev/shm`` entry naming the test's process or one of its children
  (torch names its own so) is left that was not there before it.
- ``tmpfs(size) -> path``: a tmpfs of ``size`` bytes mounted for the test (skipped with the
  reason when it cannot be mounted: that needs root or CAP_SYS_ADMIN).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import re
import shutil
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nnh_data import ShardedStreamingDataset, ShardIndex, build_shard_index, streaming_loader
from tests.support import numbered_samples, write_tar

SHARDS, PER_SHARD, PAYLOAD = 6, 8, 256


@dataclass(frozen=True)
class Remote:
    index: ShardIndex
    bucket: str  # "s3://name"
    extension: str

    @property
    def expected(self) -> Counter:
        return Counter(f"{g:08d}" for g in range(SHARDS * PER_SHARD))

    def url(self, i: int) -> str:
        return f"{self.bucket}/shard-{i:06d}.{self.extension}"

    def path(self, i: int) -> str:
        return self.url(i)[len("s3:/") :]


def _write(path: Path, first: int, payload: int) -> None:
    samples = numbered_samples(first, PER_SHARD, payload)
    if path.suffix == ".tar":
        write_tar(path, samples, pax=False)
    else:  # two row groups
        columns = {name: [sample[name] for sample in samples] for name in samples[0]}
        pq.write_table(pa.table(columns), path, row_group_size=PER_SHARD // 2)


def _remote(moto_s3, tmp_path_factory, extension: str, payload: int = PAYLOAD) -> Remote:
    folder = tmp_path_factory.mktemp(f"fault-{extension}")
    bucket = moto_s3.bucket(f"faults-{extension}-{payload}")
    fs = fsspec.filesystem("s3", **moto_s3.storage_options, skip_instance_cache=True)
    for i in range(SHARDS):
        path = folder / f"shard-{i:06d}.{extension}"
        _write(path, i * PER_SHARD, payload)
        fs.put_file(str(path), f"{bucket}/{path.name}")
    pattern = f"{bucket}/*.{extension}"
    return Remote(build_shard_index(pattern, storage_options=moto_s3.storage_options), bucket,
                  extension)  # fmt: skip


@pytest.fixture(scope="module", params=["tar", "parquet"])
def remote(request, moto_s3, tmp_path_factory) -> Remote:
    return _remote(moto_s3, tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def remote_tar(moto_s3, tmp_path_factory) -> Remote:
    """The tar shards alone, for the cases where the format makes no difference."""
    return _remote(moto_s3, tmp_path_factory, "tar")


@pytest.fixture(scope="module")
def remote_large(moto_s3, tmp_path_factory) -> Remote:
    """Tar shards of about 72 kB (8 samples of 8 kB), for a cache on a small disk."""
    return _remote(moto_s3, tmp_path_factory, "tar", payload=8192)


def keys_of(batch: list[dict]) -> list[str]:
    """The collate function of the suite: the keys of a batch's real samples."""
    return [sample["__key__"] for sample in batch if not sample["__pad__"]]


@pytest.fixture
def deliver() -> Callable[..., list[Counter]]:
    def run(
        ds: ShardedStreamingDataset, epochs=(0,), workers: int = 2, before_epoch=None, **kwargs
    ) -> list[Counter]:
        loader = streaming_loader(ds, 4, workers, collate_fn=keys_of, **kwargs)
        out = []
        try:
            for epoch in epochs:
                ds.set_epoch(epoch)
                if before_epoch is not None:
                    before_epoch(epoch)
                out.append(Counter(key for batch in loader for key in batch))
        except BaseException as exc:
            exc.__traceback__ = None  # its frames hold the loader's workers
            raise
        finally:
            del loader
            gc.collect()  # the workers are shut down here
        return out

    return run


def _children() -> set[int]:
    me = str(os.getpid())
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone
        if fields[1] == me and fields[0] != "Z":
            found.add(int(pid))
    return found


def _files() -> dict[int, str]:
    """This process's open file descriptors other than sockets, by number."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listing's own descriptor
        if not target.startswith(("socket:", "anon_inode:")):
            out[int(name)] = target
    return out


def _shared_memory(pids: set[int]) -> set[str]:
    """The ``/dev/shm`` entries that name one of ``pids`` (as torch's do: ``torch_<pid>_...``):
    other processes of the machine make theirs there too, which must not count here."""
    pattern = re.compile(r"(?:^|_)(\d+)(?:_|$)")
    return {name for name in os.listdir("/dev/shm")
            if any(int(pid) in pids for pid in pattern.findall(name))}  # fmt: skip


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    children, files = _children(), _files()
    ours, stop = {os.getpid()}, threading.Event()
    shm = _shared_memory(ours | children)

    def watch() -> None:  # the test's child processes, whose /dev/shm entries would be ours
        while not stop.wait(0.05):
            ours.update(_children() - children)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    yield
    stop.set()
    watcher.join()
    gc.collect()  # a loader the test's exception held: its workers are shut down now
    deadline = time.monotonic() + 15  # workers of a killed process notice it within seconds
    while (_children() - children) and time.monotonic() < deadline:
        time.sleep(0.1)
    # DataLoader does not join the workers of a pass that raised: their handles (two pipes
    # each) live until multiprocessing reaps finished children, as any next start would.
    multiprocessing.active_children()
    gc.collect()
    assert _children() - children == set(), "child processes left behind"
    new = {fd: target for fd, target in _files().items() if files.get(fd) != target}
    assert new == {}, "file descriptors left open"
    assert _shared_memory(ours) - shm == set(), "/dev/shm entries left behind"


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        path = tmp_path / f"tmpfs-{len(mounted)}"
        path.mkdir()
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a tmpfs for the disk-full case needs root and mount(8)")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs for the disk-full case: {done.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=True)
