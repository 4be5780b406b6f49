from __future__ import annotations

import json
from importlib.metadata import entry_points

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nnh_data.cli import main
from nnh_data.shards.reading import build_shard_index, iter_shard_samples


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


def test_convert_a_parquet_folder_and_rerun_inside_it(tmp_path, capsys):
    pq.write_table(pa.table({"n": [1, 2, None]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"n": [4]}), tmp_path / "b.parquet")
    pattern = str(tmp_path / "s-%02d.tar")
    for _ in range(2):  # the second run must not read its own shards or sidecar
        with pytest.warns(UserWarning, match="'a/2' holds only nulls"):
            assert main(["convert", str(tmp_path), pattern]) == 0
        assert "1 shards, 3 samples" in capsys.readouterr().out
    index = build_shard_index(str(tmp_path / "s-00.tar"))
    samples = list(iter_shard_samples(index.shards[0]))
    assert samples[1:] == [{"__key__": "a/1", "n.cls": b"2"}, {"__key__": "b/0", "n.cls": b"4"}]
    for key in range(2):
        (tmp_path / "files" / f"{key}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "files" / f"{key}.txt").write_text("x")
    inside = str(tmp_path / "files" / "out-%d.tar")
    for _ in range(2):
        assert main(["convert", str(tmp_path / "files"), inside]) == 0
        assert "2 samples" in capsys.readouterr().out


def test_options_after_the_command_and_one_line_errors(tar_shards, tmp_path, capsys):
    tar_shards([2])
    source = str(tmp_path / "shard-000000.tar")
    assert main(["index", source, "--storage-options", "{}"]) == 0
    assert main(["--storage-options", "{}", "index", source]) == 0
    nested = tmp_path / "new" / "dir" / "idx.json"
    assert main(["index", source, "--index-path", str(nested)]) == 0 and nested.exists()
    capsys.readouterr()
    with pytest.raises(SystemExit) as caught:
        main(["index", str(tmp_path / "missing.tar")])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("\n") == 1 and "missing.tar" in err
    assert "Traceback" not in err


def test_an_index_that_cannot_be_saved_is_an_error(tar_shards, tmp_path, capsys):
    """A folder nnh cannot write to (here: a path under a file, which fails even for root)."""
    tar_shards([2])
    blocked = tmp_path / "shard-000000.tar" / "nnh-index.json"
    with pytest.raises(SystemExit) as caught:
        main(["index", str(tmp_path / "shard-000000.tar"), "--index-path", str(blocked)])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "could not save" in err and str(blocked) in err


@pytest.mark.parametrize("kind", ["files", "parquet"])
def test_convert_split_over_tasks_equals_one_task(tmp_path, kind, capsys):
    source = tmp_path / "in"
    source.mkdir()
    if kind == "files":
        for key in range(23):
            (source / f"{key:03d}.txt").write_text(f"text {key}")
    else:
        for part, rows in enumerate([10, 0, 13]):
            table = pa.table({"n": list(range(100 * part, 100 * part + rows))})
            pq.write_table(table, source / f"p{part}.parquet", row_group_size=4)

    def shards(folder: str, tasks: int) -> dict[str, bytes]:
        pattern = str(tmp_path / folder / "s-%03d.tar")
        for task in range(tasks):
            flags = ["--task-index", str(task), "--num-tasks", str(tasks), "--max-count", "5"]
            assert main(["convert", str(source), pattern, *flags]) == 0
        return {p.name: p.read_bytes() for p in (tmp_path / folder).glob("s-*.tar")}

    one, three = shards("one", 1), shards("three", 3)
    assert len(one) == 5 and one == three
    assert main(["index", str(tmp_path / "three" / "s-*.tar")]) == 0
    assert "5 shards, 23 samples" in capsys.readouterr().out


def test_convert_task_from_a_slurm_array(tmp_path, monkeypatch):
    for key in range(4):
        (tmp_path / f"{key}.txt").write_text("x")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    assert (
        main(["convert", str(tmp_path), str(tmp_path / "o" / "s-%d.tar"), "--max-count", "1"]) == 0
    )
    assert sorted(p.name for p in (tmp_path / "o").glob("*.tar")) == ["s-2.tar", "s-3.tar"]


def test_convert_refuses_a_key_that_would_leave_the_folder(tmp_path, capsys):
    pq.write_table(pa.table({"__key__": ["ok", "../../x"], "txt": ["a", "b"]}),
                   tmp_path / "t.parquet")  # fmt: skip
    with pytest.raises(SystemExit) as caught:
        main(["convert", str(tmp_path / "t.parquet"), str(tmp_path / "out" / "s-%d.tar")])
    err = capsys.readouterr().err
    assert caught.value.code == 2
    assert err == (
        "nnh-data: error: sample key '../../x' is not a safe relative path (it starts with '/', "
        "has a '..' part or a NUL): tar tools would extract it outside their folder, so it is "
        "refused rather than renamed; give the sample a relative key\n"
    )
    assert not list((tmp_path / "out").glob("*.tar"))


def test_convert_skips_symbolic_links_unless_asked(tmp_path, capsys):
    (tmp_path / "outside.txt").write_text("secret")
    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "a.txt").write_text("A")
    (folder / "b.txt").symlink_to(tmp_path / "outside.txt")
    pattern = str(tmp_path / "out" / "s-%d.tar")
    with pytest.warns(UserWarning, match="skipped 1 symbolic link"):
        assert main(["convert", str(folder), pattern]) == 0
    assert "1 shards, 1 samples" in capsys.readouterr().out
    assert main(["convert", str(folder), pattern, "--follow-symlinks"]) == 0
    samples = list(iter_shard_samples(build_shard_index(pattern % 0).shards[0]))
    assert samples == [{"__key__": "a", "txt": b"A"}, {"__key__": "b", "txt": b"secret"}]


def test_convert_a_save_to_disk_folder_with_images(tmp_path, capsys):
    pytest.importorskip("datasets", reason="the datasets package (dev extra)")
    from tests.nnh_data.hf_data import hf_row, row_of_key, write_parquet, write_saved

    saved = write_saved(tmp_path / "saved", shards=3)
    assert main(["convert", saved, str(tmp_path / "out" / "s-%d.tar"), "--max-count", "10"]) == 0
    assert "4 shards, 37 samples" in capsys.readouterr().out
    index = build_shard_index(str(tmp_path / "out"))
    samples = [s for info in index.shards for s in iter_shard_samples(info)]
    assert len(samples) == 37
    for sample in samples:
        row = hf_row(row_of_key(sample["__key__"], 3))
        assert sample["image.jpg"] == row["image"]["bytes"]
        assert int(sample["label.cls"]) == row["label"]
        assert ("score.cls" in sample) == (row["score"] is not None)
        assert json.loads(sample["tags.json"]) == row["tags"]
    parquet = write_parquet(tmp_path / "parquet", shards=2)
    assert main(["convert", parquet, str(tmp_path / "out2" / "s-%d.tar")]) == 0
    assert "1 shards, 37 samples" in capsys.readouterr().out
