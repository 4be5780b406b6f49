"""Checking a finished parameter table against the generator: every file's size and footer,
then every (or a sampled share of the) file's rows recomputed and compared, and its bytes
against the receipt's sha256.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from nnh_data.precompute.spec import PrecomputeSpec, check_sizes, file_spec, read_manifest
from nnh_data.precompute.views import map_file

__all__ = ["verify_precomputed_params"]


def verify_precomputed_params(directory: str | os.PathLike, fraction: float = 1.0) -> int:
    """Check the finished table in ``directory`` against the parameters it should hold; the
    number of rows recomputed.

    Every file is checked to be listed and present, and no other Parquet file to lie beside
    them. Then every row of the files checked (all, or ``fraction`` of them chosen at random,
    at least one) is read with plain pyarrow and compared bit for bit with a fresh
    computation: keys first (each sample id, epoch and rank exactly once, in order), then
    values, then the file's sha256; each other file is checked to have its listed size and a
    footer that describes this table and its rows (cheap: a sampled check still finds a
    truncated or replaced file). The first difference raises ``ValueError`` naming the file,
    row, column, expected and found values.

    Example:
        >>> import tempfile
        >>> out = tempfile.mkdtemp()
        >>> _ = write_precomputed_params(PrecomputeSpec(10, epochs=2), out, progress=False)
        >>> verify_precomputed_params(out)
        20
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    directory = Path(directory)
    spec, receipts = read_manifest(directory)
    stray = sorted(set(_parquet_names(directory)) - {r["name"] for r in receipts})
    if stray:
        raise ValueError(
            f"{directory / stray[0]} is not part of the table (a Parquet reader "
            "of the directory would read it too)"
        )
    count = max(1, math.ceil(fraction * spec.num_files))
    chosen = set(random.sample(range(spec.num_files), count))
    rows = 0
    for i, receipt in enumerate(receipts):
        if i in chosen:
            rows += _verify_file(directory, spec, i, receipt)
        else:
            check_sizes(directory, [receipt])
            with _opened(directory / receipt["name"], spec, receipt):
                pass
    return rows


def _parquet_names(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if n.endswith(".parquet") and n[0] not in "._"]


def _opened(path: Path, spec: PrecomputeSpec, receipt: dict) -> pq.ParquetFile:
    """The file at ``path`` opened (a context manager), its footer checked against the table:
    description, columns and rows."""
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: no readable Parquet footer ({exc})") from None
    found = file_spec(file, path)
    if found != spec:
        raise ValueError(f"{path} belongs to another table ({found.differences(spec)})")
    if tuple(file.schema_arrow.names) != spec.column_names():
        raise ValueError(
            f"{path} has columns {file.schema_arrow.names}, expected {list(spec.column_names())}"
        )
    if file.metadata.num_rows != receipt["rows"]:
        raise ValueError(
            f"{path} holds {file.metadata.num_rows} rows, the table needs {receipt['rows']} "
            "(a missing or duplicated row)"
        )
    return file


def _verify_file(directory: Path, spec: PrecomputeSpec, index: int, receipt: dict) -> int:
    path = directory / receipt["name"]
    start, row = spec.file_rows(index).start, 0
    with _opened(path, spec, receipt) as file:
        for group in range(file.num_row_groups):
            table = file.read_row_group(group)
            expected = spec.generate(range(start + row, start + row + table.num_rows))
            _compare(path.name, row, expected, table)
            row += table.num_rows
    digest = hashlib.sha256(map_file(str(path))).hexdigest()
    if digest != receipt["sha256"]:
        raise ValueError(
            f"{path.name}: sha256 {digest} ({path.stat().st_size} bytes) differs from the "
            f"manifest's {receipt['sha256']} ({receipt['bytes']} bytes) though every value matches"
        )
    return row


def _compare(name: str, first_row: int, expected: dict[str, np.ndarray], table: pa.Table) -> None:
    """Raise at the first value of ``table`` (rows from ``first_row`` of file ``name``) whose
    bits differ from ``expected``."""
    for column, want in expected.items():
        got = table.column(column).to_numpy()
        if got.dtype != want.dtype:
            raise ValueError(f"{name} column {column} is {got.dtype}, expected {want.dtype}")
        bad = np.flatnonzero(got.view(np.uint64) != want.view(np.uint64))
        if bad.size:
            i = bad[0]
            hint = (
                " (each sample id, epoch and rank once, in order)"
                if column in ("sample_id", "epoch", "rank")
                else ""
            )
            raise ValueError(
                f"{name} row {first_row + i} column {column}: expected "
                f"{want[i]}, found {got[i]}{hint}"
            )
