"""Crafted checkpoints: a real checkpoint with one field changed, written with ``torch.save``
(weights only, as any file a user is sent), and loaded the ways a user loads one
(``NNHandler.load(path)``, ``handler.load_state``, ``train(resume=)``). Every field out of type
or range is a ``CheckpointError`` naming the file and the field before anything is built or
set; a recorded model whose arguments would allocate far more than the checkpoint holds is
refused before it is built (in a child process under a 16 GiB address-space limit, so that the
check cannot cost this machine its memory)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from nnh_train import CheckpointError, NNHandler
from nnh_train.checkpoint import load_checkpoint
from tests.support import ROOT, Net, data

pytestmark = pytest.mark.timeout(120)


def _trained(tmp_path) -> tuple[NNHandler, dict]:
    h = NNHandler(Net, device="cpu", use_distributed=False)
    h.log_fn = lambda line: None
    h.set_optimizer(torch.optim.SGD, lr=0.1)
    h.set_loss_fn(nn.functional.mse_loss)
    h.set_train_loader(data(16), batch_size=4, num_workers=0)
    h.train(1, max_steps=3)
    h.save(tmp_path / "good.pt")
    return h, load_checkpoint(tmp_path / "good.pt")


def _set(state: dict, field: str, value) -> dict:
    """``state`` with ``field`` ("ranks.0.rng": nested) set to ``value``; ``...``: removed."""
    state = copy.deepcopy(state)
    *outer, last = field.split(".")
    place = state
    for key in outer:
        place = place[int(key) if isinstance(place, list) else key]
    if value is ...:
        del place[last]
    else:
        place[int(last) if isinstance(place, list) else last] = value
    return state


CASES = [
    ("epoch", -5, "epoch=-5; it must be an int >= 0"),
    ("step", -1, "step=-1; it must be an int >= 0"),
    ("batches_done", "3", "batches_done='3'; it must be an int >= 0"),
    ("epoch", True, "epoch=True; it must be an int >= 0"),
    ("world_size", 0, "world_size=0; it must be an int >= 1"),
    ("ranks", [], "ranks=[]; it must be a list of one share per rank (world_size=1)"),
    ("world_size", 2, "ranks=[{"),  # one share for two ranks
    ("ranks.0.rng", ..., "ranks[0]['rng']=None; it must be the generator states"),
    ("ranks.0.epoch_rng.numpy_extra", [1], "ranks[0]['epoch_rng']="),
    ("ranks.0.loader", [1, 2], "ranks[0]['loader']=[1, 2]; it must be a loader state dict"),
    ("sums", ["x"], "sums=['x']; it must be a list of numbers"),
    ("model", {"body.0.weight": [1.0]}, "model={'body.0.weight': [1.0]}; it must be a state dict"),
    ("history", ..., "history=None; it must be a dict of records"),
    ("history.train_metrics", [1], "history['train_metrics']=[1]; it must be a dict of lists"),
    ("optimizer", [1], "optimizer=[1]; it must be a state dict or None"),
    ("model_class", 5, "model_class=5; it must be 'module:qualname' or None"),
    ("model_kwargs", {"a b": 1}, "model_kwargs={'a b': 1}; it must be a dict of keyword"),
]


@pytest.mark.parametrize(("field", "value", "message"), CASES,
                         ids=[f"{f}={v!r}"[:40] for f, v, _ in CASES])  # fmt: skip
def test_a_field_out_of_type_or_range_is_named(tmp_path, field, value, message):
    h, state = _trained(tmp_path)
    path = tmp_path / "crafted.pt"
    torch.save(_set(state, field, value), path)
    step = h.step
    for load in (NNHandler.load, h.load_state, lambda p: h.train(2, resume=p)):
        with pytest.raises(CheckpointError) as caught:
            load(path)
        assert str(path) in str(caught.value) and message in str(caught.value)
    assert h.step == step  # nothing taken from it


CRAFTED = """
import json, resource, sys
import torch
from torch import nn
resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))
from nnh_train import NNHandler
try:
    NNHandler.load(sys.argv[1], device="cpu", use_distributed=False)
    outcome = "loaded"
except Exception as exc:
    outcome = f"{type(exc).__name__}: {exc}"
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"outcome": outcome, "peak_mib": peak / 1024}))
"""


@pytest.mark.parametrize("side", [200_000, 12_000])
def test_a_recorded_model_far_larger_than_its_tensors_is_not_built(tmp_path, side):
    """A checkpoint of ``nn.Linear(4, 4)`` whose record says ``in_features=out_features=side``
    (200,000: 160 GB of weights; 12,000: 576 MB, which would fit): refused naming the
    parameter and both shapes, and the process never holds more than torch itself."""
    model = nn.Linear(4, 4)
    _, state = _trained(tmp_path)
    state.update(model=model.state_dict(), model_class="torch.nn.modules.linear:Linear",
                 model_kwargs={"in_features": side, "out_features": side})  # fmt: skip
    torch.save(state, tmp_path / "crafted.pt")
    done = subprocess.run([sys.executable, "-c", CRAFTED, str(tmp_path / "crafted.pt")],
                          capture_output=True, text=True, timeout=100, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["outcome"].startswith("CheckpointError: ")
    assert f"'weight' has shape ({side}, {side}) ({side * side} values)" in report["outcome"]
    assert "holds a tensor of shape (4, 4)" in report["outcome"]
    assert report["peak_mib"] < 1024  # torch and the test's tensors, no weights of that size
