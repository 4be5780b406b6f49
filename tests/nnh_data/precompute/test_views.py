"""nnh_data.precompute.views: zero-copy views equal what pyarrow decodes, and files written any
other way are refused by name instead of misread."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nnh_data.precompute.views import ONE_PAGE_OPTIONS, column_views, map_file

TYPES = {"f": pa.float64(), "u": pa.uint64(), "i": pa.int64(), "g": pa.float32()}


def table_of(rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    columns = {
        "f": rng.standard_normal(rows),
        "u": rng.integers(0, 2**64 - 1, rows, dtype=np.uint64, endpoint=True),
        "i": rng.integers(-(2**63), 2**63 - 1, rows, dtype=np.int64),
        "g": rng.standard_normal(rows).astype(np.float32),
    }
    schema = pa.schema([pa.field(name, kind, nullable=False) for name, kind in TYPES.items()])
    return pa.Table.from_pydict(columns, schema=schema)


def encoded(table: pa.Table, **options) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **{**ONE_PAGE_OPTIONS, **options})
    return sink.getvalue()


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 3000), group=st.integers(1, 1200), seed=st.integers(0, 99))
def test_views_equal_pyarrow_reads(rows, group, seed):
    table = table_of(rows, seed)
    data = encoded(table, row_group_size=group)
    views = column_views(data, list(TYPES), "t")
    file = pq.ParquetFile(pa.BufferReader(data))
    assert len(views) == file.num_row_groups
    for g, columns in enumerate(views):
        decoded = file.read_row_group(g)
        for name in TYPES:
            want = decoded[name].to_numpy()
            assert columns[name].dtype == want.dtype and columns[name].tobytes() == want.tobytes()


def test_views_of_a_memory_mapped_file_outlive_the_file_object(tmp_path):
    table = table_of(100, 0)
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, **ONE_PAGE_OPTIONS)
    [columns] = column_views(map_file(str(path)), ["u", "f"], str(path))
    assert np.array_equal(columns["u"], table["u"].to_numpy())
    assert not columns["f"].flags.writeable


@pytest.mark.parametrize(
    "options",
    [
        {"compression": "zstd"},
        {"use_dictionary": True},
        {"data_page_size": 64, "write_batch_size": 16},  # several pages per row group
        {"data_page_version": "2.0"},
    ],
    ids=["compressed", "dictionary", "pages", "page-v2"],
)
def test_other_layouts_are_refused(options):
    data = encoded(table_of(500, 1), **options)
    with pytest.raises(ValueError, match="t.parquet: column f is not one uncompressed PLAIN page"):
        column_views(data, ["f"], "t.parquet")


def test_nullable_columns_are_refused():
    data = encoded(pa.table({"f": pa.array([1.0, None, 3.0])}))
    with pytest.raises(ValueError, match="column f is not one uncompressed PLAIN page"):
        column_views(data, ["f"], "t")
