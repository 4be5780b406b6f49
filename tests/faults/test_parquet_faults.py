"""Hostile Parquet shards: shards whose column types differ are named when indexed (the shards
and the column; Arrow IPC shards too, and Parquet and Arrow ones mixed), never read as samples
or batches of mixed types; a row group is decoded in bounded slices, each row once, however big
it is; a value over the stated limit is a ShardError naming the shard, the row group and the
column."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nnh_data import ShardedStreamingDataset, ShardError, build_shard_index, streaming_loader
from nnh_data.shards import parquet
from nnh_data.shards.parquet import ParquetReader
from nnh_data.shards.reading import split_shard_range

pytestmark = pytest.mark.timeout(60)


def _write(path, **columns) -> str:
    """A Parquet file, or an Arrow IPC file where ``path`` ends in ``.arrow``."""
    table = pa.table(columns)
    if path.suffix == ".arrow":
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    else:
        pq.write_table(table, path)
    return str(path)


@pytest.mark.parametrize("formats", ["parquet", "arrow", "parquet+arrow"])
@pytest.mark.parametrize("mode", ["index", "samples", "batches"])
def test_shards_whose_column_types_differ_are_named(mode, formats, tmp_path):
    first, _, second = formats.partition("+")
    a = _write(tmp_path / f"p-0.{first}", id=pa.array([1, 2], pa.int64()), text=["a", "b"])
    b = _write(tmp_path / f"p-1.{second or first}", id=["3", "4"], text=["c", "d"])
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


@pytest.mark.parametrize("mode", ["samples", "batches"])
def test_large_and_plain_text_and_bytes_are_one_type(mode, tmp_path):
    """``string``/``large_string`` and ``binary``/``large_binary`` (which writers choose by
    size, ``datasets`` among them) give the same values: no difference."""
    a = _write(tmp_path / "p-0.parquet", text=pa.array(["a", "b"], pa.string()),
               blob=pa.array([b"x", b"y"], pa.binary()))  # fmt: skip
    b = _write(tmp_path / "p-1.arrow", text=pa.array(["c", "d"], pa.large_string()),
               blob=pa.array([b"z", b"w"], pa.large_binary()))  # fmt: skip
    ds = ShardedStreamingDataset([a, b], shuffle=False)
    if mode == "samples":
        rows = [(s["text"], bytes(s["blob"])) for s in ds]
    else:
        rows = [(t, bytes(v)) for batch in streaming_loader(ds, 2)
                for t, v in zip(batch["text"], batch["blob"])]  # fmt: skip
    assert rows == [("a", b"x"), ("b", b"y"), ("c", b"z"), ("d", b"w")]


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


# ---------------------------------------------------------------- big row groups, big values


def _decoded_rows(monkeypatch) -> list[int]:
    """The rows of every batch the Parquet readers decode, as they decode them."""
    seen: list[int] = []
    real = parquet._Rows._decoded

    def counting(self):
        batch = real(self)
        seen.append(batch.num_rows)
        return batch

    monkeypatch.setattr(parquet._Rows, "_decoded", counting)
    return seen


@pytest.mark.parametrize("arrow", [False, True], ids=["samples", "batches"])
def test_a_big_row_group_is_decoded_in_slices_each_row_once(arrow, tmp_path, monkeypatch):
    """One row group of 200,000 rows read in the pieces the planner cuts (inside the row
    group): each read decodes only batches of a bounded size, and every row once over all."""
    n = 200_000
    path = _write(tmp_path / "big.parquet", id=pa.array(range(n), pa.int64()),
                  text=[f"row {i}" for i in range(n)])  # fmt: skip
    info = build_shard_index(path).shards[0]
    pieces = split_shard_range(info, 0, n, max_bytes=256 << 10)
    assert len(info.offsets) == 2 and len(pieces) > 10  # one row group, many pieces
    decoded = _decoded_rows(monkeypatch)
    reader = ParquetReader(arrow=arrow)
    first = reader.read(info, *pieces[0])
    assert sum(decoded) < 2 * (pieces[0][1] - pieces[0][0]) + 1024  # not the row group
    ids = [first["id"], *(reader.read(info, a, b)["id"] for a, b in pieces[1:])]
    assert np.concatenate(ids).tolist() == list(range(n))
    assert sum(decoded) == n and max(decoded) <= 1024


@pytest.mark.parametrize("arrow", [False, True], ids=["samples", "batches"])
def test_a_read_further_on_skips_the_row_groups_between(arrow, tmp_path, monkeypatch):
    """Blocks of one shard read out of order (a worker's share, a shuffled block order):
    a read past the row groups decoded so far starts at its own row group, and a read
    behind starts again, so each read decodes only its row groups."""
    path = _write(tmp_path / "groups.parquet", id=pa.array(range(1000), pa.int64()))
    pq.write_table(pq.read_table(path), path, row_group_size=100)
    info = build_shard_index(path).shards[0]
    decoded = _decoded_rows(monkeypatch)
    reader = ParquetReader(arrow=arrow)
    for start in (0, 900, 450, 120):
        assert list(reader.read(info, start, start + 10)["id"]) == list(range(start, start + 10))
    reader.close()
    assert sum(decoded) == 400  # one row group a read


@pytest.mark.parametrize("how", ["declared", "decoded"])
def test_a_value_over_the_limit_names_shard_row_group_and_column(how, tmp_path, monkeypatch):
    """``declared``: every value of a column is over the limit, which the footer proves
    before anything is decoded; ``decoded``: one value among small ones, found in its batch."""
    monkeypatch.setattr(parquet, "MAX_VALUE_BYTES", 1 << 20)
    big = b"x" * (3 << 20)
    blobs = [big, big] if how == "declared" else [b"a"] * 50 + [big] + [b"b"] * 49
    path = tmp_path / "values.parquet"
    pq.write_table(pa.table({"id": list(range(len(blobs))), "blob": blobs}), path,
                   row_group_size=len(blobs) // 2)  # fmt: skip
    ds = ShardedStreamingDataset([str(path)], shuffle=False)
    with pytest.raises(ShardError) as caught:
        list(ds)
    group = 0 if how == "declared" else 1
    assert (caught.value.url, caught.value.position) == (str(path), f"row group {group}, "
                                                                     "column 'blob'")
    said = re.match(r"a value of ([\d,]+) bytes( on average)?, over the limit of 1,048,576",
                    caught.value.reason)  # fmt: skip
    size = int(said[1].replace(",", ""))  # declared: with the pages' length prefixes
    assert size == 3 << 20 if how == "decoded" else 3 << 20 < size < (3 << 20) + 1024


# ---------------------------------------------------------------- peak memory, in a process


_PEAK = "int(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))"


def _peak_mib(code: str, path: str, mode: str) -> float:
    """The growth of the peak RSS (MiB) of a fresh process reading the first sample (or the
    first batch of 8) of the shard at ``path``, after its imports; ``code`` writes the file
    first, in a process of its own (its memory is not the reader's)."""
    subprocess.run([sys.executable, "-c", code, path], check=True, timeout=100)
    read = ("next(iter(ds))" if mode == "samples" else
            "next(iter(streaming_loader(ds, 8, collate_fn=lambda b: b)))")  # fmt: skip
    script = (f"import sys\nfrom nnh_data import ShardedStreamingDataset, streaming_loader\n"
              f"build_shard_index = __import__('nnh_data').build_shard_index\n"
              f"build_shard_index([sys.argv[1]])\nbefore = {_PEAK}\n"
              f"ds = ShardedStreamingDataset([sys.argv[1]], shuffle=False)\n{read}\n"
              f"print(({_PEAK} - before) / 1024)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True,
                          check=True, timeout=100)  # fmt: skip
    return float(done.stdout.split()[-1])


_BOMB = """import sys, pyarrow as pa, pyarrow.parquet as pq
strings = pa.array(["a" * (1 << 20)] * 512)  # 512 MiB of strings in one page, 22 KB of zstd
pq.write_table(pa.table({"text": strings}), sys.argv[1], compression="zstd", use_dictionary=False)
"""
_BIG_GROUP = """import sys, numpy as np, pyarrow as pa, pyarrow.parquet as pq
rows = 2_000_000  # one row group, 100 MiB of text decoded
text = pa.array([f"row {i:044d}" for i in range(rows)])
pq.write_table(pa.table({"id": np.arange(rows), "text": text}), sys.argv[1], row_group_size=rows)
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["samples", "batches"])
def test_a_small_file_declaring_512_mib_of_strings_does_not_peak_at_gigabytes(mode, tmp_path):
    """512 values of 1 MiB in one row group and one page: pyarrow decompresses the page whole
    (512 MiB, its own floor), but rows are decoded 8 MiB at a time, not all 512 MiB (the whole
    row group, or batches of 256 rows, peaked 1.1 GB over the imports)."""
    path = str(tmp_path / "bomb.parquet")
    grown = _peak_mib(_BOMB, path, mode)
    assert os.path.getsize(path) < 64 << 10
    assert grown < 512 + 160, f"peak RSS grew {grown:.0f} MiB"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["samples", "batches"])
def test_one_row_group_of_millions_of_rows_reaches_its_first_rows_in_bounded_memory(
    mode, tmp_path
):
    """2*10^6 rows in one row group (115 MiB decoded): the first sample or batch decodes one
    read block (8 MiB of what the footer declares, ~140,000 rows: ~90 MiB as Python values),
    not the row group (over 1 GiB as Python values)."""
    grown = _peak_mib(_BIG_GROUP, str(tmp_path / "big.parquet"), mode)
    assert grown < 192, f"peak RSS grew {grown:.0f} MiB"
