"""A precomputed parameter table changed after it was written: a byte flipped in place in a
value page (the size unchanged), with and without page checksums (tables written before them),
is an error at the first lookup of that row group, never a wrong value; a file truncated to 100
bytes fails a sampled ``nnh-precompute verify`` whichever files the sample picks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from nnh_data import PrecomputeSpec, gen_augmentation_params_batch, get_preset
from nnh_data.precompute import views
from nnh_data.precompute.read import load_precomputed_params
from nnh_data.precompute.write import write_precomputed_params

pytestmark = pytest.mark.timeout(120)
SPEC = PrecomputeSpec(300, epochs=1, config=get_preset("mild"), seed=4, rows_per_file=30)


def _flip_a_value_byte(path: Path, column: str, row: int) -> None:
    """Flip one bit of value ``row`` of ``column`` in row group 0, in place."""
    data = bytearray(path.read_bytes())
    chunk = pq.read_metadata(path).row_group(0).column(SPEC.column_names().index(column))
    values_end = chunk.data_page_offset + chunk.total_compressed_size
    at = values_end - 8 * chunk.num_values + 8 * row + 3
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("checksums", [True, False], ids=["page-crc", "before-page-crc"])
def test_a_flipped_byte_is_an_error_at_its_first_lookup(checksums, tmp_path, monkeypatch):
    if not checksums:
        monkeypatch.setitem(views.ONE_PAGE_OPTIONS, "write_page_checksum", False)
    write_precomputed_params(SPEC, tmp_path, progress=False)
    path = tmp_path / SPEC.file_name(2)
    _flip_a_value_byte(path, "rotation", 5)
    params = load_precomputed_params(tmp_path)  # the size is unchanged
    ids = np.arange(30)
    want = gen_augmentation_params_batch(ids, config=SPEC.config, base_seed=SPEC.seed,
                                         rank_aware=False)
    assert np.array_equal(params.batch(ids, 0)["rotation"], want["rotation"])  # other files
    with pytest.raises(ValueError, match=rf"{path}: (row group 0, column rotation: )?its bytes "
                       "differ from what was written"):  # fmt: skip
        params.batch(np.arange(60, 90), 0)


def test_a_truncated_file_fails_a_sampled_verify(tmp_path):
    write_precomputed_params(SPEC, tmp_path, progress=False)
    path = tmp_path / SPEC.file_name(7)
    path.write_bytes(path.read_bytes()[:100])
    for _ in range(3):  # whichever file the 1% sample picks
        done = subprocess.run([str(Path(sys.executable).with_name("nnh-precompute")), "verify",
                               str(tmp_path), "--fraction", "0.01"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 1 and done.stdout == "", done.stdout
        assert str(path) in done.stderr and len(done.stderr.splitlines()) == 1
