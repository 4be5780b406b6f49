"""nnh_data.command_line: one line per error, the type named when the message may not say it;
usage errors one line with status 2, in both commands."""

from __future__ import annotations

import pytest

from nnh_data.cli import main as nnh_data
from nnh_data.command_line import OneLineParser, error_line
from nnh_data.errors import ShardError


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (ValueError("max_count must be >= 1, got 0"), "max_count must be >= 1, got 0"),
        (ShardError("a.tar", "byte 0", "truncated"), "a.tar: truncated (at byte 0)"),
        (KeyError("files"), "KeyError: 'files'"),
        (RuntimeError("first\n  second\n"), "RuntimeError: first; second"),
        (MemoryError(), "MemoryError"),
    ],
)  # fmt: skip
def test_error_line(error, line):
    assert error_line("prog", error) == f"prog: error: {line}\n"


def test_usage_errors_are_one_line(capsys):
    parser = OneLineParser(prog="p")
    parser.add_argument("--n", type=int)
    with pytest.raises(SystemExit) as caught:
        parser.parse_args(["--n", "x"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err == "p: error: argument --n: invalid int value: 'x' (see p --help)\n"
    with pytest.raises(SystemExit) as caught:
        nnh_data(["convert", "only-one"])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("\n") == 1 and "nnh-data convert" in err
