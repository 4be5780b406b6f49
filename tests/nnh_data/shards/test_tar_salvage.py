"""Salvage of damaged tar shards: what is kept, what is lost, and whether the count is exact.

Archives are built in memory and damaged byte by byte; every kept sample is read back through
the salvaged offsets and gaps, the way a reader cuts them, and must be a whole sample."""

from __future__ import annotations

import io
import tarfile
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nnh_data.shards.index import ShardInfo
from nnh_data.shards.reading import decode_shard_range
from nnh_data.shards.tar import parse_samples
from nnh_data.shards.tar_salvage import AFTER_END, Salvaged, salvage_tar

FIELDS = ("bin", "cls")


def archive(count: int, *, fmt: int = tarfile.USTAR_FORMAT, fields=FIELDS, size=16) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for i in range(count):
            for field in fields:
                info = tarfile.TarInfo(f"{i:04d}.{field}")
                info.size = size
                info.mtime = 1.5 if fmt == tarfile.PAX_FORMAT else 0  # PAX: a header each
                tar.addfile(info, io.BytesIO(bytes([i]) * size))
    return out.getvalue()


def member_offset(data: bytes, sample: int, member: int, fields=FIELDS) -> int:
    """Where the headers of member ``member`` of sample ``sample`` start (PAX ones included)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return tar.getmembers()[sample * len(fields) + member].offset


def bad_checksum(data: bytes, offset: int) -> bytes:
    return data[: offset + 148] + b"7777777\0" + data[offset + 156 :]


def salvaged_samples(data: bytes) -> tuple[list[dict], Salvaged]:
    """The samples a reader gets through the salvaged index (as ``ShardReader.fetch`` reads
    them: the shard's byte range and the block after it), and the salvage."""
    found = salvage_tar(lambda a, b: data[a:b], len(data))
    info = replace(ShardInfo.from_offsets("x.tar", "tar", found.offsets, len(data)),
                   gaps=tuple(found.gaps))  # fmt: skip
    stop = info.num_samples
    end = int(info.offsets[stop])
    payload = data[int(info.offsets[0]) : end + 512 if end + 512 <= len(data) else end]
    return list(decode_shard_range(info, payload, 0, stop)) if stop else [], found


def keys(samples: list[dict], fields=FIELDS) -> list[int]:
    assert all(set(s) == {"__key__", *fields} for s in samples), "a partial sample"
    return [int(s["__key__"]) for s in samples]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize(("sample", "member"), [(4, 0), (4, 1), (0, 0), (9, 0), (9, 1)])
def test_a_bad_header_checksum_loses_exactly_its_sample(fmt, sample, member):
    data = archive(10, fmt=fmt)
    at = member_offset(data, sample, member)  # a PAX header, when there is one
    samples, found = salvaged_samples(bad_checksum(data, at))
    assert keys(samples) == [i for i in range(10) if i != sample]
    assert (found.lost, found.exact) == (1, True)
    assert found.reasons == [f"bad tar header checksum at byte {at}"]


def test_a_member_declaring_10_gib_loses_only_its_sample():
    data = archive(10)
    at = member_offset(data, 4, 0)
    info = tarfile.TarInfo("0004.bin")
    info.size = 10 << 30
    damaged = data[:at] + info.tobuf(tarfile.GNU_FORMAT) + data[at + 512 :]
    samples, found = salvaged_samples(damaged)
    assert keys(samples) == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert (found.lost, found.exact) == (1, True)
    assert found.reasons == [
        f"the member at byte {at} '0004.bin' declares {10 << 30} bytes, past the end of the "
        f"file ({len(data)} bytes)"
    ]


def test_a_file_that_is_not_a_tar_is_empty_and_its_loss_unknown():
    data = b"these bytes are no tar archive\n" * 100
    samples, found = salvaged_samples(data)
    assert samples == [] and (found.lost, found.exact) == (0, False)
    assert found.reasons == [f"not a tar file: no readable tar header in its {len(data)} bytes"]


def test_a_file_cut_short_keeps_what_is_whole_and_says_at_least():
    data = archive(10, size=600)  # 2 blocks of data per member
    cut = data[: member_offset(data, 6, 1) + 700]  # inside sample 6's second member
    samples, found = salvaged_samples(cut)
    assert keys(samples) == [0, 1, 2, 3, 4, 5]
    assert found.lost == 1 and not found.exact  # sample 6, and who knows how many after it


def test_a_zeroed_stretch_is_no_end_of_archive_and_its_count_a_lower_bound():
    data = archive(10)
    a, b = member_offset(data, 3, 1), member_offset(data, 6, 0)  # from 3.cls to 5.cls
    samples, found = salvaged_samples(data[:a] + bytes(b - a) + data[b:])
    # nothing tells what the zeros held: 3 and 6 may have lost a member into them
    assert keys(samples) == [0, 1, 2, 7, 8, 9]
    assert found.lost == 2 and not found.exact
    assert found.reasons == [AFTER_END.format(a)]


def test_several_damaged_headers_each_lose_their_sample():
    data = archive(12)
    for at in [member_offset(data, sample, 1) for sample in (2, 7, 11)]:
        data = bad_checksum(data, at)
    samples, found = salvaged_samples(data)
    assert keys(samples) == [0, 1, 3, 4, 5, 6, 8, 9, 10]
    assert (found.lost, found.exact, len(found.reasons)) == (3, True, 3)


def test_a_damaged_name_never_gives_a_sample_short_of_a_field():
    data = archive(10)
    at = member_offset(data, 4, 1)  # 0004.cls
    damaged = bytearray(data)
    damaged[at : at + 4] = b"0005"  # the name now claims the next sample (checksum broken too)
    samples, found = salvaged_samples(bytes(damaged))
    # 0004 lacks its cls: left out; 0005 is named by the damaged member: left out too
    assert keys(samples) == [0, 1, 2, 3, 6, 7, 8, 9]
    assert (found.lost, found.exact) == (2, True)


def test_an_undamaged_archive_is_kept_whole():
    data = archive(7)
    samples, found = salvaged_samples(data)
    assert keys(samples) == list(range(7))
    assert (found.lost, found.exact, found.gaps) == (0, True, [])
    assert found.offsets[-1] == parse_samples(data, 0, len(data)).stop


@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(2, 40),
    fields=st.sampled_from([("bin",), ("bin", "cls"), ("a", "b", "c")]),
    pax=st.booleans(),
    data=st.data(),
)
def test_one_damaged_header_loses_one_sample_and_never_a_field(count, fields, pax, data):
    fmt = tarfile.PAX_FORMAT if pax else tarfile.USTAR_FORMAT
    raw = archive(count, fmt=fmt, fields=fields, size=data.draw(st.integers(1, 1500)))
    sample = data.draw(st.integers(0, count - 1))
    at = member_offset(raw, sample, data.draw(st.integers(0, len(fields) - 1)), fields)
    got, found = salvaged_samples(bad_checksum(raw, at))
    assert all(set(s) == {"__key__", *fields} for s in got)
    assert [int(s["__key__"]) for s in got] == [i for i in range(count) if i != sample]
    assert (found.lost, found.exact) == (1, True)
