"""Hostile Parquet shards: shards whose column types differ are named when indexed (the shards
and the column), never read as samples or batches of mixed types."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nnh_data import ShardedStreamingDataset, build_shard_index, streaming_loader

pytestmark = pytest.mark.timeout(60)


def _write(path, **columns) -> str:
    pq.write_table(pa.table(columns), path)
    return str(path)


@pytest.mark.parametrize("mode", ["index", "samples", "batches"])
def test_shards_whose_column_types_differ_are_named(mode, tmp_path):
    a = _write(tmp_path / "p-0.parquet", id=pa.array([1, 2], pa.int64()), text=["a", "b"])
    b = _write(tmp_path / "p-1.parquet", id=["3", "4"], text=["c", "d"])
    message = f"column 'id': {a} holds int64, {b} holds string"
    with pytest.raises(ValueError, match=message):
        if mode == "index":
            build_shard_index([a, b])
        else:
            ds = ShardedStreamingDataset([a, b], shuffle=False)
            list(streaming_loader(ds, 2) if mode == "batches" else ds)


def test_all_null_columns_column_order_and_own_columns_are_no_difference(tmp_path):
    """A column of type null (all null in its shard) fits any type; a column one shard lacks
    is left out of its samples."""
    a = _write(tmp_path / "p-0.parquet", id=[1, 2], text=pa.nulls(2))
    b = _write(tmp_path / "p-1.parquet", text=["c", "d"], id=[3, 4], more=[5, 6])
    ds = ShardedStreamingDataset([a, b], shuffle=False)
    assert [(s["id"], s["text"], s.get("more")) for s in ds] == [
        (1, None, None), (2, None, None), (3, "c", 5), (4, "d", 6)]


def test_a_sidecar_from_before_schemas_were_kept_is_checked_too(tmp_path):
    a = _write(tmp_path / "p-0.parquet", id=[1, 2])
    b = _write(tmp_path / "p-1.parquet", id=[3, 4])
    build_shard_index([a, b])
    sidecar = tmp_path / "nnh-index.json"
    saved = json.loads(sidecar.read_text())
    for entry in saved["shards"].values():
        del entry["schema"]
    sidecar.write_text(json.dumps(saved))
    _write(tmp_path / "p-1.parquet", id=[3.5, 4.5])  # another size: its entry is not reused
    with pytest.raises(ValueError, match=f"{a} holds int64, {b} holds double"):
        build_shard_index([a, b])
