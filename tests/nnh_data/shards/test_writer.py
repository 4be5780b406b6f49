from __future__ import annotations

import os
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnh_data.shards.reading import build_shard_index, iter_shard_samples
from nnh_data.shards.writer import (
    count_directory_samples,
    directory_samples,
    parquet_samples,
    write_shards,
)


def numbered(n: int, size: int = 100) -> list[dict]:
    return [{"__key__": f"{i:05d}", "bin": bytes([i % 256]) * size, "cls": i} for i in range(n)]


def read_back(index) -> list[dict]:
    return [sample for info in index.shards for sample in iter_shard_samples(info)]


def test_written_shards_read_back_with_nnh_and_webdataset(tmp_path):
    index = write_shards(numbered(10), str(tmp_path / "s-%03d.tar"), max_count=4)
    assert [info.num_samples for info in index.shards] == [4, 4, 2]
    expected = [
        {"__key__": f"{i:05d}", "bin": bytes([i]) * 100, "cls": b"%d" % i} for i in range(10)
    ]
    assert read_back(index) == expected
    theirs = list(wds.WebDataset(str(tmp_path / "s-{000..002}.tar"), shardshuffle=False))
    assert [{k: s[k] for k in ("__key__", "bin", "cls")} for s in theirs] == expected


def test_members_are_plain_ustar_unless_a_name_needs_pax(tmp_path):
    long_key = "k" * 120
    samples = [{"__key__": "a", "txt": "x"}, {"__key__": long_key, "txt": "y"}]
    (info,) = write_shards(samples, str(tmp_path / "s-%d.tar")).shards
    with tarfile.open(info.url) as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == ["a.txt", f"{long_key}.txt"]
    assert [m.mtime for m in members] == [0, 0]
    assert members[0].pax_headers == {} and members[1].pax_headers == {"path": f"{long_key}.txt"}
    assert [s["__key__"] for s in read_back(build_shard_index(info.url))] == ["a", long_key]


def test_max_bytes_splits_shards(tmp_path):
    # a sample is 2560 bytes (two headers, data padded to 512), a shard ends with 1024 zeros
    index = write_shards(numbered(6, size=1000), str(tmp_path / "s-%d.tar"), max_bytes=6200)
    assert [info.num_samples for info in index.shards] == [2, 2, 2]
    assert all(os.path.getsize(info.url) == 6144 for info in index.shards)


def test_index_is_written_with_the_shards_and_reused(tmp_path):
    written = write_shards(numbered(5), str(tmp_path / "s-%02d.tar"), max_count=2)
    sidecar = tmp_path / "nnh-index.json"
    assert written.path == str(sidecar)
    mtime = os.stat(sidecar).st_mtime_ns
    assert build_shard_index(str(tmp_path / "s-{00..02}.tar")) == written
    assert os.stat(sidecar).st_mtime_ns == mtime
    assert sorted(os.listdir(tmp_path)) == ["nnh-index.json", "s-00.tar", "s-01.tar", "s-02.tar"]


def test_a_failing_source_leaves_no_partial_shard(tmp_path):
    def broken():
        yield from numbered(3)
        raise RuntimeError("source failed")

    with pytest.raises(RuntimeError, match="source failed"):
        write_shards(broken(), str(tmp_path / "s-%d.tar"), max_count=2)
    assert sorted(os.listdir(tmp_path)) == ["s-0.tar"]


@pytest.mark.parametrize(
    "sample, match",
    [
        ({"txt": "x"}, "__key__"),
        ({"__key__": "a.b", "txt": "x"}, "read back"),
        ({"__key__": "a", "TXT": "x"}, "read back"),
        ({"__key__": "a", "bin": 3}, "no handler"),
    ],
)
def test_samples_that_would_not_read_back_are_refused(tmp_path, sample, match):
    with pytest.raises(ValueError, match=match):
        write_shards([sample], str(tmp_path / "s-%d.tar"))


def test_repeated_key_and_bad_pattern_are_refused(tmp_path):
    with pytest.raises(ValueError, match="share __key__"):
        write_shards([{"__key__": "a", "x": b""}] * 2, str(tmp_path / "s-%d.tar"))
    with pytest.raises(ValueError, match="pattern"):
        write_shards(numbered(1), str(tmp_path / "s.tar"))


def test_write_to_an_fsspec_url():
    index = write_shards(numbered(3), "memory://written/s-%d.tar", max_count=2)
    assert [info.url for info in index.shards] == [
        "memory://written/s-0.tar",
        "memory://written/s-1.tar",
    ]
    assert len(read_back(build_shard_index("memory://written/s-*.tar"))) == 3


names = st.text(alphabet="abcdefghij0123456789_-", min_size=1, max_size=12).filter(
    lambda name: not name.startswith("_")
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    samples=st.lists(
        st.dictionaries(names, st.binary(max_size=1200), min_size=1, max_size=3),
        max_size=12,
    ),
    max_count=st.integers(1, 5),
)
def test_write_then_read_round_trip(tmp_path_factory, samples, max_count):
    keyed = [{"__key__": f"{i:04d}", **fields} for i, fields in enumerate(samples)]
    folder = tmp_path_factory.mktemp("round")
    index = write_shards(keyed, str(folder / "s-%04d.tar"), max_count=max_count, encoder=False)
    assert read_back(index) == keyed
    if keyed:
        assert build_shard_index(str(folder / "s-*.tar"), rebuild=True) == index


def test_directory_and_parquet_samples(tmp_path):
    folder = tmp_path / "files" / "sub"
    folder.mkdir(parents=True)
    for name, data in [("b.txt", b"B"), ("a.jpg", b"J"), ("a.cls", b"1"), ("README", b"")]:
        (folder / name).write_bytes(data)
    assert list(directory_samples(str(tmp_path / "files"))) == [
        {"__key__": "sub/a", "cls": b"1", "jpg": b"J"},
        {"__key__": "sub/b", "txt": b"B"},
    ]
    table = pa.table(
        {"label": [1, None], "text": ["x", "y"], "raw": [b"r", b"s"], "tags": [[1, 2], None],
         "score": [0.5, 1.5], "meta": [{"a": 1}, {"a": 2}]}
    )  # fmt: skip
    pq.write_table(table, tmp_path / "t.parquet")
    assert list(parquet_samples(str(tmp_path / "t.parquet"))) == [
        {"__key__": "t/0", "label.cls": b"1", "text.txt": b"x", "raw": b"r",
         "tags.json": b"[1, 2]", "score.json": b"0.5", "meta.json": b'{"a": 1}'},
        {"__key__": "t/1", "text.txt": b"y", "raw": b"s", "score.json": b"1.5",
         "meta.json": b'{"a": 2}'},
    ]  # fmt: skip


@pytest.mark.parametrize("key", ["../../x", "/etc/x", "a/../../x", "a/..", "..", "a\0b"])
def test_keys_that_would_leave_the_extraction_folder_are_refused(tmp_path, key):
    with pytest.raises(ValueError) as caught:
        write_shards([{"__key__": key, "txt": "x"}], str(tmp_path / "s-%d.tar"))
    assert str(caught.value) == (
        f"sample key {key!r} is not a safe relative path (it starts with '/', has a '..' part "
        "or a NUL): tar tools would extract it outside their folder, so it is refused rather "
        "than renamed; give the sample a relative key"
    )
    assert not list(tmp_path.glob("*.tar"))


def test_relative_keys_with_folders_and_dots_are_written(tmp_path):
    samples = [{"__key__": k, "txt": "x"} for k in ("a/b/1", "./c/2", "d..e/3", "..f/4")]
    assert [s["__key__"] for s in read_back(write_shards(samples, str(tmp_path / "s-%d.tar")))] \
        == ["a/b/1", "./c/2", "d..e/3", "..f/4"]  # fmt: skip


def test_directory_samples_skip_symbolic_links_unless_asked(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"S")
    (outside / "more").mkdir()
    (outside / "more" / "deep.txt").write_bytes(b"D")
    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"A")
    (folder / "b.txt").symlink_to(outside / "secret.txt")
    (folder / "linked").symlink_to(outside / "more")
    message = (
        f"skipped 2 symbolic link(s) in {str(folder)!r}, e.g. {str(folder / 'linked')!r}: a "
        "link may lead out of the folder; pass follow_symlinks=True (nnh-data convert "
        "--follow-symlinks) to read what they point to"
    )
    with pytest.warns(UserWarning) as caught:
        assert list(directory_samples(str(folder))) == [{"__key__": "a", "txt": b"A"}]
    assert [str(w.message) for w in caught] == [message]
    with pytest.warns(UserWarning, match="skipped 2 symbolic link"):
        assert count_directory_samples(str(folder)) == 1
    followed = list(directory_samples(str(folder), follow_symlinks=True))
    assert followed == [{"__key__": "a", "txt": b"A"}, {"__key__": "b", "txt": b"S"},
                        {"__key__": "linked/deep", "txt": b"D"}]  # fmt: skip
