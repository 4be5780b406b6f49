"""The commands under faults of what they read: an unreachable store, a hand-edited manifest.
Every error is one line on stderr and exit status 2, from the installed console scripts in
real processes (the status a shell script sees), never a traceback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
BIN = Path(sys.executable).parent
UNREACHABLE = {"key": "a", "secret": "b", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
               "config_kwargs": {"retries": {"max_attempts": 1}}}  # fmt: skip


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=100)


def _one_line_error(done: subprocess.CompletedProcess, prog: str, pattern: str) -> None:
    assert done.returncode == 2, done.stderr
    assert re.fullmatch(rf"{prog}: error: [^\n]*{pattern}[^\n]*\n", done.stderr), done.stderr


@pytest.mark.parametrize("command", ["index", "cache warm"])
def test_an_unreachable_store_is_one_line_and_status_2(command, tmp_path):
    extra = ["--cache-dir", str(tmp_path / "cache")] if command == "cache warm" else []
    done = _run(str(BIN / "nnh-data"), *command.split(), "s3://bucket/train-*.tar",
                "--storage-options", json.dumps(UNREACHABLE), *extra)  # fmt: skip
    _one_line_error(done, "nnh-data", r"EndpointConnectionError: .*127\.0\.0\.1:9")


def test_a_manifest_without_a_key_is_one_line_and_status_2(tmp_path):
    table = tmp_path / "t"
    write = ["--num-samples", "8", "--epochs", "1", "--preset", "mild", "--seed", "0",
             "--out", str(table), "--no-progress"]  # fmt: skip
    assert _run(str(BIN / "nnh-precompute"), *write).returncode == 0
    manifest = table / "_manifest.json"
    edited = json.loads(manifest.read_text())
    del edited["files"][0]["sha256"]
    manifest.write_text(json.dumps(edited))
    done = _run(str(BIN / "nnh-precompute"), "verify", str(table))
    _one_line_error(done, "nnh-precompute", "KeyError: 'sha256'")
