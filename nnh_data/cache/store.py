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
never holds more than the limit.

Content. A record holds the CRC-32 of the bytes downloaded. Before a copy is used its record
must be this user's and of its key, and its content must match that CRC-32, which is computed
again (one read of the shard) unless the file's :func:`~nnh_data.cache.files.signature` (boot,
inode, size, modification and change times) is the one recorded when it was last found to match:
so every process skips the check until the file is written to (a write sets the change time,
which no user can set back), truncated, moved or the machine restarts (shards are not fsynced).
A copy that fails is removed, with a warning, and downloaded again.

Eviction follows the live plans: each reader publishes the keys it will read and when, and
making room for a shard needed at distance ``d`` evicts unpinned shards by farthest next use,
never one needed at or before ``d``. Prefetch follows the same rule and is capped so that what
all live plans hold ahead stays under a quarter of the limit (``PREFETCH_SHARE``). A released
plan stays live ``PLAN_GRACE_SECONDS`` (the gap between epochs, or from ``nnh-data cache warm``
to the job); the plan of a process that died holding it is removed at the next scan, which
every new plan makes. The trade-off: a decision scans
the folder and the plans under the node lock (milliseconds for 10,000 shards), which is small
next to a shard's download.

Use. A reader (one DataLoader worker's pass) opens a :class:`~nnh_data.cache.session.CacheSession`
with :meth:`ShardCache.session`; the session downloads (:mod:`nnh_data.cache.download`) into the
parts this class claims for it. ``cache_dir`` must be on node-local disk: ``flock`` on NFS is
emulated or absent.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from nnh_data.cache.files import (
    PLAN_HEADER_BYTES,
    Counters,
    Part,
    age,
    boot_id,
    file_crc,
    file_size,
    foreign,
    locked_file,
    new_part_path,
    node_lock,
    open_if_unlocked,
    parse_part,
    prepare_folder,
    read_record,
    record_path,
    shard_name,
    shard_path,
    signature,
    summed_counts,
    try_lock,
    unlink,
    write_record,
)
from nnh_data.cache.policy import Plan, choose_victims, next_uses, parse_size, shard_key
from nnh_data.cache.session import CacheSession
from nnh_data.shards.index import ShardInfo

__all__ = [
    "DISK_RESERVE",
    "PLAN_GRACE_SECONDS",
    "PREFETCH_SHARE",
    "CacheEntry",
    "Claim",
    "ShardCache",
]

logger = logging.getLogger(__name__)

PLAN_GRACE_SECONDS = 120.0  # a released plan stays live this long (the gap between epochs)
PREFETCH_SHARE = 0.25  # what all live plans hold ahead stays under this share of the limit
DISK_RESERVE = 1 << 30  # kept free on the disk (a twentieth of a disk under 20 GiB)
_MTIME_SLACK_NS = 200_000_000  # a folder or shard changed this recently is looked at again


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
            meta = read_record(record_path(self.cache_dir, key))
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

    def remove_dead_plans(self) -> None:
        """Remove the plans of processes that died holding them, and released ones older than
        ``PLAN_GRACE_SECONDS`` (each new plan does, so that they go also when no read misses)."""
        with node_lock(self.cache_dir):
            if os.path.isdir(self._folder("procs")):  # (the folder deleted: none to remove)
                self._live_plans()

    def verify(self) -> list[str]:
        """Check every shard against its record (size, owner, key, content: one read of each)
        and remove what fails, dead downloads' parts and orphan records; returns what was
        found."""
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
        fails its checks is removed, with a warning when it changed since its download."""
        path = shard_path(self.cache_dir, key, info.url)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        status = os.fstat(fd)
        reason = self._unusable(key, fd, status, info.size) if status.st_nlink else "removed"
        if reason is None:
            Counters.of(self.cache_dir).add("hits")
            return os.fdopen(fd, "rb")
        os.close(fd)
        if status.st_nlink and self.remove_unusable(key, path, status.st_ino):
            _report(self.cache_dir, info.url, reason)
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
        os.makedirs(os.path.dirname(record), mode=0o700, exist_ok=True)
        write_record(record, meta)
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
            meta = read_record(record_path(self.cache_dir, key))
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
        ``PLAN_GRACE_SECONDS`` ago (under the node lock); the others are removed."""
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
            unheld = try_lock(fd, fcntl.LOCK_SH)  # nobody holds it: released, or its process died
            head = os.pread(fd, PLAN_HEADER_BYTES, 0).split()  # (then nobody writes it)
            if unheld:
                released = head[3:] == [b"R"]
                if not released or time.time() - stat.st_mtime > PLAN_GRACE_SECONDS:
                    unlink(path)
                    return None
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

    def _unusable(
        self, key: str, fd: int, status: os.stat_result, size: int, full: bool = False
    ) -> str | None:
        """Why the shard of ``key`` open as ``fd`` (``status``) cannot be used, or None: its
        size, its owner, its record, its content (see the module's design; ``full``: its CRC
        whatever its signature)."""
        if status.st_size != size:
            return f"has size {status.st_size}, expected {size}"
        owner = foreign(status)
        if owner is not None:
            return f"cannot be trusted: {owner}"
        record = record_path(self.cache_dir, key)
        meta = read_record(record)
        if meta is None or _key_of(meta) != key:
            return "has no record of its own (missing, unreadable, of another shard or user)"
        seen = signature(status)
        if meta.get("checked") == seen and not full:
            return None
        if file_crc(fd) != meta.get("crc32"):
            return _CHANGED if meta.get("boot_id") == seen[0] else _RESTART
        if time.time_ns() - status.st_ctime_ns > _MTIME_SLACK_NS:  # a time a write cannot share
            write_record(record, {**meta, "boot_id": seen[0], "checked": seen})
        return None

    def _check_entry(self, key: str, path: str, size: int) -> str | None:
        """Why the shard at ``path`` is unusable, or None."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            return self._unusable(key, fd, os.fstat(fd), size, full=True)
        finally:
            os.close(fd)

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


_CHANGED = "changed since it was downloaded (its CRC-32 differs)"
_RESTART = "lost bytes in a restart (its CRC-32 differs)"


def _key_of(meta: dict[str, Any]) -> str | None:
    """The key a record describes, or None when it is not a record."""
    try:
        return shard_key(meta["url"], meta["size"], meta["version"])
    except (KeyError, TypeError, ValueError):
        return None


def _report(cache_dir: str, url: str, reason: str) -> None:
    """Say why the copy of ``url`` was removed: in the log after a restart (shards are not
    fsynced, so a crash can leave holes), else in a warning (something wrote the cache)."""
    message = f"the cached copy of {url!r} in {cache_dir!r} {reason}: removed, downloading it again"
    if reason == _RESTART:
        logger.info(message)
    else:
        warnings.warn(message, stacklevel=4)
