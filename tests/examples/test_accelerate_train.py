"""``examples/accelerate_train.py`` under ``accelerate launch --multi_gpu --num_processes 2``
on the CPU: every sample once per epoch (the audit, and the ids each rank recorded), equal step
counts, a run stopped mid-epoch and resumed with ``load_state`` gets exactly the rest of the
epoch and ends with the weights of an uninterrupted run; the map-style rank-cached loader too.
And nnh's loaders passed to ``accelerator.prepare()``, the mistake users make: stopped at once
with the fix, or, behind a user's wrapper, failed by the audit at the first epoch's end with
Accelerate's second cut named (the numbers of huggingface/accelerate#3547: 2 processes, 1,110
samples, each rank trains on 288 of its 555)."""

from __future__ import annotations

import json
import sys

import pytest

from nnh_data.audit.epoch_audit import SECOND_CUT
from tests.examples.frameworks import (
    SAMPLES,
    assert_each_sample_once,
    assert_same_weights,
    audit_lines,
    common_args,
    run,
)
from tests.support import ROOT, SCRIPTS, free_port

pytest.importorskip("accelerate")
SCRIPT = str(ROOT / "examples" / "accelerate_train.py")


def accelerate(script: str, *args: str) -> list[str]:
    # a free port, not accelerate's 29500: launches of tests running side by side collide there
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
              "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "--main_process_port", str(free_port())]  # fmt: skip
    return [*launch, script, *args]


@pytest.mark.timeout(600)
def test_streaming_resumes_mid_epoch_with_the_rest_of_it(tmp_path):
    data = tmp_path / "data"
    whole = run(accelerate(SCRIPT, "--cpu", *common_args(data, tmp_path / "a", tmp_path / "ia")))
    assert audit_lines(whole) == [f"epoch {e}: {SAMPLES} of {SAMPLES} planned samples consumed "
                                  "on 2 rank(s); 0 missing, 0 repeated" for e in (0, 1)]
    assert_each_sample_once(tmp_path / "ia")
    args = ["--cpu", *common_args(data, tmp_path / "b", tmp_path / "ib")]
    stopped = run(accelerate(SCRIPT, *args, "--max-steps", "12"))  # 4 steps into epoch 1
    assert len(audit_lines(stopped)) == 1 and "trained 12 steps" in stopped
    resumed = run(accelerate(SCRIPT, *args, "--resume", "auto"))
    assert audit_lines(resumed) == [f"epoch 1: {SAMPLES // 2} of {SAMPLES // 2} planned samples "
                                    "consumed on 2 rank(s); 0 missing, 0 repeated"]
    assert_each_sample_once(tmp_path / "ib")
    assert_same_weights(tmp_path / "a" / "net.pt", tmp_path / "b" / "net.pt")


@pytest.mark.timeout(300)
def test_the_rank_cached_loader(tmp_path):
    args = common_args(tmp_path / "data", tmp_path / "run", tmp_path / "ids")
    out = run(accelerate(SCRIPT, "--cpu", *args, "--loader", "cached"))
    assert len(audit_lines(out)) == 2 and "0 missing, 0 repeated" in audit_lines(out)[1]
    assert_each_sample_once(tmp_path / "ids")


@pytest.mark.timeout(300)
def test_prepared_nnh_loaders_stop_at_once_or_fail_the_audit(tar_shards):
    urls = tar_shards([300, 300, 300, 210], size=8)  # 1,110 samples
    out = run(accelerate(str(SCRIPTS / "accelerate_prepare.py"), urls[0].replace("000000", "*")))
    cases = {}
    for line in out.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            cases.setdefault(result["case"], []).append(result)
    for case, wrapper in (("dispatch", "DataLoaderDispatcher"), ("shard", "IterableDatasetShard")):
        for result in cases[case]:  # every rank, before its first batch
            assert result["consumed"] == 0 and result["error"] == "RuntimeError"
            assert wrapper in result["message"] and "do not pass them to accelerator.prepare()" \
                in result["message"]
    for case in ("shard_wrapped", "cached"):
        messages = {r["message"] for r in cases[case]}
        assert len(messages) == 1 and len(cases[case]) == 2  # one verdict, raised on each rank
        message = messages.pop()
        assert [r["error"] for r in cases[case]] == ["ExactlyOnceError"] * 2
        assert message.startswith("epoch 0: 576 of 1,110 planned samples consumed on 2 rank(s); "
                                  "544 missing, 10 repeated")
        assert "rank 0: 288 of 555 samples" in message and "rank 1: 288 of 555" in message
        assert SECOND_CUT.format(n=2) in message
