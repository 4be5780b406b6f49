"""Checkpoint files: atomic replacement, errors naming the file, wrapper prefixes, RNG states."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from nnh_train.checkpoint import (
    load_checkpoint,
    load_model_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
    strip_prefixes,
)
from nnh_train.errors import CheckpointError


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint({"epoch": 1, "w": torch.ones(3)}, path)

    def crash(obj, fh):
        fh.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt  # e.g. killed while writing

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"epoch": 2}, path)
    assert load_checkpoint(path)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary file left


def test_truncated_and_foreign_files_are_errors_naming_them(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"w": torch.arange(1000)}, path)
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(CheckpointError, match=f"cannot read checkpoint '{path}'"):
        load_checkpoint(path)
    torch.save({"model": nn.Linear(2, 1)}, path)  # a pickled module: code, refused
    with pytest.raises(CheckpointError, match="ckpt.pt"):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.pt")


@pytest.mark.parametrize(
    "keys, expected",
    [
        (["module.fc.weight", "module.fc.bias"], ["fc.weight", "fc.bias"]),
        (["_orig_mod.module.fc.weight"], ["fc.weight"]),
        (["module._orig_mod.fc.weight"], ["fc.weight"]),
        (["module.fc.weight", "head.bias"], ["module.fc.weight", "head.bias"]),  # not shared
        (["fc.weight"], ["fc.weight"]),
    ],
)
def test_strip_prefixes(keys, expected):
    assert list(strip_prefixes(dict.fromkeys(keys, 0))) == expected


def test_prefixed_state_dicts_load_into_the_plain_module():
    source = nn.Sequential(nn.Linear(3, 2))
    wrapped = {f"module._orig_mod.{k}": v for k, v in source.state_dict().items()}
    target = nn.Sequential(nn.Linear(3, 2))
    load_model_state(target, wrapped)
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(),
                                                  target.state_dict().values()))  # fmt: skip


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.standard_normal()  # a cached Gaussian in numpy's state
    save_checkpoint({"rng": rng_state()}, tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.standard_normal(3), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    set_rng_state(load_checkpoint(tmp_path / "rng.pt")["rng"])
    got = (torch.rand(3), np.random.standard_normal(3), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2] == expected[2]
