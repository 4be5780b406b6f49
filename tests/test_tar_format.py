from __future__ import annotations

import io
import tarfile

import pytest
from hypothesis import given
from hypothesis import strategies as st
from webdataset.tariterators import base_plus_ext, group_by_keys, tar_file_expander

from nnh_data.tar_format import TarFormatError, parse_samples, split_name


def tar_bytes(members, *, format=tarfile.PAX_FORMAT, pax_headers=None) -> bytes:
    """members: (name, data) for files, (name, None) for directories."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=format, pax_headers=pax_headers) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                info.mtime = 1.5  # fractional: PAX format writes a PAX header per member
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def samples_of(buf: bytes) -> list[dict]:
    parsed = parse_samples(buf, 0, len(buf))
    assert parsed.end
    return parsed.samples


def webdataset_samples(buf: bytes) -> list[dict]:
    source = [{"url": "mem", "stream": io.BytesIO(buf)}]
    grouped = group_by_keys(tar_file_expander(source))
    return [{k: v for k, v in s.items() if k != "__url__"} for s in grouped]


TRICKY = [
    ("dir", None),
    ("dir/000001.JPG", b"jpeg"),
    ("dir/000001.seg.png", b"png"),
    ("dir/000001.cls", b"3"),
    ("__meta__", b"skipped"),
    ("README", b"no dot: skipped"),
    ("d" * 90 + "/" + "k" * 40 + ".txt", b"a ustar prefix or a PAX path"),
    ("long/" + "n" * 200 + ".bin", b"long name"),
    ("utf8/é.txt", b"non-ascii"),
    ("dir/000002.cls", b""),
]


@pytest.mark.parametrize("form", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_grouping_matches_webdataset(form):
    buf = tar_bytes(
        TRICKY,
        format=form,
        pax_headers={"comment": "global"} if form == tarfile.PAX_FORMAT else None,
    )
    ours = samples_of(buf)
    assert ours == webdataset_samples(buf)
    assert ours[0] == {"__key__": "dir/000001", "jpg": b"jpeg", "seg.png": b"png", "cls": b"3"}
    assert [s["__key__"] for s in ours[1:]] == [
        "d" * 90 + "/" + "k" * 40,
        "long/" + "n" * 200,
        "utf8/é",
        "dir/000002",
    ]


def test_ustar_prefix_field():
    name = "p" * 120 + "/file.txt"
    buf = tar_bytes([(name, b"x")], format=tarfile.USTAR_FORMAT)
    assert samples_of(buf) == [{"__key__": "p" * 120 + "/file", "txt": b"x"}]


def test_pax_size_record_overrides_the_header():
    info = tarfile.TarInfo("a.bin")
    info.pax_headers = {"size": "5"}
    header = info.tobuf(tarfile.PAX_FORMAT)  # the ustar size field says 0
    buf = header + b"12345".ljust(512, b"\0") + bytes(1024)
    assert samples_of(buf) == [{"__key__": "a", "bin": b"12345"}]


def test_sample_starts_include_extended_headers_and_keys_carry_over():
    buf = tar_bytes([("a.x", b"1"), ("a.y", b"2"), ("b.x", b"3")])
    parsed = parse_samples(buf, 0, len(buf))
    # each member is a PAX header (2 blocks) then its own header and one data block
    assert (parsed.starts, parsed.key) == ([0, 2 * 4 * 512], "b")
    second_half = parse_samples(buf, 4 * 512, len(buf), key="a")
    assert second_half.starts == [2 * 4 * 512]
    assert second_half.samples == [{"__key__": "b", "x": b"3"}]


def test_parsing_stops_where_the_buffer_ends():
    buf = tar_bytes([("a.x", b"1" * 600), ("b.x", b"2")])
    cut = buf[: 4 * 512]  # PAX header, header, half of a's data
    parsed = parse_samples(cut, 0, len(cut))
    assert (parsed.starts, parsed.stop, parsed.end) == ([], 0, False)
    headers_only = parse_samples(cut, 0, len(cut), need_data=False)
    assert (headers_only.starts, headers_only.samples, headers_only.stop) == ([0], [], 5 * 512)


def test_bad_checksum_and_duplicate_field():
    buf = bytearray(tar_bytes([("a.x", b"1"), ("b.x", b"2")], format=tarfile.USTAR_FORMAT))
    buf[1024] ^= 1  # b's name
    with pytest.raises(TarFormatError, match="checksum") as caught:
        parse_samples(bytes(buf), 0, len(buf))
    assert caught.value.offset == 1024
    duplicate = tar_bytes([("a.x", b"1"), ("a.x", b"2")])
    for need_data in (True, False):
        with pytest.raises(TarFormatError, match="duplicate field") as caught:
            parse_samples(duplicate, 0, len(duplicate), need_data=need_data)
        assert caught.value.offset == 2 * 512 * 2


def test_garbage_is_a_format_error():
    with pytest.raises(TarFormatError):
        parse_samples(b"x" * 2048, 0, 2048)


@given(st.text(alphabet="ab./_C", max_size=12))
def test_split_name_matches_webdataset(path):
    key, field = base_plus_ext(path)
    assert split_name(path) == (key, field.lower() if key is not None else "")
