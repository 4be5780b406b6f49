"""A node-local cache of whole remote shards: one download per shard per node, evicted by the
known future order (Belady's rule) instead of by recency.

Design. Every process of a node (ranks, DataLoader workers, other jobs) shares one folder::

    lock                                   node lock (flock), held for bookkeeping only
    shards/<kk>/<key>-<name>, <key>.json   complete shards (appear by rename) and their record
    tmp/<key>.<size>.<pid>.<rand>.part     downloads in flight
    procs/<pid>.<rand>.plan                each live reader's plan and position
    stats/<pid>.json                       each process's counters, summed by stats()

``key = hash(url, size, version)``, so a rewritten object is a new key and never served stale.
Every lock is an ``fcntl.flock`` on an open file, so the kernel drops it when its process dies:
no shared memory, no lock file that is unlinked, no shared counter a crash leaves wrong. A
reader pins a shard with ``LOCK_SH`` on its open file; a downloader holds ``LOCK_EX`` on its part
(a part whose ``LOCK_EX`` can be taken belongs to a dead writer and is removed); eviction takes
``LOCK_EX | LOCK_NB`` under the node lock, so a pinned shard is never removed. A miss looks, under
the node lock, for a live part of the key first, then for the published file: a live part is
waited on, and otherwise room is made before the part is created (in-flight parts count at their
full size), so the folder never holds more than the limit. Shards are not fsynced (that costs a
small cache 10-20% of an epoch); each record holds the boot id and a CRC-32, and a shard of an
earlier boot is checked against it before use.

Eviction. Each reader publishes a plan: the keys it will read and the item index at which it
reads each (this pass, then the next epoch), and moves its position as it reads. A shard's next
use is the minimum over live plans of ``(t - position) * num_workers``; making room for a shard
needed at distance ``d`` evicts unpinned shards by farthest next use, never one needed at or
before ``d`` (``d = 0`` for a read on demand, which goes around the cache when no room can be
made). Prefetch follows the same rule and is capped so that what all live plans hold ahead stays
under a quarter of the limit. The trade-off: a decision scans the folder and the plans under the
node lock (milliseconds for 10,000 shards), which is small next to a shard's download.

Use. A reader (one DataLoader worker's pass) opens a :class:`CacheSession`, publishes its plan
(:func:`read_schedule` gives it from the epoch order), reports its position with ``advance`` and
reads shards through ``open``/``release``; ``open`` returns None when the cache is smaller than
what the readers need at once, and the caller then reads the remote directly. ``cache_dir`` must
be on node-local disk: ``flock`` on NFS is emulated or absent.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import queue
import re
import secrets
import shutil
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from nnh_data.atomic import replace_file
from nnh_data.cache.policy import Plan, choose_victims, next_uses, parse_size, shard_key
from nnh_data.checks import check_int
from nnh_data.errors import ShardError, StaleIndexError
from nnh_data.shards.index import ShardInfo
from nnh_data.shards.retries import remote_fs, retrying

__all__ = [
    "CHUNK_BYTES",
    "DISK_RESERVE",
    "PLAN_GRACE_SECONDS",
    "PREFETCH_SHARE",
    "STALL_SECONDS",
    "CacheEntry",
    "CacheSession",
    "ShardCache",
]

STALL_SECONDS = 120.0  # a download without progress for this long is aborted
PLAN_GRACE_SECONDS = 120.0  # a released plan stays live this long (the gap between epochs)
PREFETCH_SHARE = 0.25  # what all live plans hold ahead stays under this share of the limit
DISK_RESERVE = 1 << 30  # kept free on the disk (a twentieth of a disk under 20 GiB)
CHUNK_BYTES = 4 << 20
_POLL_S = 0.2
_RETRY_S = 0.5  # a prefetch that found no room looks again after this long
_MTIME_SLACK_NS = 200_000_000  # a folder changed this recently is listed again
_HEADER = 51  # a plan file starts with "<position:20> <ahead:20> <plan id:8>\n"
_COUNTERS = ("downloads", "hits", "around", "evictions")
_BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"


# ---------------------------------------------------------------- files and locks


@dataclass(frozen=True)
class CacheEntry:
    """A complete shard in the cache: where it came from and where it lies."""

    url: str
    size: int
    path: str
    key: str
    version: str


def _try_lock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _open_if_unlocked(path: str) -> int | None:
    """``path`` opened with ``LOCK_EX`` when nobody holds a lock on it; else (or when it is
    gone) None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    if _try_lock(fd, fcntl.LOCK_EX):
        return fd
    os.close(fd)
    return None


def _unlink(*paths: str) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _locked_file(path: str, data: bytes) -> int:
    """A new file ``path`` holding ``data``, open and locked (``LOCK_EX``); nothing is left
    behind when that fails."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _write_all(fd, data)
    except BaseException:
        os.close(fd)
        _unlink(path)
        raise
    return fd


def _read_json(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _boot_id() -> str:
    try:
        with open(_BOOT_ID_FILE) as f:
            return f.read().strip()
    except OSError:
        return ""


def _file_crc(fd: int) -> int:
    crc, offset = 0, 0
    while chunk := os.pread(fd, CHUNK_BYTES, offset):
        crc = zlib.crc32(chunk, crc)
        offset += len(chunk)
    return crc


def _shard_name(url: str) -> str:
    """The URL's file name, safe as a file name."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", url.rstrip("/").rsplit("/", 1)[-1])[-80:] or "shard"


@dataclass(frozen=True)
class _Part:
    path: str
    key: str
    size: int


def _parse_part(folder: str, name: str) -> _Part | None:
    fields = name.split(".")
    if len(fields) != 5 or fields[-1] != "part" or not fields[1].isdigit():
        return None
    return _Part(os.path.join(folder, name), fields[0], int(fields[1]))


class _Counters:
    """This process's counters, in ``stats/<pid>.json`` (a fixed-width record overwritten in
    place); a process reusing a dead one's pid carries its counts on."""

    _lock = threading.Lock()
    _all: dict[str, _Counters] = {}

    def __init__(self, folder: str) -> None:
        self.folder, self.pid, self.values = folder, -1, dict.fromkeys(_COUNTERS, 0)

    @classmethod
    def of(cls, folder: str) -> _Counters:
        with cls._lock:
            return cls._all.setdefault(folder, cls(folder))

    def add(self, name: str, count: int = 1) -> None:
        with self._lock:
            self._own()
            self.values[name] += count
            record = ", ".join(f'"{k}": {v:<20d}' for k, v in self.values.items())
            try:
                self._write(("{" + record + "}\n").encode())
            except OSError:
                pass  # a full disk: the count stays here and is written with the next one

    def _write(self, record: bytes) -> None:
        os.makedirs(self.folder, exist_ok=True)  # the cache folder was deleted under a job
        fd = os.open(self._path(), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            os.pwrite(fd, record, 0)
        finally:
            os.close(fd)

    def current(self) -> dict[str, int]:
        """A copy of this process's counts."""
        with self._lock:
            self._own()
            return dict(self.values)

    def _own(self) -> None:
        if self.pid != os.getpid():  # first use, or a forked child
            self.pid = os.getpid()
            self.values = _load_counts(self._path())

    def _path(self) -> str:
        return os.path.join(self.folder, f"{self.pid}.json")


def _load_counts(path: str) -> dict[str, int]:
    saved = _read_json(path) or {}
    return {k: int(saved.get(k, 0)) for k in _COUNTERS}


@dataclass
class _Usage:
    """What the folder holds: complete shards (key -> (path, size)) and parts in flight."""

    shards: dict[str, tuple[str, int]]
    parts: list[_Part]
    written: int  # bytes the parts hold so far

    @property
    def total(self) -> int:
        return sum(size for _, size in self.shards.values()) + sum(p.size for p in self.parts)


@dataclass
class _LivePlans:
    plans: list[Plan]
    ahead: int  # bytes all of them hold ahead


@dataclass
class _Claim:
    """The outcome of a claim: a part to fill (``fd``), a part to wait on, or neither."""

    fd: int | None = None
    part: str | None = None
    wait: str | None = None
    full: bool = False


# ---------------------------------------------------------------- the cache


class ShardCache:
    """The shard cache in ``cache_dir`` (node-local disk), holding at most ``limit`` bytes.

    ``limit`` is bytes as an int or text ("50GB", "1.5GiB"); ``None`` bounds the cache by the
    disk, keeping 1 GiB free. Complete shards and downloads in flight count, bookkeeping not.
    Readers go through a :meth:`session`; the other methods inspect and tidy the folder.

    Example:
        >>> cache = ShardCache("/local/cache", limit="50GB")  # doctest: +SKIP
        >>> with cache.session(storage_options={"anon": True}) as session:  # doctest: +SKIP
        ...     session.set_plan(index.shards, range(len(index.shards)))
        ...     f = session.open(index.shards[0])  # a pinned local file, or None: read remote
    """

    def __init__(self, cache_dir: str | os.PathLike, limit: int | str | None = None) -> None:
        self.limit = None if limit is None else parse_size(limit)
        self.cache_dir = _prepared_folder(cache_dir)
        self._sizes: dict[str, int] = {}  # key -> size: a key's size never changes
        self._dirs: dict[str, tuple[int, dict]] = {}  # subfolder -> (mtime, its listing)
        self._plan_memo: dict[tuple[str, str], tuple[list[str], np.ndarray, int]] = {}

    def __getstate__(self) -> dict:
        return {"cache_dir": self.cache_dir, "limit": self.limit}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _sizes={}, _dirs={}, _plan_memo={})

    def __repr__(self) -> str:
        return f"ShardCache({self.cache_dir!r}, limit={self.limit!r})"

    def session(
        self,
        *,
        storage_options: dict[str, Any] | None = None,
        prefetch: int = 1,
        num_workers: int = 1,
    ) -> CacheSession:
        """A reader's session (one per DataLoader worker pass); see :class:`CacheSession`."""
        return CacheSession(self, storage_options, prefetch, num_workers)

    # ------------------------------------------------------------ inspection and tidying

    def entries(self) -> list[CacheEntry]:
        """The complete shards in the cache."""
        out = []
        for key, (path, size) in self._listing().items():
            meta = _read_json(self._meta_path(key))
            if meta is not None:
                out.append(CacheEntry(meta["url"], size, path, key, meta["version"]))
        return out

    def stats(self) -> dict[str, Any]:
        """``files``, ``bytes`` (complete shards), ``limit``, ``in_flight`` (parts),
        ``in_flight_bytes``, and ``downloads``, ``hits``, ``around`` (reads that went around the
        cache) and ``evictions`` summed over every process that used the folder."""
        with self._node_lock():
            usage = self._usage()
        counts = dict.fromkeys(_COUNTERS, 0)
        with os.scandir(self._folder("stats")) as found:
            for entry in found:
                if entry.name.endswith(".json"):
                    for name, value in _load_counts(entry.path).items():
                        counts[name] += value
        return {
            "files": len(usage.shards),
            "bytes": sum(size for _, size in usage.shards.values()),
            "limit": self._limit_now(usage),
            "in_flight": len(usage.parts),
            "in_flight_bytes": sum(p.size for p in usage.parts),
            **counts,
        }

    def process_counts(self) -> dict[str, int]:
        """This process's ``downloads``, ``hits``, ``around`` and ``evictions`` in this folder:
        its part of what :meth:`stats` sums over every process."""
        return _Counters.of(self._folder("stats")).current()

    def evict(self, url: str) -> bool:
        """Remove the cached copies of ``url`` that nobody reads; True when one was removed."""
        removed = False
        with self._node_lock():
            for entry in self.entries():
                if entry.url == url:
                    removed |= self._remove_unpinned(entry.key, entry.path)
        return removed

    def clear(self) -> None:
        """Remove every shard nobody reads, and what dead processes left behind."""
        with self._node_lock():
            for key, (path, _) in self._usage().shards.items():
                self._remove_unpinned(key, path)
            self._live_plans()
            self._tidy_records()

    def verify(self) -> list[str]:
        """Check every shard against its record (size, key; content for an earlier boot's) and
        remove what fails, dead downloads' parts and orphan records; returns what was found."""
        problems = []
        with self._node_lock():
            listing = self._listing()
            problems += [f"removed the part of a dead download: {p}" for p in self._dead_parts()]
            problems += self._tidy_records()
            self._live_plans()
        for key, (path, size) in listing.items():
            reason = self._check_entry(key, path, size)
            if reason is not None and self._remove_bad(key, path):
                problems.append(f"removed {path}: {reason}")
        return problems

    def warm(self, shards: Sequence[ShardInfo], *, storage_options: dict | None = None) -> int:
        """Download ``shards`` in order (most needed first) until the next would not fit;
        returns how many of them are cached. Their plan keeps them for a later job's plans
        to take over."""
        cached = 0
        with self.session(storage_options=storage_options, prefetch=0) as session:
            session.set_plan(shards, range(len(shards)))
            for t, info in enumerate(shards):
                if self._fetch_ahead(info, t, session, capped=False) == "full":
                    break
                cached += 1
        return cached

    # ------------------------------------------------------------ paths and listing

    def _folder(self, name: str) -> str:
        return os.path.join(self.cache_dir, name)

    def _shard_path(self, key: str, url: str) -> str:
        return os.path.join(self.cache_dir, "shards", key[:2], f"{key}-{_shard_name(url)}")

    def _meta_path(self, key: str) -> str:
        return os.path.join(self.cache_dir, "shards", key[:2], f"{key}.json")

    @contextmanager
    def _node_lock(self) -> Iterator[None]:
        # Opened per use and held under _FORK_GUARD, so no fork copies a held node lock.
        with _FORK_GUARD:
            fd = self._open_lock()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def _open_lock(self) -> int:
        """The node lock's file, opened; the layout is created again when the folder was
        deleted under a running job."""
        path, flags = self._folder("lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        try:
            return os.open(path, flags, 0o666)
        except FileNotFoundError:
            _prepared_folder(self.cache_dir)
            return os.open(path, flags, 0o666)

    def _listing(self) -> dict[str, tuple[str, int]]:
        """Complete shards: key -> (path, size). A subfolder is listed again only when its
        modification time changed or was too recent to trust (timestamps are coarse)."""
        out: dict[str, tuple[str, int]] = {}
        trusted = time.time_ns() - _MTIME_SLACK_NS
        with os.scandir(self._folder("shards")) as folders:
            for folder in folders:
                mtime = folder.stat().st_mtime_ns
                memo = self._dirs.get(folder.path)
                if memo is None or memo[0] != mtime:
                    memo = (mtime if mtime < trusted else -1, self._list_folder(folder.path))
                    self._dirs[folder.path] = memo
                out.update(memo[1])
        return out

    def _list_folder(self, folder: str) -> dict[str, tuple[str, int]]:
        out = {}
        with os.scandir(folder) as found:
            for entry in found:
                name = entry.name
                if name[:1] != "." and not name.endswith(".json"):
                    out[name[:32]] = (entry.path, self._size_of(name[:32], entry.path))
        return out

    def _size_of(self, key: str, path: str) -> int:
        size = self._sizes.get(key)
        if size is None:
            meta = _read_json(self._meta_path(key))
            try:
                size = int(meta["size"]) if meta else os.stat(path).st_size
            except FileNotFoundError:
                return 0
            self._sizes[key] = size
        return size

    def _usage(self) -> _Usage:
        """What the folder holds (under the node lock); dead downloads' parts are removed."""
        self._dead_parts()
        parts = self._parts()
        return _Usage(self._listing(), parts, sum(_file_size(p.path) for p in parts))

    def _parts(self, key: str | None = None) -> list[_Part]:
        folder = self._folder("tmp")
        parts = (_parse_part(folder, name) for name in os.listdir(folder))
        return [p for p in parts if p is not None and (key is None or p.key == key)]

    def _dead_parts(self, key: str | None = None) -> list[str]:
        """Remove the parts of ``key`` (or all) whose writer died (under the node lock)."""
        removed = []
        for part in self._parts(key):
            fd = _open_if_unlocked(part.path)
            if fd is not None:
                _unlink(part.path)
                os.close(fd)
                removed.append(part.path)
        return removed

    def _limit_now(self, usage: _Usage) -> int:
        """The limit, or less when the disk cannot hold that much: what the cache holds plus
        the free space, less ``DISK_RESERVE`` (a twentieth of a smaller disk)."""
        disk = shutil.disk_usage(self.cache_dir)
        held = sum(size for _, size in usage.shards.values()) + usage.written
        room = max(0, disk.free + held - min(DISK_RESERVE, disk.total // 20))
        return room if self.limit is None else min(self.limit, room)

    # ------------------------------------------------------------ plans

    def _live_plans(self) -> _LivePlans:
        """The plans whose process holds them or released them less than
        ``PLAN_GRACE_SECONDS`` ago (under the node lock); older ones are removed."""
        plans, ahead, seen = [], 0, set()
        folder = self._folder("procs")
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if not name.endswith(".plan"):
                self._remove_if_stale(path)
                continue
            read = self._read_plan(path)
            if read is not None:
                plan, held, memo_key = read
                plans.append(plan)
                ahead += held
                seen.add(memo_key)
        self._plan_memo = {k: v for k, v in self._plan_memo.items() if k in seen}
        return _LivePlans(plans, ahead)

    def _read_plan(self, path: str) -> tuple[Plan, int, tuple[str, str]] | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            stat = os.fstat(fd)
            if _try_lock(fd, fcntl.LOCK_SH):  # nobody holds it: released, or its process died
                if time.time() - stat.st_mtime > PLAN_GRACE_SECONDS:
                    _unlink(path)
                    return None
            head = os.pread(fd, _HEADER, 0).split()
            memo_key = (path, head[2].decode())
            if memo_key not in self._plan_memo:
                body = json.loads(os.pread(fd, stat.st_size, _HEADER))
                times = np.asarray(body["times"], dtype=np.int64)
                self._plan_memo[memo_key] = (body["keys"], times, body["num_workers"])
            keys, times, num_workers = self._plan_memo[memo_key]
            return Plan(keys, times, int(head[0]), num_workers), int(head[1]), memo_key
        except (ValueError, KeyError, IndexError):
            return None
        finally:
            os.close(fd)

    def _remove_if_stale(self, path: str) -> None:
        try:
            if time.time() - os.stat(path).st_mtime > PLAN_GRACE_SECONDS:
                _unlink(path)
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------ reads

    def _open_hit(self, key: str, info: ShardInfo) -> BinaryIO | None:
        """The published shard, pinned (``LOCK_SH``), or None; a copy that fails its checks
        is removed."""
        path = self._shard_path(key, info.url)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        stat = os.fstat(fd)
        if stat.st_nlink and stat.st_size == info.size and self._fresh(key, fd):
            return os.fdopen(fd, "rb")
        os.close(fd)
        if stat.st_nlink:
            self._remove_bad(key, path, stat.st_ino)
        return None

    def _fresh(self, key: str, fd: int) -> bool:
        """True when the record is of this boot, or the content matches its CRC (then the
        record is renewed): shards are not fsynced, so a crash can leave holes."""
        meta = _read_json(self._meta_path(key))
        if meta is None:
            return False
        if meta.get("boot_id") == _boot_id():
            return True
        if _file_crc(fd) != meta.get("crc32"):
            return False
        replace_file(self._meta_path(key), json.dumps({**meta, "boot_id": _boot_id()}).encode())
        return True

    def _check_entry(self, key: str, path: str, size: int) -> str | None:
        """Why the shard at ``path`` is unusable, or None."""
        meta = _read_json(self._meta_path(key))
        if meta is None:
            return "no readable record"
        if shard_key(meta["url"], meta["size"], meta["version"]) != key:
            return "record does not match the key"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            actual = os.fstat(fd).st_size
            if actual != size or actual != meta["size"]:
                return f"size {actual}, expected {meta['size']}"
            if not self._fresh(key, fd):
                return "content of an earlier boot does not match its CRC-32"
        finally:
            os.close(fd)
        return None

    def _acquire(self, info: ShardInfo, session: CacheSession) -> BinaryIO | None:
        """The shard pinned, downloaded now if needed; None when no room can be made. The
        session's earlier failure of this shard (ahead, maybe while this waited) is raised."""
        key = shard_key(info.url, info.size, info.version)
        self._sizes[key] = info.size
        while True:
            f = self._open_hit(key, info)
            if f is not None:
                _Counters.of(self._folder("stats")).add("hits")
                return f
            claim = self._claim(key, info, 0.0)
            if claim.full:
                return None
            if claim.wait is not None:
                _wait_for(claim.wait)
                if key in session._failed:
                    raise session._failed[key]
            elif claim.fd is not None:
                return os.fdopen(self._fill(claim, info, session), "rb")

    def _fetch_ahead(
        self, info: ShardInfo, t: int, session: CacheSession, capped: bool = True
    ) -> str:
        """Download ``info`` unpinned for ``session``'s read at item ``t``: "cached" (it was,
        or is now), "busy" (another process downloads it) or "full" (no room without evicting
        a shard needed sooner, or, ``capped``, over the prefetch cap)."""
        key = shard_key(info.url, info.size, info.version)
        self._sizes[key] = info.size
        if os.path.exists(self._shard_path(key, info.url)):
            return "cached"
        hold = (session, t) if capped else None
        claim = self._claim(key, info, session._distance(t), hold)
        if claim.fd is None:
            return "full" if claim.full else "busy" if claim.wait else "cached"
        os.close(self._fill(claim, info, session))
        return "cached"

    def _claim(
        self,
        key: str,
        info: ShardInfo,
        distance: float,
        hold: tuple[CacheSession, int] | None = None,
    ) -> _Claim:
        """Under the node lock: a live part of ``key`` to wait on, else the published file
        (retry), else room made and a part created (``LOCK_EX``). ``hold``: a prefetch, capped
        and counted as held ahead by that session until its item."""
        with self._node_lock():
            self._dead_parts(key)
            live = self._parts(key)
            if live:
                return _Claim(wait=live[0].path)
            if os.path.exists(self._shard_path(key, info.url)):
                return _Claim()
            usage, plans = self._usage(), self._live_plans()
            limit = self._limit_now(usage)
            if hold is not None and plans.ahead + info.size > limit * PREFETCH_SHARE:
                return _Claim(full=True)
            if not self._make_room(usage, plans.plans, info.size, distance, limit):
                return _Claim(full=True)
            claim = self._create_part(key, info.size)
            if hold is not None:
                hold[0]._hold_ahead(key, info.size, hold[1])
            return claim

    def _make_room(
        self, usage: _Usage, plans: list[Plan], size: int, distance: float, limit: int
    ) -> bool:
        """Evict (Belady) so that ``size`` more bytes fit under ``limit``; False when that
        would evict a shard needed at or before ``distance`` (nothing is evicted then)."""
        need = usage.total + size - limit
        if need <= 0:
            return True
        if size > limit:
            return False
        keys = list(usage.shards)
        sizes = [usage.shards[k][1] for k in keys]
        held: list[int] = []

        def evictable(i: int) -> bool:
            fd = _open_if_unlocked(usage.shards[keys[i]][0])
            if fd is not None:
                held.append(fd)
            return fd is not None

        try:
            victims = choose_victims(sizes, next_uses(plans, keys), need, distance, evictable)
            for i in victims or ():
                _unlink(usage.shards[keys[i]][0], self._meta_path(keys[i]))
        finally:
            for fd in held:
                os.close(fd)
        if victims:
            _Counters.of(self._folder("stats")).add("evictions", len(victims))
        return victims is not None

    def _create_part(self, key: str, size: int) -> _Claim:
        name = f"{key}.{size}.{os.getpid()}.{secrets.token_hex(4)}.part"
        path = os.path.join(self._folder("tmp"), name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return _Claim(fd=fd, part=path)

    def _fill(self, claim: _Claim, info: ShardInfo, session: CacheSession) -> int:
        """Download into the claimed part, check it, write the record and publish by rename;
        returns the published file's fd, pinned. Errors remove the part: a remote failure
        raises ShardError (kept in ``session`` first, for a read waiting on this part), a
        local one (disk full, folder deleted) OSError."""
        fd, part = claim.fd, claim.part
        key = shard_key(info.url, info.size, info.version)
        try:
            crc = _download(info, fd, session.storage_options, session.stopping)
            meta = {"url": info.url, "size": info.size, "version": info.version,
                    "name": _shard_name(info.url), "boot_id": _boot_id(), "crc32": crc}  # fmt: skip
            os.makedirs(os.path.dirname(self._meta_path(key)), exist_ok=True)
            replace_file(self._meta_path(key), json.dumps(meta).encode())
            with self._node_lock():  # no eviction sees it between the rename and the pin
                os.rename(part, self._shard_path(key, info.url))
                fcntl.flock(fd, fcntl.LOCK_SH)
            os.lseek(fd, 0, os.SEEK_SET)
        except BaseException as exc:
            if isinstance(exc, ShardError):
                session._failed[key] = exc
            _unlink(part)
            os.close(fd)
            raise
        _Counters.of(self._folder("stats")).add("downloads")
        return fd

    def _remove_unpinned(self, key: str, path: str) -> bool:
        """Remove a shard nobody pins (under the node lock)."""
        fd = _open_if_unlocked(path)
        if fd is None:
            return False
        _unlink(path, self._meta_path(key))
        os.close(fd)
        return True

    def _remove_bad(self, key: str, path: str, inode: int | None = None) -> bool:
        """Remove an unusable copy (its readers keep their open file), unless ``path`` now
        holds another file than ``inode``."""
        with self._node_lock():
            try:
                if inode is not None and os.stat(path).st_ino != inode:
                    return False
            except FileNotFoundError:
                return False
            _unlink(path, self._meta_path(key))
        return True

    def _tidy_records(self) -> list[str]:
        """Remove records without a shard or a download in flight, and temporary files older
        than ``PLAN_GRACE_SECONDS`` (under the node lock); returns what was removed."""
        removed = []
        keep = set(self._listing()) | {part.key for part in self._parts()}
        for folder in os.scandir(self._folder("shards")):
            for entry in os.scandir(folder.path):
                name = entry.name
                if name.startswith("."):
                    if _age(entry.path) > PLAN_GRACE_SECONDS:
                        _unlink(entry.path)
                elif name.endswith(".json") and name[:32] not in keep:
                    _unlink(entry.path)
                    removed.append(f"removed a record without its shard: {entry.path}")
        return removed


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def _age(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return 0.0


def _prepared_folder(cache_dir: str | os.PathLike) -> str:
    """``cache_dir`` as an absolute path, with its layout created; ValueError naming
    ``cache_dir`` when it is a file or cannot be written."""
    path = os.path.abspath(os.fspath(cache_dir))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"cache_dir must be a folder, got a file: {path!r}")
    try:
        for name in ("shards", "tmp", "procs", "stats"):
            os.makedirs(os.path.join(path, name), exist_ok=True)
        os.close(os.open(os.path.join(path, "lock"), os.O_RDWR | os.O_CREAT, 0o666))
    except OSError as exc:
        raise ValueError(f"cache_dir must be a writable folder, got {path!r} ({exc})") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"cache_dir must be a writable folder, got {path!r}")
    return path


def _wait_for(part: str) -> None:
    """Wait until the writer of ``part`` is done (published, failed or dead)."""
    try:
        fd = os.open(part, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)


def _download(info: ShardInfo, fd: int, options: dict, stop: threading.Event) -> int:
    """Write ``info``'s bytes to ``fd``; returns their CRC-32. ShardError when the remote
    fails, the count differs from the index's or no byte comes for ``STALL_SECONDS``; OSError
    when the local write fails."""
    crc, count = 0, 0
    for chunk in _remote_chunks(info, options, stop):
        _write_all(fd, chunk)
        crc = zlib.crc32(chunk, crc)
        count += len(chunk)
        if count > info.size:
            break
    if count != info.size:
        raise ShardError(info.url, f"byte {count}", f"read {count} bytes, indexed {info.size}")
    return crc


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _remote_chunks(info: ShardInfo, options: dict, stop: threading.Event) -> Iterator[bytes]:
    """The remote file's bytes in chunks, read in a daemon thread so that a stalled read is
    detected (and abandoned) here."""
    chunks: queue.Queue = queue.Queue(maxsize=2)
    abort = threading.Event()
    reader = threading.Thread(
        target=_read_remote, args=(info, options, chunks, abort), daemon=True,
        name="nnh-cache-download",
    )  # fmt: skip
    reader.start()
    try:
        deadline = time.monotonic() + STALL_SECONDS
        while True:
            if stop.is_set():
                raise ShardError(info.url, "download", "stopped")
            try:
                item = chunks.get(timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise ShardError(
                        info.url, "download", f"no progress for {STALL_SECONDS} s"
                    ) from None
                continue
            if isinstance(item, BaseException):
                raise item
            if not item:
                return
            deadline = time.monotonic() + STALL_SECONDS
            yield item
    finally:
        abort.set()


def _read_remote(
    info: ShardInfo, options: dict, chunks: queue.Queue, abort: threading.Event
) -> None:
    """Ranged reads of the indexed size, one request each (tried again on transient errors,
    :mod:`nnh_data.shards.retries`), while the object's details (its version) are asked for in
    parallel: ``fs.open`` would wait for them before its first read, a second round trip per
    shard. Nothing is published before the version matched. Errors go to the consumer as
    ShardError."""
    try:
        fs, path = remote_fs(info.url, options)
        details = _in_background(functools.partial(
            retrying, functools.partial(fs.info, path), info.url, "open"))  # fmt: skip
        for start in range(0, info.size, CHUNK_BYTES):
            if abort.is_set():
                return
            end = min(info.size, start + CHUNK_BYTES)
            read = functools.partial(fs.cat_file, path, start=start, end=end)
            _put(chunks, retrying(read, info.url, f"byte {start}"), abort)
        _check_version(info, details.result())
        _put(chunks, b"", abort)
    except BaseException as exc:  # handed to the consumer, which raises it
        if not isinstance(exc, ShardError):
            error = ShardError(info.url, "download", f"{type(exc).__name__}: {exc}")
            error.__cause__, exc = exc, error
        _put(chunks, exc, abort)


def _in_background(call: Callable[[], Any]) -> Future:
    """``call()`` in a daemon thread, which never holds up its process's exit (an executor's
    thread does, for as long as a remote call takes)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as exc:  # handed to the caller of result()
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="nnh-cache-details").start()
    return future


def _put(chunks: queue.Queue, item: object, abort: threading.Event) -> None:
    while not abort.is_set():
        try:
            chunks.put(item, timeout=_POLL_S)
            return
        except queue.Full:
            continue


def _check_version(info: ShardInfo, details: dict | None) -> None:
    """StaleIndexError when the object's size or version field differs from the index's."""
    name, _, value = info.version.partition("=")
    if details and name in details and str(details[name]) != value:
        raise StaleIndexError(info.url, "open", f"{name} is {details[name]!s}, indexed {value}")
    if details and details.get("size") not in (None, info.size):
        raise StaleIndexError(info.url, "open", f"size is {details['size']}, indexed {info.size}")


# ---------------------------------------------------------------- a reader's session


class CacheSession:
    """One reader's use of the cache (a DataLoader worker's pass): its plan, its position, its
    pins and its prefetch thread. A context manager; :meth:`close` ends it.

    One thread calls the methods (the prefetch thread is internal). A forked child must open
    its own session: a fork lets go of the parent's sessions in the child (their pins and the
    plan's lock are open files, which the child would otherwise hold on to).

    A shard whose download failed (on demand or ahead, after the retries of
    :mod:`nnh_data.shards.retries`) is not tried again by this session: :meth:`open` raises the same
    error. A failure of the local folder (disk full, the folder deleted, unwritable) is no
    error: that shard is read around the cache, with one warning per process.
    """

    def __init__(
        self,
        cache: ShardCache,
        storage_options: dict[str, Any] | None,
        prefetch: int,
        num_workers: int,
    ) -> None:
        self.cache = cache
        self.storage_options = dict(storage_options or {})
        self.prefetch = check_int("cache_prefetch", prefetch, low=0)
        self.num_workers = check_int("num_workers", num_workers, low=1)
        self.stopping = threading.Event()
        self._pins: dict[str, tuple[BinaryIO, int]] = {}
        self._state = _PlanState()
        self._changed = threading.Condition()  # taken after the node lock, never before
        self._version = 0  # bumped when the shards to prefetch change
        self._starved = False  # a read went around the cache: no prefetch until one fits
        self._plan_fd: int | None = None
        self._plan_path = os.path.join(
            cache._folder("procs"), f"{os.getpid()}.{secrets.token_hex(4)}.plan"
        )
        self._thread: threading.Thread | None = None
        self._failed: dict[str, ShardError] = {}  # key -> its download's error
        _SESSIONS.add(self)

    def __enter__(self) -> CacheSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_plan(self, shards: Sequence[ShardInfo], times: Sequence[int]) -> None:
        """Publish this reader's plan: it reads ``shards[j]`` from item index ``times[j]``
        (non-decreasing; this pass from its position, then the next epoch), starting at item 0.
        Replaces the previous plan and steers prefetch."""
        times = np.asarray(times, dtype=np.int64).reshape(-1)
        if len(times) != len(shards) or np.any(np.diff(times) < 0):
            raise ValueError(
                "times must be one non-decreasing item index per shard, got "
                f"{len(times)} times for {len(shards)} shards"
            )
        keys = [shard_key(info.url, info.size, info.version) for info in shards]
        state = _PlanState(list(shards), keys, times)
        try:
            fd, temporary = self._plan_file(state)
        except OSError as exc:  # the folder cannot take it: reads go on, the plan unpublished
            _warn_local(self.cache, exc)
            fd = temporary = None
        with self.cache._node_lock(), self._changed:  # no scan sees the old plan unlocked
            if temporary is not None:
                os.rename(temporary, self._plan_path)
            if self._plan_fd is not None:
                os.close(self._plan_fd)
            self._plan_fd, self._state = fd, state
            self._version += 1
            self._changed.notify_all()
        if self.prefetch and self._thread is None:
            self._thread = threading.Thread(
                target=self._prefetch_loop, daemon=True, name="nnh-cache-prefetch"
            )
            self._thread.start()

    def advance(self, t: int) -> None:
        """This reader now stands at item index ``t`` of its plan (cheap: one write of a few
        bytes; calling it once per read block is enough)."""
        with self._changed:
            before = self._state.next_index()
            self._state.position = int(t)
            self._write_header()
            if self._state.next_index() != before:
                self._version += 1
                self._changed.notify_all()

    def open(self, info: ShardInfo) -> BinaryIO | None:
        """The local copy of ``info``, pinned until :meth:`release` (downloaded now if needed);
        None when the cache cannot hold it without evicting what is needed now, or its folder
        failed: then read the remote directly. Repeated opens share one file (and count pins);
        do not close it. ShardError when its download failed (now or ahead)."""
        key = shard_key(info.url, info.size, info.version)
        if key in self._pins:
            f, count = self._pins[key]
            self._pins[key] = (f, count + 1)
            return f
        if key in self._failed:
            raise self._failed[key]
        try:
            f = self.cache._acquire(info, self)
        except OSError as exc:  # the folder failed (disk full, deleted): go around it
            self._starved = True
            _read_around(self.cache, exc)
            return None
        self._starved = f is None
        if f is None:
            _read_around(self.cache)
            return None
        self._pins[key] = (f, 1)
        return f

    def release(self, info: ShardInfo) -> None:
        """Unpin ``info`` (one :meth:`open`'s worth)."""
        key = shard_key(info.url, info.size, info.version)
        f, count = self._pins.pop(key, (None, 0))
        if count > 1:
            self._pins[key] = (f, count - 1)
        elif f is not None:
            f.close()

    def discard(self, info: ShardInfo) -> None:
        """Unpin ``info`` and remove the local copy (after a read error on it; readers of it
        keep their open file); the next :meth:`open` downloads it again."""
        key = shard_key(info.url, info.size, info.version)
        f, _ = self._pins.pop(key, (None, 0))
        if f is not None:
            f.close()
        self.cache._remove_bad(key, self.cache._shard_path(key, info.url))

    def close(self) -> None:
        """Unpin all, stop prefetch and release the plan (it stays live
        ``PLAN_GRACE_SECONDS`` more, the gap to the next pass)."""
        self.stopping.set()
        with self._changed:
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=STALL_SECONDS + 10)
            self._thread = None
        for f, _ in self._pins.values():
            f.close()
        self._pins.clear()
        if self._plan_fd is not None:
            with self._changed:
                self._state.ahead.clear()  # a closed reader holds nothing ahead
                self._write_header()
            os.close(self._plan_fd)  # its modification time is the release time
            self._plan_fd = None

    def _distance(self, t: int) -> float:
        """The distance of this reader's read at item ``t`` in next-use units."""
        return float((t - self._state.position) * self.num_workers)

    def _hold_ahead(self, key: str, size: int, t: int) -> None:
        """Count a prefetched shard as held ahead until this reader reaches item ``t``."""
        with self._changed:
            self._state.ahead[key] = (size, t)
            self._write_header()

    # ------------------------------------------------------------ plan file and prefetch

    def _plan_file(self, state: _PlanState) -> tuple[int, str]:
        """The plan written to a new file, locked (``LOCK_EX``); its fd and name. The layout
        is created again when the folder was deleted under a running job."""
        body = json.dumps(
            {"num_workers": self.num_workers, "keys": state.keys, "times": state.times.tolist()}
        )
        data = state.header() + body.encode()
        temporary = f"{self._plan_path}.{secrets.token_hex(4)}.tmp"
        try:
            return _locked_file(temporary, data), temporary
        except FileNotFoundError:
            _prepared_folder(self.cache.cache_dir)
            return _locked_file(temporary, data), temporary

    def _write_header(self) -> None:
        if self._plan_fd is not None:
            os.pwrite(self._plan_fd, self._state.header(), 0)

    def _drop_inherited(self) -> None:
        """In a forked child: close the parent's pins and plan (the parent keeps them)."""
        self.stopping.set()
        for f, _ in self._pins.values():
            f.close()
        if self._plan_fd is not None:
            os.close(self._plan_fd)
        self._pins, self._plan_fd, self._thread = {}, None, None

    def _prefetch_loop(self) -> None:
        """Keep the next ``prefetch`` shards of the plan cached. After a pass over them, wait
        for them to change; when one found no room (or another process downloads it), look
        again a little later, as other readers move."""
        while not self.stopping.is_set():
            with self._changed:
                targets = [] if self._starved else self._state.upcoming(self.prefetch)
                version = self._version
            outcome = "cached"
            for info, t in targets:
                try:
                    outcome = self.cache._fetch_ahead(info, t, self)
                except ShardError:  # kept in _failed: the read on demand raises it
                    outcome = "failed"
                except OSError as exc:  # the folder failed: the read on demand goes around
                    _warn_local(self.cache, exc)
                    self._starved, outcome = True, "failed"
                if outcome != "cached" or self.stopping.is_set():
                    break
            with self._changed:
                if self._version == version and not self.stopping.is_set():
                    self._changed.wait(timeout=_RETRY_S if outcome != "cached" else 1.0)


@dataclass
class _PlanState:
    """A session's plan, position and what its prefetch holds ahead."""

    shards: list[ShardInfo] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    times: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    position: int = 0
    ahead: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (size, its t)
    plan_id: str = field(default_factory=lambda: secrets.token_hex(4))  # names the body

    def header(self) -> bytes:
        """The plan file's first line: the position and the bytes held ahead of it."""
        self.ahead = {k: st for k, st in self.ahead.items() if st[1] > self.position}
        held = sum(size for size, _ in self.ahead.values())
        return f"{self.position:>20d} {held:>20d} {self.plan_id}\n".encode()

    def next_index(self) -> int:
        """The index of the first read after the position."""
        return int(np.searchsorted(self.times, self.position, side="right"))

    def upcoming(self, count: int) -> list[tuple[ShardInfo, int]]:
        """The next ``count`` distinct shards read after the position, with their times."""
        out: list[tuple[ShardInfo, int]] = []
        seen: set[str] = set()
        for j in range(self.next_index(), len(self.keys)):
            if len(out) == count:
                break
            if self.keys[j] not in seen:
                seen.add(self.keys[j])
                out.append((self.shards[j], int(self.times[j])))
        return out


_WARNED: set[tuple[int, str, str]] = set()  # (pid, what, cache folder) warned about


def _read_around(cache: ShardCache, failure: OSError | None = None) -> None:
    """Count a read that goes around the cache (it has no room, or its folder ``failure``);
    warn once per process and cache folder."""
    _Counters.of(cache._folder("stats")).add("around")
    if failure is not None:
        _warn_local(cache, failure)
        return
    _warn_once(
        cache,
        "small",
        f"the shard cache in {cache.cache_dir!r} is smaller than what its readers need at "
        "once (live workers x (1 + prefetch) shards, within cache_limit and the free disk): "
        "reading some shards from the remote directly; raise cache_limit or free disk space",
    )


def _warn_local(cache: ShardCache, exc: OSError) -> None:
    """Warn, once per process and folder, that the cache folder failed and reads go around it."""
    _warn_once(
        cache,
        "local",
        f"the shard cache in {cache.cache_dir!r} failed on this node ({exc}): reading the "
        "shards it cannot hold from the remote directly",
    )


def _warn_once(cache: ShardCache, what: str, message: str) -> None:
    key = (os.getpid(), what, str(cache.cache_dir))
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=4)


# A fork copies this process's open files, and their flocks with them: no fork may happen while
# a thread holds the node lock (the child would hold it for ever), and a child lets go of the
# parent's sessions (their pins and plan locks), which it does not use.
_FORK_GUARD = threading.Lock()
_SESSIONS: weakref.WeakSet[CacheSession] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    _FORK_GUARD.release()
    for session in list(_SESSIONS):
        session._drop_inherited()


os.register_at_fork(
    before=_FORK_GUARD.acquire, after_in_parent=_FORK_GUARD.release,
    after_in_child=_after_fork_in_child,
)  # fmt: skip
