from __future__ import annotations

import fsspec
import pytest

from nnh_data.sources import detect_format, expand_sources, is_local, shard_filesystem


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
