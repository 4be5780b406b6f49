"""What a precomputed parameter table is: its description (:class:`PrecomputeSpec`) and the manifest
that lists its files.

Layout. A table holds the parameters of every sample id in ``[0, num_samples)`` for every
epoch in ``[0, epochs)`` (and every rank in ``[0, world_size)`` when rank-aware), one row each,
in (epoch, rank, sample id) order: row ``(epoch * ranks + rank) * num_samples + sample_id``.
The rows are cut into files of ``rows_per_file`` rows (``part-000000.parquet``, ...), each cut
into row groups of ``ROWS_PER_GROUP`` rows, so where any sample's row lies is arithmetic: a
lookup reads only the row groups its ids fall in, and no index is built or stored. The
description is written as ``_table.json`` by the first task, into every file's Parquet metadata,
and with every file's receipt into ``_manifest.json`` when the table is complete.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from nnh_data.augment.params import AugmentationConfig, gen_augmentation_params_batch, param_names
from nnh_data.checks import check_int
from nnh_data.columns import concat
from nnh_data.seeding import ALGORITHM_VERSION, MASK64, MAX_SAMPLE_ID

__all__ = [
    "DONE_FOLDER",
    "FORMAT",
    "MANIFEST_NAME",
    "METADATA_KEY",
    "ROWS_PER_GROUP",
    "SPEC_NAME",
    "VALUE_TYPES",
    "PrecomputeSpec",
    "check_files",
    "check_sizes",
    "clip",
    "dumps_json",
    "file_spec",
    "read_json",
    "read_manifest",
    "row_groups",
]


MANIFEST_NAME = "_manifest.json"

ROWS_PER_GROUP = 1 << 16  # one page of each column: 512 KiB, fine for any Parquet reader

METADATA_KEY = b"nnh.precompute"  # the table's description, in every file's Parquet metadata

FORMAT = "nnh-precompute"

SPEC_NAME = "_table.json"  # the description, written by the first task: later tasks compare

DONE_FOLDER = "_done"  # receipts

VALUE_TYPES = {"seed": np.uint64, "flip": np.int64}  # the others are float64


@functools.cache
def _package_version() -> str:
    try:
        return importlib.metadata.version("nnh")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class PrecomputeSpec:
    """What a table holds: ids ``[0, num_samples)`` for epochs ``[0, epochs)``, their config and
    base seed, the rank-aware form for ranks ``[0, world_size)``, and how rows are cut in files.

    Example:
        >>> spec = PrecomputeSpec(num_samples=10, epochs=2, seed=7, rows_per_file=15)
        >>> spec.num_rows, spec.file_name(1), spec.file_rows(1)
        (20, 'part-000001.parquet', range(15, 20))
    """

    num_samples: int
    epochs: int
    config: AugmentationConfig = AugmentationConfig()
    seed: int = 0
    rank_aware: bool = False
    world_size: int = 1
    rows_per_file: int = 1_000_000

    def __post_init__(self) -> None:
        put = functools.partial(object.__setattr__, self)
        put("num_samples", check_int("num_samples", self.num_samples, low=1, high=MAX_SAMPLE_ID))
        put("epochs", check_int("epochs", self.epochs, low=1))
        put("seed", check_int("seed", self.seed, low=0, high=MASK64))
        put("world_size", check_int("world_size", self.world_size, low=1))
        put("rows_per_file", check_int("rows_per_file", self.rows_per_file, low=1))
        if not isinstance(self.config, AugmentationConfig):
            raise ValueError(f"config must be an AugmentationConfig, got {self.config!r}")
        if not isinstance(self.rank_aware, bool):
            raise ValueError(f"rank_aware must be True or False, got {self.rank_aware!r}")
        if not self.rank_aware and self.world_size != 1:
            raise ValueError(
                f"world_size is {self.world_size} but rank_aware is False: plain parameters do "
                "not depend on the world size; pass rank_aware=True for one row per rank"
            )
        if self.num_rows > MAX_SAMPLE_ID:
            raise ValueError(
                f"epochs x ranks x num_samples must be at most {MAX_SAMPLE_ID}, got {self.num_rows}"
            )

    @property
    def ranks(self) -> int:
        """Rows per (sample id, epoch): ``world_size`` when rank-aware, else 1."""
        return self.world_size if self.rank_aware else 1

    @property
    def num_rows(self) -> int:
        """Rows of the whole table."""
        return self.epochs * self.ranks * self.num_samples

    @property
    def num_files(self) -> int:
        """Files of the whole table."""
        return -(-self.num_rows // self.rows_per_file)

    @property
    def groups_per_file(self) -> int:
        """Row groups of a full file."""
        return -(-self.rows_per_file // ROWS_PER_GROUP)

    def file_name(self, index: int) -> str:
        """Name of file ``index``: zero-padded, so names sort in row order."""
        width = max(6, len(str(self.num_files - 1)))
        return f"part-{index:0{width}d}.parquet"

    def file_rows(self, index: int) -> range:
        """Rows of the table held by file ``index``."""
        start = index * self.rows_per_file
        return range(start, min(start + self.rows_per_file, self.num_rows))

    def first_row(self, epoch: int, rank: int) -> int:
        """Row of sample id 0 for ``epoch`` and ``rank`` (any rank of a plain table)."""
        return (epoch * self.ranks + (rank if self.rank_aware else 0)) * self.num_samples

    def column_names(self) -> tuple[str, ...]:
        """Columns of a file: sample_id, epoch, rank (rank-aware only), parameters, seed."""
        keys = ("sample_id", "epoch", "rank") if self.rank_aware else ("sample_id", "epoch")
        return (*keys, *self.value_columns())

    def value_columns(self) -> tuple[str, ...]:
        """The columns lookups read: the config's parameters (``param_names``), then seed."""
        return (*param_names(self.config), "seed")

    def generate(self, rows: range) -> dict[str, np.ndarray]:
        """The columns of ``rows`` (a step-1 range), from ``gen_augmentation_params_batch``."""
        parts, row = [], rows.start
        while row < rows.stop:  # one step per (epoch, rank) segment
            segment, first_id = divmod(row, self.num_samples)
            epoch, rank = divmod(segment, self.ranks)
            count = min(self.num_samples - first_id, rows.stop - row)
            ids = np.arange(first_id, first_id + count, dtype=np.int64)
            cols = gen_augmentation_params_batch(
                ids, rank, self.ranks, self.config, self.seed, epoch, self.rank_aware
            )
            parts.append({name: cols[name] for name in self.column_names()})
            row += count
        return concat(parts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe description, with the format, algorithm and package versions."""
        return {
            "format": FORMAT,
            "algorithm_version": ALGORITHM_VERSION,
            "package_version": _package_version(),
            "num_samples": self.num_samples,
            "epochs": self.epochs,
            "config": self.config.to_dict(),
            "seed": self.seed,
            "rank_aware": self.rank_aware,
            "world_size": self.world_size,
            "rows_per_file": self.rows_per_file,
            "rows_per_group": ROWS_PER_GROUP,
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "the table") -> PrecomputeSpec:
        """The spec described by ``to_dict`` output; an error naming ``source`` when it is not
        such a description or comes from another algorithm version."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{source} has no {FORMAT} description (got {clip(data)})")
        if data.get("algorithm_version") != ALGORITHM_VERSION:
            raise ValueError(
                f"{source} was computed by algorithm version {data.get('algorithm_version')!r}; "
                f"this nnh computes version {ALGORITHM_VERSION}: compute the table again"
            )
        if data.get("rows_per_group") != ROWS_PER_GROUP:
            raise ValueError(
                f"{source} has rows_per_group {data.get('rows_per_group')!r}, "
                f"this nnh reads {ROWS_PER_GROUP}"
            )
        fields = ("num_samples", "epochs", "seed", "rank_aware", "world_size", "rows_per_file")
        try:
            config = AugmentationConfig.from_dict(data["config"])
            return cls(config=config, **{name: data[name] for name in fields})
        except (KeyError, TypeError) as err:
            raise ValueError(f"{source} has an incomplete description: {err!r}") from None

    def table(self, rows: range) -> pa.Table:
        """The Arrow table of ``rows`` (a step-1 range), with ``schema()``."""
        return pa.Table.from_pydict(self.generate(rows), schema=self.schema())

    def schema(self) -> pa.Schema:
        """Arrow schema of a file: non-nullable columns and the description as metadata."""
        types = {"seed": pa.uint64(), **dict.fromkeys(param_names(self.config), pa.float64())}
        types["flip"] = pa.int64()
        fields = [pa.field(n, types.get(n, pa.int64()), False) for n in self.column_names()]
        return pa.schema(fields, metadata={METADATA_KEY: json.dumps(self.to_dict())})

    def differences(self, other: PrecomputeSpec) -> str:
        """``name: mine != other's`` for every field that differs, for error messages."""
        mine, theirs = self.to_dict(), other.to_dict()
        return "; ".join(f"{k}: {mine[k]!r} != {theirs[k]!r}" for k in mine if mine[k] != theirs[k])


def clip(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def row_groups(rows: range) -> list[range]:
    return [rows[i : i + ROWS_PER_GROUP] for i in range(0, len(rows), ROWS_PER_GROUP)]


def dumps_json(value: Any) -> bytes:
    return json.dumps(value, indent=1).encode()


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def read_manifest(directory: Path) -> tuple[PrecomputeSpec, list[dict[str, Any]]]:
    """The spec and receipts of the finished table in ``directory``, checked against the
    table's layout (names and rows) and the files present (no file read)."""
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise ValueError(f"directory {directory} does not exist")
    if not path.exists():
        raise ValueError(
            f"{directory} has no {MANIFEST_NAME}: the table is incomplete or not finalized (run "
            f"`nnh-precompute finalize {directory}` once every task is done)"
        )
    manifest = read_json(path)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        raise ValueError(f"{path} is not an {FORMAT} manifest (got {clip(manifest)})")
    spec = PrecomputeSpec.from_dict(manifest.get("table"), str(path))
    check_files(directory, spec, manifest["files"])
    return spec, manifest["files"]


def check_files(directory: Path, spec: PrecomputeSpec, receipts: list[Any]) -> None:
    """Every file of ``spec`` listed in order with its rows, and present."""
    if len(receipts) != spec.num_files:
        raise ValueError(
            f"{directory}: {len(receipts)} files listed, the table has {spec.num_files}"
        )
    for index, receipt in enumerate(receipts):
        name, rows = spec.file_name(index), len(spec.file_rows(index))
        if not isinstance(receipt, dict) or receipt.get("name") != name:
            raise ValueError(f"{directory}: file {index} should be {name}, got {clip(receipt)}")
        if receipt.get("rows") != rows:
            raise ValueError(f"{name}: {receipt.get('rows')!r} rows listed, the table has {rows}")
        if not (directory / name).exists():
            raise ValueError(f"{directory / name} is missing")


def check_sizes(directory: Path, receipts: list[dict[str, Any]]) -> None:
    """Every listed file of its listed size: a cheap guard against truncated or changed files."""
    for receipt in receipts:
        size = (directory / receipt["name"]).stat().st_size
        if size != receipt.get("bytes"):
            raise ValueError(
                f"{directory / receipt['name']} has {size} bytes, {receipt.get('bytes')!r} listed "
                "(changed or truncated)"
            )


def file_spec(file: pq.ParquetFile, path: Path) -> PrecomputeSpec:
    """The spec recorded in a file's Parquet metadata."""
    metadata = file.schema_arrow.metadata or {}
    if METADATA_KEY not in metadata:
        raise ValueError(f"{path} has no {METADATA_KEY.decode()} entry in its Parquet metadata")
    return PrecomputeSpec.from_dict(json.loads(metadata[METADATA_KEY]), str(path))
