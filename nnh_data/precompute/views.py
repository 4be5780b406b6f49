"""Fixed-width Parquet columns as zero-copy numpy views of a memory-mapped file.

pyarrow decodes every Parquet page it reads into new memory, even an uncompressed one, so a
lookup of a few ids costs the decoding of whole row groups. But a column written PLAIN,
uncompressed, non-nullable and in one data page per row group is stored as the raw
little-endian values right after the page header: such a column chunk can be viewed in place,
and a lookup then costs only the ids it touches. ``ONE_PAGE_OPTIONS`` makes ``pq.write_table``
write such chunks, each page with the CRC-32 of its data (Parquet's page checksum);
``column_views`` finds the values from the footer and checks each page header (type and sizes:
the first fields of the Thrift-encoded ``PageHeader``), so a file written any other way is an
error naming the column, never misread numbers, and ``page_checksums`` reads the CRC-32 each
header records, which a reader compares with the bytes it views (:mod:`.read`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["ONE_PAGE_OPTIONS", "column_views", "map_file", "page_checksums"]

_DATA_PAGE = 0  # PageType.DATA_PAGE (version 1)
_I32_FIELD = 0x15  # Thrift compact field header: field id delta 1, type i32
_HEADER_PREFIX = 32  # bytes that hold the first four fields of a PageHeader

# pyarrow >= 23 also cuts pages every 20,000 rows unless told otherwise; older ones only by size
ONE_PAGE_OPTIONS: dict[str, Any] = {
    "compression": "none",
    "use_dictionary": False,
    "data_page_version": "1.0",
    "data_page_size": 1 << 30,
    "write_page_checksum": True,
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
    schema = file.schema_arrow
    types = {name: np.dtype(schema.field(name).type.to_pandas_dtype()) for name in names}
    groups = []
    for chunks in _chunks(file, names):
        views = {}
        for name, chunk in chunks.items():
            dtype = types[name].newbyteorder("<")
            offset = _values_offset(data, chunk, dtype.itemsize, source)
            views[name] = np.frombuffer(data, dtype, chunk.num_values, offset)
        groups.append(views)
    return groups


def page_checksums(data: pa.Buffer, names: Sequence[str]) -> list[dict[str, int | None]]:
    """Per row group, the CRC-32 that the page header of each column ``names`` records (None:
    written without one, as tables were before page checksums)."""
    file = pq.ParquetFile(pa.BufferReader(data))
    return [{name: _page_header(_header(data, chunk))[3] for name, chunk in chunks.items()}
            for chunks in _chunks(file, names)]  # fmt: skip


def _chunks(file: pq.ParquetFile, names: Sequence[str]) -> list[dict[str, Any]]:
    """Per row group, the column chunk metadata of ``names``."""
    metadata, schema = file.metadata, file.schema_arrow
    columns = {name: schema.get_field_index(name) for name in names}
    return [{name: metadata.row_group(g).column(j) for name, j in columns.items()}
            for g in range(metadata.num_row_groups)]  # fmt: skip


def _header(data: pa.Buffer, chunk: pq.ColumnChunkMetaData) -> bytes:
    start = chunk.data_page_offset
    return bytes(data[start : start + _HEADER_PREFIX])


def _values_offset(data: pa.Buffer, chunk: pq.ColumnChunkMetaData, width: int, source: str) -> int:
    """Where the values of ``chunk`` start in ``data``: the chunk's end less its values."""
    size = chunk.num_values * width
    start, stored = chunk.data_page_offset, chunk.total_compressed_size
    page = _page_header(_header(data, chunk))[:3]
    plain = set(chunk.encodings) <= {"PLAIN", "RLE"} and chunk.compression == "UNCOMPRESSED"
    if not plain or page != (_DATA_PAGE, size, size) or stored < size:
        raise ValueError(
            f"{source}: column {chunk.path_in_schema} is not one uncompressed PLAIN page of "
            f"{chunk.num_values} non-null values (encodings {chunk.encodings}, compression "
            f"{chunk.compression}, first page (type, raw, stored bytes) {page})"
        )
    return start + stored - size


def _page_header(header: bytes) -> tuple[int | None, ...]:
    """``(type, uncompressed_page_size, compressed_page_size, crc)``: the first four fields of
    a Thrift-compact ``PageHeader`` (each a field header byte, then a zigzag varint; the CRC-32
    unsigned), None for each that ``header`` does not hold in that order (a header without a
    checksum ends after three)."""
    fields: list[int | None] = []
    pos = 0
    for _ in range(4):
        if pos >= len(header) or header[pos] != _I32_FIELD:
            break
        value, shift, pos = 0, 0, pos + 1
        while pos < len(header):
            byte, pos = header[pos], pos + 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        fields.append((value >> 1) ^ -(value & 1))
    if len(fields) < 3:
        return (None, None, None, None)
    crc = fields[3] & 0xFFFFFFFF if len(fields) == 4 else None
    return fields[0], fields[1], fields[2], crc
