"""``examples/lightning_train.py`` under ``Trainer(strategy="ddp", accelerator="cpu",
devices=2)``: every sample once per epoch (the audit, and the ids each rank recorded), equal
step counts, a run stopped mid-epoch and resumed from Lightning's checkpoint gets exactly the
rest of the epoch and ends with the weights of an uninterrupted run; the map-style rank-cached
loader too."""

from __future__ import annotations

import sys

import pytest

from tests.examples.frameworks import (
    SAMPLES,
    assert_each_sample_once,
    assert_same_weights,
    audit_lines,
    common_args,
    run,
)
from tests.support import ROOT

pytest.importorskip("lightning")
SCRIPT = str(ROOT / "examples" / "lightning_train.py")


def lightning(*args: str) -> list[str]:
    return [sys.executable, SCRIPT, "--devices", "2", *args]


@pytest.mark.timeout(600)
def test_streaming_resumes_mid_epoch_with_the_rest_of_it(tmp_path):
    data = tmp_path / "data"
    whole = run(lightning(*common_args(data, tmp_path / "a", tmp_path / "ids_a")))
    assert audit_lines(whole) == [f"epoch {e}: {SAMPLES} of {SAMPLES} planned samples consumed "
                                  "on 2 rank(s); 0 missing, 0 repeated" for e in (0, 1)]
    assert_each_sample_once(tmp_path / "ids_a")
    args = common_args(data, tmp_path / "b", tmp_path / "ids_b")
    stopped = run(lightning(*args, "--max-steps", "12", "--save-every", "4"))  # 4 into epoch 1
    assert len(audit_lines(stopped)) == 1 and "trained 12 steps" in stopped
    resumed = run(lightning(*args, "--save-every", "4", "--resume", "auto"))
    assert audit_lines(resumed) == [f"epoch 1: {SAMPLES // 2} of {SAMPLES // 2} planned samples "
                                    "consumed on 2 rank(s); 0 missing, 0 repeated"]
    assert_each_sample_once(tmp_path / "ids_b")
    assert_same_weights(tmp_path / "a" / "net.pt", tmp_path / "b" / "net.pt")


@pytest.mark.timeout(300)
def test_the_rank_cached_loader_without_lightnings_sampler(tmp_path):
    args = common_args(tmp_path / "data", tmp_path / "run", tmp_path / "ids")
    out = run(lightning(*args, "--loader", "cached"))
    assert len(audit_lines(out)) == 2 and "0 missing, 0 repeated" in audit_lines(out)[1]
    assert_each_sample_once(tmp_path / "ids")
