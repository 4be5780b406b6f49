"""Epoch progress: a tqdm bar on a terminal; plain lines, no carriage return, where stderr is a
file or a pipe (a real handler job's stderr piped); silent with TQDM_DISABLE and on other ranks.
The position a resumed run reports is in test_handler_ddp.py (another world size)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest

from nnh_train.progress import EpochProgress, epoch_summary
from tests.support import SCRIPTS

LAUNCH = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LINE = r"epoch (\d)/3 batch (\d+)/24 loss \S+ \S+ samples/s"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def shown(monkeypatch, stream: io.StringIO, steps: int, **options) -> str:
    monkeypatch.setattr(sys, "stderr", stream)
    with EpochProgress("epoch 1/2", **{"total": 40, "done": 0, **options}) as progress:
        for _ in range(steps):
            progress.update(1, 8, 0.5)
    return stream.getvalue()


def test_not_a_terminal_gives_a_plain_line_every_tenth_of_the_epoch(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    text = shown(monkeypatch, io.StringIO(), 40)
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 10 and lines[0].startswith("epoch 1/2 batch 4/40 loss 0.5 ")
    assert all(line.endswith(" samples/s") for line in lines)
    assert lines[-1].startswith("epoch 1/2 batch 40/40 ")


@pytest.mark.parametrize(
    ("options", "expected"),
    [({"every": 7}, [7, 14]), ({"done": 5}, [8, 12, 16]), ({"total": None}, []),
     ({"total": 13, "every": 5}, [5, 10, 13])],
)  # fmt: skip
def test_lines_fall_on_multiples_and_the_last_batch(monkeypatch, options, expected):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    text = shown(monkeypatch, io.StringIO(), 14, **options)  # every 100 without a total
    assert [int(n) for n in re.findall(r"batch (\d+)", text)] == expected


def test_silent_with_tqdm_disable_and_on_other_ranks(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert shown(monkeypatch, io.StringIO(), 40, enabled=False) == ""
    assert shown(monkeypatch, Terminal(), 40, enabled=False) == ""
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert shown(monkeypatch, io.StringIO(), 40) == ""


def test_a_terminal_gets_the_tqdm_bar(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    text = shown(monkeypatch, Terminal(), 3)
    assert "\r" in text and "epoch 1/2:" in text and "0/40" in text and "samples/s" not in text


def test_every_is_checked():
    with pytest.raises(ValueError, match="every"):
        EpochProgress("epoch 1/2", 40, 0, every=0)


@pytest.mark.timeout(120)
def test_a_handler_job_piped_prints_plain_lines(tmp_path):
    env = {k: v for k, v in os.environ.items()  # one process, not under a launcher
           if not k.startswith(("TQDM_", "SLURM_", "TORCHELASTIC_", "PET_")) and k not in LAUNCH}
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "handler_job.py"), str(tmp_path)], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\r" not in done.stderr
    found = [(int(e), int(b)) for e, b in re.findall(LINE, done.stderr)]  # 24 batches an epoch
    assert found == [(epoch, batch) for epoch in (1, 2, 3) for batch in range(2, 25, 2)]


DATA = {"data_samples": 24, "data_bytes": 1e5, "data_read_s": 0.5, "data_decode_s": 0.25,
        "data_params_s": 0.0, "data_wait_s": 0.1, "data_gets": 0, "data_retries": 0,
        "data_cache_hits": 0, "data_cache_misses": 0, "data_cache_evictions": 0,
        "data_skipped": 0}  # fmt: skip


@pytest.mark.parametrize("logs, lines", [
    ({"epoch": 1, "step": 5, "train_loss": 3.97512, "train_mae": 1.6, "val_loss": None,
      "val_mae": None, "samples_per_s": 1234.4, "data_wait": 0.123},
     ["epoch 1/3: train_loss 3.975, train_mae 1.6 | 1234 samples/s, data wait 12%"]),
    ({"epoch": 2, "step": 9, "train_loss": 2.0, "val_loss": 1.5, "samples_per_s": None,
      "data_wait": None}, ["epoch 2/3: train_loss 2, val_loss 1.5"]),
    ({"epoch": 3, "step": 9, "train_loss": 2.0, "samples_per_s": 10.0, "data_wait": 0.5, **DATA},
     ["epoch 3/3: train_loss 2 | 10 samples/s, data wait 50%",
      "data: 24 samples, 0.1 MB read; reading 0.50 s, decoding 0.25 s, parameters 0.00 s, "
      "loop waiting 0.10 s; 0 GETs, 0 retries; cache 0 hits, 0 misses, 0 evictions; "
      "0 skipped"]),
])  # fmt: skip
def test_epoch_summary(logs, lines):
    assert epoch_summary(logs, 3) == lines
