from __future__ import annotations

import errno
import json
import logging
import re
import tarfile
import warnings

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem
from hypothesis import given
from hypothesis import strategies as st

from nnh_data import ShardedStreamingDataset
from nnh_data.errors import ShardError
from nnh_data.shards.index import ShardInfo, decode_offsets, encode_offsets
from nnh_data.shards.reading import build_shard_index


@given(st.lists(st.integers(0, 2**40), max_size=50), st.sampled_from(["tar", "parquet"]))
def test_offsets_round_trip(steps, format):
    unit = 512 if format == "tar" else 1
    offsets = np.cumsum([0, *steps], dtype=np.int64) * unit
    assert decode_offsets(encode_offsets(offsets, format), format).tolist() == offsets.tolist()


def test_seek_text_is_short_and_offsets_are_checked():
    offsets = [0, *range(4608, 4608 * 1001, 4608)]  # 1000 samples of 9 blocks
    info = ShardInfo.from_offsets("s.tar", "tar", offsets, size=-1)
    assert info.num_samples == 1000 and len(info.seek) < 1400
    assert info.offsets.tolist() == offsets
    with pytest.raises(ValueError, match="do not match 999 samples"):
        _ = ShardInfo("s.tar", "tar", 999, info.seek).offsets
    with pytest.raises(ValueError, match="format"):
        ShardInfo("s.zip", "zip", 0)


def test_sidecar_keeps_other_shard_sets_and_serves_subsets(tar_shards, tmp_path):
    train = tar_shards([2, 3], name="train")
    val = tar_shards([4], name="val")
    build_shard_index(train)
    build_shard_index(val)
    saved = json.loads((tmp_path / "nnh-index.json").read_text())["shards"]
    assert sorted(saved) == ["train-000000.tar", "train-000001.tar", "val-000000.tar"]
    subset = build_shard_index(train[1:])
    assert subset.shards[0].num_samples == 3


def test_infos_from_the_sidecar_equal_those_of_a_scan(tar_shards, tmp_path):
    """ShardInfos rebuilt from sidecar entries (without the dataclass's __init__) are the
    scanned ones: equal, hashable, their offsets decoded."""
    urls = tar_shards([2, 3])
    pq.write_table(pa.table({"x": [1, None, 3]}), tmp_path / "p.parquet", row_group_size=2)
    for source in (urls, str(tmp_path / "p.parquet")):
        scanned = build_shard_index(source, rebuild=True)
        cached = build_shard_index(source)
        assert cached == scanned and hash(cached) == hash(scanned)
        offsets = [[info.offsets.tolist() for info in i.shards] for i in (cached, scanned)]
        assert offsets[0] == offsets[1]
    assert cached.shards[0].nullable == ("x",)


@pytest.mark.parametrize("text", ["{not json", '{"version": 1, "shards": {}}'])
def test_unusable_sidecar_is_rebuilt_with_a_warning(tar_shards, tmp_path, text):
    paths = tar_shards([2])
    (tmp_path / "nnh-index.json").write_text(text)
    with pytest.warns(UserWarning, match="ignoring"):
        index = build_shard_index(paths)
    assert index.total_samples == 2
    assert json.loads((tmp_path / "nnh-index.json").read_text())["version"] == 3


def test_missing_shard_is_named(tar_shards, tmp_path):
    paths = tar_shards([1])
    with pytest.raises(FileNotFoundError, match="gone.tar"):
        build_shard_index([*paths, str(tmp_path / "gone.tar")])


class ReadOnlyFileSystem(LocalFileSystem):
    """Local files behind ``readonly://``, refusing every write as a read-only mount does (the
    tests run as root, whom file modes do not stop)."""

    protocol = ("readonly",)

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("readonly://"))

    def _refuse(self, *args, **kwargs):
        raise PermissionError(errno.EROFS, "Read-only file system")

    pipe_file = mv = makedirs = rm_file = touch = _refuse

    def _open(self, path, mode="rb", **kwargs):
        if "r" not in mode:
            self._refuse()
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("readonly", ReadOnlyFileSystem, clobber=True)


def test_a_read_only_folder_is_read_with_its_index_in_memory(tar_shards, tmp_path):
    tar_shards([3, 4])
    folder = f"readonly://{tmp_path}"
    message = (
        f"could not save the shard index to 'readonly://{tmp_path}/nnh-index.json' ([Errno 30] "
        "Read-only file system); it is kept in memory for this process only, so every open "
        "scans the shards again: pass index_path= a writable file (e.g. on local disk) to keep it"
    )
    with pytest.warns(UserWarning, match=re.escape(message)):
        ds = ShardedStreamingDataset(folder, shuffle=False)
    assert [s["__key__"] for s in ds] == [f"{g:08d}" for g in range(7)]
    assert not (tmp_path / "nnh-index.json").exists()
    elsewhere = tmp_path / "local" / "index.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # kept where it was asked to go: nothing to say
        assert len(ShardedStreamingDataset(folder, index_path=str(elsewhere))) == 7
    saved = json.loads(elsewhere.read_text())["shards"]
    assert sorted(saved) == [f"{folder}/shard-00000{i}.tar" for i in range(2)]


def test_writing_the_sidecar_beside_the_shards_is_said_once(tar_shards, tmp_path, caplog):
    urls = tar_shards([2, 3])
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, "nnh_data.shards.index"):
        warnings.simplefilter("error")  # information is logged, not warned
        build_shard_index(urls)
    assert caplog.messages == [
        f"wrote the shard index {str(tmp_path / 'nnh-index.json')!r} beside the shards (their "
        "sample counts and seek positions, reused while they are unchanged); pass index_path= "
        "to keep it elsewhere, e.g. for a read-only or shared folder"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_shard_index(urls)  # reused
        build_shard_index(tar_shards([2, 3, 4]))  # a sidecar that exists is updated silently


def test_a_damaged_shard_is_recorded_in_the_sidecar_and_reported_again(tar_shards, tmp_path):
    urls = tar_shards([3, 2], pax=False)
    with tarfile.open(urls[0]) as tar:
        at = tar.getmembers()[2].offset  # the first header of sample 1
    with open(urls[0], "r+b") as f:
        f.seek(at + 148)
        f.write(b"7777777\0")
    message = f"{urls[0]}: 1 sample lost, 2 indexed (bad tar header checksum at byte {at})"
    with pytest.warns(UserWarning, match=re.escape(message)):
        index = build_shard_index(urls, on_error="skip")
    info = index.shards[0]
    assert (info.num_samples, info.lost, info.lost_exact, info.loss) == (2, 1, True, "1 sample")
    assert info.gaps == ((at, at + 2048),)  # sample 1: two members of a header and a block
    saved = json.loads((tmp_path / "nnh-index.json").read_text())["shards"]["shard-000000.tar"]
    assert {k: saved[k] for k in ("error", "lost", "lost_exact", "gaps")} == {
        "error": info.error, "lost": 1, "lost_exact": True, "gaps": [[at, at + 2048]]}
    with pytest.warns(UserWarning, match=re.escape(message)):
        assert build_shard_index(urls, on_error="skip") == index  # from the sidecar
    with pytest.raises(ShardError, match=re.escape(f"bad tar header checksum (at byte {at})")):
        build_shard_index(urls)  # on_error="raise" scans the damaged shard again


def test_local_stats_are_what_the_fsspec_listing_gives(tmp_path):
    """file_stats stats local files with os.stat: the same sizes and versions as
    fsspec's listing (links followed), so sidecars written either way keep matching."""
    import os

    from fsspec.implementations.local import LocalFileSystem

    from nnh_data.shards.index import file_stats, file_version

    for i, size in enumerate([0, 5, 1000]):
        (tmp_path / f"s-{i}.tar").write_bytes(b"x" * size)
    os.symlink(tmp_path / "s-2.tar", tmp_path / "link.tar")
    os.symlink(tmp_path / "gone.tar", tmp_path / "dangling.tar")
    fs = LocalFileSystem()
    names = ["s-0.tar", "s-1.tar", "s-2.tar", "link.tar"]
    paths = [fs._strip_protocol(str(tmp_path / n)) for n in names]
    expected = [(fs.info(p)["size"], file_version(fs.info(p))) for p in paths]
    assert file_stats(fs, paths) == expected
    with pytest.raises(FileNotFoundError, match="dangling.tar"):
        file_stats(fs, [fs._strip_protocol(str(tmp_path / "dangling.tar"))])
