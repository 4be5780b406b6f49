"""Building and wrapping the handler's model (nnh_train/model_setup.py) in one process; the DDP
wrapping and DDP's own error are exercised on 2 gloo ranks in test_handler_ddp.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nnh_train.model_setup import build_model, unused_parameters_named, wrap_model
from tests.support import Net


@pytest.mark.parametrize("model, kwargs, expected", [
    (Net, {"hidden": 3}, Net),
    (nn.Linear(2, 1), {}, nn.Linear),
    (lambda: nn.ReLU(), {}, nn.ReLU),  # any callable that builds a module
])  # fmt: skip
def test_build_model(model, kwargs, expected):
    assert isinstance(build_model(model, kwargs), expected)


@pytest.mark.parametrize("model, kwargs, error", [
    (nn.Linear(2, 1), {"bias": False}, r"model keyword arguments \['bias'\] given with a built"),
    (dict, {}, "model_class_or_instance must be an nn.Module or build one, got <class 'dict'>"),
    ("Net", {}, "model_class_or_instance must be an nn.Module or build one, got 'Net'"),
])  # fmt: skip
def test_build_model_errors_name_what_was_given(model, kwargs, error):
    with pytest.raises(ValueError, match=error):
        build_model(model, kwargs)


def test_one_process_trains_the_module_itself(monkeypatch):
    monkeypatch.setenv("DDP_FIND_UNUSED_PARAMETERS", "maybe")  # not read without DDP
    module = nn.Linear(2, 1)
    assert wrap_model(module, False, torch.device("cpu"), None, {}) is module


def test_ddps_unused_parameter_error_names_the_handlers_switches():
    with pytest.raises(RuntimeError, match=r"NNHandler\(..., find_unused_parameters=True\) or "
                                           r"set DDP_FIND_UNUSED_PARAMETERS=1") as caught:
        with unused_parameters_named():
            raise RuntimeError("pass find_unused_parameters=True to DistributedDataParallel")
    assert str(caught.value).endswith("\n\npass find_unused_parameters=True to "
                                      "DistributedDataParallel")  # fmt: skip
    with pytest.raises(RuntimeError, match="^another error$"):
        with unused_parameters_named():
            raise RuntimeError("another error")
