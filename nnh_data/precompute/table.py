"""Augmentation parameters computed offline: Parquet tables written by job-array tasks,
verified and replayed.

Layout. A table holds the parameters of every sample id in ``[0, num_samples)`` for every
epoch in ``[0, epochs)`` (and every rank in ``[0, world_size)`` when rank-aware), one row each,
in (epoch, rank, sample id) order: row ``(epoch * ranks + rank) * num_samples + sample_id``.
The rows are cut into files of ``rows_per_file`` rows (``part-000000.parquet``, ...), each cut
into row groups of ``ROWS_PER_GROUP`` rows, so where any sample's row lies is arithmetic: a
lookup reads only the row groups its ids fall in, and no index is built or stored.

Format, and its trade-off. pyarrow decodes every Parquet page it reads into new memory, so a
lookup through it costs whole row groups (64K rows, about 1 ms) however few ids it wants, and
a streaming window's ids (a few thousand, from one shard) would pay that again at each shard.
So the parameter and seed columns are written PLAIN, uncompressed, one page per row group, and
lookups view them in place in the memory-mapped file (``nnh_data.precompute.views``): a lookup
costs only the ids it touches, and every worker of a node shares the page cache. The price is
small: zstd would save 6% of these columns (random 64-bit values hardly compress; measured
48.0 against 45.4 MB per million rows) at 1.7x the write time and a decoding copy per read.
The key columns (sample id, epoch, rank), which lookups never read, are delta-encoded to
almost nothing: 48.1 bytes a row in all. Any Parquet reader reads the files.

Work split and restarts. File ``i`` belongs to one task (``DistributedRangeSplitter`` over the
files). Each file is written under a hidden temporary name and renamed when complete; then its
receipt (``_done/<file>.json``: rows, bytes, sha256) is written the same way. A file is done
when its receipt exists, so a task killed and rerun redoes only its unfinished files. The task
that finds every receipt present writes ``_manifest.json`` (the table's description and every
receipt); ``finalize_precomputed_params`` does it on demand. Names starting with ``_`` or ``.``
are skipped by Parquet dataset readers (pyarrow, Spark), so ``pq.read_table(DIR)`` reads the
table and nothing else.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import itertools
import json
import math
import os
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from nnh_data.augment.params import AugmentationConfig, gen_augmentation_params_batch, param_names
from nnh_data.checks import check_int
from nnh_data.columns import concat
from nnh_data.order.ranges import DistributedRangeSplitter
from nnh_data.precompute.job_array import array_task_info
from nnh_data.precompute.views import ONE_PAGE_OPTIONS, column_views, map_file
from nnh_data.seeding import ALGORITHM_VERSION, MASK64, MAX_SAMPLE_ID, as_sample_ids

__all__ = [
    "MANIFEST_NAME",
    "ROWS_PER_GROUP",
    "PrecomputeSpec",
    "PrecomputedParams",
    "finalize_precomputed_params",
    "load_precomputed_params",
    "verify_precomputed_params",
    "write_precomputed_params",
]

MANIFEST_NAME = "_manifest.json"
ROWS_PER_GROUP = 1 << 16  # one page of each column: 512 KiB, fine for any Parquet reader
METADATA_KEY = b"nnh.precompute"  # the table's description, in every file's Parquet metadata
FORMAT = "nnh-precompute"
_SPEC_NAME = "_table.json"  # the description, written by the first task: later tasks compare
_DONE = "_done"  # receipts
_VALUE_TYPES = {"seed": np.uint64, "flip": np.int64}  # the others are float64
_OPEN_FILES = 64  # files a lookup keeps mapped (no descriptor stays open; mappings are capped)


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
            raise ValueError(f"{source} has no {FORMAT} description (got {_clip(data)})")
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


def _clip(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# --- writing -----------------------------------------------------------------------------------


def write_precomputed_params(
    spec: PrecomputeSpec,
    directory: str | os.PathLike,
    *,
    task_index: int | None = None,
    num_tasks: int | None = None,
    progress: bool = True,
) -> list[str]:
    """Write this task's files of the table ``spec`` into ``directory``; the names written.

    The task is ``array_task_info(task_index, num_tasks)`` (a Slurm array task by default);
    files already done (their receipt exists) are skipped, so a rerun finishes a killed task.
    The task that finds the table complete writes the manifest. ``progress`` shows a tqdm bar,
    advanced once per file.

    Example:
        >>> import tempfile
        >>> out = tempfile.mkdtemp()
        >>> write_precomputed_params(PrecomputeSpec(100, epochs=2), out, progress=False)
        ['part-000000.parquet']
        >>> load_precomputed_params(out).batch(np.arange(3), epoch=1)["sample_id"]
        array([0, 1, 2])
    """
    task_index, num_tasks = array_task_info(task_index, num_tasks)
    directory = Path(directory)
    _claim(directory, spec)
    first, stop = DistributedRangeSplitter(spec.num_files, num_tasks).get_rank_range(task_index)
    done = _receipt_names(directory)
    todo = [i for i in range(first, stop) if spec.file_name(i) not in done]
    _remove_temporaries(directory, {spec.file_name(i) for i in todo})
    rows = sum(len(spec.file_rows(i)) for i in todo)
    desc = f"task {task_index}/{num_tasks}"
    with tqdm(
        total=rows, unit="row", unit_scale=True, desc=desc, disable=not progress, mininterval=1.0
    ) as bar:
        _write_files(directory, spec, todo, bar)
    if not _missing(directory, spec):
        finalize_precomputed_params(directory)
    return [spec.file_name(i) for i in todo]


def _claim(directory: Path, spec: PrecomputeSpec) -> None:
    """Make ``directory`` hold ``spec``'s table: record the spec, or check the one recorded."""
    (directory / _DONE).mkdir(parents=True, exist_ok=True)
    path = directory / _SPEC_NAME
    if not path.exists():
        _replace(path, _dumps(spec.to_dict()))
        return
    found = PrecomputeSpec.from_dict(_read_json(path), str(path))
    if found != spec:
        raise ValueError(
            f"{directory} holds another table ({found.differences(spec)}, recorded != asked): "
            "pass the same arguments, or write to another directory"
        )


def _remove_temporaries(directory: Path, names: set[str]) -> None:
    """Remove what killed runs left of files ``names`` and their receipts (see ``_replace``)."""
    targets = names | {f"{name}.json" for name in names}
    for folder in (directory, directory / _DONE):
        for entry in os.listdir(folder):
            if entry.endswith(".tmp") and entry[1:].rsplit(".", 2)[0] in targets:
                (folder / entry).unlink(missing_ok=True)


def _write_files(directory: Path, spec: PrecomputeSpec, todo: list[int], bar: tqdm) -> None:
    """Write files ``todo`` in three stages that run at once: a thread computes the rows of
    the next row group, this one encodes and writes the current one, another thread checks,
    hashes and commits finished files (numpy, pyarrow, hashlib and file I/O release the GIL).
    Memory holds two row groups, whatever the size of the table."""
    parts = [(i, rows) for i in todo for rows in _row_groups(spec.file_rows(i))]
    with ThreadPoolExecutor(1) as computer, ThreadPoolExecutor(1) as committer:
        tables = _computed_ahead(computer, lambda part: spec.table(part[1]), parts)
        commits = []
        for index, group in itertools.groupby(zip(parts, tables), key=lambda pair: pair[0][0]):
            temporary = _write_file(directory / spec.file_name(index), spec, (t for _, t in group))
            commits.append(committer.submit(_commit, directory, spec, index, temporary))
            bar.update(len(spec.file_rows(index)))
        for commit in commits:
            commit.result()


def _row_groups(rows: range) -> list[range]:
    return [rows[i : i + ROWS_PER_GROUP] for i in range(0, len(rows), ROWS_PER_GROUP)]


def _computed_ahead(pool: ThreadPoolExecutor, fn: Callable, items: list) -> Iterator:
    """``fn(item)`` of every item in order, each computed in ``pool`` while the caller uses
    the one before."""
    pending = None
    for item in items:
        submitted = pool.submit(fn, item)
        if pending is not None:
            yield pending.result()
        pending = submitted
    if pending is not None:
        yield pending.result()


def _write_file(path: Path, spec: PrecomputeSpec, tables: Iterable[pa.Table]) -> Path:
    """Write the row groups ``tables`` of file ``path`` under a temporary name; that name.

    Values are PLAIN, uncompressed, one page per row group (lookups view them in place); the
    keys (sample id, epoch, rank) are delta-encoded (48 bytes a row instead of 72) with
    statistics, so that query engines skip row groups by sample id.
    """
    keys = [name for name in spec.column_names() if name not in spec.value_columns()]
    options = {"column_encoding": dict.fromkeys(keys, "DELTA_BINARY_PACKED"), **ONE_PAGE_OPTIONS}
    temporary = _temporary(path)
    with pq.ParquetWriter(temporary, spec.schema(), write_statistics=keys, **options) as writer:
        for table in tables:
            writer.write_table(table, row_group_size=ROWS_PER_GROUP)
    return temporary


def _commit(directory: Path, spec: PrecomputeSpec, index: int, temporary: Path) -> None:
    """Check that lookups can view the written file, rename it, then write its receipt."""
    path, data = directory / spec.file_name(index), map_file(str(temporary))
    column_views(data, spec.value_columns(), str(path))
    receipt = {
        "name": path.name,
        "rows": len(spec.file_rows(index)),
        "bytes": data.size,
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    os.replace(temporary, path)
    _replace(directory / _DONE / f"{path.name}.json", _dumps(receipt))


def _temporary(path: Path) -> Path:
    """A hidden name beside ``path`` for this process: readers skip it, and a killed run's
    leftovers are removed by the next run (``_remove_temporaries``)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _replace(path: Path, data: bytes | pa.Buffer) -> None:
    """Write ``data`` to a hidden temporary file beside ``path``, then rename it to ``path``.

    A task killed mid-write leaves only a hidden temporary, which readers skip.
    """
    temporary = _temporary(path)
    with open(temporary, "wb") as file:
        file.write(memoryview(data))
    os.replace(temporary, path)


def _dumps(value: Any) -> bytes:
    return json.dumps(value, indent=1).encode()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def _receipt_names(directory: Path) -> set[str]:
    """Names of the files whose receipt exists."""
    receipts = directory / _DONE
    return {name[: -len(".json")] for name in os.listdir(receipts) if name.endswith(".json")}


def _missing(directory: Path, spec: PrecomputeSpec) -> list[str]:
    """Names of the table's files that are not done yet."""
    done = _receipt_names(directory)
    return [spec.file_name(i) for i in range(spec.num_files) if spec.file_name(i) not in done]


def finalize_precomputed_params(directory: str | os.PathLike) -> Path:
    """Write the manifest of a complete table in ``directory``; its path.

    The manifest is the table's description and every file's receipt (name, rows, bytes,
    sha256), in file order. An error names the missing files when the table is incomplete.

    Example:
        >>> import tempfile
        >>> out = tempfile.mkdtemp()
        >>> _ = write_precomputed_params(PrecomputeSpec(10, epochs=1), out, progress=False)
        >>> finalize_precomputed_params(out).name
        '_manifest.json'
    """
    directory = Path(directory)
    if not (directory / _SPEC_NAME).exists():
        raise ValueError(f"directory {directory} holds no table: no {_SPEC_NAME} in it")
    spec = PrecomputeSpec.from_dict(_read_json(directory / _SPEC_NAME), str(directory))
    missing = _missing(directory, spec)
    if missing:
        raise ValueError(
            f"the table in {directory} is incomplete: {len(missing)} of {spec.num_files} files "
            f"are not done ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
            "rerun the tasks that wrote them"
        )
    receipts = [
        _read_json(directory / _DONE / f"{spec.file_name(i)}.json") for i in range(spec.num_files)
    ]
    _check_files(directory, spec, receipts)
    _check_sizes(directory, receipts)
    path = directory / MANIFEST_NAME
    _replace(path, _dumps({"table": spec.to_dict(), "files": receipts}))
    return path


# --- reading -----------------------------------------------------------------------------------


def _read_manifest(directory: Path) -> tuple[PrecomputeSpec, list[dict[str, Any]]]:
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
    manifest = _read_json(path)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        raise ValueError(f"{path} is not an {FORMAT} manifest (got {_clip(manifest)})")
    spec = PrecomputeSpec.from_dict(manifest.get("table"), str(path))
    _check_files(directory, spec, manifest["files"])
    return spec, manifest["files"]


def _check_files(directory: Path, spec: PrecomputeSpec, receipts: list[Any]) -> None:
    """Every file of ``spec`` listed in order with its rows, and present."""
    if len(receipts) != spec.num_files:
        raise ValueError(
            f"{directory}: {len(receipts)} files listed, the table has {spec.num_files}"
        )
    for index, receipt in enumerate(receipts):
        name, rows = spec.file_name(index), len(spec.file_rows(index))
        if not isinstance(receipt, dict) or receipt.get("name") != name:
            raise ValueError(f"{directory}: file {index} should be {name}, got {_clip(receipt)}")
        if receipt.get("rows") != rows:
            raise ValueError(f"{name}: {receipt.get('rows')!r} rows listed, the table has {rows}")
        if not (directory / name).exists():
            raise ValueError(f"{directory / name} is missing")


def _check_sizes(directory: Path, receipts: list[dict[str, Any]]) -> None:
    """Every listed file of its listed size: a cheap guard against truncated or changed files."""
    for receipt in receipts:
        size = (directory / receipt["name"]).stat().st_size
        if size != receipt.get("bytes"):
            raise ValueError(
                f"{directory / receipt['name']} has {size} bytes, {receipt.get('bytes')!r} listed "
                "(changed or truncated)"
            )


def _file_spec(file: pq.ParquetFile, path: Path) -> PrecomputeSpec:
    """The spec recorded in a file's Parquet metadata."""
    metadata = file.schema_arrow.metadata or {}
    if METADATA_KEY not in metadata:
        raise ValueError(f"{path} has no {METADATA_KEY.decode()} entry in its Parquet metadata")
    return PrecomputeSpec.from_dict(json.loads(metadata[METADATA_KEY]), str(path))


def load_precomputed_params(directory: str | os.PathLike) -> PrecomputedParams:
    """The finished table in ``directory``, for lookups (files are read when first needed).

    An error when the manifest is missing or from another algorithm version, or when a file is
    missing or has another size than listed.

    Example:
        >>> import tempfile
        >>> out = tempfile.mkdtemp()
        >>> _ = write_precomputed_params(PrecomputeSpec(10, epochs=1, seed=3), out, progress=False)
        >>> load_precomputed_params(out).spec.seed
        3
    """
    directory = Path(directory)
    spec, receipts = _read_manifest(directory)
    _check_sizes(directory, receipts)
    return PrecomputedParams(directory, spec)


class PrecomputedParams:
    """A finished table: the parameters of any sample ids, columnar, read from its files.

    Build it with ``load_precomputed_params``. Files are memory-mapped when a lookup first needs
    them (the last 64 stay mapped) and values are gathered from views of them: the table is
    never read whole. Picklable (the maps stay behind), so it travels to DataLoader workers.

    Example:
        >>> import tempfile
        >>> out = tempfile.mkdtemp()
        >>> spec = PrecomputeSpec(50, epochs=2, seed=1)
        >>> _ = write_precomputed_params(spec, out, progress=False)
        >>> params = load_precomputed_params(out)
        >>> ids = np.array([7, 3, 42])
        >>> got = params.batch(ids, epoch=1)
        >>> want = gen_augmentation_params_batch(ids, base_seed=1, epoch=1, rank_aware=False)
        >>> all(np.array_equal(got[k], want[k]) for k in want)
        True
    """

    def __init__(self, directory: str | os.PathLike, spec: PrecomputeSpec) -> None:
        self.directory = Path(directory)
        self.spec = spec
        self._groups = functools.lru_cache(maxsize=_OPEN_FILES)(self._map_groups)

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory, "spec": self.spec}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["directory"], state["spec"])

    def __repr__(self) -> str:
        return f"PrecomputedParams({str(self.directory)!r}, {self.spec})"

    def batch(
        self, sample_ids: Sequence[int] | np.ndarray, epoch: int, rank: int | None = None
    ) -> dict[str, np.ndarray]:
        """Parameters of ``sample_ids`` at ``epoch``, as ``gen_augmentation_params_batch``
        returns them: the same keys, dtypes and bits.

        ``rank`` is required for a rank-aware table; for a plain one it only fills the
        ``rank`` column (default 0), as in ``gen_augmentation_params_batch``.
        """
        ids = as_sample_ids(sample_ids)
        rank = self._rank(rank)
        location = self._first_row(ids, epoch, rank) + ids
        names = self.spec.value_columns()
        out = {name: np.empty(len(ids), _VALUE_TYPES.get(name, np.float64)) for name in names}
        for (file_index, group_index), where, offset in self._locate(location):
            columns = self._groups(file_index)[group_index]
            for name in names:
                out[name][where] = columns[name][offset]
        return {
            **{name: out[name] for name in names[:-1]},
            "sample_id": ids,
            "rank": np.full(ids.shape, rank, dtype=np.int64),
            "epoch": np.full(ids.shape, epoch, dtype=np.int64),
            "seed": out["seed"],
        }

    def _locate(self, rows: np.ndarray) -> list[tuple[tuple[int, int], Any, np.ndarray]]:
        """Per row group that ``rows`` touch: its (file, group) numbers, which of ``rows`` lie
        in it (a mask, or every one) and their offsets in the group."""
        if rows.size == 0:
            return []
        first, last = self._group_of(int(rows.min())), self._group_of(int(rows.max()))
        if first == last:  # the usual case: a window of ids in one row group
            start = first[0] * self.spec.rows_per_file + first[1] * ROWS_PER_GROUP
            return [(first, slice(None), rows - start)]
        file, row = np.divmod(rows, self.spec.rows_per_file)
        group, offset = np.divmod(row, ROWS_PER_GROUP)
        number = file * self.spec.groups_per_file + group  # numbered across the table
        located = []
        for n in np.unique(number).tolist():
            where = number == n
            located.append((divmod(n, self.spec.groups_per_file), where, offset[where]))
        return located

    def _group_of(self, row: int) -> tuple[int, int]:
        file, row_in_file = divmod(row, self.spec.rows_per_file)
        return file, row_in_file // ROWS_PER_GROUP

    def _rank(self, rank: int | None) -> int:
        if not self.spec.rank_aware:
            return check_int("rank", 0 if rank is None else rank, low=0)
        if rank is None:
            raise ValueError(f"rank is required: the table in {self.directory} is rank-aware")
        return check_int("rank", rank, low=0, high=self.spec.world_size - 1)

    def _first_row(self, ids: np.ndarray, epoch: int, rank: int) -> int:
        epoch = check_int("epoch", epoch, low=0)
        if epoch >= self.spec.epochs:
            raise ValueError(
                f"epoch {epoch} is not in the table in {self.directory} "
                f"(epochs 0 to {self.spec.epochs - 1})"
            )
        if ids.size and ids.max() >= self.spec.num_samples:
            raise ValueError(
                f"sample_ids must be below the table's num_samples="
                f"{self.spec.num_samples}, got {ids.max()}"
            )
        return self.spec.first_row(epoch, rank)

    def _map_groups(self, file_index: int) -> list[dict[str, np.ndarray]]:
        """Per row group of a file, its value columns as views of the memory-mapped file,
        checked against the table's description and layout."""
        path = self.directory / self.spec.file_name(file_index)
        data = map_file(str(path))
        found = _file_spec(pq.ParquetFile(pa.BufferReader(data)), path)
        if found != self.spec:
            raise ValueError(f"{path} belongs to another table ({found.differences(self.spec)})")
        groups = column_views(data, self.spec.value_columns(), str(path))
        sizes = [len(group["seed"]) for group in groups]
        rows = self.spec.file_rows(file_index)
        if sizes != [len(part) for part in _row_groups(rows)]:
            raise ValueError(
                f"{path} has row groups of {sizes} rows, the table needs {len(rows)} "
                f"rows in groups of {ROWS_PER_GROUP}"
            )
        return groups

    def check_covers(
        self,
        config: AugmentationConfig | None,
        seed: int,
        epochs_needed: range | int,
        num_samples: int,
        rank_aware: bool,
        world_size: int,
    ) -> None:
        """Raise ``ValueError`` naming what differs unless this table holds the parameters a
        dataset with these settings asks for: the same config (None: the ``moderate`` preset)
        and seed, every epoch of ``epochs_needed`` (one epoch when an int), ids below
        ``num_samples``, and the same form (rank-aware with the same world size, or plain).
        """
        spec, source = self.spec, f"the table in {self.directory}"
        config = AugmentationConfig() if config is None else config
        if config != spec.config:
            raise ValueError(
                f"config differs from {source}: {config.to_dict()} != {spec.config.to_dict()}"
            )
        if seed != spec.seed:
            raise ValueError(f"seed {seed} differs from {source}'s {spec.seed}")
        if not isinstance(epochs_needed, range):
            epoch = check_int("epochs_needed", epochs_needed, low=0)
            epochs_needed = range(epoch, epoch + 1)
        if epochs_needed and (min(epochs_needed) < 0 or max(epochs_needed) >= spec.epochs):
            raise ValueError(
                f"epochs {epochs_needed} are not all in {source} (epochs 0 to {spec.epochs - 1})"
            )
        if num_samples > spec.num_samples:
            raise ValueError(
                f"num_samples {num_samples} exceeds {source}'s {spec.num_samples}: "
                f"sample ids from {spec.num_samples} on are not in it"
            )
        if rank_aware != spec.rank_aware:
            kind = "rank-aware" if spec.rank_aware else "plain"
            raise ValueError(f"rank_aware={rank_aware} but {source} is {kind}")
        if rank_aware and world_size != spec.world_size:
            raise ValueError(f"world_size {world_size} differs from {source}'s {spec.world_size}")


# --- verifying ---------------------------------------------------------------------------------


def verify_precomputed_params(directory: str | os.PathLike, fraction: float = 1.0) -> int:
    """Check the finished table in ``directory`` against the parameters it should hold; the
    number of rows recomputed.

    Every file is checked to be listed and present, and no other Parquet file to lie beside
    them. Then every row of the files checked (all, or ``fraction`` of them
    chosen at random, at least one) is read with plain pyarrow and compared bit for bit with
    a fresh computation: keys first (each sample id, epoch and rank exactly once, in order),
    then values, then the file's sha256. The first difference raises ``ValueError`` naming the
    file, row, column, expected and found values.

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
    spec, receipts = _read_manifest(directory)
    stray = sorted(set(_parquet_names(directory)) - {r["name"] for r in receipts})
    if stray:
        raise ValueError(
            f"{directory / stray[0]} is not part of the table (a Parquet reader "
            "of the directory would read it too)"
        )
    count = max(1, math.ceil(fraction * spec.num_files))
    chosen = sorted(random.sample(range(spec.num_files), count))
    return sum(_verify_file(directory, spec, i, receipts[i]) for i in chosen)


def _parquet_names(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if n.endswith(".parquet") and n[0] not in "._"]


def _verify_file(directory: Path, spec: PrecomputeSpec, index: int, receipt: dict) -> int:
    path = directory / receipt["name"]
    file = pq.ParquetFile(path)
    found = _file_spec(file, path)
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
    start, row = spec.file_rows(index).start, 0
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
