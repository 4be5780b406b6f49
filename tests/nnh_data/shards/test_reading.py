from __future__ import annotations

import io
import json
import os
import tarfile
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds

from nnh_data.errors import ShardError
from nnh_data.shards import reading as shards
from nnh_data.shards.reading import (
    ShardReader,
    build_shard_index,
    decode_shard_range,
    fetch_shard_range,
    iter_shard_samples,
    split_shard_range,
)
from tests.support import sample_bytes


def read_all(index) -> list[dict]:
    return [sample for info in index.shards for sample in iter_shard_samples(info)]


@pytest.mark.parametrize("pax", [True, False])
def test_tar_index_counts_and_reads_every_sample(tar_shards, pax):
    paths = tar_shards([3, 0, 5, 1], pax=pax)
    index = build_shard_index(paths)
    assert [info.num_samples for info in index.shards] == [3, 0, 5, 1]
    assert index.offsets().tolist() == [0, 3, 3, 8, 9]
    samples = read_all(index)
    assert [s["__key__"] for s in samples] == [f"{g:08d}" for g in range(9)]
    assert samples[4] == {"__key__": "00000004", "cls": b"4", "bin": sample_bytes(4, 16)}


def test_tar_ranges_match_the_whole_shard(tar_shards):
    (path,) = tar_shards([10], size=700)
    info = build_shard_index(path).shards[0]
    every = list(iter_shard_samples(info))
    for start, stop in [(0, 10), (3, 4), (9, 10), (5, 5), (2, 8)]:
        payload = fetch_shard_range(info, start, stop)
        assert list(decode_shard_range(info, payload, start, stop)) == every[start:stop]


def test_fetch_block_reads_into_a_buffer_only_once_its_views_are_let_go(tar_shards):
    (path,) = tar_shards([40], size=3000)
    info = build_shard_index(path).shards[0]
    reader = ShardReader()
    first = reader.fetch_block(info, 0, 10)
    second = reader.fetch_block(info, 10, 20)  # the first is held: another buffer
    assert bytes(first) == fetch_shard_range(info, 0, 10)
    buffers = id(first.obj), id(second.obj)
    assert buffers[0] != buffers[1]
    held = first[100:200]  # a view of the view holds the buffer too
    kept = bytes(held)
    del first
    third = reader.fetch_block(info, 20, 30)
    assert id(third.obj) not in buffers and bytes(held) == kept
    del held, second
    fourth = reader.fetch_block(info, 30, 40)  # the shard's last block, with the end marker
    assert id(fourth.obj) in buffers  # a buffer let go of is read into again
    assert bytes(fourth) == fetch_shard_range(info, 30, 40)
    assert bytes(third) == fetch_shard_range(info, 20, 30)
    assert type(reader.fetch(info, 0, 10)) is bytes  # fetch gives bytes of its own


def test_fetch_block_reads_a_large_block_into_memory_of_its_own(tar_shards, monkeypatch):
    # a reused buffer keeps its size for the pass: a block of one large sample is not put in one
    monkeypatch.setattr(shards, "_REUSED_BYTES", 20_000)
    (path,) = tar_shards([6], size=9000)
    info = build_shard_index(path).shards[0]
    reader = ShardReader()
    small, large = reader.fetch_block(info, 0, 1), reader.fetch_block(info, 1, 4)
    assert isinstance(small, memoryview) and type(large) is bytes
    assert large == fetch_shard_range(info, 1, 4) and len(reader._buffers) == 1


def test_split_shard_range_bounds_bytes(tar_shards, parquet_shards):
    (tar,) = tar_shards([10], size=1000)
    info = build_shard_index(tar).shards[0]
    pieces = split_shard_range(info, 1, 9, max_bytes=5000)
    assert pieces[0][0] == 1 and pieces[-1][1] == 9
    assert all(info.offsets[b] - info.offsets[a] <= 5000 for a, b in pieces)
    assert split_shard_range(info, 0, 3, max_bytes=1) == [(0, 1), (1, 2), (2, 3)]
    (table,) = parquet_shards([10], row_group_size=4)
    info = build_shard_index(table).shards[0]
    assert info.offsets.tolist() == [0, 4, 8, 10]
    assert split_shard_range(info, 2, 9, max_bytes=1) == [(a, a + 1) for a in range(2, 9)]
    assert split_shard_range(info, 2, 9) == [(2, 9)]  # all rows fit the default bytes
    per_row = max(info.size, info.data_bytes) / 10
    nine_rows = int(per_row * 9) + 1  # whole row groups when they fit
    assert split_shard_range(info, 0, 10, max_bytes=nine_rows) == [(0, 8), (8, 10)]
    three_rows = int(per_row * 3) + 1  # a row group larger than that is cut
    assert split_shard_range(info, 0, 10, max_bytes=three_rows) == [
        (0, 3), (3, 4), (4, 7), (7, 10)]


def test_webdataset_shardwriter_interop(tmp_path):
    pattern = str(tmp_path / "wds-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=4, verbose=0) as sink:
        for g in range(10):
            sink.write({"__key__": f"k{g}", "cls": g, "seg.png": b"x" * g, "txt": f"t{g}"})
    source = str(tmp_path / "wds-{000000..000002}.tar")
    ours = read_all(build_shard_index(source))
    theirs = list(wds.WebDataset(source, shardshuffle=False))
    assert len(ours) == 10
    for mine, reference in zip(ours, theirs):
        del reference["__url__"], reference["__local_path__"]
        assert mine == reference


def test_parquet_rows_as_samples(parquet_shards):
    paths = parquet_shards([5, 0, 7], row_group_size=3)
    index = build_shard_index(paths)
    assert [info.num_samples for info in index.shards] == [5, 0, 7]
    samples = read_all(index)
    assert [s["id"] for s in samples] == list(range(12))
    assert samples[6] == {"__key__": "part-000002/1", "id": 6, "text": "row 6"}
    info = index.shards[2]
    payload = fetch_shard_range(info, 2, 5)
    assert [s["id"] for s in decode_shard_range(info, payload, 2, 5)] == [7, 8, 9]


@pytest.mark.parametrize(("start", "stop"), [(0, 1500), (300, 1100), (255, 257), (599, 601)])
def test_parquet_ranges_across_row_groups_and_read_batches(tmp_path, start, stop):
    """Rows are read in batches smaller than a row group; any range comes out exactly."""
    path = str(tmp_path / "big.parquet")
    pq.write_table(pa.table({"id": list(range(1500))}), path, row_group_size=600)
    info = build_shard_index(path).shards[0]
    payload = fetch_shard_range(info, start, stop)
    assert payload["id"].tolist() == list(range(start, stop))
    assert [s["__key__"] for s in decode_shard_range(info, payload, start, stop)] == [
        f"big/{i}" for i in range(start, stop)
    ]


def test_parquet_key_column_is_used(tmp_path):
    path = str(tmp_path / "keys.parquet")
    pq.write_table(pa.table({"__key__": ["a", "b"], "v": [1.5, 2.5]}), path)
    assert read_all(build_shard_index(path)) == [
        {"__key__": "a", "v": 1.5},
        {"__key__": "b", "v": 2.5},
    ]


def test_brace_and_glob_sources(tar_shards, tmp_path):
    tar_shards([1, 2, 3])
    brace = build_shard_index(str(tmp_path / "shard-{000000..000002}.tar"))
    glob = build_shard_index(str(tmp_path / "shard-*.tar"))
    assert [i.url for i in brace.shards] == [i.url for i in glob.shards]
    assert glob.total_samples == 6
    with pytest.raises(FileNotFoundError, match="no shard matches"):
        build_shard_index(str(tmp_path / "nothing-*.tar"))
    with pytest.raises(ValueError, match="format"):
        build_shard_index(str(tmp_path / "shard-000000.tar"), format="zip")


def test_sidecar_is_reused_and_rebuilt_when_stale(tar_shards, tmp_path):
    paths = tar_shards([2, 3])
    first = build_shard_index(paths)
    sidecar = tmp_path / "nnh-index.json"
    assert first.path == str(sidecar)
    saved = json.loads(sidecar.read_text())
    assert set(saved["shards"]) == {"shard-000000.tar", "shard-000001.tar"}
    mtime = os.stat(sidecar).st_mtime_ns
    assert build_shard_index(paths) == first
    assert os.stat(sidecar).st_mtime_ns == mtime  # reused, not rewritten
    tar_shards([2, 5])  # shard 1 changes size
    assert [i.num_samples for i in build_shard_index(paths).shards] == [2, 5]
    assert json.loads(sidecar.read_text())["shards"]["shard-000001.tar"]["num_samples"] == 5


def test_sidecar_at_index_path(tar_shards, tmp_path):
    paths = tar_shards([2])
    index_path = str(tmp_path / "elsewhere" / "idx.json")
    os.makedirs(os.path.dirname(index_path))
    assert build_shard_index(paths, index_path=index_path).path == index_path
    assert json.loads(open(index_path).read())["shards"]


def test_truncated_tar_names_url_and_position(tar_shards):
    (path,) = tar_shards([4], size=2000)
    with open(path, "r+b") as f:
        f.truncate(5000)
    with pytest.raises(ShardError, match="truncated") as caught:
        build_shard_index(path)
    assert caught.value.url == path and "byte" in caught.value.position


def test_bad_checksum_names_url_and_position(tar_shards):
    (path,) = tar_shards([4], pax=False)
    info = build_shard_index(path).shards[0]
    with open(path, "r+b") as f:  # corrupt the name of sample 2 after indexing
        f.seek(info.offsets[2])
        f.write(b"X")
    payload = fetch_shard_range(info, 1, 4)
    with pytest.raises(ShardError, match="checksum") as caught:
        list(decode_shard_range(info, payload, 1, 4))
    assert caught.value.position == f"sample 2, byte {info.offsets[2]}"
    with pytest.raises(ShardError, match="checksum"):
        build_shard_index(path, rebuild=True)


def test_duplicate_field_is_a_shard_error(tmp_path):
    path = str(tmp_path / "dup.tar")
    with tarfile.open(path, "w") as tar:
        for name in ["a.x", "b.x", "b.x"]:
            tar.addfile(tarfile.TarInfo(name), io.BytesIO(b""))
    with pytest.raises(ShardError, match="duplicate field 'x' in sample 'b'") as caught:
        build_shard_index(path)
    assert caught.value.position == "byte 1024"


def test_unreadable_parquet_and_skip(parquet_shards, tar_shards):
    paths = parquet_shards([3, 3])
    with open(paths[1], "r+b") as f:
        f.truncate(20)
    with pytest.raises(ShardError, match="Parquet") as caught:
        build_shard_index(paths)
    assert caught.value.url == paths[1]
    with warnings.catch_warnings(record=True) as caught_warnings:
        warnings.simplefilter("always")
        index = build_shard_index(paths, on_error="skip")
    assert [i.num_samples for i in index.shards] == [3, 0]
    assert index.shards[1].error and index.shards[1].loss == "an unknown number of samples"
    lost = [str(w.message) for w in caught_warnings if "lost" in str(w.message)]
    assert lost == [f"{paths[1]}: an unknown number of samples lost, 0 indexed "
                    f"({index.shards[1].error})"]  # fmt: skip


def test_shard_error_survives_pickling_and_one_argument_construction():
    import pickle

    error = pickle.loads(pickle.dumps(ShardError("s3://b/x.tar", "byte 512", "bad")))
    assert (error.url, error.position, str(error)) == ("s3://b/x.tar", "byte 512", str(error))
    assert "byte 512" in str(error)
    assert str(ShardError("message")) == "message"
