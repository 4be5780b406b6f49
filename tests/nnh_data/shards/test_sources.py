from __future__ import annotations

import bz2
import gzip
import lzma
import tracemalloc

import braceexpand
import fsspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nnh_data.shards import sources
from nnh_data.shards.sources import (
    content_format,
    detect_format,
    expand_sources,
    is_local,
    name_count,
    shard_filesystem,
)


def test_brace_patterns_keep_padding_and_take_lists():
    assert expand_sources("d/s-{08..10}.tar") == ["d/s-08.tar", "d/s-09.tar", "d/s-10.tar"]
    assert expand_sources(["a/{x,y}.tar", "b.tar"]) == ["a/x.tar", "a/y.tar", "b.tar"]


def test_globs_are_sorted_and_keep_the_protocol(tmp_path):
    for name in ["b.tar", "a.tar", "c.parquet"]:
        (tmp_path / name).write_bytes(b"")
    assert expand_sources(str(tmp_path / "*.tar")) == [
        str(tmp_path / n) for n in ["a.tar", "b.tar"]
    ]
    assert expand_sources(f"file://{tmp_path}/*.tar")[0] == f"file://{tmp_path}/a.tar"
    fsspec.filesystem("memory").pipe("/globbed/x-1.tar", b"")
    assert expand_sources("memory://globbed/x-*.tar") == ["memory:///globbed/x-1.tar"]
    with pytest.raises(FileNotFoundError, match="no shard matches"):
        expand_sources(str(tmp_path / "*.zip"))


def test_formats():
    assert detect_format("s3://b/x.TAR") == "tar"
    assert detect_format("x.pq") == detect_format("x.parquet") == "parquet"
    assert detect_format("x.bin", "tar") == "tar"
    with pytest.raises(ValueError, match="pass format="):
        detect_format("x.zip")
    for name in ("x.tar.gz", "x.TGZ", "s3://b/x.tar.zst"):
        with pytest.raises(ValueError, match="compressed tar is not supported"):
            detect_format(name)
    with pytest.raises(ValueError, match="format must be one of"):
        detect_format("x.tar", "zip")


def test_local_paths_are_fsspecs():
    for urls in (["/d/x.tar", "/d/y.tar/", "/", "//d//z.tar", "/d/./w.tar", "rel/x.tar"],
                 ["file:///d/v.tar", "file://rel/u.tar"]):  # fmt: skip
        fs, paths = shard_filesystem(urls)
        assert paths == [fs._strip_protocol(url) for url in urls]


def test_one_filesystem_per_source():
    fs, paths = shard_filesystem(["memory://a/x.tar", "memory://a/y.tar"])
    assert "memory" in fs.protocol and paths == ["/a/x.tar", "/a/y.tar"]
    with pytest.raises(ValueError, match="one filesystem"):
        shard_filesystem(["memory://a/x.tar", "/local/y.tar"])
    with pytest.raises(ValueError, match="at least one shard"):
        expand_sources([])


@pytest.mark.parametrize(
    ("url", "local"),
    [("data/a.tar", True), ("/abs/a.tar", True), ("file:///abs/a.tar", True),
     ("memory://a.tar", True), ("s3://b/a.tar", False), ("gs://b/a.tar", False),
     ("https://host/a.tar", False)],
)  # fmt: skip
def test_is_local_tells_files_read_in_place(url, local):
    assert is_local(url) is local


PATTERNS = [
    "a{1..3}b", "{a..c}", "index.html{,.backup}", "python{2.{5..7},3.{2,3}}", "{07..10}",
    "{a..g..2}", "{4..1}", "{2..-1}", "x{Z..a}", "x{z..A}", "{a,b}{1..10..3}{,x,{y,z{1..2}}}",
    "plain", "{}", "{,}", "{a}", "x{a,{b}}", "{5..5..2}", "{1..10..0}", r"a\{1,2\}",
    r"{a\,b,c}", r"a\b.tar", "s-{000000..000999}.tar", "{-05..3..2}x", "{0..-010}", "a{1..2}{3..4}",
    r"{1..2}\x", "{1..2..-1}", "{01..1}", "{-0..3}",
]  # fmt: skip


@pytest.mark.parametrize("pattern", PATTERNS)
def test_name_count_is_the_length_of_the_expansion(pattern):
    assert name_count(pattern) == len(list(braceexpand.braceexpand(pattern)))


@pytest.mark.parametrize("pattern", PATTERNS)
def test_brace_patterns_expand_as_braceexpand_does(pattern):
    """The fast path for plain names and one integer range gives braceexpand's names."""
    folder = "/no-such-folder/"  # plain names are kept without a listing
    assert expand_sources(folder + pattern) == list(braceexpand.braceexpand(folder + pattern))


@pytest.mark.parametrize("pattern", ["{1..2}}", "}{1..2}", "a}b"])
def test_unbalanced_braces_are_refused(pattern):
    with pytest.raises(ValueError, match="nbalanced"):
        expand_sources(pattern)


@pytest.mark.timeout(20)
def test_a_huge_brace_pattern_is_refused_before_it_fills_memory(monkeypatch):
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as caught:
            expand_sources("s3://bucket/x-{0..999999999}.tar")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(caught.value) == (
        "source 's3://bucket/x-{0..999999999}.tar' expands to 1,000,000,000 names, more than "
        "MAX_SHARDS=1,000,000; check its braces (e.g. {000000..000063}), or pass the shard URLs "
        "or a glob"
    )
    assert peak < 1 << 20
    monkeypatch.setattr(sources, "MAX_SHARDS", 10)
    assert len(expand_sources("s3://b/{0..9}.tar")) == 10
    with pytest.raises(ValueError, match="expands to 11 names, more than MAX_SHARDS=10"):
        expand_sources("s3://b/{0..10}.tar")


@pytest.mark.parametrize(
    ("head", "what"),
    [
        (gzip.compress(b"x", mtime=0),  # mtime: the same test id in every xdist worker
         "gzip-compressed, not supported (nnh seeks to samples by byte offset, which a compressed "
         "stream cannot do): decompress it with gunzip"),  # fmt: skip
        (bz2.compress(b"x"), "bzip2-compressed, not supported"),
        (lzma.compress(b"x"), "xz-compressed, not supported"),
        (b"(\xb5/\xfd\x00\x00", "zstd-compressed, not supported"),
        (b"PK\x03\x04rest", "a zip archive"),
        (b"PAR1\x15\x04", "a Parquet file"),
        (bytes(257) + b"ustar\x0000", "a tar file"),
        (b"just text", None),
        (b"", None),
    ],
)
def test_content_format_tells_what_the_first_bytes_say(head, what):
    found = content_format(head)
    assert found == what if what is None else found.startswith(what)


@given(
    first=st.integers(-30, 30), last=st.integers(-30, 30), step=st.integers(-3, 3),
    pad=st.sampled_from(["", "0", "00"]), with_step=st.booleans(),
)  # fmt: skip
def test_integer_ranges_expand_as_braceexpand_does(first, last, step, pad, with_step):
    """Zero padding, signs and steps of the fast path for one integer range."""
    ends = [f"-{pad}{-n}" if n < 0 else f"{pad}{n}" for n in (first, last)]
    expr = "..".join(ends) + (f"..{step}" if with_step else "")
    pattern = f"/no-such-folder/s-{{{expr}}}.tar"
    assert expand_sources(pattern) == list(braceexpand.braceexpand(pattern))


def test_a_save_to_disk_folder_is_its_arrow_files_in_state_order(tmp_path):
    import json

    folder = tmp_path / "saved"
    folder.mkdir()
    names = ["data-00001-of-00002.arrow", "data-00000-of-00002.arrow"]  # not sorted
    for name in names + ["cache-x.arrow"]:  # a stray file the state does not list
        (folder / name).write_bytes(b"")
    state = {"_data_files": [{"filename": name} for name in names]}
    (folder / "state.json").write_text(json.dumps(state))
    (folder / "dataset_info.json").write_text("{}")
    assert expand_sources(str(folder)) == [f"{folder}/{name}" for name in names]
    assert [detect_format(url) for url in expand_sources(str(folder))] == ["arrow", "arrow"]


def test_a_saved_dataset_dict_asks_for_one_split(tmp_path):
    (tmp_path / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    with pytest.raises(ValueError, match=r"DatasetDict.*splits \['test', 'train'\].*/test'"):
        expand_sources(str(tmp_path))


def test_arrow_files_in_a_folder_and_by_their_magic(tmp_path):
    (tmp_path / "a.arrow").write_bytes(b"ARROW1\x00\x00")
    assert expand_sources(str(tmp_path)) == [f"{tmp_path}/a.arrow"]
    assert content_format(b"ARROW1\x00\x00") == "an Arrow IPC file"
