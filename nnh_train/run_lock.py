"""One run per run directory: a lock that names its owner and ends with it.

Design. Two runs started on one folder would both write it (doubled metric rows, checkpoints of
whichever saved last), so :meth:`NNHandler.train` locks the folders its callbacks write
(``Callback.run_dirs``) on rank 0 and a second run is refused with :class:`RunDirLockedError`,
naming the folder and the owner. The lock is ``fcntl.lockf`` (a POSIX record lock) on
``<folder>/.nnh-run.lock``: the kernel drops it when the owning process ends, however it ends
(SIGKILL, a crash), so a dead run never leaves a folder stuck. Unlike ``flock`` (the node-local
shard cache's lock), a record lock is not inherited by forked children, so the DataLoader workers
of a killed run do not keep its folder locked until they notice, and NFS serves it to every node,
so two jobs on different nodes see each other (filesystems mounted with node-local locks, such as
Lustre's ``localflock``, do not). The file holds the owner's host, pid, Slurm job and start time for
the message; it is never removed, since removing a lock file races with the next run that opens
it. Within a process the lock is counted: callbacks sharing a folder, and consecutive ``train``
calls, take it again. A record lock is released when its process closes any descriptor of the
file, so only this module opens it.

A folder deleted under its run (``rm -rf``) takes its lock file along: the lock then holds a file
that no path reaches, and a second run could start there. So the run checks that the lock file at
the path is still its own (:func:`check_run_dirs`: a stat per folder, at each epoch's end and
each save): when it is gone, the folder is made and locked again, with a warning; when another
run holds it already, this run stops with :class:`RunDirLockedError`. Either way no two runs
write one folder.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from nnh_train.ddp_decorators import on_rank
from nnh_train.errors import RunDirLockedError

__all__ = [
    "LOCK_NAME",
    "RunDirLockedError",
    "acquire_run_dirs",
    "check_run_dirs",
    "release_run_dirs",
    "run_dirs_held",
]

LOCK_NAME = ".nnh-run.lock"

_held: dict[str, tuple[int, int]] = {}  # real folder path -> (descriptor, count)
_guard = threading.Lock()


def acquire_run_dirs(folders: Iterable[str | os.PathLike]) -> None:
    """Lock each folder for this process (created when missing), or lock none of them.

    Raises:
        RunDirLockedError: a folder is locked by another process; the message names the folder
            and its owner.

    Example:
        >>> acquire_run_dirs(["runs/exp1"])  # doctest: +SKIP
        >>> release_run_dirs(["runs/exp1"])  # doctest: +SKIP
    """
    taken: list[str] = []
    try:
        for folder in folders:
            _acquire(folder)
            taken.append(folder)
    except BaseException:
        release_run_dirs(taken)
        raise


def release_run_dirs(folders: Iterable[str | os.PathLike]) -> None:
    """Undo one :func:`acquire_run_dirs` of each folder; the last one unlocks it."""
    with _guard:
        for folder in folders:
            key = os.path.realpath(folder)
            fd, count = _held[key]
            if count > 1:
                _held[key] = (fd, count - 1)
            else:
                del _held[key]
                os.close(fd)  # drops the record lock


@contextmanager
def run_dirs_held(folders: Iterable[str], rank: int) -> Iterator[None]:
    """Hold ``folders`` for a run, as the rank ``rank`` of it: rank 0 locks them and every rank
    raises its error (call it on every rank), and rank 0 unlocks them after."""
    folders = sorted(set(folders))
    if folders:
        on_rank(0)(acquire_run_dirs)(folders)
    try:
        yield
    finally:
        if folders and rank == 0:
            release_run_dirs(folders)


def check_run_dirs(folders: Iterable[str | os.PathLike]) -> None:
    """Check that this process still holds each of ``folders`` that it locked with
    :func:`acquire_run_dirs` (others are skipped): one deleted under the run is made and locked
    again, with a warning.

    Raises:
        RunDirLockedError: a folder was deleted and another run has used it since (its lock file
            is another's); the message names the folder and that run.
    """
    with _guard:
        for folder in folders:
            key = os.path.realpath(folder)
            fd, count = _held.get(key, (-1, 0))
            if not count or _same_file(fd, os.path.join(key, LOCK_NAME)):
                continue
            try:
                locked = _lock(folder, key, again=True)
            except (RunDirLockedError, FileExistsError):
                owner = _owner_of(os.path.join(key, LOCK_NAME))  # another's file, not the one held
                raise RunDirLockedError(
                    f"run directory {os.fspath(folder)!r} was deleted while this run held it, "
                    f"and another run has used it since ({owner}): stopping, so that two runs "
                    "never write one folder"
                ) from None
            os.close(fd)  # the lock of the deleted file
            _held[key] = (locked, count)
            warnings.warn(f"run directory {os.fspath(folder)!r} was deleted while this run held "
                          "it: made it again and locked it, so that no other run starts there "
                          "(what it held is gone)", RuntimeWarning, stacklevel=2)  # fmt: skip


def _same_file(fd: int, path: str) -> bool:
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)


def _acquire(folder: str | os.PathLike) -> None:
    os.makedirs(folder, exist_ok=True)
    key = os.path.realpath(folder)
    with _guard:
        if key in _held:
            fd, count = _held[key]
            _held[key] = (fd, count + 1)
            return
        _held[key] = (_lock(folder, key), 1)


def _lock(folder: str | os.PathLike, key: str, again: bool = False) -> int:
    """``key/LOCK_NAME`` locked for this process and naming it (the folder made when missing;
    ``again``: the file made now, FileExistsError when another run made it)."""
    os.makedirs(key, exist_ok=True)
    path = os.path.join(key, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_EXCL if again else 0), 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        owner = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirLockedError(
            f"run directory {os.fspath(folder)!r} is in use by another run ({owner}): two "
            "runs writing one folder mix their checkpoints and metrics; wait for it to end, "
            "stop it, or choose another folder"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, _owner().encode(), 0)
    return fd


def _owner_of(path: str) -> str:
    """Who lock file ``path`` names; never call it on a file this process locked (closing any
    descriptor of that file drops the lock)."""
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode(errors="replace").strip() or "unknown"
    except OSError:
        return "unknown"


def _owner() -> str:
    job = os.environ.get("SLURM_JOB_ID")
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    return (f"pid {os.getpid()} on host {socket.gethostname()}"
            f"{f', Slurm job {job}' if job else ''}, since {started}")  # fmt: skip
