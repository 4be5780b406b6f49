"""Reading a finished parameter table: lookups of any sample ids, columnar, from mapped files.

Files are mapped when a lookup first needs them (the last 64 stay mapped) and values gathered
from views of their pages (:mod:`nnh_data.precompute.views`): the table is never read whole,
and every worker of a node shares the page cache. A changed file is an error, never other
numbers: at open every file must have its listed size; when a file is first mapped in a
process its footer must describe this table; and when a row group is first used, its value
pages must have the CRC-32 their headers record (about 1 ms a row group of 65,536 rows, once
per process: a flipped byte anywhere in the values is found before a value of that group is
returned). A table written before page checksums has its file's sha256 checked against the
manifest instead, when the file is first mapped.
"""

from __future__ import annotations

import functools
import hashlib
import os
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from nnh_data.augment.params import AugmentationConfig
from nnh_data.checks import check_int
from nnh_data.precompute.spec import (
    ROWS_PER_GROUP,
    VALUE_TYPES,
    PrecomputeSpec,
    check_sizes,
    file_spec,
    read_manifest,
    row_groups,
)
from nnh_data.precompute.views import column_views, map_file, page_checksums
from nnh_data.seeding import as_sample_ids

__all__ = ["PrecomputedParams", "load_precomputed_params"]


_OPEN_FILES = 64  # files a lookup keeps mapped (no descriptor stays open; mappings are capped)


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
    spec, receipts = read_manifest(directory)
    check_sizes(directory, receipts)
    return PrecomputedParams(directory, spec, [receipt["sha256"] for receipt in receipts])


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

    def __init__(
        self, directory: str | os.PathLike, spec: PrecomputeSpec, digests: Sequence[str]
    ) -> None:
        self.directory = Path(directory)
        self.spec = spec
        self.digests = list(digests)  # each file's sha256, from the manifest
        self._groups = functools.lru_cache(maxsize=_OPEN_FILES)(self._map_groups)

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory, "spec": self.spec, "digests": self.digests}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["directory"], state["spec"], state["digests"])

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
        out = {name: np.empty(len(ids), VALUE_TYPES.get(name, np.float64)) for name in names}
        for (file_index, group_index), where, offset in self._locate(location):
            columns = self._groups(file_index).group(group_index)
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

    def _map_groups(self, file_index: int) -> _MappedFile:
        """A file's row groups, their value columns as views of the memory-mapped file,
        checked against the table's description and layout (and, for a file without page
        checksums, its bytes against the manifest's sha256)."""
        path = self.directory / self.spec.file_name(file_index)
        data = map_file(str(path))
        found = file_spec(pq.ParquetFile(pa.BufferReader(data)), path)
        if found != self.spec:
            raise ValueError(f"{path} belongs to another table ({found.differences(self.spec)})")
        groups = column_views(data, self.spec.value_columns(), str(path))
        sizes = [len(group["seed"]) for group in groups]
        rows = self.spec.file_rows(file_index)
        if sizes != [len(part) for part in row_groups(rows)]:
            raise ValueError(
                f"{path} has row groups of {sizes} rows, the table needs {len(rows)} "
                f"rows in groups of {ROWS_PER_GROUP}"
            )
        checksums = page_checksums(data, self.spec.value_columns())
        if any(crc is None for group in checksums for crc in group.values()):
            if hashlib.sha256(data).hexdigest() != self.digests[file_index]:
                raise ValueError(f"{path}: {_CHANGED}")
            checksums = None  # checked whole
        return _MappedFile(path, groups, checksums)

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


_CHANGED = (
    "its bytes differ from what was written (the manifest's sha256, or a page checksum): the "
    "file changed or was damaged after it was written; write the table again and check it "
    "with `nnh-precompute verify`"
)


class _MappedFile:
    """A mapped file's row groups (value columns as views), each checked against the CRC-32
    of its pages when first used (``checksums`` None: the file was checked whole)."""

    def __init__(
        self, path: Path, groups: list[dict[str, np.ndarray]],
        checksums: list[dict[str, int | None]] | None,
    ) -> None:  # fmt: skip
        self.path, self.groups, self.checksums = path, groups, checksums
        self._checked: set[int] = set()

    def group(self, number: int) -> dict[str, np.ndarray]:
        columns = self.groups[number]
        if self.checksums is not None and number not in self._checked:
            for name, view in columns.items():
                if zlib.crc32(view) != self.checksums[number][name]:
                    raise ValueError(f"{self.path}: row group {number}, column {name}: "
                                     f"{_CHANGED}")  # fmt: skip
            self._checked.add(number)
        return columns
