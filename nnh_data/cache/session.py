"""One reader's use of the node-local cache: its plan, its position, its pins, its prefetch.

A reader (one DataLoader worker's pass) opens a :class:`CacheSession`
(:meth:`ShardCache.session <nnh_data.cache.store.ShardCache.session>`), publishes its plan
(:func:`~nnh_data.cache.policy.read_schedule` gives it from the epoch order), reports its
position with ``advance`` and reads shards through ``open``/``release``; ``open`` returns None
when the cache is smaller than what the readers need at once, and the caller then reads the
remote directly. The plan is a file in ``procs/``, locked by the session while it lives, whose
first line (the position and the bytes prefetched ahead of it) is rewritten in place as the
reader moves, so every process's evictions see where every reader stands. A closed session
marks its plan released, which keeps it a while for the next pass to take over; the plan of a
process that died holding it is removed by the next reader that publishes one (or any scan of
the plans). A miss claims a part from the store
(:meth:`~nnh_data.cache.store.ShardCache.claim`), downloads into it
(:func:`~nnh_data.cache.download.download`) and publishes it; a thread prefetches the next
``prefetch`` shards of the plan the same way, under the store's cap on what is held ahead.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import threading
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from nnh_data.cache.download import STALL_SECONDS, download
from nnh_data.cache.files import (
    Counters,
    lay_out,
    locked_file,
    new_plan_path,
    node_lock,
    plan_header,
    shard_path,
    unlink,
    wait_unlocked,
)
from nnh_data.cache.policy import shard_key
from nnh_data.checks import check_int
from nnh_data.errors import ShardError
from nnh_data.shards.index import ShardInfo

if TYPE_CHECKING:
    from nnh_data.cache.store import Claim, ShardCache

__all__ = ["CacheSession"]

_RETRY_S = 0.5  # a prefetch that found no room looks again after this long


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
            self.cache.remove_dead_plans()
            fd, temporary = self._plan_file(state)
        except OSError as exc:  # the folder cannot take it: reads go on, the plan unpublished
            _warn_local(self.cache, exc)
            fd = temporary = None
        try:
            with node_lock(self.cache.cache_dir), self._changed:  # no scan sees the old plan
                if temporary is not None:  # unlocked
                    os.rename(temporary, self._plan_path)
                self._use_plan(fd, state)
        except OSError as exc:  # the folder failed (another user's now): the plan unpublished
            _warn_local(self.cache, exc)
            if temporary is not None:
                os.close(fd)
                unlink(temporary)
            with self._changed:
                self._use_plan(None, state)
        if self.prefetch and self._thread is None:
            self._thread = threading.Thread(
                target=self._prefetch_loop, daemon=True, name="nnh-cache-prefetch"
            )
            self._thread.start()

    def _use_plan(self, fd: int | None, state: _PlanState) -> None:
        """Make ``state`` this reader's plan, published in ``fd`` (None: unpublished)."""
        if self._plan_fd is not None:
            os.close(self._plan_fd)
        self._plan_fd, self._state = fd, state
        self._version += 1
        self._changed.notify_all()

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
        try:
            self.cache.remove_unusable(key, shard_path(self.cache.cache_dir, key, info.url))
        except OSError as exc:  # the folder failed: the next open reads around it
            _warn_local(self.cache, exc)

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
                self._write_header(released=True)
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
            lay_out(self.cache.cache_dir)
            return locked_file(temporary, data), temporary

    def _write_header(self, released: bool = False) -> None:
        if self._plan_fd is not None:
            os.pwrite(self._plan_fd, self._state.header(released), 0)

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

    def header(self, released: bool = False) -> bytes:
        """The plan file's first line: the position, the bytes held ahead of it, whether it is
        released."""
        self.ahead = {k: st for k, st in self.ahead.items() if st[1] > self.position}
        held = sum(size for size, _ in self.ahead.values())
        return plan_header(self.position, held, self.plan_id, released)

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
