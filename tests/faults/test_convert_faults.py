"""``nnh-data convert`` of a folder that holds special files: a FIFO nobody writes to, and a
link to /dev/zero read with --follow-symlinks. Only regular files are read; the others are
skipped and counted in a warning, and no temporary file is left. Real processes with a
timeout and a memory limit, so a convert that blocks or reads forever fails the test rather
than the machine."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from nnh_data import build_shard_index, iter_shard_samples

pytestmark = pytest.mark.timeout(120)
NNH_DATA = str(Path(sys.executable).with_name("nnh-data"))
MEMORY = 2 << 30  # bytes of address space the command may take


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def _convert(folder: Path, pattern: str, *flags: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([NNH_DATA, "convert", str(folder), pattern, *flags],
                              capture_output=True, text=True, timeout=60,
                              preexec_fn=_limited)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("nnh-data convert still running after 60 s (blocked on a special file?)")


@pytest.mark.parametrize("special", ["fifo", "link to /dev/zero"])
def test_convert_reads_regular_files_only(special, tmp_path):
    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "a.txt").write_text("A")
    (folder / "c.txt").write_text("C")
    if special == "fifo":
        os.mkfifo(folder / "b.txt")
        flags = []
    else:
        (folder / "b.txt").symlink_to("/dev/zero")
        flags = ["--follow-symlinks"]
    out = tmp_path / "out"
    done = _convert(folder, str(out / "s-%d.tar"), *flags)
    assert done.returncode == 0, done.stderr
    assert "skipped 1 special file(s)" in done.stderr and "b.txt" in done.stderr
    assert "1 shards, 2 samples" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["nnh-index.json", "s-0.tar"]  # no .tmp
    samples = list(iter_shard_samples(build_shard_index(str(out / "s-0.tar")).shards[0]))
    assert samples == [{"__key__": "a", "txt": b"A"}, {"__key__": "c", "txt": b"C"}]
