"""Arrow IPC shards: the file and the stream format (as pyarrow and ``datasets`` write them)
indexed by record batch and read in any row range like Parquet, memory-mapped without a copy;
a stale index, a damaged file and a remote file."""

from __future__ import annotations

import fsspec
import numpy as np
import pyarrow as pa
import pytest

from nnh_data.errors import ShardError, StaleIndexError
from nnh_data.shards.arrow import ArrowReader
from nnh_data.shards.reading import ShardReader, build_shard_index, split_shard_range

ROWS, BATCH = 23, 5


def table(first: int = 0) -> pa.Table:
    ids = list(range(first, first + ROWS))
    return pa.table({
        "id": pa.array(ids, pa.int64()), "blob": [bytes([i % 256]) * 300 for i in ids],
        "n": [None if i % 4 == 1 else i for i in ids], "tags": [["a"] * (i % 3) for i in ids],
    })  # fmt: skip


def write(path, data: pa.Table, stream: bool) -> str:
    new = pa.ipc.new_stream if stream else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, new(sink, data.schema) as writer:
        for batch in data.to_batches(BATCH):
            writer.write_batch(batch)
    return str(path)


@pytest.fixture(params=["file", "stream"])
def shard(request, tmp_path):
    path = write(tmp_path / "part-0.arrow", table(), request.param == "stream")
    return build_shard_index(path).shards[0]


def test_indexed_by_record_batch_with_its_nullable_columns(shard):
    assert shard.format == "arrow" and shard.num_samples == ROWS
    assert shard.offsets.tolist() == [0, 5, 10, 15, 20, 23]
    assert shard.nullable == ("n",)  # exact: from the batches' null counts
    assert split_shard_range(shard, 3, 17) == [(3, 17)]
    assert split_shard_range(shard, 3, 17, max_bytes=1) == [(a, a + 1) for a in range(3, 17)]


@pytest.mark.parametrize(("start", "stop"), [(0, 23), (0, 1), (3, 17), (5, 10), (22, 23)])
@pytest.mark.parametrize("arrow", [False, True])
def test_any_row_range_as_columns(shard, start, stop, arrow):
    columns = ArrowReader(arrow=arrow).read(shard, start, stop)
    want = table().slice(start, stop - start)
    assert columns["id"].tolist() == list(range(start, stop))
    assert isinstance(columns["id"], np.ndarray)
    for name in ("blob", "n", "tags"):
        got = columns[name].to_pylist() if arrow else columns[name]
        assert got == want.column(name).to_pylist(), name
    assert columns["__key__"] == [f"part-0/{i}" for i in range(start, stop)]


def test_a_local_shard_is_mapped_not_copied(tmp_path):
    path = write(tmp_path / "big.arrow", pa.table({"b": [b"x" * 4096] * 512}), stream=True)
    info = build_shard_index(path).shards[0]
    before = pa.total_allocated_bytes()
    columns = ArrowReader(arrow=True).read(info, 0, 512)  # views of the values, as batches get
    assert pa.total_allocated_bytes() - before < 64 << 10  # the 2 MiB of values lie in the map
    assert columns["b"][511].as_py() == b"x" * 4096


def test_a_rewritten_shard_is_stale_and_a_damaged_one_names_itself(tmp_path):
    path = write(tmp_path / "s.arrow", table(), stream=False)
    info = build_shard_index(path).shards[0]
    write(tmp_path / "s.arrow", table().slice(0, 12), stream=False)
    with pytest.raises(StaleIndexError, match="12 rows in 3 record batches"):
        ArrowReader().read(info, 0, 5)
    (tmp_path / "bad.arrow").write_bytes(b"ARROW1\x00\x00" + b"\x07" * 100)
    with pytest.raises(ShardError, match="bad.arrow") as caught:
        build_shard_index(str(tmp_path / "bad.arrow"))
    assert "Arrow IPC" in str(caught.value)


def test_a_remote_shard_is_read_whole(tmp_path):
    data = open(write(tmp_path / "r.arrow", table(), stream=True), "rb").read()
    with fsspec.open("memory://hf/r.arrow", "wb") as f:
        f.write(data)
    info = build_shard_index("memory://hf/r.arrow").shards[0]
    columns = ShardReader().fetch(info, 7, 12)
    assert columns["id"].tolist() == list(range(7, 12))


def test_datasets_arrow_writer_files(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the datasets package (dev extra)")
    from datasets.arrow_writer import ArrowWriter

    path = str(tmp_path / "w.arrow")
    with ArrowWriter(path=path, writer_batch_size=4) as writer:
        for i in range(10):
            writer.write({"x": i, "s": None if i == 3 else str(i)})
        writer.finalize()
    info = build_shard_index(path).shards[0]
    assert info.offsets.tolist() == [0, 4, 8, 10] and "s" in info.nullable
    assert ArrowReader().read(info, 2, 9)["s"] == ["2", None, "4", "5", "6", "7", "8"]
    assert datasets.Dataset.from_file(path)["x"] == list(range(10))
