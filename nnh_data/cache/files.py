"""The cache folder on disk: its layout, its locks, its records and its counters.

Every process of a node (ranks, DataLoader workers, other jobs) shares one folder::

    lock                                   node lock (flock), held for bookkeeping only
    shards/<kk>/<key>-<name>, <key>.json   complete shards (appear by rename) and their record
    tmp/<key>.<size>.<pid>.<rand>.part     downloads in flight
    procs/<pid>.<rand>.plan                each reader's plan and position (while it lives)
    stats/<pid>.json                       each process's counters, summed by stats()

Every lock is an ``fcntl.flock`` on an open file, so the kernel drops it when its process dies:
no shared memory, no lock file that is unlinked, no shared counter a crash leaves wrong. A
reader pins a shard with ``LOCK_SH`` on its open file; a downloader holds ``LOCK_EX`` on its part
(a part whose ``LOCK_EX`` can be taken, :func:`open_if_unlocked`, belongs to a dead writer and
is removed). Shards are not fsynced (that costs a small cache 10-20% of an epoch); each record
holds the boot id and a CRC-32 (:func:`boot_id`, :func:`file_crc`), so a shard of an earlier
boot can be checked before use. A fork copies the process's open files and their flocks with
them, so no fork happens while a thread holds the node lock (:func:`node_lock`; the child would
hold it for ever). The folder must be on node-local disk: ``flock`` on NFS is emulated or
absent.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import stat
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from nnh_data.atomic import atomic_write

__all__ = [
    "CHUNK_BYTES",
    "COUNTERS",
    "PLAN_HEADER_BYTES",
    "Counters",
    "Part",
    "age",
    "boot_id",
    "file_crc",
    "exposed",
    "file_size",
    "foreign",
    "lay_out",
    "locked_file",
    "new_part_path",
    "new_plan_path",
    "node_lock",
    "open_if_unlocked",
    "parse_part",
    "plan_header",
    "prepare_folder",
    "read_json",
    "read_record",
    "record_path",
    "shard_name",
    "shard_path",
    "signature",
    "summed_counts",
    "try_lock",
    "unlink",
    "wait_unlocked",
    "write_all",
    "write_record",
]

CHUNK_BYTES = 4 << 20  # bytes per read of a shard's content (download, CRC)
COUNTERS = ("downloads", "hits", "around", "evictions")
PLAN_HEADER_BYTES = 53  # a plan starts with "<position:20> <ahead:20> <plan id:8> <L|R>\n"
_LAYOUT = ("shards", "tmp", "procs", "stats")
_BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
_PRIVATE = 0o700  # folders made here
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


# ---------------------------------------------------------------- the layout


def prepare_folder(cache_dir: str | os.PathLike) -> str:
    """The folder to use for ``cache_dir`` as an absolute path, laid out: ``cache_dir`` itself
    when only its owner (this user, or root) can write it and its layout, else its private
    subfolder ``uid-<uid>``, with a warning. ValueError naming ``cache_dir`` when it is a file,
    cannot be written, or its private subfolder is not private either (another user made it)."""
    path = os.path.abspath(os.fspath(cache_dir))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"cache_dir must be a folder, got a file: {path!r}")
    try:
        os.makedirs(path, mode=_PRIVATE, exist_ok=True)
        problem = exposed(path)
        if problem is not None:
            path = _private_subfolder(path, problem)
        lay_out(path)
    except OSError as exc:
        raise ValueError(f"cache_dir must be a writable folder, got {path!r} ({exc})") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"cache_dir must be a writable folder, got {path!r}")
    return path


def _private_subfolder(path: str, problem: str) -> str:
    private = os.path.join(path, f"uid-{os.geteuid()}")
    os.makedirs(private, mode=_PRIVATE, exist_ok=True)
    again = exposed(private)
    if again is not None:
        raise ValueError(
            f"cache_dir {path!r} can be written by other users ({problem}), and so can its "
            f"private subfolder ({again}): another user could swap the shards it holds; use a "
            "folder only you can write (mkdir -m 700 DIR)"
        )
    warnings.warn(
        f"cache_dir {path!r} can be written by other users ({problem}): they could swap the "
        f"shards it holds, so the cache uses its private subfolder {private!r}; give a folder "
        "only you can write (chmod go-w, or mkdir -m 700 DIR) to use it directly",
        stacklevel=4,
    )
    return private


def lay_out(path: str) -> None:
    """Create ``path``'s layout where it is missing (after the folder was deleted under a
    running job, too). PermissionError when ``path`` is no longer this user's."""
    os.makedirs(path, mode=_PRIVATE, exist_ok=True)
    owner = foreign(os.stat(path), path)
    if owner is not None:
        raise PermissionError(f"{owner}: not using this cache folder any more")
    for name in _LAYOUT:
        os.makedirs(os.path.join(path, name), mode=_PRIVATE, exist_ok=True)
    os.close(os.open(os.path.join(path, "lock"), os.O_RDWR | os.O_CREAT, 0o600))


def exposed(path: str) -> str | None:
    """What in cache folder ``path`` (the folder, its layout, its subfolders of shards) another
    user could write, or None."""
    problem = foreign(os.stat(path), path)
    names = [os.path.join(path, name) for name in ("lock", *_LAYOUT)]
    shards = os.path.join(path, "shards")
    if os.path.isdir(shards) and not os.path.islink(shards):
        names += [entry.path for entry in os.scandir(shards)]
    for name in names:
        if problem is not None:
            return problem
        try:
            problem = foreign(os.lstat(name), name)
        except FileNotFoundError:
            continue
    return problem


def foreign(status: os.stat_result, name: str = "it") -> str | None:
    """Why a file or folder with ``status`` may hold another user's bytes (it is theirs, or
    writable by its group or others), or None: this user's or root's, writable by them only."""
    if status.st_uid not in (os.geteuid(), 0):
        return f"{name} belongs to uid {status.st_uid}"
    if status.st_mode & _OTHERS_WRITE and not stat.S_ISLNK(status.st_mode):
        return f"{name} has mode {stat.S_IMODE(status.st_mode):o}, writable by other users"
    return None


def shard_name(url: str) -> str:
    """The URL's file name, safe as a file name."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", url.rstrip("/").rsplit("/", 1)[-1])[-80:] or "shard"


def shard_path(cache_dir: str, key: str, url: str) -> str:
    """Where the complete shard of ``key`` lies."""
    return os.path.join(cache_dir, "shards", key[:2], f"{key}-{shard_name(url)}")


def record_path(cache_dir: str, key: str) -> str:
    """Where the record of ``key`` lies (JSON: url, size, version, name, boot id, CRC-32)."""
    return os.path.join(cache_dir, "shards", key[:2], f"{key}.json")


@dataclass(frozen=True)
class Part:
    """A download in flight: its path, the key it fills and the shard's full size."""

    path: str
    key: str
    size: int


def new_part_path(cache_dir: str, key: str, size: int) -> str:
    """A fresh name for a download of ``key`` (``size`` bytes), owned by this process."""
    name = f"{key}.{size}.{os.getpid()}.{secrets.token_hex(4)}.part"
    return os.path.join(cache_dir, "tmp", name)


def parse_part(folder: str, name: str) -> Part | None:
    """The part named ``name`` in ``folder``, or None when the name is not a part's."""
    fields = name.split(".")
    if len(fields) != 5 or fields[-1] != "part" or not fields[1].isdigit():
        return None
    return Part(os.path.join(folder, name), fields[0], int(fields[1]))


def new_plan_path(cache_dir: str) -> str:
    """A fresh name for a reader's plan, owned by this process."""
    return os.path.join(cache_dir, "procs", f"{os.getpid()}.{secrets.token_hex(4)}.plan")


def plan_header(position: int, ahead: int, plan_id: str, released: bool = False) -> bytes:
    """A plan file's first line (``PLAN_HEADER_BYTES``, rewritten in place as the reader moves):
    its position, the bytes it holds ahead of it, the id of the plan below, and ``R`` once its
    reader released it (ended its pass) or ``L`` (live; or its process died holding it)."""
    return f"{position:>20d} {ahead:>20d} {plan_id} {'R' if released else 'L'}\n".encode()


# ---------------------------------------------------------------- locks


def try_lock(fd: int, mode: int) -> bool:
    """Take the flock ``mode`` on ``fd`` if nobody holds a conflicting one; whether it did."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def open_if_unlocked(path: str) -> int | None:
    """``path`` opened with ``LOCK_EX`` when nobody holds a lock on it; else (or when it is
    gone) None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    if try_lock(fd, fcntl.LOCK_EX):
        return fd
    os.close(fd)
    return None


def wait_unlocked(path: str) -> None:
    """Wait until the writer of ``path`` is done (published, failed or dead)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)


def locked_file(path: str, data: bytes = b"") -> int:
    """A new file ``path`` holding ``data``, open and locked (``LOCK_EX``); nothing is left
    behind when that fails."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        write_all(fd, data)
    except BaseException:
        os.close(fd)
        unlink(path)
        raise
    return fd


# Opened per use and held under _FORK_GUARD, so no fork copies a held node lock.
_FORK_GUARD = threading.Lock()
os.register_at_fork(
    before=_FORK_GUARD.acquire, after_in_parent=_FORK_GUARD.release,
    after_in_child=_FORK_GUARD.release,
)  # fmt: skip


@contextmanager
def node_lock(cache_dir: str) -> Iterator[None]:
    """The node lock of ``cache_dir`` held for the block (bookkeeping only, never a download);
    the layout is created again when the folder was deleted under a running job."""
    with _FORK_GUARD:
        fd = _open_lock(cache_dir)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _open_lock(cache_dir: str) -> int:
    """The node lock's file, opened; PermissionError when the folder is no longer this user's
    (another user moved it away and made their own in its place)."""
    path, flags = os.path.join(cache_dir, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        lay_out(cache_dir)
        fd = os.open(path, flags, 0o600)
    owner = foreign(os.stat(cache_dir), cache_dir)
    if owner is not None:
        os.close(fd)
        raise PermissionError(f"{owner}: not using this cache folder any more")
    return fd


# ---------------------------------------------------------------- files and records


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def unlink(*paths: str) -> None:
    """Remove ``paths``, those already gone included."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def read_json(path: str) -> dict | None:
    """The JSON object in ``path``, or None when it is missing, unreadable or not an object."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_record(path: str) -> dict | None:
    """The record in ``path``, or None when it is missing, unreadable, not an object, or
    another user's (:func:`foreign`)."""
    try:
        with open(path, "rb") as f:
            if foreign(os.fstat(f.fileno())) is not None:
                return None
            value = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_record(path: str, record: dict[str, Any]) -> None:
    """Replace the record in ``path`` at once, readable by others and writable by this user
    only (whatever the umask)."""
    with atomic_write(path) as f:
        os.fchmod(f.fileno(), 0o644)
        f.write(json.dumps(record).encode())


_BOOT: list[str] = []


def boot_id() -> str:
    """This boot's id ("" where the kernel does not tell); read once per process."""
    if not _BOOT:
        try:
            with open(_BOOT_ID_FILE) as f:
                _BOOT.append(f.read().strip())
        except OSError:
            _BOOT.append("")
    return _BOOT[0]


def signature(status: os.stat_result) -> list[Any]:
    """What changes when a file's content changes (its inode's change time: set by every write,
    truncate and rename, and by no user on purpose), or when the machine restarts."""
    return [boot_id(), status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns]


def file_crc(fd: int) -> int:
    """The CRC-32 of the whole file open as ``fd``."""
    crc, offset = 0, 0
    while chunk := os.pread(fd, CHUNK_BYTES, offset):
        crc = zlib.crc32(chunk, crc)
        offset += len(chunk)
    return crc


def file_size(path: str) -> int:
    """The size of ``path``; 0 when it is gone."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def age(path: str) -> float:
    """Seconds since ``path`` was modified; 0 when it is gone."""
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return 0.0


# ---------------------------------------------------------------- counters


class Counters:
    """This process's counters in a cache folder, in ``stats/<pid>.json`` (a fixed-width record
    overwritten in place); a process reusing a dead one's pid carries its counts on."""

    _lock = threading.Lock()
    _all: dict[str, Counters] = {}

    def __init__(self, folder: str) -> None:
        self.folder, self.pid, self.values = folder, -1, dict.fromkeys(COUNTERS, 0)

    @classmethod
    def of(cls, cache_dir: str) -> Counters:
        """The counters of this process in ``cache_dir``."""
        with cls._lock:
            return cls._all.setdefault(cache_dir, cls(os.path.join(cache_dir, "stats")))

    def add(self, name: str, count: int = 1) -> None:
        """Add ``count`` to the counter ``name`` (one of ``COUNTERS``) and write the record."""
        with self._lock:
            self._own()
            self.values[name] += count
            record = ", ".join(f'"{k}": {v:<20d}' for k, v in self.values.items())
            try:
                self._write(("{" + record + "}\n").encode())
            except OSError:
                pass  # a full disk: the count stays here and is written with the next one

    def current(self) -> dict[str, int]:
        """A copy of this process's counts."""
        with self._lock:
            self._own()
            return dict(self.values)

    def _write(self, record: bytes) -> None:
        os.makedirs(self.folder, exist_ok=True)  # the cache folder was deleted under a job
        fd = os.open(self._path(), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.pwrite(fd, record, 0)
        finally:
            os.close(fd)

    def _own(self) -> None:
        if self.pid != os.getpid():  # first use, or a forked child
            self.pid = os.getpid()
            self.values = _load_counts(self._path())

    def _path(self) -> str:
        return os.path.join(self.folder, f"{self.pid}.json")


def summed_counts(cache_dir: str) -> dict[str, int]:
    """The counters summed over every process that used ``cache_dir``."""
    counts = dict.fromkeys(COUNTERS, 0)
    with os.scandir(os.path.join(cache_dir, "stats")) as found:
        for entry in found:
            if entry.name.endswith(".json"):
                for name, value in _load_counts(entry.path).items():
                    counts[name] += value
    return counts


def _load_counts(path: str) -> dict[str, int]:
    saved = read_json(path) or {}
    return {k: int(saved.get(k, 0)) for k in COUNTERS}
