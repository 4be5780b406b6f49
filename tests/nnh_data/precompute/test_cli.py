"""nnh_data.precompute.cli, the ``nnh-precompute`` command: write, show, verify and finalize a
table, in this process (``main``) and as the installed console script and ``python -m`` in real
processes; every error is one line on stderr with exit status 2 (1 when ``verify`` finds the
table wrong), never a traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from nnh_data import (
    AugmentationConfig,
    gen_augmentation_params,
    gen_distributed_augmentation_params,
    get_preset,
)
from nnh_data.precompute.cli import main
from nnh_data.precompute.spec import MANIFEST_NAME

pytestmark = pytest.mark.timeout(60)
MILD = get_preset("mild")
SCRIPT = str(Path(sys.executable).with_name("nnh-precompute"))
MODULE = [sys.executable, "-m", "nnh_data.precompute.cli"]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    """``command`` in a real process; help text wrapped at 200 columns."""
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(command, capture_output=True, text=True, timeout=50, env=env)


def _write(out: Path, *extra: str, samples: int = 30) -> list[str]:
    return ["--num-samples", str(samples), "--epochs", "2", "--preset", "mild", "--seed", "1",
            "--out", str(out), "--no-progress", *extra]  # fmt: skip


def test_command_writes_shows_and_verifies(tmp_path, capsys):
    out = str(tmp_path / "t")
    args = ["--num-samples", "40", "--epochs", "2", "--preset", "mild", "--seed", "7",
            "--rank-aware", "--world-size", "2", "--out", out, "--no-progress"]  # fmt: skip
    assert main(args) == 0
    assert "task 0/1: wrote 1 of 1 files; table complete" in capsys.readouterr().out
    assert main(["show", out, "--sample-id", "42", "--epoch", "1", "--rank", "1"]) == 2
    assert "sample_ids must be below" in capsys.readouterr().err
    assert main(["show", out, "--sample-id", "39", "--epoch", "1", "--rank", "1"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown == gen_distributed_augmentation_params(39, 1, MILD, 7, 2, 1)
    assert main(["verify", out]) == 0
    assert "ok: 160 rows" in capsys.readouterr().out


def test_command_reads_a_config_file(tmp_path, capsys):
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({**MILD.to_dict(), "rotation_range": [-5, 5]}))
    out = str(tmp_path / "t")
    assert main(["--num-samples", "5", "--epochs", "1", "--config", str(config), "--seed", "0",
                 "--out", out, "--no-progress"]) == 0  # fmt: skip
    assert main(["show", out, "--sample-id", "3"]) == 0
    want = gen_augmentation_params(3, AugmentationConfig.from_dict(json.loads(config.read_text())))
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == want


def test_tasks_of_an_array_then_finalize(tmp_path, capsys):
    """Two tasks given by ``--task-index``/``--num-tasks``: the first says the table is not
    complete yet and how to finish it; ``finalize`` before the second names what is missing,
    after it (the manifest lost, as when the last task's node went down) writes it."""
    out = tmp_path / "t"
    split = _write(out, "--rows-per-file", "20", "--num-tasks", "2")  # 3 files
    assert main([*split, "--task-index", "0"]) == 0
    assert capsys.readouterr().out == (
        f"task 0/2: wrote 2 of 3 files; table not complete yet: the last task writes "
        f"{MANIFEST_NAME} (or run `nnh-precompute finalize {out}`)\n"
    )
    assert main(["finalize", str(out)]) == 2
    assert re.fullmatch(r"nnh-precompute: error: the table in .* is incomplete: 1 of 3 files "
                        r"are not done \(part-000002.parquet\); rerun the tasks that wrote them\n",
                        capsys.readouterr().err)  # fmt: skip
    assert main([*split, "--task-index", "1"]) == 0
    assert "table complete" in capsys.readouterr().out
    (out / MANIFEST_NAME).unlink()
    assert main(["finalize", str(out)]) == 0
    assert capsys.readouterr().out == f"{out / MANIFEST_NAME}\n"
    assert main(["verify", str(out)]) == 0


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["--num-samples", "x"], 2, "argument --num-samples: invalid int value"),
        (["--num-samples", "5", "--epochs", "1", "--seed", "0", "--out", "o"], 2,
         "one of the arguments --preset --config is required"),
        (["--num-samples", "5", "--epochs", "1", "--seed", "0", "--preset", "mild", "--out",
          "{tmp}/o", "--world-size", "2"], 2, "world_size is 2 but rank_aware is False"),
        (["--num-samples", "5", "--epochs", "1", "--seed", "0", "--config", "{tmp}/none.json",
          "--out", "{tmp}/o"], 2, "No such file"),
        (["--num-samples", "5", "--epochs", "1", "--seed", "0", "--config", "{tmp}/bad.json",
          "--out", "{tmp}/o"], 2, r"bad.json is not valid JSON: Expecting property"),
        (["--num-samples", "5", "--epochs", "1", "--seed", "0", "--preset", "wild", "--out",
          "{tmp}/o"], 2, r"argument --preset: invalid choice: 'wild' \(choose from"),
        (["--num-samples", "5", "--epochs", "1", "--seed", "0", "--preset", "mild", "--out",
          "{tmp}/o", "--num-tasks", "3"], 2, "num_tasks is 3 but task_index is not given"),
        (["verify", "{tmp}/nowhere"], 1, "does not exist"),
        (["verify", "{tmp}", "--fraction", "2"], 2, r"--fraction must be in \(0, 1\], got 2"),
        (["finalize", "{tmp}"], 2, "holds no table"),
        (["show", "{tmp}"], 2, "the following arguments are required: --sample-id"),
    ],
)  # fmt: skip
def test_command_errors_are_one_line_with_a_status(tmp_path, capsys, args, status, message):
    (tmp_path / "bad.json").write_text("{not json")
    assert main([a.replace("{tmp}", str(tmp_path)) for a in args]) == status
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("nnh-precompute")
    assert re.search(message, err), err


def test_a_rank_aware_table_needs_a_rank_to_show(tmp_path, capsys):
    out = tmp_path / "t"
    assert main(_write(out, "--rank-aware", "--world-size", "2")) == 0
    assert main(["show", str(out), "--sample-id", "3"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "rank" in err, err


def test_verify_failure_exits_1_with_the_difference(tmp_path, capsys):
    table = tmp_path / "t"
    assert main(_write(table, "--rows-per-file", "20")) == 0
    (table / "part-000001.parquet").unlink()
    assert main(["verify", str(table)]) == 1
    err = capsys.readouterr().err
    missing = table / "part-000001.parquet"
    assert err.splitlines() == [f"nnh-precompute: error: {missing} is missing"]


def test_console_script_is_installed():
    (script,) = entry_points(group="console_scripts", name="nnh-precompute")
    assert script.value == "nnh_data.precompute.cli:main"
    assert os.access(SCRIPT, os.X_OK)


def test_the_console_script_in_a_real_process(tmp_path, capsys):
    """Arguments from the command line, the output on stdout, the status as the exit code."""
    out = tmp_path / "t"
    done = _run([SCRIPT, *_write(out, samples=12)])
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("task 0/1: wrote 1 of 1 files; table complete: ")
    assert main(["show", str(out), "--sample-id", "5", "--epoch", "1"]) == 0
    assert json.loads(capsys.readouterr().out) == gen_augmentation_params(5, MILD, 1, 1)
    done = _run([SCRIPT, "verify", str(out)])
    assert (done.returncode, done.stdout) == (0, f"ok: 24 rows of {out} recomputed; keys, "
                                                 "values and checksums match\n")  # fmt: skip


def test_python_m_errors_are_one_line_without_a_traceback(tmp_path):
    done = _run([*MODULE, "--num-samples", "-3", "--epochs", "1", "--seed", "0", "--preset",
                 "mild", "--out", str(tmp_path / "o")])  # fmt: skip
    assert (done.returncode, done.stdout) == (2, "")
    assert re.fullmatch(r"nnh-precompute: error: num_samples must be .*-3\n", done.stderr)


def test_help_lists_the_other_commands():
    done = _run([*MODULE, "--help"])
    assert done.returncode == 0 and "--num-samples NUM_SAMPLES" in done.stdout
    assert done.stdout.endswith("other commands: nnh-precompute finalize -h, nnh-precompute "
                                "verify -h, nnh-precompute show -h\n")  # fmt: skip
