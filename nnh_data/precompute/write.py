"""Writing a precomputed parameter table: by job-array tasks, restartable, finalized once.

Format, and its trade-off. pyarrow decodes every Parquet page it reads into new memory, so a
lookup through it costs whole row groups (64K rows, about 1 ms) however few ids it wants, and
a streaming window's ids (a few thousand, from one shard) would pay that again at each shard.
So the parameter and seed columns are written PLAIN, uncompressed, one page per row group, and
lookups view them in place in the memory-mapped file (:mod:`nnh_data.precompute.views`): a
lookup costs only the ids it touches, and every worker of a node shares the page cache. The
price is small: zstd would save 6% of these columns (random 64-bit values hardly compress;
measured 48.0 against 45.4 MB per million rows) at 1.7x the write time and a decoding copy per
read. The key columns (sample id, epoch, rank), which lookups never read, are delta-encoded to
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

import hashlib
import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from nnh_data.atomic import replace_file, temporary_name
from nnh_data.order.ranges import DistributedRangeSplitter
from nnh_data.precompute.job_array import array_task_info
from nnh_data.precompute.spec import (
    DONE_FOLDER,
    MANIFEST_NAME,
    ROWS_PER_GROUP,
    SPEC_NAME,
    PrecomputeSpec,
    check_files,
    check_sizes,
    dumps_json,
    read_json,
    row_groups,
)
from nnh_data.precompute.views import ONE_PAGE_OPTIONS, column_views, map_file

__all__ = ["finalize_precomputed_params", "write_precomputed_params"]


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
    (directory / DONE_FOLDER).mkdir(parents=True, exist_ok=True)
    path = directory / SPEC_NAME
    if not path.exists():
        replace_file(path, dumps_json(spec.to_dict()))
        return
    found = PrecomputeSpec.from_dict(read_json(path), str(path))
    if found != spec:
        raise ValueError(
            f"{directory} holds another table ({found.differences(spec)}, recorded != asked): "
            "pass the same arguments, or write to another directory"
        )


def _remove_temporaries(directory: Path, names: set[str]) -> None:
    """Remove what killed runs left of files ``names`` and their receipts (their temporary
    names: :func:`~nnh_data.atomic.temporary_name`)."""
    targets = names | {f"{name}.json" for name in names}
    for folder in (directory, directory / DONE_FOLDER):
        for entry in os.listdir(folder):
            if entry.endswith(".tmp") and entry[1:].rsplit(".", 3)[0] in targets:
                (folder / entry).unlink(missing_ok=True)


def _write_files(directory: Path, spec: PrecomputeSpec, todo: list[int], bar: tqdm) -> None:
    """Write files ``todo`` in three stages that run at once: a thread computes the rows of
    the next row group, this one encodes and writes the current one, another thread checks,
    hashes and commits finished files (numpy, pyarrow, hashlib and file I/O release the GIL).
    Memory holds two row groups, whatever the size of the table."""
    parts = [(i, rows) for i in todo for rows in row_groups(spec.file_rows(i))]
    with ThreadPoolExecutor(1) as computer, ThreadPoolExecutor(1) as committer:
        tables = _computed_ahead(computer, lambda part: spec.table(part[1]), parts)
        commits = []
        for index, group in itertools.groupby(zip(parts, tables), key=lambda pair: pair[0][0]):
            temporary = _write_file(directory / spec.file_name(index), spec, (t for _, t in group))
            commits.append(committer.submit(_commit, directory, spec, index, temporary))
            bar.update(len(spec.file_rows(index)))
        for commit in commits:
            commit.result()


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
    temporary = Path(temporary_name(str(path)))
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
    replace_file(directory / DONE_FOLDER / f"{path.name}.json", dumps_json(receipt))


def _receipt_names(directory: Path) -> set[str]:
    """Names of the files whose receipt exists."""
    receipts = directory / DONE_FOLDER
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
    if not (directory / SPEC_NAME).exists():
        raise ValueError(f"directory {directory} holds no table: no {SPEC_NAME} in it")
    spec = PrecomputeSpec.from_dict(read_json(directory / SPEC_NAME), str(directory))
    missing = _missing(directory, spec)
    if missing:
        raise ValueError(
            f"the table in {directory} is incomplete: {len(missing)} of {spec.num_files} files "
            f"are not done ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
            "rerun the tasks that wrote them"
        )
    receipts = [
        read_json(directory / DONE_FOLDER / f"{spec.file_name(i)}.json")
        for i in range(spec.num_files)
    ]
    check_files(directory, spec, receipts)
    check_sizes(directory, receipts)
    path = directory / MANIFEST_NAME
    replace_file(path, dumps_json({"table": spec.to_dict(), "files": receipts}))
    return path
