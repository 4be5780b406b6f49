from __future__ import annotations

import json
from importlib.metadata import entry_points

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nnh_data.cli import main
from nnh_data.shards import build_shard_index, iter_shard_samples


def test_index_prints_a_summary_and_saves_the_sidecar(tar_shards, tmp_path, capsys):
    tar_shards([3, 0, 4])
    assert main(["index", str(tmp_path / "shard-{000000..000002}.tar")]) == 0
    out = capsys.readouterr().out
    assert "3 shards, 7 samples (0 to 4 per shard)" in out
    assert str(tmp_path / "nnh-index.json") in out
    assert len(json.loads((tmp_path / "nnh-index.json").read_text())["shards"]) == 3


def test_convert_a_folder_of_files(tmp_path, capsys):
    for key in range(5):
        (tmp_path / f"{key:03d}.txt").write_text(f"text {key}")
        (tmp_path / f"{key:03d}.cls").write_text(str(key))
    pattern = str(tmp_path / "out" / "s-%02d.tar")
    assert main(["convert", str(tmp_path), pattern, "--max-count", "2"]) == 0
    assert "3 shards, 5 samples" in capsys.readouterr().out
    index = build_shard_index(str(tmp_path / "out" / "s-*.tar"))
    samples = [s for info in index.shards for s in iter_shard_samples(info)]
    assert samples[4] == {"__key__": "004", "cls": b"4", "txt": b"text 4"}


def test_convert_parquet(tmp_path, capsys):
    pq.write_table(pa.table({"__key__": ["a", "b"], "txt": ["x", "y"]}), tmp_path / "t.parquet")
    assert main(["convert", str(tmp_path / "*.parquet"), str(tmp_path / "s-%d.tar")]) == 0
    index = build_shard_index(str(tmp_path / "s-0.tar"))
    assert list(iter_shard_samples(index.shards[0])) == [
        {"__key__": "a", "txt": b"x"},
        {"__key__": "b", "txt": b"y"},
    ]


def test_usage_errors_exit_nonzero(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["index"])
    assert caught.value.code == 2


def test_console_script_is_main():
    (script,) = entry_points(group="console_scripts", name="nnh-data")
    assert script.load() is main
