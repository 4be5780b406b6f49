"""nnh_data.precompute (spec, write, read, verify): values and coverage, lookups, task splits in
real ``nnh-precompute`` processes (one killed and rerun), verify and bad tables. The command itself
(its subcommands, messages and exit codes): ``test_precompute_cli.py``."""

from __future__ import annotations

import itertools
import json
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from nnh_data import (
    PrecomputedParams,
    PrecomputeSpec,
    gen_augmentation_params,
    gen_augmentation_params_batch,
    gen_distributed_augmentation_params,
    get_preset,
    load_precomputed_params,
    verify_precomputed_params,
    write_precomputed_params,
)
from nnh_data.precompute.cli import main
from nnh_data.precompute.spec import MANIFEST_NAME, ROWS_PER_GROUP
from nnh_data.precompute.write import finalize_precomputed_params
from nnh_data.seeding import ALGORITHM_VERSION, seed_hex

MILD = get_preset("mild")
PLAIN = {"num_samples": 37, "epochs": 3, "seed": 11, "rows_per_file": 25}  # files span epochs
RANKS = {"num_samples": 23, "epochs": 2, "seed": 5, "rank_aware": True, "world_size": 3,
         "rows_per_file": 40}  # fmt: skip
CLI = [sys.executable, "-m", "nnh_data.precompute.cli"]


def write(directory: Path, **kwargs) -> Path:
    write_precomputed_params(PrecomputeSpec(config=MILD, **kwargs), directory, progress=False)
    return directory


def scalar_params(row: dict, spec: PrecomputeSpec) -> dict:
    """What the scalar generator gives for a row's keys."""
    if spec.rank_aware:
        return gen_distributed_augmentation_params(
            row["sample_id"], row["rank"], spec.config, spec.seed, spec.world_size, row["epoch"]
        )
    return gen_augmentation_params(row["sample_id"], spec.config, spec.seed, row["epoch"])


def assert_same_columns(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert got[key].tobytes() == want[key].tobytes(), key


def tree(directory: Path) -> dict[str, bytes]:
    """Every file below ``directory`` (hidden ones too) by relative path, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file()}  # fmt: skip


# --- the table's content -----------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [PLAIN, RANKS], ids=["plain", "rank-aware"])
def test_rows_equal_the_scalar_generators_each_key_once(tmp_path, kwargs):
    spec = PrecomputeSpec(config=MILD, **kwargs)
    rows = pq.read_table(write(tmp_path / "t", **kwargs)).to_pylist()  # as any reader sees it
    keys = [(r["epoch"], r.get("rank", 0), r["sample_id"]) for r in rows]
    assert keys == list(itertools.product(range(spec.epochs), range(spec.ranks),
                                          range(spec.num_samples)))  # fmt: skip
    for row in rows[::5]:
        want = scalar_params(row, spec)
        assert {**row, "seed": seed_hex(row["seed"])} == {key: want[key] for key in row}


def test_files_carry_the_description_and_sort_in_row_order(tmp_path):
    out = write(tmp_path / "t", **PLAIN)
    names = sorted(p.name for p in out.glob("*.parquet"))
    assert names == [f"part-{i:06d}.parquet" for i in range(5)]  # 111 rows, 25 a file
    described = json.loads(pq.read_schema(out / names[3]).metadata[b"nnh.precompute"])
    assert described["config"] == MILD.to_dict() and described["seed"] == 11
    assert described["epochs"] == 3 and described["algorithm_version"] == ALGORITHM_VERSION
    assert described["package_version"]
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert [f["name"] for f in manifest["files"]] == names
    assert [f["rows"] for f in manifest["files"]] == [25, 25, 25, 25, 11]


# --- lookups -----------------------------------------------------------------------------------

BIG = {"num_samples": 70_000, "epochs": 2, "seed": 3, "rows_per_file": 100_000}  # 3 row groups


@pytest.fixture(scope="module")
def big_table(tmp_path_factory) -> PrecomputedParams:
    return load_precomputed_params(write(tmp_path_factory.mktemp("big"), **BIG))


def generated(ids, epoch: int, spec: PrecomputeSpec, rank: int = 0) -> dict:
    return gen_augmentation_params_batch(
        ids, rank, spec.world_size, spec.config, spec.seed, epoch, spec.rank_aware
    )


@settings(max_examples=40, deadline=None)
@given(
    ids=st.lists(st.integers(0, BIG["num_samples"] - 1), max_size=300),
    epoch=st.integers(0, BIG["epochs"] - 1),
)
def test_batch_equals_generation_for_any_ids(big_table, ids, epoch):
    ids = np.array(ids, dtype=np.int64)
    assert_same_columns(big_table.batch(ids, epoch), generated(ids, epoch, big_table.spec))


@pytest.mark.parametrize("first", [0, ROWS_PER_GROUP - 100, 30_000, BIG["num_samples"] - 500])
def test_batch_of_a_shuffled_window_across_groups_and_files(big_table, first):
    ids = np.random.default_rng(first).permutation(np.arange(first, first + 500))
    for epoch in (0, 1):  # epoch 1 of the first window crosses from file 0 into file 1
        assert_same_columns(big_table.batch(ids, epoch), generated(ids, epoch, big_table.spec))


def test_rank_aware_batch_for_every_rank_and_epoch(tmp_path):
    params = load_precomputed_params(write(tmp_path / "t", **RANKS))
    ids = np.array([22, 0, 7, 7, 13])
    for epoch, rank in itertools.product(range(2), range(3)):
        want = generated(ids, epoch, params.spec, rank)
        assert_same_columns(params.batch(ids, epoch, rank=rank), want)


def test_plain_batch_reports_the_rank_asked_and_any_world(big_table):
    ids = np.arange(5)
    want = gen_augmentation_params_batch(ids, 3, 8, MILD, 3, 1, rank_aware=False)
    assert_same_columns(big_table.batch(ids, 1, rank=3), want)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: p.batch([1], epoch=2), r"epoch 2 is not in the table .* \(epochs 0 to 1\)"),
        (lambda p: p.batch([70_000], epoch=0), "sample_ids must be below .*70000, got 70000"),
        (lambda p: p.batch([-1], epoch=0), "sample_ids must be in"),
        (lambda p: p.batch([1], epoch=0, rank=-1), "rank must be in"),
    ],
)
def test_batch_rejects_what_the_table_lacks(big_table, call, message):
    with pytest.raises(ValueError, match=message):
        call(big_table)


def test_rank_aware_table_needs_a_rank(tmp_path):
    params = load_precomputed_params(write(tmp_path / "t", **RANKS))
    with pytest.raises(ValueError, match="rank is required"):
        params.batch([1], epoch=0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\], got 3"):
        params.batch([1], epoch=0, rank=3)


class Windows(Dataset):
    def __init__(self, params: PrecomputedParams) -> None:
        self.params = params

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict:
        return self.params.batch(np.arange(i * 1000, i * 1000 + 1000), epoch=1)


@pytest.mark.timeout(60)
def test_lookups_in_dataloader_workers_and_after_pickling(big_table):
    loader = DataLoader(Windows(big_table), batch_size=None, num_workers=2)
    for i, batch in enumerate(loader):
        want = generated(np.arange(i * 1000, i * 1000 + 1000), 1, big_table.spec)
        assert all(np.array_equal(batch[key].numpy(), want[key]) for key in want)
    copy = pickle.loads(pickle.dumps(big_table))
    assert_same_columns(copy.batch([5, 69_999], 0), big_table.batch([5, 69_999], 0))


# --- what check_covers accepts -----------------------------------------------------------------

COVERED = {"config": MILD, "seed": 3, "epochs_needed": range(2), "num_samples": 70_000,
           "rank_aware": False, "world_size": 8}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"config": get_preset("aggressive")}, "config differs"),
        ({"config": None}, "config differs"),  # None is the moderate preset
        ({"seed": 4}, "seed 4 differs from .*'s 3"),
        ({"epochs_needed": range(3)}, r"epochs range\(0, 3\) are not all in"),
        ({"epochs_needed": 2}, r"epochs range\(2, 3\) are not all in"),
        ({"num_samples": 70_001}, "num_samples 70001 exceeds .*70000"),
        ({"rank_aware": True}, "rank_aware=True but .* is plain"),
    ],
)
def test_check_covers_names_what_differs(big_table, change, message):
    with pytest.raises(ValueError, match=message):
        big_table.check_covers(**{**COVERED, **change})


def test_check_covers_accepts_what_the_table_holds(big_table, tmp_path):
    big_table.check_covers(**COVERED)
    big_table.check_covers(**{**COVERED, "epochs_needed": 1, "num_samples": 10})
    ranks = load_precomputed_params(write(tmp_path / "t", **RANKS))
    covered = {**COVERED, "seed": 5, "num_samples": 23, "rank_aware": True, "world_size": 3}
    ranks.check_covers(**covered)
    with pytest.raises(ValueError, match="world_size 4 differs from .*'s 3"):
        ranks.check_covers(**{**covered, "world_size": 4})


# --- task splits and restarts ------------------------------------------------------------------

SPLIT = ["--num-samples", "200000", "--epochs", "2", "--preset", "mild", "--seed", "9",
         "--rows-per-file", "50000", "--no-progress"]  # fmt: skip  # 8 files, 2 a task


def kill_while_writing(command: list[str], temporary: Callable[[int], Path | None]) -> None:
    """Start ``command`` and SIGKILL it once ``temporary(pid)`` finds a file it is writing."""
    task = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while temporary(task.pid) is None:
        assert task.poll() is None, "the task ended before it could be killed mid-run"
        assert time.monotonic() < deadline, "the task never started its last file"
        time.sleep(0.001)
    task.send_signal(signal.SIGKILL)
    task.wait(timeout=10)


@pytest.mark.timeout(180)
def test_four_tasks_one_killed_and_rerun_equal_one_task(tmp_path):
    one, four = tmp_path / "one", tmp_path / "four"
    assert main([*SPLIT, "--out", str(one)]) == 0
    task = [*CLI, *SPLIT, "--out", str(four), "--num-tasks", "4", "--task-index"]
    others = [subprocess.Popen([*task, str(i)]) for i in (0, 1, 3)]
    writing = lambda pid: next(four.glob(f".part-000005.parquet.{pid}.*.tmp"), None)  # noqa: E731
    kill_while_writing([*task, "2"], writing)
    assert [p.wait(timeout=120) for p in others] == [0, 0, 0]
    assert not (four / "_done" / "part-000005.parquet.json").exists()
    assert not (four / MANIFEST_NAME).exists()
    # Files are written in a pipeline: the killed task may have left its file 4 without its
    # receipt (then it is redone); a file with a receipt is never redone.
    kept = {p.name: p.stat().st_mtime_ns for p in four.glob("part-*.parquet")
            if (four / "_done" / f"{p.name}.json").exists()}  # fmt: skip
    assert len(kept) >= 6  # the other tasks' files
    assert subprocess.run([*task, "2"], timeout=120).returncode == 0
    assert {name: (four / name).stat().st_mtime_ns for name in kept} == kept  # not redone
    assert tree(four) == tree(one)  # every file, manifest and receipt, byte for byte; no leftovers


def test_slurm_array_variables_pick_the_task(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "11")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "10")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    written = write_precomputed_params(PrecomputeSpec(30, 1, rows_per_file=10), tmp_path,
                                       progress=False)  # fmt: skip
    assert written == ["part-000001.parquet"]


def test_finalize_names_what_is_missing_then_writes_the_manifest(tmp_path):
    spec = PrecomputeSpec(30, 1, rows_per_file=10)
    write_precomputed_params(spec, tmp_path, task_index=0, num_tasks=2, progress=False)
    with pytest.raises(ValueError, match=r"incomplete: 1 of 3 files are not done \(part-000002"):
        finalize_precomputed_params(tmp_path)
    with pytest.raises(ValueError, match="incomplete or not finalized"):
        load_precomputed_params(tmp_path)
    write_precomputed_params(spec, tmp_path, task_index=1, num_tasks=2, progress=False)
    (tmp_path / MANIFEST_NAME).unlink()  # as if the last task's node went down before it
    assert finalize_precomputed_params(tmp_path) == tmp_path / MANIFEST_NAME
    assert verify_precomputed_params(tmp_path) == 30


def test_a_directory_holds_one_table(tmp_path):
    write(tmp_path, **PLAIN)
    with pytest.raises(ValueError, match=r"holds another table \(seed: 11 != 12"):
        write(tmp_path, **{**PLAIN, "seed": 12})


# --- verify ------------------------------------------------------------------------------------


@pytest.fixture
def table(tmp_path) -> Path:
    return write(tmp_path / "t", num_samples=30, epochs=2, seed=1, rows_per_file=20)  # 3 files


def test_verify_recomputes_every_row_or_a_fraction_of_the_files(table):
    assert verify_precomputed_params(table) == 60
    assert verify_precomputed_params(table, fraction=0.3) == 20


def test_verify_names_a_changed_value(table):
    path = table / "part-000001.parquet"
    value = pq.read_table(path)["rotation"][3].as_py()
    data = path.read_bytes()
    assert data.count(struct.pack("<d", value)) == 1
    path.write_bytes(data.replace(struct.pack("<d", value), struct.pack("<d", value + 1)))
    with pytest.raises(ValueError, match=rf"part-000001.parquet row 3 column rotation: expected "
                       rf"{value}, found {value + 1}"):  # fmt: skip
        verify_precomputed_params(table)


def test_verify_names_a_duplicated_row(table):
    path = table / "part-000000.parquet"
    rows = pq.read_table(path)
    duplicated = rows.take([0, 1, 2, 3, 4, 4, *range(6, 20)])
    pq.write_table(duplicated, path)
    with pytest.raises(ValueError, match="row 5 column sample_id: expected 5, found 4 .*once"):
        verify_precomputed_params(table)
    pq.write_table(rows.take([*range(20), 19]), path)
    with pytest.raises(ValueError, match="holds 21 rows, the table needs 20"):
        verify_precomputed_params(table)


def test_verify_names_a_missing_or_stray_file(table):
    shutil.copy(table / "part-000000.parquet", table / "part-000009.parquet")
    with pytest.raises(ValueError, match="part-000009.parquet is not part of the table"):
        verify_precomputed_params(table)
    (table / "part-000009.parquet").unlink()
    (table / "part-000002.parquet").unlink()
    with pytest.raises(ValueError, match="part-000002.parquet is missing"):
        verify_precomputed_params(table)


def test_verify_names_a_file_whose_bytes_differ_with_equal_values(table):
    path = table / "part-000001.parquet"
    pq.write_table(pq.read_table(path), path, compression="zstd")
    with pytest.raises(ValueError, match="sha256 .* though every value matches"):
        verify_precomputed_params(table)


# --- bad tables --------------------------------------------------------------------------------


def test_a_table_from_another_algorithm_version_is_refused(table):
    manifest = json.loads((table / MANIFEST_NAME).read_text())
    manifest["table"]["algorithm_version"] = ALGORITHM_VERSION + 1
    (table / MANIFEST_NAME).write_text(json.dumps(manifest))
    for read in (load_precomputed_params, verify_precomputed_params):
        with pytest.raises(ValueError, match=f"algorithm version {ALGORITHM_VERSION + 1}"):
            read(table)


def test_a_file_of_another_table_is_refused_at_lookup(table, tmp_path):
    other = write(tmp_path / "other", num_samples=30, epochs=2, seed=2, rows_per_file=20)
    shutil.copy(other / "part-000001.parquet", table / "part-000001.parquet")
    params = load_precomputed_params(table)  # same size: only the first lookup reads the file
    params.batch([0], epoch=0)
    with pytest.raises(ValueError, match=r"part-000001.parquet belongs to another table \(seed"):
        params.batch([25], epoch=0)


def test_missing_truncated_or_unfinished_tables_are_refused(table, tmp_path):
    path = table / "part-000002.parquet"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="has .* bytes, .* listed"):
        load_precomputed_params(table)
    path.unlink()
    with pytest.raises(ValueError, match="part-000002.parquet is missing"):
        load_precomputed_params(table)
    with pytest.raises(ValueError, match="does not exist"):
        load_precomputed_params(tmp_path / "nowhere")
    (table / MANIFEST_NAME).write_text("[1, 2]")
    with pytest.raises(ValueError, match="is not an nnh-precompute manifest"):
        load_precomputed_params(table)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_samples": 0, "epochs": 1}, r"num_samples must be in \[1, "),
        ({"num_samples": 5, "epochs": 0}, r"epochs must be in \[1, inf\), got 0"),
        ({"num_samples": 5, "epochs": 1, "world_size": 2}, "world_size is 2 but rank_aware"),
        ({"num_samples": 5, "epochs": 1, "seed": -1}, "seed must be in"),
        ({"num_samples": 5, "epochs": 1, "rows_per_file": 0}, "rows_per_file must be in"),
        ({"num_samples": 5, "epochs": 1, "config": "mild"}, "config must be an Augmentation"),
        ({"num_samples": 5, "epochs": 1, "rank_aware": 1}, "rank_aware must be True or False"),
    ],
)
def test_spec_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrecomputeSpec(**kwargs)


def test_a_table_with_crop_and_flip_columns(tmp_path):
    """The imagenet preset's geometry columns are stored, looked up, verified and streamed."""
    cfg = get_preset("imagenet")
    spec = PrecomputeSpec(num_samples=30, epochs=2, config=cfg, seed=3, rows_per_file=25)
    write_precomputed_params(spec, tmp_path, progress=False)
    assert verify_precomputed_params(tmp_path) == 60
    table = pq.read_table(tmp_path)
    assert table.column_names[-6:] == ["crop_x", "crop_y", "crop_w", "crop_h", "flip", "seed"]
    ids = np.array([29, 0, 7, 25])
    got = load_precomputed_params(tmp_path).batch(ids, epoch=1)
    want = gen_augmentation_params_batch(ids, config=cfg, base_seed=3, epoch=1, rank_aware=False)
    assert list(got) == list(want)
    assert all(got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]) for k in want)
