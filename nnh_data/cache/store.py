"""A node-local cache of whole remote shards: one download per shard per node, evicted by the
known future order (Belady's rule, :mod:`nnh_data.cache.policy`) instead of by recency.

Design. Every process of a node shares one folder (its layout, locks and records:
:mod:`nnh_data.cache.files`); :class:`ShardCache` is that folder's bookkeeping, done under the
node lock: listing the complete shards, the downloads in flight and the live plans, claiming a
download, evicting, publishing, checking and tidying. ``key = hash(url, size, version)``, so a
rewritten object is a new key and never served stale. Eviction takes ``LOCK_EX | LOCK_NB`` under
the node lock, so a pinned shard is never removed. A miss looks, under the node lock, for a live
part of the key first, then for the published file: a live part is waited on, and otherwise room
is made before the part is created (in-flight parts count at their full size), so the folder
never holds more than the limit. A shard of an earlier boot (shards are not fsynced) is checked
against its record's CRC-32 before use.

Eviction follows the live plans: each reader publishes the keys it will read and when, and
making room for a shard needed at distance ``d`` evicts unpinned shards by farthest next use,
never one needed at or before ``d``. Prefetch follows the same rule and is capped so that what
all live plans hold ahead stays under a quarter of the limit (``PREFETCH_SHARE``). A released
plan stays live ``PLAN_GRACE_SECONDS`` (the gap between epochs). The trade-off: a decision scans
the folder and the plans under the node lock (milliseconds for 10,000 shards), which is small
next to a shard's download.

Use. A reader (one DataLoader worker's pass) opens a :class:`CacheSession`
with :meth:`ShardCache.session`; the session downloads (:mod:`nnh_data.cache.download`) into the
parts this class claims for it. ``cache_dir`` must be on node-local disk: ``flock`` on NFS is
emulated or absent.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import secrets
import shutil
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from nnh_data.atomic import replace_file
from nnh_data.cache.download import STALL_SECONDS, download
from nnh_data.cache.files import (
    PLAN_HEADER_BYTES,
    Counters,
    Part,
    age,
    boot_id,
    file_crc,
    file_size,
    locked_file,
    new_part_path,
    new_plan_path,
    node_lock,
    open_if_unlocked,
    parse_part,
    plan_header,
    prepare_folder,
    read_json,
    record_path,
    shard_name,
    shard_path,
    summed_counts,
    try_lock,
    unlink,
    wait_unlocked,
)
from nnh_data.cache.policy import Plan, choose_victims, next_uses, parse_size, shard_key
from nnh_data.checks import check_int
from nnh_data.errors import ShardError
from nnh_data.shards.index import ShardInfo

__all__ = [
    "DISK_RESERVE",
    "PLAN_GRACE_SECONDS",
    "PREFETCH_SHARE",
    "CacheEntry",
    "CacheSession",
    "Claim",
    "ShardCache",
]

PLAN_GRACE_SECONDS = 120.0  # a released plan stays live this long (the gap between epochs)
PREFETCH_SHARE = 0.25  # what all live plans hold ahead stays under this share of the limit
DISK_RESERVE = 1 << 30  # kept free on the disk (a twentieth of a disk under 20 GiB)
_MTIME_SLACK_NS = 200_000_000  # a folder changed this recently is listed again
_RETRY_S = 0.5  # a prefetch that found no room looks again after this long


@dataclass(frozen=True)
class CacheEntry:
    """A complete shard in the cache: where it came from and where it lies."""

    url: str
    size: int
    path: str
    key: str
    version: str


@dataclass
class Claim:
    """The outcome of :meth:`ShardCache.claim` for ``key``: a part to fill (``fd``, open and
    locked, at ``part``), a part to wait on (``wait``), or neither (published: look again;
    ``full``: no room)."""

    key: str
    fd: int | None = None
    part: str | None = None
    wait: str | None = None
    full: bool = False

    def abandon(self) -> None:
        """Remove the part to fill and let go of it (a failed download)."""
        assert self.fd is not None and self.part is not None
        unlink(self.part)
        os.close(self.fd)


@dataclass
class _Usage:
    """What the folder holds: complete shards (key -> (path, size)) and parts in flight."""

    shards: dict[str, tuple[str, int]]
    parts: list[Part]
    written: int  # bytes the parts hold so far

    @property
    def total(self) -> int:
        return sum(size for _, size in self.shards.values()) + sum(p.size for p in self.parts)


@dataclass
class _LivePlans:
    plans: list[Plan]
    ahead: int  # bytes all of them hold ahead


class ShardCache:
    """The shard cache in ``cache_dir`` (node-local disk), holding at most ``limit`` bytes.

    ``limit`` is bytes as an int or text ("50GB", "1.5GiB"); ``None`` bounds the cache by the
    disk, keeping 1 GiB free. Complete shards and downloads in flight count, bookkeeping not.
    Readers go through a :meth:`session`; :meth:`entries` to :meth:`warm` inspect and tidy the
    folder; :meth:`open_copy` to :meth:`remove_unusable` are the steps a session's reads take.

    Example:
        >>> cache = ShardCache("/local/cache", limit="50GB")  # doctest: +SKIP
        >>> with cache.session(storage_options={"anon": True}) as session:  # doctest: +SKIP
        ...     session.set_plan(index.shards, range(len(index.shards)))
        ...     f = session.open(index.shards[0])  # a pinned local file, or None: read remote
    """

    def __init__(self, cache_dir: str | os.PathLike, limit: int | str | None = None) -> None:
        self.limit = None if limit is None else parse_size(limit)
        self.cache_dir = prepare_folder(cache_dir)
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
            meta = read_json(record_path(self.cache_dir, key))
            if meta is not None:
                out.append(CacheEntry(meta["url"], size, path, key, meta["version"]))
        return out

    def stats(self) -> dict[str, Any]:
        """``files``, ``bytes`` (complete shards), ``limit``, ``in_flight`` (parts),
        ``in_flight_bytes``, and ``downloads``, ``hits``, ``around`` (reads that went around the
        cache) and ``evictions`` summed over every process that used the folder."""
        with node_lock(self.cache_dir):
            usage = self._usage()
        return {
            "files": len(usage.shards),
            "bytes": sum(size for _, size in usage.shards.values()),
            "limit": self._limit_now(usage),
            "in_flight": len(usage.parts),
            "in_flight_bytes": sum(p.size for p in usage.parts),
            **summed_counts(self.cache_dir),
        }

    def process_counts(self) -> dict[str, int]:
        """This process's ``downloads``, ``hits``, ``around`` and ``evictions`` in this folder:
        its part of what :meth:`stats` sums over every process."""
        return Counters.of(self.cache_dir).current()

    def evict(self, url: str) -> bool:
        """Remove the cached copies of ``url`` that nobody reads; True when one was removed."""
        removed = False
        with node_lock(self.cache_dir):
            for entry in self.entries():
                if entry.url == url:
                    removed |= self._remove_unpinned(entry.key, entry.path)
        return removed

    def clear(self) -> None:
        """Remove every shard nobody reads, and what dead processes left behind."""
        with node_lock(self.cache_dir):
            for key, (path, _) in self._usage().shards.items():
                self._remove_unpinned(key, path)
            self._live_plans()
            self._tidy_records()

    def verify(self) -> list[str]:
        """Check every shard against its record (size, key; content for an earlier boot's) and
        remove what fails, dead downloads' parts and orphan records; returns what was found."""
        problems = []
        with node_lock(self.cache_dir):
            listing = self._listing()
            problems += [f"removed the part of a dead download: {p}" for p in self._dead_parts()]
            problems += self._tidy_records()
            self._live_plans()
        for key, (path, size) in listing.items():
            reason = self._check_entry(key, path, size)
            if reason is not None and self.remove_unusable(key, path):
                problems.append(f"removed {path}: {reason}")
        return problems

    def warm(self, shards: Sequence[ShardInfo], *, storage_options: dict | None = None) -> int:
        """Download ``shards`` in order (most needed first) until the next would not fit;
        returns how many of them are cached. Their plan keeps them for a later job's plans
        to take over."""
        with self.session(storage_options=storage_options, prefetch=0) as session:
            return session.warm(shards)

    # ------------------------------------------------------------ a session's steps

    def open_copy(self, key: str, info: ShardInfo) -> BinaryIO | None:
        """The published shard, pinned (``LOCK_SH``) and counted as a hit, or None; a copy that
        fails its checks is removed."""
        path = shard_path(self.cache_dir, key, info.url)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        stat = os.fstat(fd)
        if stat.st_nlink and stat.st_size == info.size and self._fresh(key, fd):
            Counters.of(self.cache_dir).add("hits")
            return os.fdopen(fd, "rb")
        os.close(fd)
        if stat.st_nlink:
            self.remove_unusable(key, path, stat.st_ino)
        return None

    def claim(
        self,
        key: str,
        info: ShardInfo,
        distance: float,
        ahead: Callable[[], None] | None = None,
    ) -> Claim:
        """Under the node lock: a live part of ``key`` to wait on, else the published file
        (look again), else room made for a shard needed at ``distance`` and a part created
        (``LOCK_EX``). ``ahead``: a prefetch, capped by ``PREFETCH_SHARE``; called under the
        node lock once the part exists, to count it as held ahead."""
        self._sizes[key] = info.size
        with node_lock(self.cache_dir):
            self._dead_parts(key)
            live = self._parts(key)
            if live:
                return Claim(key, wait=live[0].path)
            if os.path.exists(shard_path(self.cache_dir, key, info.url)):
                return Claim(key)
            usage, plans = self._usage(), self._live_plans()
            limit = self._limit_now(usage)
            if ahead is not None and plans.ahead + info.size > limit * PREFETCH_SHARE:
                return Claim(key, full=True)
            if not self._make_room(usage, plans.plans, info.size, distance, limit):
                return Claim(key, full=True)
            part = new_part_path(self.cache_dir, key, info.size)
            claim = Claim(key, fd=locked_file(part), part=part)
            if ahead is not None:
                ahead()
            return claim

    def publish(self, claim: Claim, info: ShardInfo, crc: int) -> int:
        """Write the record of the filled part ``claim`` (its content's CRC-32 ``crc``) and
        publish it by rename; returns its fd, pinned, at offset 0. On an error the part is the
        caller's to :meth:`Claim.abandon`."""
        assert claim.fd is not None and claim.part is not None
        meta = {"url": info.url, "size": info.size, "version": info.version,
                "name": shard_name(info.url), "boot_id": boot_id(), "crc32": crc}  # fmt: skip
        record = record_path(self.cache_dir, claim.key)
        os.makedirs(os.path.dirname(record), exist_ok=True)
        replace_file(record, json.dumps(meta).encode())
        with node_lock(self.cache_dir):  # no eviction sees it between the rename and the pin
            os.rename(claim.part, shard_path(self.cache_dir, claim.key, info.url))
            fcntl.flock(claim.fd, fcntl.LOCK_SH)
        os.lseek(claim.fd, 0, os.SEEK_SET)
        Counters.of(self.cache_dir).add("downloads")
        return claim.fd

    def remove_unusable(self, key: str, path: str, inode: int | None = None) -> bool:
        """Remove an unusable copy (its readers keep their open file), unless ``path`` now
        holds another file than ``inode``."""
        with node_lock(self.cache_dir):
            try:
                if inode is not None and os.stat(path).st_ino != inode:
                    return False
            except FileNotFoundError:
                return False
            unlink(path, record_path(self.cache_dir, key))
        return True

    # ------------------------------------------------------------ listing

    def _folder(self, name: str) -> str:
        return os.path.join(self.cache_dir, name)

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
            meta = read_json(record_path(self.cache_dir, key))
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
        return _Usage(self._listing(), parts, sum(file_size(p.path) for p in parts))

    def _parts(self, key: str | None = None) -> list[Part]:
        folder = self._folder("tmp")
        parts = (parse_part(folder, name) for name in os.listdir(folder))
        return [p for p in parts if p is not None and (key is None or p.key == key)]

    def _dead_parts(self, key: str | None = None) -> list[str]:
        """Remove the parts of ``key`` (or all) whose writer died (under the node lock)."""
        removed = []
        for part in self._parts(key):
            fd = open_if_unlocked(part.path)
            if fd is not None:
                unlink(part.path)
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
            if try_lock(fd, fcntl.LOCK_SH):  # nobody holds it: released, or its process died
                if time.time() - stat.st_mtime > PLAN_GRACE_SECONDS:
                    unlink(path)
                    return None
            head = os.pread(fd, PLAN_HEADER_BYTES, 0).split()
            memo_key = (path, head[2].decode())
            if memo_key not in self._plan_memo:
                body = json.loads(os.pread(fd, stat.st_size, PLAN_HEADER_BYTES))
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
                unlink(path)
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------ checks and eviction

    def _fresh(self, key: str, fd: int) -> bool:
        """True when the record is of this boot, or the content matches its CRC (then the
        record is renewed): shards are not fsynced, so a crash can leave holes."""
        record = record_path(self.cache_dir, key)
        meta = read_json(record)
        if meta is None:
            return False
        if meta.get("boot_id") == boot_id():
            return True
        if file_crc(fd) != meta.get("crc32"):
            return False
        replace_file(record, json.dumps({**meta, "boot_id": boot_id()}).encode())
        return True

    def _check_entry(self, key: str, path: str, size: int) -> str | None:
        """Why the shard at ``path`` is unusable, or None."""
        meta = read_json(record_path(self.cache_dir, key))
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
            fd = open_if_unlocked(usage.shards[keys[i]][0])
            if fd is not None:
                held.append(fd)
            return fd is not None

        try:
            victims = choose_victims(sizes, next_uses(plans, keys), need, distance, evictable)
            for i in victims or ():
                unlink(usage.shards[keys[i]][0], record_path(self.cache_dir, keys[i]))
        finally:
            for fd in held:
                os.close(fd)
        if victims:
            Counters.of(self.cache_dir).add("evictions", len(victims))
        return victims is not None

    def _remove_unpinned(self, key: str, path: str) -> bool:
        """Remove a shard nobody pins (under the node lock)."""
        fd = open_if_unlocked(path)
        if fd is None:
            return False
        unlink(path, record_path(self.cache_dir, key))
        os.close(fd)
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
                    if age(entry.path) > PLAN_GRACE_SECONDS:
                        unlink(entry.path)
                elif name.endswith(".json") and name[:32] not in keep:
                    unlink(entry.path)
                    removed.append(f"removed a record without its shard: {entry.path}")
        return removed


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
        self._plan_path = new_plan_path(cache.cache_dir)
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
        with node_lock(self.cache.cache_dir), self._changed:  # no scan sees the old plan unlocked
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
            f = self._acquire(info)
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
        self.cache.remove_unusable(key, shard_path(self.cache.cache_dir, key, info.url))

    def warm(self, shards: Sequence[ShardInfo]) -> int:
        """Publish ``shards`` as the plan, in order, and download them (most needed first) until
        the next would not fit; returns how many of them are cached."""
        self.set_plan(shards, range(len(shards)))
        for t, info in enumerate(shards):
            if self._fetch_ahead(info, t, capped=False) == "full":
                return t
        return len(shards)

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

    # ------------------------------------------------------------ reads

    def _acquire(self, info: ShardInfo) -> BinaryIO | None:
        """The shard pinned, downloaded now if needed; None when no room can be made. This
        session's earlier failure of this shard (ahead, maybe while this waited) is raised."""
        key = shard_key(info.url, info.size, info.version)
        while True:
            f = self.cache.open_copy(key, info)
            if f is not None:
                return f
            claim = self.cache.claim(key, info, 0.0)
            if claim.full:
                return None
            if claim.wait is not None:
                wait_unlocked(claim.wait)
                if key in self._failed:
                    raise self._failed[key]
            elif claim.fd is not None:
                return os.fdopen(self._fill(claim, info), "rb")

    def _fetch_ahead(self, info: ShardInfo, t: int, capped: bool = True) -> str:
        """Download ``info`` unpinned for this reader's read at item ``t``: "cached" (it was,
        or is now), "busy" (another process downloads it) or "full" (no room without evicting
        a shard needed sooner, or, ``capped``, over the prefetch cap)."""
        key = shard_key(info.url, info.size, info.version)
        if os.path.exists(shard_path(self.cache.cache_dir, key, info.url)):
            return "cached"
        ahead = functools.partial(self._hold_ahead, key, info.size, t) if capped else None
        claim = self.cache.claim(key, info, self._distance(t), ahead)
        if claim.fd is None:
            return "full" if claim.full else "busy" if claim.wait else "cached"
        os.close(self._fill(claim, info))
        return "cached"

    def _fill(self, claim: Claim, info: ShardInfo) -> int:
        """Download into the claimed part, check it, write the record and publish by rename;
        returns the published file's fd, pinned. Errors remove the part: a remote failure
        raises ShardError (kept first, for a read waiting on this part), a local one (disk
        full, folder deleted) OSError."""
        assert claim.fd is not None
        try:
            crc = download(info, claim.fd, self.storage_options, self.stopping)
            return self.cache.publish(claim, info, crc)
        except BaseException as exc:
            if isinstance(exc, ShardError):
                self._failed[claim.key] = exc
            claim.abandon()
            raise

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
            return locked_file(temporary, data), temporary
        except FileNotFoundError:
            prepare_folder(self.cache.cache_dir)
            return locked_file(temporary, data), temporary

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
                    outcome = self._fetch_ahead(info, t)
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
        return plan_header(self.position, held, self.plan_id)

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
    Counters.of(cache.cache_dir).add("around")
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


# A fork copies this process's open files, and their flocks with them: a child lets go of the
# parent's sessions (their pins and plan locks), which it does not use.
_SESSIONS: weakref.WeakSet[CacheSession] = weakref.WeakSet()


def _drop_inherited_sessions() -> None:
    for session in list(_SESSIONS):
        session._drop_inherited()


os.register_at_fork(after_in_child=_drop_inherited_sessions)
