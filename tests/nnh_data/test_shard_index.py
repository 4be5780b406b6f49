from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nnh_data.shard_index import ShardInfo, decode_offsets, encode_offsets
from nnh_data.shards import build_shard_index


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


def test_local_stats_are_what_the_fsspec_listing_gives(tmp_path):
    """file_stats lists a local folder with os.scandir: the same sizes and versions as
    fsspec's listing (links followed), so sidecars written either way keep matching."""
    import os

    from fsspec.implementations.local import LocalFileSystem

    from nnh_data.shard_index import file_stats, file_version

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
