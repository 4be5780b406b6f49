"""ParquetReader: any row range of a Parquet shard as columns, its types, its keys, the open
file it keeps, and the errors that name the shard and where."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nnh_data.errors import ShardError, StaleIndexError
from nnh_data.shards.parquet import ParquetReader
from nnh_data.shards.reading import build_shard_index


@pytest.fixture
def shard(tmp_path):
    """ids 0-24 in row groups of 10, a string column and a nullable float column."""
    path = str(tmp_path / "part-0.parquet")
    values = [None if i % 7 == 3 else i / 2 for i in range(25)]
    table = pa.table({"id": pa.array(range(25), pa.int64()), "text": [f"r{i}" for i in range(25)],
                      "score": pa.array(values, pa.float64())})  # fmt: skip
    pq.write_table(table, path, row_group_size=10)
    return build_shard_index(path).shards[0]


@pytest.mark.parametrize(
    ("start", "stop"), [(0, 25), (0, 1), (3, 17), (10, 20), (19, 21), (24, 25)]
)
def test_any_row_range_across_row_groups(shard, start, stop):
    columns = ParquetReader().read(shard, start, stop)
    assert columns["id"].tolist() == list(range(start, stop))
    assert columns["text"] == [f"r{i}" for i in range(start, stop)]
    assert columns["__key__"] == [f"part-0/{i}" for i in range(start, stop)]


def test_numeric_columns_are_numpy_unless_nullable(shard):
    assert shard.nullable == ("score",)  # from the footer statistics
    columns = ParquetReader().read(shard, 0, 5)
    assert isinstance(columns["id"], np.ndarray) and columns["id"].dtype == np.int64
    assert columns["score"] == [0.0, 0.5, 1.0, None, 2.0]  # nullable: Python values, None
    as_dataset = ParquetReader(nullable=["id", "score"]).read(shard, 0, 2)
    assert as_dataset["id"] == [0, 1]  # the dataset's union of nullable columns wins
    plain = ParquetReader(nullable=[])
    with pytest.raises(StaleIndexError, match="a null the index did not list") as caught:
        plain.read(shard, 0, 5)
    assert caught.value.position == "column 'score'"


def test_a_key_column_is_the_key(tmp_path):
    path = str(tmp_path / "k.parquet")
    pq.write_table(pa.table({"__key__": ["a", "b", "c"], "v": [1, 2, 3]}), path)
    info = build_shard_index(path).shards[0]
    assert ParquetReader().read(info, 1, 3)["__key__"] == ["b", "c"]


def test_the_open_file_is_kept_between_reads_and_let_go(shard, monkeypatch):
    opened = []
    real = pq.ParquetFile

    def counting(*args, **kwargs):
        opened.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(pq, "ParquetFile", counting)
    reader = ParquetReader()
    for start in range(0, 25, 5):
        reader.read(shard, start, start + 5)
    assert len(opened) == 1
    reader.close()
    reader.read(shard, 0, 1)
    assert len(opened) == 2


def test_reads_an_open_copy_instead_of_the_url(shard, tmp_path):
    with open(shard.url, "rb") as copy:
        columns = ParquetReader().read(shard, 8, 12, copy)
    assert columns["id"].tolist() == [8, 9, 10, 11]


def test_a_rewritten_file_is_a_stale_index(shard):
    pq.write_table(pa.table({"id": list(range(30))}), shard.url, row_group_size=10)
    with pytest.raises(StaleIndexError) as caught:
        ParquetReader().read(shard, 0, 5)
    assert caught.value.position == "footer"
    assert "the file has 30 rows in 3 row groups, the index 25 rows in 3" in str(caught.value)


def test_an_unreadable_row_group_names_the_shard_and_the_row_group(shard):
    page = pq.read_metadata(shard.url).row_group(1).column(0).data_page_offset
    with open(shard.url, "r+b") as f:
        f.seek(page)
        f.write(b"\xff" * 16)
    reader = ParquetReader()
    assert reader.read(shard, 0, 10)["id"].tolist() == list(range(10))  # group 0 is whole
    with pytest.raises(ShardError) as caught:
        reader.read(shard, 5, 15)
    assert (caught.value.url, caught.value.position) == (shard.url, "row group 0 (sample 5)")
    assert "unreadable Parquet file" in caught.value.reason
    with pytest.raises(ShardError, match=r"row group 1 \(sample 12\)"):
        reader.read(shard, 12, 14)


def test_arrow_columns_across_row_groups_and_decoded_batches(tmp_path):
    """Batches read Arrow columns in decoded batches of 1,024 rows joined: any range gives the
    values of the per-sample read (nulls kept), long bytes as views, short text as read,
    numbers as numpy."""
    path = str(tmp_path / "wide.parquet")
    n = 2500
    blobs = [None if i % 11 == 5 else bytes([i % 256]) * (i % 200) for i in range(n)]
    pq.write_table(pa.table({"id": pa.array(range(n), pa.int64()), "blob": blobs,
                             "text": [f"row {i}" * (i % 4) for i in range(n)]}),
                   path, row_group_size=1000)  # fmt: skip
    info = build_shard_index(path).shards[0]
    arrow, plain = ParquetReader(arrow=True), ParquetReader()
    for start, stop in [(0, n), (900, 2300), (1024, 2048), (999, 1001)]:
        columns, values = arrow.read(info, start, stop), plain.read(info, start, stop)
        assert columns["id"].tolist() == values["id"].tolist() == list(range(start, stop))
        assert columns["blob"].type == pa.binary_view() and columns["text"].type == pa.string()
        assert columns["blob"].to_pylist() == values["blob"] == blobs[start:stop]
        assert columns["text"].to_pylist() == values["text"]
    empty = arrow.read(info, 7, 7)
    assert empty["id"].size == 0 and len(empty["blob"]) == 0 and empty["__key__"] == []


def test_a_file_url_reads_like_the_plain_path(shard):
    """A plain path is opened by pyarrow itself, a URL through fsspec: the same rows."""
    from dataclasses import replace

    as_url = replace(shard, url=f"file://{shard.url}")
    for reader in (ParquetReader(), ParquetReader(arrow=True)):
        plain, url = reader.read(shard, 3, 17), reader.read(as_url, 3, 17)
        assert url["id"].tolist() == plain["id"].tolist() == list(range(3, 17))
        assert list(url["text"]) == list(plain["text"])
