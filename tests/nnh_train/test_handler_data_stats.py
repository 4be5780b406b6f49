"""NNHandler reports where a streaming epoch's data time went: one log line per epoch, the
figures in its epoch logs (so in CSVLogger's and TensorBoardLogger's), summed over real ranks,
and a data-wait panel below the loss plot."""

from __future__ import annotations

import csv

import pytest

import nnh_train.handler as handler_module
from nnh_train.callbacks import CSVLogger
from tests.nnh_train.test_handler import stream_handler
from tests.support import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")


def test_each_epoch_logs_its_data_figures(tar_shards, tmp_path, monkeypatch):
    h = stream_handler(tar_shards([7, 9, 8]))
    lines: list[str] = []
    h.log_fn = lines.append
    h.add_callback(CSVLogger(tmp_path / "metrics.csv"))
    h.train(2)
    data_lines = [line for line in lines if line.startswith("data: ")]
    assert len(data_lines) == 2 and data_lines[0].startswith("data: 24 samples")
    assert h.epoch_logs["data_samples"] == 24 and h.epoch_logs["data_read_s"] > 0
    with open(tmp_path / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["data_samples"]) for r in rows] == [24, 24]
    assert {"data_bytes", "data_decode_s", "data_wait_s", "data_gets", "data_cache_hits"} <= set(
        rows[0])
    drawn = []
    monkeypatch.setattr(handler_module, "plot_history", lambda panels, *a: drawn.append(panels))
    h.plot_losses(tmp_path / "loss.png")
    (loss, wait), = drawn
    assert loss[0] == "loss" and wait[0].startswith("data wait") and len(wait[1]) == 2


def _two_ranks(rank: int, world_size: int, urls: list[str]) -> dict:
    h = stream_handler(urls)
    h.train(1)
    return {k: v for k, v in h.epoch_logs.items() if k.startswith("data_") and k != "data_wait"}


@pytest.mark.timeout(120)
def test_the_figures_are_summed_over_ranks(tar_shards):
    ranks = run_distributed(_two_ranks, 2, tar_shards([7, 9, 8]), timeout=100)
    assert ranks[0] == ranks[1]  # the same figures on every rank
    assert ranks[0]["data_samples"] == 48  # each rank reads the one window its 12 lie in
