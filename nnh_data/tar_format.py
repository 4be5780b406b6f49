"""Tar members from memory, grouped into samples the way webdataset groups them.

Python's ``tarfile`` builds a ``TarInfo`` per member and reads through a file object, which caps
it (and webdataset on top of it) at ~11k small samples/s. Here a shard's byte range is read in
one block and members are sliced out of it; the per-member work is one ``struct`` unpack and a
few slices. Header checksums are verified for a whole block at once with numpy. POSIX ustar,
PAX extended headers ('x' per member, 'g' global: skipped) and GNU long names ('L') are handled;
directories, links and webdataset metadata members (``__name__``) are skipped.

Sample grouping follows ``webdataset.tariterators``: the key is the path up to the first dot of
its basename, the field is the rest of the name, lower-cased; consecutive members with the same
key form one sample.
"""

from __future__ import annotations

import re
import struct
import tarfile
from typing import NamedTuple

import numpy as np

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
# name, size, typeflag: the ustar fields read for every member (the ustar prefix only where it is
# set; checksums are verified separately, for a whole block at once).
_HEADER = struct.Struct("100s24x12s20xc")
_REGULAR = (b"0", b"\0", b"7")
_SKIPPED = (b"1", b"2", b"3", b"4", b"5", b"6", b"K", b"V", b"M", b"N")
_USTAR = b"ustar\0"
_META = re.compile(r"__[^/]*__($|/)")
_WDS_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


class TarFormatError(ValueError):
    """A tar archive that cannot be parsed; ``offset`` is the byte position in the parsed block."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(offset, reason)
        self.offset = offset
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.reason} at byte {self.offset}"


class Parsed(NamedTuple):
    """What :func:`parse_samples` found in a block."""

    starts: list[int]  # where each sample that begins in the block starts (its first header)
    samples: list[dict]  # those samples, when their data was read (``need_data``)
    key: str | None  # the key of the last sample, to carry into the next block
    stop: int  # where parsing stopped: the next header to read (or the end-of-archive marker)
    end: bool  # True when the end-of-archive marker was reached


def split_name(path: str) -> tuple[str | None, str]:
    """Split a member path into (key, field) like webdataset's ``base_plus_ext``.

    >>> split_name("a/b/000001.seg.PNG")
    ('a/b/000001', 'seg.png')
    """
    slash = path.rfind("/")
    dot = path.find(".", slash + 1)
    if dot > slash + 1:
        return path[:dot], path[dot + 1 :].lower()
    match = _WDS_NAME.match(path)
    if match is None:
        return None, ""
    return match.group(1), match.group(2).lower()


def parse_samples(
    buf: bytes, pos: int, limit: int, *, need_data: bool = True, key: str | None = None
) -> Parsed:
    """Parse the members in ``buf`` from ``pos`` up to ``limit`` (or the end-of-archive marker)
    and group them into samples ``{"__key__": key, field: bytes, ...}``.

    ``key`` is the key of the sample before ``pos``: a member with that key continues it. With
    ``need_data=False`` only headers (and extended header records) are read, for an index.
    Parsing stops early at the first header (or, with ``need_data``, member data) that lies
    beyond ``buf``; ``stop`` then points at the headers of that member, so the caller can read
    on from there (``stop`` may lie beyond ``buf`` when data is skipped). Raises
    :class:`TarFormatError` on a bad header or a field repeated within a sample.
    """
    found = Parsed([], [], key, pos, False)
    heads: list[int] = []
    try:
        found = _parse(buf, pos, limit, need_data, found, heads)
    except (ValueError, IndexError) as exc:
        check_checksums(buf, heads)  # a corrupt header explains the failure better
        if isinstance(exc, TarFormatError):
            raise
        raise TarFormatError(heads[-1] if heads else pos, f"bad tar header ({exc})") from exc
    check_checksums(buf, heads)
    return found


def _parse(
    buf: bytes, pos: int, limit: int, need_data: bool, found: Parsed, heads: list[int]
) -> Parsed:
    """The tight loop of :func:`parse_samples`; fills ``found`` and ``heads``."""
    unpack = _HEADER.unpack_from
    add_start = found.starts.append
    add_sample = found.samples.append
    add_head = heads.append
    end = len(buf)
    current = found.key
    sample: dict = {}
    start = pos
    long_path = long_size = None
    while pos < limit:
        if pos + BLOCK > end:
            return found._replace(key=current, stop=start)
        name, size_field, kind = unpack(buf, pos)
        if not name[0] and buf[pos : pos + BLOCK] == ZERO_BLOCK:
            return found._replace(key=current, stop=pos, end=True)
        add_head(pos)
        try:
            size = int(size_field.rstrip(b"\0"), 8)
        except ValueError:
            size = _number(size_field)
        if long_size is not None:
            size = long_size
        data = pos + BLOCK
        pos = data + ((size + 511) & -512)
        if kind in _REGULAR:
            if need_data and data + size > end:
                return found._replace(key=current, stop=start)
            if long_path is None:
                cut = name.find(b"\0")
                path = (name[:cut] if cut >= 0 else name).decode("utf-8", "surrogateescape")
                if buf[data - 167] and buf[data - 255 : data - 249] == _USTAR:  # prefix, magic
                    path = _ustar_prefix(buf, data - BLOCK) + path
            else:
                path = long_path
            slash = path.rfind("/")
            dot = path.find(".", slash + 1)
            if dot > slash + 1 and path[:2] != "__":
                key, field = path[:dot], path[dot + 1 :].lower()
            else:
                key, field = (None, "") if _META.match(path) else split_name(path)
            if key is not None:  # else the member is not part of a sample
                if key != current:
                    current = key
                    add_start(start)
                    sample = {"__key__": key}
                    if need_data:
                        add_sample(sample)
                elif field in sample:
                    raise TarFormatError(start, f"duplicate field {field!r} in sample {key!r}")
                sample[field] = buf[data : data + size] if need_data else None
        elif kind == b"x" or kind == b"L":
            if data + size > end:
                return found._replace(key=current, stop=start)
            records = buf[data : data + size]
            if kind == b"L":
                long_path = _text(records.rstrip(b"\0"))
            elif b"path=" in records or b"size=" in records:
                long_path, long_size = _pax(records, long_path, long_size)
            continue  # the extended header belongs to the next member
        elif kind != b"g" and kind not in _SKIPPED:
            raise TarFormatError(data - BLOCK, f"unsupported tar member type {kind!r}")
        start = pos
        long_path = long_size = None
    return found._replace(key=current, stop=pos)


def _number(field: bytes) -> int:
    """A numeric header field in GNU base-256 or octal that ``int`` cannot parse directly."""
    try:
        return tarfile.nti(field)
    except tarfile.InvalidHeaderError as exc:
        raise ValueError(f"bad number {field!r}") from exc


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _ustar_prefix(buf: bytes, head: int) -> str:
    """The ustar prefix of the header at ``head``, with its "/" separator."""
    return _text(buf[head + 345 : head + 500].split(b"\0", 1)[0]) + "/"


def _pax(records: bytes, path: str | None, size: int | None) -> tuple[str | None, int | None]:
    """Apply the ``path`` and ``size`` records of a PAX extended header; others are ignored."""
    pos = 0
    while pos < len(records) and records[pos] != 0:
        space = records.index(b" ", pos)
        length = int(records[pos:space])
        keyword, _, value = records[space + 1 : pos + length - 1].partition(b"=")
        if keyword == b"path":
            path = _text(value)
        elif keyword == b"size":
            size = int(value)
        pos += length
    return path, size


def check_checksums(buf: bytes, heads: list[int]) -> None:
    """Verify the checksums of the headers at ``heads`` (512-byte aligned) in one pass."""
    if not heads:
        return
    blocks = np.frombuffer(buf, np.uint8, count=len(buf) // BLOCK * BLOCK).reshape(-1, BLOCK)
    rows = blocks.take(np.asarray(heads) >> 9, axis=0)
    field = rows[:, 148:156]
    computed = rows.sum(1, dtype=np.uint32).astype(np.int64) - field.sum(1, dtype=np.int64) + 256
    for row in np.flatnonzero(computed != _octal_columns(field)):
        block = rows[row].view(np.int8)  # some writers sum signed bytes
        signed = block.sum(dtype=np.int64) - block[148:156].sum(dtype=np.int64) + 8 * 32
        if signed != _octal_columns(field[row : row + 1])[0]:
            raise TarFormatError(heads[row], "bad tar header checksum")


def _octal_columns(field: np.ndarray) -> np.ndarray:
    """Parse an (n, 8) array of octal text fields ("0012345\\0 ", " 12345\\0") at once."""
    digits = field.astype(np.int64) - 48
    is_digit = (digits >= 0) & (digits <= 7)
    # a digit's power of 8 is the number of digits after it (one run of digits per field)
    power = np.cumsum(is_digit[:, ::-1], axis=1)[:, ::-1] - 1
    return np.where(is_digit, digits << (3 * np.maximum(power, 0)), 0).sum(1)
