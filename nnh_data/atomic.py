"""Files that appear whole or not at all: write to a hidden temporary name beside the
destination, then rename over it.

One helper for every file nnh writes that a reader may open at any moment (index sidecars,
cache records and plans, precomputed tables and receipts, checkpoints, the metrics CSV): a
reader, a crash or a second writer never sees a partial file, and a failed write leaves
nothing behind. ``fsync=True`` also flushes the bytes and the folder entry to disk before
returning, for files a crash must not lose (checkpoints); without it the rename is atomic for
other processes but a power loss may lose the newest version (cheap enough for files written
often, such as cache plans). Remote filesystems (any fsspec ``fs``) write the temporary object
and move it; there ``fsync`` is up to the store.
"""

from __future__ import annotations

import os
import posixpath
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

__all__ = ["atomic_write", "replace_file", "temporary_name"]


def temporary_name(path: str) -> str:
    """A hidden, unique name beside ``path`` (``.<name>.<pid>.<random>.tmp``): readers that
    skip dot files (Parquet dataset readers, ``nnh-data``) never see it; the pid says whose."""
    folder, _, name = str(path).rpartition("/")
    hidden = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    return posixpath.join(folder, hidden) if folder else hidden


@contextmanager
def atomic_write(
    path: str | os.PathLike, mode: str = "wb", *, fsync: bool = False, fs: Any = None
) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; on leaving the block without an
    exception, rename it to ``path`` (after flushing it and, with ``fsync``, syncing it and its
    folder); on an exception, remove it. ``fs``: an fsspec filesystem (default: local).

    Example:
        >>> import tempfile, pathlib
        >>> out = pathlib.Path(tempfile.mkdtemp()) / "a.json"
        >>> with atomic_write(out, "w") as f:
        ...     _ = f.write("{}")
        >>> out.read_text()
        '{}'
    """
    path = os.fspath(path)
    if fs is not None:
        yield from _remote(fs, path, mode)
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temporary = temporary_name(path)
    try:
        with open(temporary, mode, newline="" if "b" not in mode else None) as file:
            yield file
            file.flush()
            if fsync:
                os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        _remove(temporary)
        raise
    if fsync:
        _fsync_folder(folder)


def replace_file(
    path: str | os.PathLike, data: bytes | str | memoryview, *, fsync: bool = False, fs: Any = None
) -> None:
    """Replace ``path``'s content with ``data`` atomically (see :func:`atomic_write`)."""
    with atomic_write(path, "w" if isinstance(data, str) else "wb", fsync=fsync, fs=fs) as file:
        file.write(data)


def _remote(fs: Any, path: str, mode: str) -> Iterator[IO]:
    temporary = temporary_name(path)
    folder = posixpath.dirname(path)
    if folder:
        fs.makedirs(folder, exist_ok=True)
    try:
        with fs.open(temporary, mode) as file:
            yield file
        fs.mv(temporary, path)
    except BaseException:
        if fs.exists(temporary):
            fs.rm(temporary)
        raise


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_folder(folder: str) -> None:
    """Make the rename durable: the folder entry is flushed like the file's bytes."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
