"""A real 2-process gloo run under torchrun: equal batch counts, every sample once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import SCRIPTS

SCRIPT = SCRIPTS / "streaming_ddp_count.py"


@pytest.mark.timeout(180)
def test_torchrun_two_ranks_count_equal_batches(tar_shards, tmp_path):
    urls = tar_shards([9, 0, 14, 6])  # 29 samples: one rank pads
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(SCRIPT), urls[0].replace("000000", "*")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(line["rank"] for line in lines) == [0, 1]
    assert all(line["ok"] and line["world"] == 2 for line in lines), lines
    assert {line["batches"] for line in lines} == {4}  # 15 samples per rank in batches of 4


def _index_once(rank: int, world_size: int, urls: list[str], bad: str) -> dict:
    """Build the dataset under a gloo group, counting this rank's shard scans."""
    import nnh_data.shards.index as shards
    from nnh_data import ShardedStreamingDataset, ShardError

    scans = []
    original = shards.scan_shard
    shards.scan_shard = lambda *a, **k: scans.append(a[2]) or original(*a, **k)
    ds = ShardedStreamingDataset(urls)
    try:
        ShardedStreamingDataset([*urls[:1], bad])
        error = None
    except ShardError as exc:
        error = str(exc)
    return {"scans": len(scans), "total": ds.total_samples, "error": error}


@pytest.mark.timeout(120)
def test_the_index_is_built_once_under_ddp(tar_shards, tmp_path):
    from tests.support import run_distributed

    urls = tar_shards([3, 4, 5])
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"not a tar" * 200)
    results = run_distributed(_index_once, 2, urls, str(bad), timeout=90)
    assert [r["scans"] for r in results] == [4, 0]  # rank 0 scans (3 shards + the bad one)
    assert {r["total"] for r in results} == {12}
    assert all(r["error"] and "bad.tar" in r["error"] for r in results)  # raised on every rank
