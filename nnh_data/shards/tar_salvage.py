"""Indexing what can be read of a damaged tar shard (``on_error="skip"`` at index time).

A header with a wrong checksum, a member declaring more bytes than the file holds, a field
repeated in a sample: the ordinary scan stops at the first of these and the shard would be lost
whole. Salvage reads on. It parses the archive sample by sample; at a damaged member it looks
for the next block that is a real header (the ustar magic and a right checksum: what GNU tar
does when it skips to the next header) and goes on from there. The bytes in between become a
gap of the index, which readers cut out of what they read, so the samples after it keep their
seek positions (:func:`nnh_data.shards.reading.fetch_shard_range`).

Which samples are lost. A sample with a member in a damaged span is left out, never handed out
short of a field. The samples on either side of a span may be whole or may have lost a member
into it: one is kept only when the span holds exactly one member (its size leads to the next
header, or no other block in it carries the magic) whose name belongs to another sample, and
when it has the fields most samples of the shard have (which catches a damaged name). The count
of lost samples is exact when every span holds one member; otherwise (several destroyed headers,
a file cut short, a file that is no tar at all) it is a lower bound, marked as one: the span
could have held any number of samples. A block of member data that happens to look like a
header (a tar stored inside the tar) would be taken for one; that is the price of reading on.

>>> salvaged = salvage_tar(lambda a, b: data[a:b], len(data))  # doctest: +SKIP
>>> salvaged.lost, salvaged.exact, len(salvaged.offsets) - 1  # doctest: +SKIP
(1, True, 9)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from nnh_data.errors import TarFormatError
from nnh_data.shards.tar import parse_samples
from nnh_data.shards.tar_members import BLOCK, ZERO_BLOCK, Parsed, header_at, header_blocks

__all__ = ["AFTER_END", "Salvaged", "data_after_end", "salvage_tar"]

_READ = 1 << 20  # bytes read at a time
_HEAD_BYTES = 64 << 10  # enough for a member's headers, long PAX records included
_NEXT = "\0next"  # the damaged header is an extended header of the member after the span
AFTER_END = (
    "more data after the end-of-archive marker (a zero block) at byte {}: a zeroed stretch of "
    "the archive, or a second archive appended to it"
)


@dataclass(frozen=True)
class Salvaged:
    """What :func:`salvage_tar` could index: ``offsets`` (where each kept sample starts, then
    where the last one's piece ends), ``gaps`` (byte spans inside those pieces that readers
    cut out), ``lost`` samples (a lower bound unless ``exact``) and the damage found."""

    offsets: list[int]
    gaps: list[tuple[int, int]]
    lost: int
    exact: bool
    reasons: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Sample:
    start: int
    end: int
    key: str
    fields: frozenset[str]


@dataclass(frozen=True)
class _Damage:
    start: int  # the damaged member's first block
    stop: int  # where reading resumed: the next real header, or the end of the file
    key: str | None  # the damaged member's sample key, when its header can be trusted
    exact: bool  # the span holds exactly one member
    before: int  # how many samples were read before it
    reason: str


def salvage_tar(read: Callable[[int, int], bytes], size: int) -> Salvaged:
    """Index the readable samples of a tar archive of ``size`` bytes, read through
    ``read(start, stop)``; see the module docstring."""
    samples: list[_Sample] = []
    damages: list[_Damage] = []
    pos, block, end = 0, _READ, size
    while pos < size:
        buf = read(pos, min(pos + block, size))
        try:
            parsed, bad = parse_samples(buf, 0, len(buf)), None
        except TarFormatError as exc:
            parsed, bad = parse_samples(buf, 0, exc.offset), exc
        whole = parsed.end or bad is not None or pos + len(buf) >= size
        if not whole:  # the last sample may go on after this block: read it again from its start
            keep = len(parsed.starts) - 1
            advance = parsed.starts[keep] if parsed.starts else parsed.stop
            _add(samples, pos, parsed, max(keep, 0))
            pos, block = (pos + advance, _READ) if advance else (pos, block * 2)
            continue
        _add(samples, pos, parsed, len(parsed.starts))
        if parsed.end and not data_after_end(read, pos + parsed.stop, size):
            end = pos + parsed.stop
            break
        if not parsed.end and bad is None and parsed.stop == len(buf):
            break  # the file ends after a whole member, without an end-of-archive marker
        reason = f"{bad.reason} at byte {pos + bad.offset}" if bad else ""
        if parsed.end:
            reason = AFTER_END.format(pos + parsed.stop)
        damage = _damage(read, pos + parsed.stop, size, len(samples), reason)
        damages.append(damage)
        pos = damage.stop
    return _decide(samples, damages, end, size)


def data_after_end(read: Callable[[int, int], bytes], marker: int, size: int) -> bool:
    """Whether anything but zeros follows the end-of-archive marker at ``marker``: tar pads
    an archive with zeros, so data there is a zeroed stretch of the archive (or a second
    archive appended to it), whose members a reader stopping at the marker would silently miss.
    """
    pos = marker
    while pos < size:
        chunk = read(pos, min(pos + _READ, size))
        if chunk.count(0) != len(chunk):
            return True
        pos += len(chunk)
    return False


def _add(samples: list[_Sample], pos: int, parsed: Parsed, count: int) -> None:
    """The first ``count`` samples of ``parsed`` (a block read at ``pos``)."""
    ends = [*parsed.starts[1:], parsed.stop]
    for start, stop, sample in zip(parsed.starts[:count], ends, parsed.samples):
        fields = frozenset(sample) - {"__key__"}
        samples.append(_Sample(pos + start, pos + stop, sample["__key__"], fields))


def _damage(
    read: Callable[[int, int], bytes], start: int, size: int, before: int, reason: str
) -> _Damage:
    """The damaged member whose headers start at ``start``: the span to the next real header,
    whether it holds one member, and the key of its sample when that can be trusted."""
    head = header_at(read(start, min(start + _HEAD_BYTES, size)), 0)
    own = start + head.head  # its own header block, after any readable extended headers
    stop, other_magic = _next_header(read, own + BLOCK, size)
    member_end = -1 if head.size is None else own + BLOCK + ((head.size + BLOCK - 1) & -BLOCK)
    if stop < size:
        exact = member_end == stop or head.magic and not other_magic
    else:  # no header after it: one member only if its end is the end-of-archive marker
        marker = 0 <= member_end <= size - BLOCK
        exact = marker and read(member_end, member_end + BLOCK) == ZERO_BLOCK
    if not reason:
        what = "is cut off" if head.path is None else f"{head.path!r} declares {head.size} bytes"
        reason = f"the member at byte {own} {what}, past the end of the file ({size} bytes)"
    key = _NEXT if head.kind in (b"x", b"L") else head.key if exact else None
    return _Damage(start, stop, key, exact, before, reason)


def _next_header(read: Callable[[int, int], bytes], pos: int, size: int) -> tuple[int, bool]:
    """The offset of the first real header from ``pos`` (``size`` if none), and whether a block
    before it carries the ustar magic (a header too damaged to read)."""
    magic = False
    while pos + BLOCK <= size:
        buf = read(pos, min(pos + _READ, size))
        heads, valid = header_blocks(buf)
        if valid.any():
            first = int(heads[valid.argmax()])
            return pos + first * BLOCK, magic or bool((heads < first).any())
        magic = magic or bool(heads.size)
        pos += len(buf) // BLOCK * BLOCK
    return size, magic


def _decide(samples: list[_Sample], damages: list[_Damage], end: int, size: int) -> Salvaged:
    """Which samples to keep around each damaged span, the lost count and the gaps."""
    sides = [_sides(samples, d) for d in damages]
    touching = {i for pair in sides for i in pair if i is not None}
    common = Counter(s.fields for i, s in enumerate(samples) if i not in touching).most_common(1)
    usual = common[0][0] if common else None
    dropped: set[int] = set()
    lost, exact = 0, True  # lost: samples wholly in spans, and halves counted twice (negative)
    for damage, (before, after) in zip(damages, sides):
        key = damage.key
        if key == _NEXT:
            key = None if after is None else samples[after].key
        for i in (before, after):
            if i is not None and not _whole(samples[i], key, usual):
                dropped.add(i)
        if before is not None and after is not None and samples[before].key == samples[after].key:
            dropped.update((before, after))  # two parts of one sample around the span
            lost -= 1
        exact = exact and damage.exact and key is not None
        if key and all(i is None or samples[i].key != key for i in (before, after)):
            lost += 1  # the damaged member's own sample, wholly inside the span
    kept = [s for i, s in enumerate(samples) if i not in dropped]
    for a, b in zip(kept, kept[1:]):
        if a.key == b.key:  # would read back as one sample once the gap is cut out
            dropped.add(samples.index(b))
    kept = [s for i, s in enumerate(samples) if i not in dropped]
    reasons = [d.reason for d in damages]
    if not samples and damages and not damages[0].start:
        reasons[0] = f"not a tar file: no readable tar header in its {size} bytes"
    if not kept:
        return Salvaged([0], [], lost + len(dropped), exact, reasons)
    end -= end % BLOCK  # offsets are whole blocks; a file cut short ends inside one
    offsets = [*(s.start for s in kept), end]
    gaps = [(a.end, b.start) for a, b in zip(kept, kept[1:]) if a.end < b.start]
    gaps += [(kept[-1].end, end)] if kept[-1].end < end else []
    return Salvaged(offsets, gaps, lost + len(dropped), exact, reasons)


def _sides(samples: list[_Sample], damage: _Damage) -> tuple[int | None, int | None]:
    """The samples that end where ``damage`` starts and start where it stops."""
    n = damage.before
    before = n - 1 if n and samples[n - 1].end == damage.start else None
    after = n if n < len(samples) and samples[n].start == damage.stop else None
    return before, after


def _whole(sample: _Sample, damaged_key: str | None, usual: frozenset[str] | None) -> bool:
    """Whether a sample next to a damaged span can be trusted to be whole: the damaged member
    is known to belong to another sample, and it has the usual fields."""
    return damaged_key is not None and sample.key != damaged_key and usual in (None, sample.fields)
