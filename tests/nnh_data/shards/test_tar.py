from __future__ import annotations

import functools
import io
import random
import tarfile

import pyarrow as pa
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from webdataset.tariterators import base_plus_ext, group_by_keys, tar_file_expander

from nnh_data.columns import as_list, columns_of
from nnh_data.errors import TarFormatError
from nnh_data.shards import tar as tar_format
from nnh_data.shards.tar import parse_plain, parse_samples
from nnh_data.shards.tar_members import (
    BLOCK,
    Parsed,
    header_at,
    header_blocks,
    parse_samples_loop,
    split_name,
)


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


def test_a_field_named_key_is_refused_as_webdataset_refuses_it():
    """A member ``a.__key__`` would set the sample's key to its data: a format error, also
    when it is the first member of its sample."""
    buf = tar_bytes([("a.__key__", b"x"), ("a.bin", b"y")], format=tarfile.USTAR_FORMAT)
    with pytest.raises(ValueError, match="duplicate file name"):
        webdataset_samples(buf)
    for need_data in (True, False):
        with pytest.raises(TarFormatError, match="duplicate field '__key__' in sample 'a'"):
            parse_samples(buf, 0, len(buf), need_data=need_data)


def test_garbage_is_a_format_error():
    with pytest.raises(TarFormatError):
        parse_samples(b"x" * 2048, 0, 2048)


@given(st.text(alphabet="ab./_C", max_size=12))
def test_split_name_matches_webdataset(path):
    key, field = base_plus_ext(path)
    assert split_name(path) == (key, field.lower() if key is not None else "")


# The vectorised path for plain ustar blocks must give what the member loop gives, errors included.
@pytest.fixture(autouse=True, scope="module")
def fast_path_for_few_headers():
    """The fast path leaves blocks of few headers to the member loop: here it takes them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tar_format, "_MIN_HEADERS", 0)
        yield


KEYS = ["000001", "000002", "a/b", "x.y/z", "A_B", "__k__", "__m__/q", "", ".h", "n" * 90]
EXTS = [".bin", ".BIN", ".cls", ".seg.png", ".txt", ".__key__", ""]
SIZES = [0, 1, 511, 512, 513, 1024, 3000]


@st.composite
def archives(draw, formats=(tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT), keys=KEYS, exts=EXTS):
    """The members of a tar archive of samples, maybe with a directory, and its format:
    arguments of :func:`tar_bytes`."""
    members = []
    if draw(st.booleans()):  # mostly names that the fast path takes
        keys, exts = keys[:5], [ext for ext in exts[:5] if ext != ".BIN"]
    unique = draw(st.integers(0, 3)) > 0  # else consecutive samples may share a key
    for key in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=8, unique=unique)):
        for ext in draw(st.lists(st.sampled_from(exts), min_size=1, max_size=3, unique=True)):
            members.append((key + ext, bytes([len(members)]) * draw(st.sampled_from(SIZES))))
    if draw(st.integers(0, 9)) == 0:
        members.insert(draw(st.integers(0, len(members))), ("dir", None))
    return members, draw(st.sampled_from(formats))


def outcome(parse, buf, pos, limit, need_data, key):
    try:
        return parse(buf, pos, limit, need_data=need_data, key=key)
    except TarFormatError as exc:
        return exc.offset, exc.reason


@settings(max_examples=500, deadline=None)
@given(archives(), st.data())
def test_fast_path_matches_the_member_loop(archive, data):
    members, form = archive
    buf = tar_bytes(members, format=form)
    if data.draw(st.integers(0, 3)) == 0:  # corrupt a byte: a header, its checksum, data, the end
        at = data.draw(st.integers(0, len(buf) - 1))
        buf = buf[:at] + bytes([buf[at] ^ data.draw(st.integers(1, 255))]) + buf[at + 1 :]
    if data.draw(st.integers(0, 2)) == 0:
        buf = buf[: data.draw(st.integers(0, len(buf)))]  # truncated
    pos = 0
    if data.draw(st.integers(0, 2)) == 0:
        pos = BLOCK * data.draw(st.integers(0, len(buf) // BLOCK))
    limit = data.draw(st.integers(pos, len(buf) + 2 * BLOCK) | st.just(len(buf)))
    need_data = data.draw(st.booleans())
    key = data.draw(st.sampled_from([None, *KEYS]))
    args = (buf, pos, limit, need_data, key)
    assert outcome(parse_samples, *args) == outcome(parse_samples_loop, *args)


@settings(max_examples=50, deadline=None)
@given(archives(formats=(tarfile.USTAR_FORMAT,), keys=KEYS[:5], exts=EXTS[:5]))
def test_fast_path_takes_plain_archives_and_matches_webdataset(archive):
    members, form = archive
    buf = tar_bytes(members, format=form)
    assume(isinstance(outcome(parse_samples_loop, buf, 0, len(buf), True, None), Parsed))
    parsed = parse_plain(buf, 0, len(buf), True, None)  # not a fall back to the loop
    assert parsed is not None and parsed.end
    assert parsed.samples == webdataset_samples(buf)


def as_bytes(parsed):
    """``parsed`` with Arrow columns (views) as lists of their values."""
    if not isinstance(parsed, Parsed) or parsed.columns is None:
        return parsed
    return parsed._replace(columns={k: as_list(c) for k, c in parsed.columns.items()})


@settings(max_examples=200, deadline=None)
@given(archives(), st.data())
def test_columns_are_the_samples_as_columns(archive, data):
    members, form = archive
    buf = tar_bytes(members, format=form)
    pos = BLOCK * data.draw(st.integers(0, len(buf) // BLOCK)) if data.draw(st.booleans()) else 0
    key = data.draw(st.sampled_from([None, *KEYS]))
    rows = outcome(parse_samples, buf, pos, len(buf), True, key)
    columns = functools.partial(parse_samples, as_columns=True)
    got = outcome(columns, buf, pos, len(buf), True, key)
    viewed = functools.partial(columns, views=True)
    views = outcome(viewed, bytearray(buf), pos, len(buf), True, key)
    assert as_bytes(views) == got  # values as Arrow views of the buffer, where they are
    if isinstance(got, Parsed) and got.columns is not None:
        assert got.samples == [] and got.columns == columns_of(rows.samples)
        assert list(got.columns) == list(columns_of(rows.samples))  # the fields' order
        got = got._replace(samples=rows.samples, columns=None)
    assert got == rows


@pytest.mark.parametrize("cut", [False, True])
def test_plain_values_come_as_views_of_the_buffer(cut):
    """With ``views``, a plain block's values are Arrow binary views: one of up to 12 bytes
    held in its view, a longer one pointing into the buffer. A block that ends inside its last
    member's first data block gives bytes instead (no whole block to read views from)."""
    rng = random.Random(0)
    sizes = [*range(16), 500, 511, 512, 513, 3000, 14] * 2
    members = [(f"{i:04d}.{field}", rng.randbytes(size if field == "a" else (size * 7) % 20))
               for i, size in enumerate(sizes) for field in ("a", "b")]  # fmt: skip
    buf = tar_bytes(members, format=tarfile.USTAR_FORMAT)
    if cut:  # the last value is 18 bytes: keep 20 of its block
        buf = buf[: buf.rindex(members[-1][1]) + 20]
    got = parse_samples(bytearray(buf), 0, len(buf), as_columns=True, views=True)
    assert as_bytes(got) == parse_samples(buf, 0, len(buf), as_columns=True)
    values = [got.columns[field] for field in ("a", "b")]
    if cut:
        assert all(isinstance(v, list) for v in values)
        return
    for column in values:
        assert column.type == pa.binary_view()
        column.validate(full=True)
    assert got.columns["a"].to_pylist() == [data for name, data in members[::2]]


@settings(max_examples=200, deadline=None)
@given(archives(), st.booleans())
def test_a_view_of_a_reused_buffer_parses_as_its_bytes(archive, as_columns):
    # ShardReader.fetch_block hands blocks out as views of reused buffers: the same samples,
    # their values bytes that stay as they are when the buffer is read into again
    members, form = archive
    buf = tar_bytes(members, format=form)
    scratch = bytearray(buf)
    parse = functools.partial(parse_samples, as_columns=as_columns)
    got = outcome(parse, memoryview(scratch), 0, len(buf), True, None)
    assert got == outcome(parse, buf, 0, len(buf), True, None)
    if isinstance(got, Parsed):
        columns = [c for name, c in (got.columns or {}).items() if name != "__key__"]
        values = [v for s in got.samples for k, v in s.items() if k != "__key__"]
        assert all(type(v) is bytes for v in values + [v for c in columns for v in c])
        scratch[:] = bytes(len(scratch))
        assert got == outcome(parse, buf, 0, len(buf), True, None)


def renamed(buf: bytes, names: list[bytes]) -> bytes:
    """``buf`` (ustar members) with its members' name fields set to ``names`` byte for byte
    (junk after a NUL included) and their checksums made right again."""
    out, pos = bytearray(buf), 0
    for name in names:
        header = out[pos : pos + BLOCK]
        header[:100] = name.ljust(100, b"\0")
        header[148:156] = b" " * 8
        header[148:156] = b"%06o\0 " % sum(header)
        out[pos : pos + BLOCK] = header
        pos += BLOCK + -(-int(header[124:135], 8) // BLOCK) * BLOCK
    return bytes(out)


def keyed(*pattern: bytes) -> list[bytes]:
    """The names of 4 samples: ``pattern`` formatted with each sample's number."""
    return [name % i for i in range(4) for name in pattern]


@pytest.mark.parametrize(
    "names",
    [
        keyed(b"k%03d.bin", b"k%03d.cls"),  # compared as words
        keyed(b"k%03d.seg.png", b"k%03d.Txt"),
        keyed(b"k%03d.bin\0zz", b"k%03d.cls\0zz"),  # junk after the NUL: ignored
        [b"k000.bin\0%d" % i for i in range(4)] + keyed(b"k%03d.cls")[:4],
        keyed(b"k0\0%d.bin", b"k0\0%d.cls"),  # a NUL before the dot: no key
        keyed(b"k%03d.bin", b"k%03d.BIN"),  # a field twice
        [b"k000.bin", b"k000.cls"] * 4,  # one key for all: one sample, fields repeated
        keyed(b"k%d.bin", b"k%d0.cls"),  # keys of two widths
        keyed(b"__%02d.bin", b"__%02d.cls"),
        keyed(b"\xc3\xa9%02d.bin", b"\xc3\xa9%02d.cls"),  # not ASCII
        keyed(b"k%02d.b\xffn", b"k%02d.cls"),  # a field not UTF-8
        keyed(b"d/k%d.bin", b"d/k%d.cls"),
        keyed(b"k\n%d.bin", b"k\n%d.cls"),
        [b"0000.BIN", b"a000.BIN", b"0000.BIN", b"\x00000.BIN"],  # no name, bytes after it
        keyed(b"k%d.b/n", b"k%d.cls"),
        keyed(b"k%d.bin", b"k%d.cls", b"k%d.txt")[:-1],  # the last sample cut short
    ],
)
def test_names_compared_as_words_give_what_the_member_loop_gives(names):
    members = [(f"{i:03d}.x", bytes([i]) * (i * 100)) for i in range(len(names))]
    buf = renamed(tar_bytes(members, format=tarfile.USTAR_FORMAT), names)
    expected = outcome(parse_samples_loop, buf, 0, len(buf), True, "k")
    assert outcome(parse_samples, buf, 0, len(buf), True, "k") == expected
    got = outcome(functools.partial(parse_samples, as_columns=True), buf, 0, len(buf), True, "k")
    if isinstance(got, Parsed) and got.columns is not None:
        rows = [dict(zip(got.columns, values)) for values in zip(*got.columns.values())]
        got = got._replace(samples=rows, columns=None)
    assert got == expected


def test_plain_samples_come_as_columns():
    members = [(f"{i // 2:04d}.{ext}", bytes([i]) * i) for i, ext in enumerate(["b", "a"] * 4)]
    parsed = parse_plain(tar_bytes(members, format=tarfile.USTAR_FORMAT), 0, 10**6, True, None,
                         as_columns=True)  # fmt: skip
    assert parsed.columns == {"__key__": ["0000", "0001", "0002", "0003"],
                              "b": [bytes([i]) * i for i in (0, 2, 4, 6)],
                              "a": [bytes([i]) * i for i in (1, 3, 5, 7)]}  # fmt: skip


def test_fast_path_in_pieces_carries_keys_like_the_member_loop():
    members = [(f"{i // 3:04d}.{ext}", bytes(i % 700)) for i, ext in enumerate(["a", "b", "c"] * 9)]
    buf = tar_bytes(members, format=tarfile.USTAR_FORMAT)
    for need_data in (True, False):
        for piece in (1, 2, 5, 7, 64):  # blocks per call: samples cut anywhere
            pos, key = 0, None
            while True:
                limit = pos + piece * BLOCK
                fast = parse_plain(buf, pos, limit, need_data, key)
                assert fast == parse_samples_loop(buf, pos, limit, need_data=need_data, key=key)
                if fast.end:
                    break
                pos, key = fast.stop, fast.key


def test_a_block_ending_after_an_extended_header_stops_before_it():
    """The PAX header names the member after it: a caller reading on from ``stop`` must read
    it again, or the member would be read under its truncated ustar name."""
    long_name = "k" * 120 + ".txt"
    buf = tar_bytes([("a.txt", b"1"), (long_name, b"2")])
    member = 1024  # a.txt: its PAX header and data, then its header and data
    assert buf[member + 1024 + 156 : member + 1024 + 157] == b"x"  # long name's PAX header
    parsed = parse_samples(buf, 0, member + 2048, need_data=False)  # up to its ustar header
    assert parsed.stop == member + 1024
    rest = parse_samples(buf, parsed.stop, len(buf), key=parsed.key)
    assert [s["__key__"] for s in rest.samples] == ["k" * 120]


def test_header_at_reads_a_damaged_header_leniently():
    buf = bytearray(tar_bytes([("a.txt", b"1"), ("b.cls", b"22")], format=tarfile.USTAR_FORMAT))
    buf[512 * 2 + 148 : 512 * 2 + 156] = b"7777777\0"  # b.cls: a wrong checksum
    head = header_at(bytes(buf), 1024)
    assert (head.path, head.size, head.key) == ("b.cls", 2, "b")
    assert (head.magic, head.valid) == (True, False)
    pax = tar_bytes([("c" * 120 + ".txt", b"3")])
    head = header_at(pax, 0)  # its PAX header applied and stepped over
    assert (head.start, head.head, head.path, head.key) == (0, 1024, "c" * 120 + ".txt", "c" * 120)
    heads, valid = header_blocks(bytes(buf))
    assert heads.tolist() == [0, 2] and valid.tolist() == [True, False]


def header_bytes(name: bytes, data: bytes | None, extended: str = "") -> bytes:
    """One member: a ustar header named ``name`` byte for byte (a directory when ``data`` is
    None), then its data; ``extended``: "gnu" or "pax" to name it with an extended header."""
    info = tarfile.TarInfo(name.decode("utf-8", "surrogateescape"))
    info.size = 0 if data is None else len(data)
    info.type = tarfile.DIRTYPE if data is None else tarfile.REGTYPE
    if extended:
        form = tarfile.GNU_FORMAT if extended == "gnu" else tarfile.PAX_FORMAT
        info.name = "/" * (101 - len(name)) + info.name  # past 100 bytes: an extended header
        if extended == "pax":
            info.pax_headers = {"path": info.name}
        head = info.tobuf(form, "utf-8", "surrogateescape")
    else:
        head = bytearray(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape"))
        head[:100] = name.ljust(100, b"\0")
        head[148:156] = b" " * 8
        head[148:156] = b"%06o\0 " % sum(head)
    padding = bytes(-info.size % BLOCK)
    return bytes(head) + (data or b"") + padding


ODD_KEY_BYTES = st.sampled_from(b"aZ_ .\x01\n/\xff\0")
FIELDS = [b"bin", b"cls", b"BIN", b"Cls", b"seg.png", b"", b"__key__", b"b\xffn", b"a/b", b"t\0j"]


@st.composite
def near_plain_key(draw, width: int) -> bytes:
    """``width`` digits, maybe with one byte that is not a digit."""
    key = bytearray(draw(st.lists(st.sampled_from(b"0123456789"), min_size=width, max_size=width)))
    if draw(st.integers(0, 3)) == 0:
        key[draw(st.integers(0, width - 1))] = draw(ODD_KEY_BYTES)
    return bytes(key)


@st.composite
def near_plain(draw):
    """A tar archive (bytes) of names that are plain ``key.field`` or nearly, and its keys:
    keys of one width (some with a byte the word comparison must refuse), fields in one order
    or not and in either case, repeated keys, junk after a NUL, names of about (and exactly)
    16, 32 and 64 bytes, directories and extended headers."""
    width = draw(st.sampled_from([1, 4, 8, 12, 15, 16, 28, 31, 47, 60, 63, 70]))
    keys = draw(st.lists(near_plain_key(width), min_size=1, max_size=6))
    if draw(st.booleans()) and len(keys) > 2:
        keys[draw(st.integers(2, len(keys) - 1))] = keys[0]  # a key again, not adjacently
    fields = st.sampled_from(FIELDS[:4]) | st.sampled_from(FIELDS)
    fields = draw(st.lists(fields, min_size=1, max_size=3, unique=True))
    junk = draw(st.sampled_from([b"", b"", b"\0zz", b"\0" + b"q" * 40]))
    members = []
    for key in keys:
        own = draw(st.permutations(fields)) if draw(st.integers(0, 5)) == 0 else fields
        own = own[: draw(st.integers(1, len(own)))] if draw(st.integers(0, 5)) == 0 else own
        own = [f.swapcase() if draw(st.integers(0, 9)) == 0 else f for f in own]  # "BIN", "bin"
        for field in own:
            data = bytes([len(members)]) * draw(st.sampled_from([0, 1, 512, 700]))
            members.append(header_bytes((key + b"." + field + junk)[:100], data))
    for _ in range(draw(st.integers(0, 2)) if draw(st.integers(0, 3)) == 0 else 0):
        odd = draw(st.sampled_from(["dir", "gnu", "pax"]))
        at = draw(st.integers(0, len(members)))
        if odd == "dir":
            members.insert(at, header_bytes(b"d/", None))
        else:
            members.insert(at, header_bytes(keys[0] + b"." + fields[0], b"x", odd))
    text_keys = [key.decode("utf-8", "surrogateescape") for key in keys]
    return b"".join(members) + bytes(2 * BLOCK), text_keys


@settings(max_examples=300, deadline=None)
@given(near_plain(), st.data())
def test_near_plain_names_give_what_the_member_loop_gives(archive, data):
    buf, keys = archive
    pos = BLOCK * data.draw(st.integers(0, len(buf) // BLOCK)) if data.draw(st.booleans()) else 0
    limit = data.draw(st.integers(pos, len(buf)) | st.just(len(buf)))
    need_data = data.draw(st.booleans())
    key = data.draw(st.sampled_from([None, "zz", *keys]))
    expected = outcome(parse_samples_loop, buf, pos, limit, need_data, key)
    for as_columns in (False, True):
        got = outcome(functools.partial(parse_samples, as_columns=as_columns), buf, pos, limit,
                      need_data, key)  # fmt: skip
        if isinstance(got, Parsed) and got.columns is not None:
            rows = [dict(zip(got.columns, values)) for values in zip(*got.columns.values())]
            got = got._replace(samples=rows, columns=None)
        assert got == expected
