"""nnh_train/checkpoint_fields.py: a handler's own checkpoint passes the field checks, and the
recorded model is compared with the checkpoint's tensors on the meta device (missing, unexpected
and reshaped tensors named; a model that cannot be built there refused with the fix). The
crafted files, loaded as a user loads them, are in tests/faults/test_crafted_checkpoints.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nnh_train import CheckpointError
from nnh_train.checkpoint_fields import check_fields, check_recorded_model
from tests.nnh_train.test_resume_state import version_1_checkpoint
from tests.support import Net


def test_a_written_checkpoint_passes():
    check_fields(version_1_checkpoint(), "v1.pt")
    check_recorded_model(Net, {}, Net().state_dict(), "v1.pt")
    prefixed = {f"module.{k}": v for k, v in Net(hidden=3).state_dict().items()}
    check_recorded_model(Net, {"hidden": 3}, prefixed, "v1.pt")  # DDP's prefixes


class _ReadsValues(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))
        self.scale = float(torch.ones(n).sum())  # a value: not on the meta device


@pytest.mark.parametrize(
    ("cls", "kwargs", "state", "said"),
    [
        (Net, {}, {}, ["has no tensor for 'body.0.weight' of the model it records, Net(**{})"]),
        (Net, {}, {**Net().state_dict(), "extra": torch.ones(1)}, ["holds tensors ['extra']"]),
        (Net, {"hidden": 10**6}, Net().state_dict(),
         ["Net(**{'hidden': 1000000}), whose 'body.0.weight' has shape (1000000, 4)",
          "but holds a tensor of shape (8, 4) for it"]),
        (_ReadsValues, {"n": 3}, {"weight": torch.zeros(3)},
         ["cannot be built on the meta device",
          "pass the model, NNHandler.load('c.pt', _ReadsValues, **model_kwargs)"]),
    ],
    ids=["missing", "unexpected", "larger", "not-on-meta"],
)
def test_a_recorded_model_that_does_not_match_is_named(cls, kwargs, state, said):
    with pytest.raises(CheckpointError) as caught:
        check_recorded_model(cls, kwargs, state, "c.pt")
    assert all(part in str(caught.value) for part in said), str(caught.value)
