"""Fixed-width Parquet columns as zero-copy numpy views of a memory-mapped file.

pyarrow decodes every Parquet page it reads into new memory, even an uncompressed one, so a
lookup of a few ids costs the decoding of whole row groups. But a column written PLAIN,
uncompressed, non-nullable and in one data page per row group is stored as the raw
little-endian values right after the page header: such a column chunk can be viewed in place,
and a lookup then costs only the ids it touches. ``ONE_PAGE_OPTIONS`` makes ``pq.write_table``
write such chunks; ``column_views`` finds the values from the footer and checks each page
header (type and sizes: the first fields of the Thrift-encoded ``PageHeader``), so a file
written any other way is an error naming the column, never misread numbers.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["ONE_PAGE_OPTIONS", "column_views", "map_file"]

_DATA_PAGE = 0  # PageType.DATA_PAGE (version 1)
_I32_FIELD = 0x15  # Thrift compact field header: field id delta 1, type i32
_HEADER_PREFIX = 32  # bytes that hold the first three fields of a PageHeader

# pyarrow >= 23 also cuts pages every 20,000 rows unless told otherwise; older ones only by size
ONE_PAGE_OPTIONS: dict[str, Any] = {
    "compression": "none",
    "use_dictionary": False,
    "data_page_version": "1.0",
    "data_page_size": 1 << 30,
    **(
        {"max_rows_per_page": 1 << 30}
        if "max_rows_per_page" in inspect.signature(pq.write_table).parameters
        else {}
    ),
}


def map_file(path: str) -> pa.Buffer:
    """The whole file at ``path``, memory-mapped read-only (it stays mapped while referenced)."""
    with pa.memory_map(path) as file:
        return file.read_buffer()


def column_views(data: pa.Buffer, names: Sequence[str], source: str) -> list[dict[str, np.ndarray]]:
    """Per row group, the columns ``names`` of the Parquet file ``data`` as numpy views of it.

    Views have the columns' numpy types (unsigned columns unsigned). ``source`` names the file
    in errors, raised when a column is not one uncompressed PLAIN page per row group.

    Example:
        >>> table = pa.table({"x": pa.array([1.5, 2.5])}).cast(
        ...     pa.schema([pa.field("x", pa.float64(), nullable=False)]))
        >>> sink = pa.BufferOutputStream()
        >>> pq.write_table(table, sink, **ONE_PAGE_OPTIONS)
        >>> column_views(sink.getvalue(), ["x"], "example")[0]["x"]
        array([1.5, 2.5])
    """
    file = pq.ParquetFile(pa.BufferReader(data))
    metadata, schema = file.metadata, file.schema_arrow
    columns = {name: schema.get_field_index(name) for name in names}
    types = {name: np.dtype(schema.field(name).type.to_pandas_dtype()) for name in names}
    groups = []
    for g in range(metadata.num_row_groups):
        views = {}
        for name, j in columns.items():
            chunk, dtype = metadata.row_group(g).column(j), types[name].newbyteorder("<")
            offset = _values_offset(data, chunk, dtype.itemsize, source)
            views[name] = np.frombuffer(data, dtype, chunk.num_values, offset)
        groups.append(views)
    return groups


def _values_offset(data: pa.Buffer, chunk: pq.ColumnChunkMetaData, width: int, source: str) -> int:
    """Where the values of ``chunk`` start in ``data``: the chunk's end less its values."""
    size = chunk.num_values * width
    start, stored = chunk.data_page_offset, chunk.total_compressed_size
    page = _page_sizes(bytes(data[start : start + _HEADER_PREFIX]))
    plain = set(chunk.encodings) <= {"PLAIN", "RLE"} and chunk.compression == "UNCOMPRESSED"
    if not plain or page != (_DATA_PAGE, size, size) or stored < size:
        raise ValueError(
            f"{source}: column {chunk.path_in_schema} is not one uncompressed PLAIN page of "
            f"{chunk.num_values} non-null values (encodings {chunk.encodings}, compression "
            f"{chunk.compression}, first page (type, raw, stored bytes) {page})"
        )
    return start + stored - size


def _page_sizes(header: bytes) -> tuple[int, int, int] | None:
    """``(type, uncompressed_page_size, compressed_page_size)``: the first three fields of a
    Thrift-compact ``PageHeader`` (each a field header byte, then a zigzag varint); None when
    ``header`` does not start that way."""
    fields, pos = [], 0
    for _ in range(3):
        if pos >= len(header) or header[pos] != _I32_FIELD:
            return None
        value, shift, pos = 0, 0, pos + 1
        while pos < len(header):
            byte, pos = header[pos], pos + 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        fields.append((value >> 1) ^ -(value & 1))
    return fields[0], fields[1], fields[2]
