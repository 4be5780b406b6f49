"""Tar members from memory, grouped into samples the way webdataset groups them.

Python's ``tarfile`` builds a ``TarInfo`` per member and reads through a file object, which caps
it (and webdataset on top of it) at ~11k small samples/s. Here a shard's byte range is read in
one block and members are sliced out of it. :func:`parse_samples` is the one entry point:
blocks of plain ustar (or GNU) files named ``key.field``, as :mod:`nnh_data.shards.writer`
writes them, take a vectorised path (:func:`parse_plain`): the headers are found, checked and
their names split for the whole block at once with numpy and one regular expression match per
sample (2-4x less time per sample). Anything else takes the exact member loop of
:mod:`nnh_data.shards.tar_members`. Both give the same results and errors (a property test
compares them).
"""

from __future__ import annotations

import functools
import re
from itertools import compress, repeat
from operator import eq, ne
from typing import Any

import numpy as np
import pyarrow as pa

from nnh_data.columns import rows_of
from nnh_data.shards.tar_members import (
    BLOCK,
    MAGIC,
    MAGIC_BITS,
    REGULAR_KINDS,
    SKIPPED_KINDS,
    USTAR_MAGIC,
    ZERO_BLOCK,
    Parsed,
    as_blocks,
    bad_checksums,
    parse_samples_loop,
)

__all__ = ["parse_plain", "parse_samples"]


_KINDS = np.zeros(256, np.uint8)  # by typeflag byte: 1 for regular files, 2 for skipped types

_KINDS[np.frombuffer(b"".join(REGULAR_KINDS), np.uint8)] = 1

_KINDS[np.frombuffer(b"".join(SKIPPED_KINDS) + b"g", np.uint8)] = 2

_MIN_HEADERS = 32  # in fewer, the member loop is quicker than the vectorised path

_MASK6 = (1 << 48) - 1  # the first 6 of 8 bytes (little-endian)

_USTAR_U64 = int.from_bytes(USTAR_MAGIC, "little")  # POSIX magic "ustar\0" (then a version)

_DIGITS = 8.0 ** np.arange(10, -1, -1)  # place values of the 11 digits of a ustar size field

_DIGITS_ZERO = 48 * _DIGITS.sum()  # what 11 "0" characters add up to, in those places

_CHECKSUM_DIGITS = np.stack([_DIGITS[-6:], np.ones(6)], axis=1)  # its value, its digit sum

# octal digits as bytes: 0x30 to 0x37; 8 of them in a little-endian uint64
_DIGIT_BITS = 0xF8F8F8F8F8F8F8F8

_ZEROS = 0x3030303030303030

_CHECKSUM_BITS = 0xFFFFF8F8F8F8F8F8  # 6 digits, NUL, space

_CHECKSUM_FORMAT = 0x2000303030303030

# a plain member name as the exact loop splits it, with the NULs after it in its name field:
# the key (up to a non-empty basename stem; not "__...") and the field (the rest of the basename)
_PLAIN_KEY = r"(?!__)((?:[^\0/]*+/)*+[^\0/.]++)"

_PLAIN_NAME = re.compile(_PLAIN_KEY + r"\.([^\0/]*+)\0++")

_NOT_IN_KEYS = np.zeros(256, bool)  # bytes the keys _group_fixed takes do not hold

_NOT_IN_KEYS[[0, ord("\n"), ord("."), ord("/")]] = _NOT_IN_KEYS[128:] = True

# An Arrow binary view holds a value of up to 12 bytes itself, after its size: the bytes of
# its two little-endian words to keep for each size up to 12
_LOW_KEPT = np.array([(1 << 8 * min(4 + s, 8)) - 1 for s in range(13)], np.uint64)

_HIGH_KEPT = np.array([(1 << 8 * max(s - 4, 0)) - 1 for s in range(13)], np.uint64)

_VIEW = np.dtype((np.void, 16))  # one binary view: size, then the value or prefix, buffer, offset


def parse_samples(
    buf: bytes | memoryview,
    pos: int,
    limit: int,
    *,
    need_data: bool = True,
    key: str | None = None,
    as_columns: bool = False,
    views: bool = False,
) -> Parsed:
    """Parse the members in ``buf`` from ``pos`` up to ``limit`` (or the end-of-archive marker)
    and group them into samples ``{"__key__": key, field: bytes, ...}``.

    ``key`` is the key of the sample before ``pos``: a member with that key continues it. With
    ``need_data=False`` only headers (and extended header records) are read, for an index.
    Parsing stops early at the first header (or, with ``need_data``, member data) that lies
    beyond ``buf``; ``stop`` then points at the headers of that member, so the caller can read
    on from there (``stop`` may lie beyond ``buf`` when data is skipped). Raises
    :class:`TarFormatError` on a bad header or a field repeated within a sample. With
    ``as_columns`` samples of the usual layout come as ``columns`` instead of dicts (no dict per
    sample to build and take apart again); with ``views`` too, the values of plain blocks come as
    Arrow ``binary_view`` arrays pointing into ``buf`` (no copy, no object per value: they are
    copied once, when a batch is packed or a sample handed out; ``buf`` lives while they do).

    Blocks of plain ustar files take a vectorised path (:func:`parse_plain`); anything else
    (PAX or GNU headers, directories, unusual names, errors) the exact member loop
    (:func:`parse_samples_loop`), which gives the same results.

    >>> parse_samples(tar_bytes, 0, len(tar_bytes)).samples  # doctest: +SKIP
    [{'__key__': '000000', 'cls': b'3', 'jpg': b'...'}, ...]
    """
    plain = parse_plain(buf, pos, limit, need_data, key, as_columns, views)
    if plain is not None:
        return plain
    buf = buf if isinstance(buf, bytes) else bytes(buf)  # its values are slices: bytes
    return parse_samples_loop(buf, pos, limit, need_data=need_data, key=key)


def parse_plain(
    buf: bytes | memoryview,
    pos: int,
    limit: int,
    need_data: bool,
    key: str | None,
    as_columns: bool = False,
    views: bool = False,
) -> Parsed | None:
    """:func:`parse_samples` for a block of plain ustar files named ``key.field``, with numpy
    and C-level maps instead of a loop over members; None when the block holds anything else
    (the caller then runs the exact loop, which also raises the right errors)."""
    if pos % BLOCK:
        return None
    blocks = as_blocks(buf)
    last = min(-(-limit // BLOCK), len(blocks))
    chain = _header_chain(blocks, pos // BLOCK, last)
    if chain is None:
        return None
    heads, rows, sizes, after = chain
    stop, end = after * BLOCK, False
    if after < last:  # not a ustar header: the end-of-archive marker, or something unusual
        if buf[stop : stop + BLOCK] != ZERO_BLOCK:
            return None
        end = True
    files = _plain_files(rows)
    if files is None:
        return None
    if not files.all():
        heads, rows, sizes = heads[files], rows[files], sizes[files]
    ends = (heads + 1) * BLOCK + sizes
    count = len(heads)
    if need_data and count and ends[-1] > len(buf):  # only the last member can be cut off
        stop, end, count = int(heads[-1]) * BLOCK, False, count - 1
    if not count:
        return Parsed([], [], key, stop, end)
    grouped = _grouped(buf, heads[:count], rows[:count], sizes[:count], need_data, key,
                       as_columns, views)  # fmt: skip
    if grouped is None:
        return None
    firsts, samples, key = grouped
    starts = (heads[:count][firsts] * BLOCK).tolist()
    if isinstance(samples, dict):
        return Parsed(starts, [], key, stop, end, samples)
    return Parsed(starts, samples, key, stop, end)


def _grouped(
    buf: bytes | memoryview,
    heads: np.ndarray,
    rows: np.ndarray,
    sizes: np.ndarray,
    need_data: bool,
    key: str | None,
    as_columns: bool,
    views: bool,
) -> tuple[list[int], list[dict] | dict[str, list | pa.Array], str | None] | None:
    """The members at blocks ``heads`` (header ``rows``, values ``sizes`` long) grouped into
    samples (:func:`_group_fixed`, else :func:`_group`), their values read as Arrow views of
    ``buf`` and, unless ``views`` asks for those, made bytes by Arrow (1.8x quicker than
    slicing each in Python)."""
    values = None
    if need_data:
        values = _value_views(buf, heads, sizes) if len(buf) < 1 << 31 else None  # int32
        if values is None:  # a value begins in a last, partial block
            view, starts = memoryview(buf), ((heads + 1) * BLOCK).tolist()
            values = [view[a : a + n].tobytes() for a, n in zip(starts, sizes.tolist())]
    grouped = _group_fixed(rows, key, values)
    if grouped is None:
        if isinstance(values, np.ndarray):
            values = _view_array(values, pa.py_buffer(buf)).to_pylist()
        return _group(_name_text(rows), len(rows), key, values, as_columns)
    firsts, columns, key = grouped
    if isinstance(values, np.ndarray):
        data = pa.py_buffer(buf)
        for name, col in columns.items():
            if not isinstance(col, list):  # a field's views (the keys are a list)
                array = _view_array(col, data)
                columns[name] = array if views and as_columns else array.to_pylist()
    if need_data and not as_columns:
        return firsts, rows_of(list(columns), list(columns.values())), key
    return firsts, columns if need_data else [], key


def _value_views(
    buf: bytes | memoryview, heads: np.ndarray, sizes: np.ndarray
) -> np.ndarray | None:
    """The Arrow binary views of the values of the members whose headers are blocks ``heads``
    of ``buf`` (``sizes`` long), made by numpy from each value's first 16 bytes: its size, then
    a value of up to 12 bytes itself (zero-padded), or a longer one's first 4 bytes, buffer 0
    and its offset. None when a value begins in a last, partial block."""
    words = as_blocks(buf).view("<u8")  # 64 words of 8 bytes per block
    at = heads + 1  # each value's first block
    if at[-1] >= len(words):
        return None
    first = words[at, :2]
    size, kept = sizes.astype(np.uint64), np.minimum(sizes, 12)
    out = np.empty((len(at), 2), np.uint64)
    out[:, 0] = ((first[:, 0] << np.uint64(32)) | size) & _LOW_KEPT[kept]
    inline = ((first[:, 0] >> np.uint64(32)) | (first[:, 1] << np.uint64(32))) & _HIGH_KEPT[kept]
    out[:, 1] = np.where(sizes > 12, at.astype(np.uint64) * np.uint64(BLOCK << 32), inline)
    return out.view(_VIEW)[:, 0]


def _view_array(views: np.ndarray, data: pa.Buffer) -> pa.Array:
    """A ``binary_view`` array of ``views`` (:func:`_value_views`) into ``data``; one of values
    of up to 12 bytes (held in the views themselves) does not hold ``data``, so that a field of
    labels kept by the caller does not keep the whole block in memory."""
    views = np.ascontiguousarray(views)
    inline = (views.view("<i4")[::4] <= 12).all()  # each view starts with its value's size
    buffers = [None, pa.py_buffer(views)] + ([] if inline else [data])
    return pa.Array.from_buffers(pa.binary_view(), len(views), buffers)


def _header_chain(
    blocks: np.ndarray, first: int, last: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
    """Follow the member headers from block ``first`` while they lie before ``last`` and carry
    the ustar magic: their block numbers, their rows, their sizes (for valid size fields) and
    the block after the last; None for a few headers (the member loop is quicker).

    Every block with the magic is found at once; usually they are exactly the chain (else,
    when data looks like a header, the chain is walked in Python)."""
    magic = blocks[first:last, 256:264].view("<u8")[:, 0]
    heads = first + np.flatnonzero((magic & MAGIC_BITS) == MAGIC)
    if len(heads) < _MIN_HEADERS:
        return None
    rows = blocks.take(heads, axis=0)
    sizes = (rows[:, 124:135].astype(np.float64) @ _DIGITS - _DIGITS_ZERO).astype(np.int64)
    following = heads + 1 + np.maximum(-(-sizes // BLOCK), 0)
    if not heads.size or heads[0] != first:
        return heads[:0], rows[:0], sizes[:0], first
    if (following[:-1] == heads[1:]).all():
        return heads, rows, sizes, int(following[-1])
    index = dict(zip(heads.tolist(), range(len(heads))))
    after = following.tolist()
    chain = []
    b = first
    while b < last and b in index:
        chain.append(index[b])
        b = after[index[b]]
    return heads[chain], rows[chain], sizes[chain], b


def _plain_files(rows: np.ndarray) -> np.ndarray | None:
    """Which header ``rows`` are regular files, when the others are skipped types (such as
    directories) and all have an 11-digit octal size, no ustar prefix in use and a right
    checksum, and the files a name (an empty one, bytes after its NUL, would run into the name
    before it in the names' text); else None."""
    kind = _KINDS[rows[:, 156]]
    files = kind == 1
    size_head = rows[:, 124:132].view("<u8")[:, 0]  # digits 1-8
    size_tail = rows[:, 128:136].view("<u8")[:, 0]  # digits 5-11 and a NUL or space
    magic = rows[:, 257:265].view("<u8")[:, 0]
    plain = (
        kind.astype(bool)
        & ((size_head & _DIGIT_BITS) == _ZEROS)
        & ((size_tail & (_DIGIT_BITS >> 8)) == _ZEROS >> 8)
        & ((size_tail >> 56 | 32) == 32)
        & ((rows[:, 345] == 0) | ~files | ((magic & _MASK6) != _USTAR_U64))
        & ((rows[:, 0] != 0) | ~files)
    )
    return files if plain.all() and _checksums_ok(rows) else None


def _checksums_ok(rows: np.ndarray) -> bool:
    """Whether header ``rows`` have right checksums; quick for the usual "%06o\\0 " field."""
    field = rows[:, 148:156].view("<u8")[:, 0]
    if ((field & _CHECKSUM_BITS) == _CHECKSUM_FORMAT).all():
        digits = rows[:, 148:154].astype(np.float64) - 48
        stored, digit_sum = (digits @ _CHECKSUM_DIGITS).T
        # the sum of the header bytes with the checksum field as 8 spaces
        computed = rows.sum(1, dtype=np.uint32) - (digit_sum + 6 * 48 + 32) + 8 * 32
        if (computed == stored).all():
            return True
    return not bad_checksums(rows).size


def _name_text(rows: np.ndarray) -> str:
    """The names of header ``rows``, each followed by NULs (at least one), as one string."""
    # a name ends at its first NUL: cut the rows after a column of NULs, or add one
    width = next((w for w in (16, 32, 64) if not rows[:, w].any()), None)
    if width is None:
        names = np.zeros((len(rows), 101), np.uint8)
        names[:, :100] = rows[:, :100]
    else:
        names = rows[:, : width + 1]
    return names.tobytes().decode("utf-8", "surrogateescape")


def _group(
    text: str, count: int, key: str | None, values: list[bytes] | None, as_columns: bool = False
) -> tuple[list[int], list[dict] | dict[str, list], str | None] | None:
    """Group members (their names in ``text``, their data in ``values`` when read) into
    samples: the members that start one, the samples and the last key; None when the exact loop
    must decide (a name that is not plain ``key.field``, a field repeated within a sample).

    Whole samples with the fields of the first one, in the same order (the usual layout), take
    one regular expression match each; members that continue the sample before ``text`` (key
    ``key``) and those after the last such sample go one by one. With ``as_columns``, samples
    that are all whole come as columns (a dict of lists by name)."""
    head, head_end = _continuing(text, key)
    body = text[head_end:]
    fields = _first_fields(body)
    parts = _sample_pattern(fields).split(body) if fields else [body]
    keys = parts[1:-1:2]  # one match per sample, back to back, keys unlike the one before
    if not keys or parts[0] or any(parts[2:-1:2]) or any(map(eq, keys, [key, *keys[:-1]])):
        return _group_any(text, count, key, values)
    names = ("__key__", *map(str.lower, fields))
    width = len(fields)
    done = head + len(keys) * width
    rest = None if values is None else values[done:]
    tail = _group_any(parts[-1], count - done, keys[-1], rest)
    if (
        len(set(names)) <= width  # a field twice in a sample
        or _group_any(text[:head_end], head, key, None) is None
        or tail is None
        or (done < count and tail[0][:1] != [0])  # the tail continues the last sample
    ):
        return _group_any(text, count, key, values)
    firsts = [*range(head, done, width), *(done + first for first in tail[0])]
    samples = []
    if values is not None:
        columns = [values[j:done:width] for j in range(head, head + width)]
        if as_columns and not head and done == count:
            return firsts, dict(zip(names, [keys, *columns])), tail[2]
        samples = rows_of(names, [keys, *columns])
    return firsts, samples + tail[1], tail[2]


def _group_fixed(
    rows: np.ndarray, key: str | None, values: list[bytes] | np.ndarray | None
) -> tuple[list[int], dict[str, Any], str | None] | None:
    """:func:`_group` for the usual names, compared as machine words instead of matched as
    text: ``key.field`` with an ASCII key (no newline) of one width in every name (its first
    dot at the same place) and no "/", each sample with the fields of the first in its order,
    none continuing the sample before (key ``key``); None for anything else, which
    :func:`_group` decides. The samples come as columns (each field's values taken from
    ``values``, or none without them)."""
    count = len(rows)
    width = next((w for w in (16, 32, 64) if not rows[:, w].any()), None)
    if width is None:
        return None
    words = np.ascontiguousarray(rows[:, :width].view("<u8"))  # (count, width / 8)
    names = words.view(np.uint8)
    dot = int(np.argmax(names[0] == 46))
    if (
        not dot
        or not (names[:, dot] == 46).all()
        or _NOT_IN_KEYS.take(names[:, :dot]).any()
        or ((names[:, 0] == 95) & (names[:, 1] == 95)).any()  # "__": metadata
    ):
        return None
    key_bits = _byte_mask(range(dot), width)
    keys = (words & key_bits).view(f"V{width}")[:, 0]
    same = keys[1:] == keys[:-1]  # a name with the key of the one before
    fields = count if same.all() else int(np.argmin(same)) + 1
    runs = np.append(same, False).reshape(-1, fields) if count % fields == 0 else None
    if runs is None or not runs[:, :-1].all() or runs[:, -1].any():  # not samples of `fields`
        return None
    tails = words.reshape(-1, fields, width // 8) & ~key_bits  # the dot, the field, the NULs
    if (tails != tails[0]).any():
        return None
    raw = [names[j, dot + 1 :].tobytes().split(b"\0", 1)[0] for j in range(fields)]
    if any(b"/" in field or not field.isascii() for field in raw):
        return None
    names_ = ("__key__", *(field.decode().lower() for field in raw))
    lines = np.full((count // fields, dot + 1), 10, np.uint8)  # each key, then a newline
    lines[:, :dot] = names[::fields, :dot]
    sample_keys = lines.tobytes().decode().split("\n")[:-1]
    if (
        len(set(names_)) <= fields  # a field twice
        or sample_keys[0] == key  # the first members continue the sample before
    ):
        return None
    firsts = list(range(0, count, fields))
    if values is None:
        return firsts, {}, sample_keys[-1]
    columns = [sample_keys, *(values[j::fields] for j in range(fields))]
    return firsts, dict(zip(names_, columns)), sample_keys[-1]


@functools.lru_cache(maxsize=64)
def _byte_mask(places: range, width: int) -> np.ndarray:
    """Little-endian uint64 words of ``width`` bytes with the bytes at ``places`` all ones."""
    mask = np.zeros(width, np.uint8)
    mask[places] = 255
    return mask.view("<u8")


def _continuing(text: str, key: str | None) -> tuple[int, int]:
    """How many names at the start of ``text`` have the key ``key``, and where they end."""
    count = end = 0
    for match in _PLAIN_NAME.finditer(text):
        if match.start() != end or match.group(1) != key:
            break
        count, end = count + 1, match.end()
    return count, end


def _first_fields(text: str) -> tuple[str, ...]:
    """The fields (as written) of the first sample in a names text, as far as they are plain."""
    fields = []
    first = None
    end = 0
    for match in _PLAIN_NAME.finditer(text):
        name_key, field = match.groups()
        first = first or name_key
        if name_key != first or match.start() != end:
            break
        fields.append(field)
        end = match.end()
    return tuple(fields)


@functools.lru_cache(maxsize=64)
def _sample_pattern(fields: tuple[str, ...]) -> re.Pattern:
    """Matches the names of one sample with these ``fields``; captures its key."""
    names = "\\1".join(rf"\.{re.escape(field)}\0++" for field in fields)
    return re.compile(_PLAIN_KEY + names)


def _group_any(
    text: str, count: int, key: str | None, values: list[bytes] | None
) -> tuple[list[int], list[dict], str | None] | None:
    """:func:`_group` one member at a time: members with the key of the member before continue
    its sample (before the first: ``key``)."""
    if not count:
        return [], [], key
    parts = _PLAIN_NAME.split(text)
    if len(parts) != 3 * count + 1 or any(parts[::3]):  # one match per row, back to back
        return None
    keys = parts[1::3]
    fields = list(map(str.lower, parts[2::3]))
    firsts = list(compress(range(count), map(ne, keys, [key, *keys[:-1]])))
    bounds = [*firsts, count]
    head = fields[: bounds[0]]
    if len(set(head)) < len(head):
        return None
    samples: list[dict] = []
    for a, b in zip(bounds, bounds[1:]):
        sample = {"__key__": keys[a]}
        sample.update(zip(fields[a:b], repeat(None) if values is None else values[a:b]))
        if len(sample) <= b - a:
            return None
        if values is not None:
            samples.append(sample)
    return firsts, samples, keys[-1]
