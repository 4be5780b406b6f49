"""Helpers of the cache tests: the benchmark's trace, a slow local remote (``slowfile://``),
random shards, reads through a session, and processes that read or hold shards."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import multiprocessing
import os
import sys
import time
import traceback
import zlib

import fsspec
import numpy as np
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from nnh_data.cache.store import ShardCache
from nnh_data.shards.index import ShardInfo
from nnh_data.shards.reading import build_shard_index
from tests.support import ROOT

FORK = multiprocessing.get_context("fork")


def load_bench():
    """``tools/bench/cache.py``: the demand trace and the policies simulated on it."""
    if str(ROOT / "tools/bench") not in sys.path:
        sys.path.append(str(ROOT / "tools/bench"))  # its helpers' module, as when it runs
    spec = importlib.util.spec_from_file_location("bench_cache", ROOT / "tools/bench/cache.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class SlowFileSystem(LocalFileSystem):
    """Local files under the ``slowfile://`` protocol; each read sleeps
    ``NNH_TEST_READ_DELAY`` seconds (inherited by forked processes)."""

    protocol = ("slowfile",)

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        return super()._strip_protocol(
            path[len("slowfile://") :] if path.startswith("slowfile://") else path
        )

    def _open(self, path, mode="rb", **kwargs):
        return _SlowReader(super()._open(path, mode, **kwargs))


class _SlowReader:
    def __init__(self, f) -> None:
        self.f = f

    def read(self, size=-1) -> bytes:
        time.sleep(float(os.environ.get("NNH_TEST_READ_DELAY", "0")))
        return self.f.read(size)

    def __getattr__(self, name):  # seek, tell, ...: the file's own
        return getattr(self.f, name)

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


fsspec.register_implementation("slowfile", SlowFileSystem, clobber=True)


def slow_info(path, size=None) -> ShardInfo:
    size = os.path.getsize(path) if size is None else size
    return ShardInfo(f"slowfile://{path}", "tar", 1, size=size, version="v1")


def random_file(path, size: int) -> bytes:
    data = np.random.default_rng(size).bytes(size)
    with open(path, "wb") as f:
        f.write(data)
    return data


def damage(cache: ShardCache, url: str, offset: int, data: bytes) -> None:
    """Overwrite the cached copy of ``url`` at ``offset`` (its size stays) and record the CRC-32
    of what it holds then: as if the download had brought those bytes, so the copy passes its
    checks and fails only when it is decoded."""
    (entry,) = [e for e in cache.entries() if e.url == url]
    with open(entry.path, "r+b") as f:
        f.seek(offset)
        f.write(data)
        f.seek(0)
        crc = zlib.crc32(f.read())
    record = os.path.join(os.path.dirname(entry.path), f"{entry.key}.json")
    with open(record) as f:
        meta = json.load(f)
    meta.pop("checked", None)
    with open(record, "w") as f:
        json.dump({**meta, "crc32": crc}, f)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_shard(session, info, options=None) -> bytes:
    """The shard's bytes through the cache, or from the remote when the cache is too small."""
    f = session.open(info)
    if f is None:
        fs, path = url_to_fs(info.url, **(options or {}))
        return fs.cat_file(path)
    try:
        f.seek(0)
        return f.read()
    finally:
        session.release(info)


def s3_shards(moto_s3, paths, bucket_name) -> list[ShardInfo]:
    """Upload local shards to a new bucket; their index there."""
    bucket = moto_s3.bucket(bucket_name)
    fs = fsspec.filesystem("s3", **moto_s3.storage_options, skip_instance_cache=True)
    for path in paths:
        fs.put_file(path, f"{bucket}/{os.path.basename(path)}")
    extension = paths[0].rsplit(".", 1)[-1]
    index = build_shard_index(f"{bucket}/*.{extension}", storage_options=moto_s3.storage_options)
    return list(index.shards)


def files_bytes(cache_dir) -> int:
    """Bytes of the shards and parts in the folder (what the limit bounds)."""
    total = 0
    for folder in ("shards", "tmp"):
        for root, _, names in os.walk(os.path.join(cache_dir, folder)):
            for name in names:
                if not name.endswith(".json") and not name.startswith("."):
                    try:
                        total += os.path.getsize(os.path.join(root, name))
                    except FileNotFoundError:
                        pass
    return total


def child_main(target, number, args, results) -> None:
    try:
        results.put((number, target(*args), None))
    except BaseException:  # reported to the test, which names the process
        results.put((number, None, traceback.format_exc()))


def wait_until(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def read_through_cache(cache_dir, limit, infos, options, order, barrier=None, prefetch=0):
    """One process: a session that plans and reads ``infos`` in ``order``; their digests."""
    cache = ShardCache(cache_dir, limit)
    if barrier is not None:
        barrier.wait(timeout=30)
    digests = {}
    with cache.session(storage_options=options, prefetch=prefetch) as session:
        session.set_plan([infos[i] for i in order], range(len(order)))
        for t, i in enumerate(order):
            session.advance(t)
            digests[i] = digest(read_shard(session, infos[i], options))
    return digests


def open_and_hold(cache_dir, info) -> None:
    session = ShardCache(cache_dir).session(prefetch=0)
    session.open(info)
    time.sleep(60)


def part_names(cache_dir) -> list[str]:
    return os.listdir(os.path.join(cache_dir, "tmp"))
