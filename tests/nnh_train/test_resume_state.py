"""Checkpoint assembly and resume (nnh_train/resume_state.py): the version-1 format, written and
read back (a checkpoint written before the handler was split into parts loads), object states
that wait for their objects, and the shares of another world size."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from nnh_train.checkpoint import load_checkpoint, rng_state, save_checkpoint
from nnh_train.handler import NNHandler
from nnh_train.resume_state import (
    ResumeState,
    checkpoint_state,
    read_checkpoint,
    save_on_rank0,
)
from tests.support import Net, data

V1_KEYS = ["version", "model", "optimizer", "scheduler", "scaler", "epoch", "step",
           "batches_done", "sums", "history", "world_size", "ranks", "model_class",
           "model_kwargs"]  # fmt: skip


def handler(seed: int = 0) -> NNHandler:
    torch.manual_seed(seed)
    h = NNHandler(Net, device="cpu", use_distributed=False)
    h.log_fn = lambda line: None
    h.set_optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    h.set_loss_fn(nn.functional.mse_loss)
    h.add_metric("mae", lambda out, y: (out - y).abs().mean())
    h.set_train_loader(data(40), batch_size=8, num_workers=0)
    return h


def test_a_checkpoint_holds_the_version_1_keys_in_order(tmp_path):
    h = handler()
    h.train(2, max_steps=7)
    h.save(tmp_path / "ckpt.pt")
    state = load_checkpoint(tmp_path / "ckpt.pt")
    assert list(state) == V1_KEYS and state["version"] == 1
    assert (state["epoch"], state["step"], state["batches_done"]) == (1, 7, 2)
    assert list(state["ranks"][0]) == ["rng", "epoch_rng", "loader"]
    assert state["model_class"] == "tests.support:Net" and state["model_kwargs"] == {}


def version_1_checkpoint() -> dict:
    """A checkpoint as the handler wrote it before its parts: every key spelled out."""
    torch.manual_seed(1)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # a momentum buffer in the state
    return {
        "version": 1,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": None,
        "scaler": None,
        "epoch": 2,
        "step": 10,
        "batches_done": 0,
        "sums": [],
        "history": {
            "train_losses": [3.0, 2.0],
            "val_losses": [],
            "train_metrics": {"mae": [1.5, 1.0]},
            "val_metrics": {"mae": []},
            "val_epochs": [],
            "data_waits": [0.1, 0.2],
        },
        "world_size": 1,
        "ranks": [{"rng": rng_state(), "epoch_rng": rng_state(), "loader": None}],
        "model_class": "tests.support:Net",
        "model_kwargs": {},
    }


def test_a_version_1_checkpoint_loads_and_training_goes_on(tmp_path):
    saved = version_1_checkpoint()
    save_checkpoint(saved, tmp_path / "v1.pt")
    loaded = NNHandler.load(tmp_path / "v1.pt", device="cpu", use_distributed=False)
    assert (loaded.epoch, loaded.step, loaded.train_losses) == (2, 10, [3.0, 2.0])
    assert loaded.data_waits == [0.1, 0.2] and loaded.train_metrics == {"mae": [1.5, 1.0]}
    assert all(torch.equal(v, saved["model"][k]) for k, v in loaded.module.state_dict().items())
    h = handler()
    h.set_optimizer(torch.optim.SGD, lr=0.5, momentum=0.9)
    h.train(3, resume=tmp_path / "v1.pt")
    assert h.optimizer.param_groups[0]["lr"] == 0.1  # the saved state applied
    assert (h.epoch, h.step, len(h.train_losses), len(h.train_metrics["mae"])) == (3, 15, 3, 3)
    h.save(tmp_path / "again.pt")
    assert list(load_checkpoint(tmp_path / "again.pt")) == V1_KEYS


def test_checkpoint_state_lays_out_the_parts_in_the_version_1_order():
    model = nn.Linear(2, 1)
    objects = {"scaler": None, "scheduler": {"s": 1}, "optimizer": {"o": 2}}
    position = {"sums": [1.0, 2.0], "batches_done": 3, "step": 4, "epoch": 5}
    state = checkpoint_state(model, objects, position, {"train_losses": []}, [{"rng": 0}], 1,
                             {"model_class": None, "model_kwargs": None})  # fmt: skip
    assert list(state) == V1_KEYS
    assert [state[k] for k in ("optimizer", "scheduler", "epoch", "sums")] == [
        {"o": 2}, {"s": 1}, 5, [1.0, 2.0]]


def test_one_process_saves_its_own_share(tmp_path):
    save_on_rank0(tmp_path / "c.pt", {"rng": 1}, lambda shares: {"ranks": shares}, False)
    assert load_checkpoint(tmp_path / "c.pt") == {"ranks": [{"rng": 1}]}


def test_another_version_is_refused_naming_the_file(tmp_path):
    save_checkpoint({"version": 2}, tmp_path / "v2.pt")
    with pytest.raises(ValueError, match=r"v2.pt' has version 2; this nnh reads 1"):
        read_checkpoint(tmp_path / "v2.pt")


def test_object_states_wait_for_their_objects():
    resume = ResumeState()
    saved = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.3).state_dict()
    state = {"optimizer": saved, "scheduler": None, "scaler": None, "world_size": 1,
             "batches_done": 0, "ranks": [{"rng": None}]}  # fmt: skip
    resume.load(state, "ckpt.pt", 0, 1, {"optimizer": None, "scheduler": None})
    assert resume.object_states({"optimizer": None}) == {"optimizer": saved}  # still pending
    optimizer = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.9)
    resume.apply("optimizer", optimizer)
    assert optimizer.param_groups[0]["lr"] == 0.3 and resume.pending == {}
    assert resume.share == {"rng": None}


def shares_state(batches_done: int, loader_state) -> dict:
    share = {"rng": rng_state(), "epoch_rng": rng_state(), "loader": loader_state}
    return {"optimizer": None, "scheduler": None, "scaler": None, "world_size": 2,
            "batches_done": batches_done, "ranks": [share, share]}  # fmt: skip


def test_another_world_size_mid_epoch_with_a_map_style_loader_is_refused():
    with pytest.raises(ValueError, match=r"saved mid-epoch with world_size=2 and a map-style "
                                         r"loader; it resumes only with that world size, not 1"):
        ResumeState().load(shares_state(3, None), "ckpt.pt", 0, 1, {})


def test_another_world_size_at_an_epoch_end_resumes_with_fresh_generators():
    resume = ResumeState()
    with pytest.warns(RuntimeWarning, match="world_size=2, not 3: random generator states"):
        resume.load(shares_state(0, None), "ckpt.pt", 2, 3, {})
    assert resume.share["loader"] is None and resume.share["dataset"] is None


def test_a_held_share_is_what_the_next_epoch_starts_from():
    resume = ResumeState()
    loader = DataLoader(range(6), batch_size=2)
    resume.hold(loader, 1)  # stopped after batch 1
    held = resume.share
    assert resume.rank_share(loader, 1) is held  # saved as held until resumed
    torch.rand(3)  # the caller's own draws do not shift the resumed run
    batches, at = resume.epoch_batches(loader, 1)
    assert at == 1 and [b.tolist() for b in batches] == [[2, 3], [4, 5]]
    assert torch.equal(torch.get_rng_state(), held["rng"]["torch"]) and resume.share is None
