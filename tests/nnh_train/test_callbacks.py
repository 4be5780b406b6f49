"""Callbacks on one process: the stop and save decisions read the history, TensorBoard events.
(Agreement between ranks is tested in test_handler_ddp.py.)"""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import pytest

from nnh_train.callbacks import EarlyStopping, ModelCheckpoint, TensorBoardLogger
from nnh_train.checkpoint import load_checkpoint
from tests.nnh_train.test_handler import handler

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def stopped(values: list[float], **kwargs) -> bool:
    """Whether EarlyStopping stops after the last of ``values`` (a val_loss history)."""
    state = SimpleNamespace(should_stop=False, epoch_logs={"val_loss": values[-1]},
                            history=lambda name: values)  # fmt: skip
    EarlyStopping("val_loss", **kwargs).on_epoch_end(state)
    return state.should_stop


@pytest.mark.parametrize(
    "values, kwargs, expected",
    [
        ([3.0, 2.0, 2.5, 2.4], {"patience": 2}, True),  # best 2 steps back
        ([3.0, 2.0, 2.5], {"patience": 2}, False),
        ([3.0, 2.0, 1.99, 1.98], {"patience": 2, "min_delta": 0.05}, True),  # too small a gain
        ([0.5, 0.7, 0.6], {"patience": 1, "mode": "max"}, True),
        ([0.5, 0.7], {"patience": 1, "mode": "max"}, False),
    ],
)
def test_early_stopping_reads_the_history(values, kwargs, expected):
    assert stopped(values, **kwargs) is expected


def test_model_checkpoint_every_n_steps_and_best(tmp_path):
    h = handler()  # 5 steps per epoch
    h.add_callback(ModelCheckpoint(tmp_path, monitor="train_loss", every_n_steps=3))
    h.train(1, max_steps=4)
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 3  # mid-epoch
    h.train(2)
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 10
    assert load_checkpoint(tmp_path / "best.pt")["epoch"] == 2  # the loss went down


def test_unknown_monitor_fails_before_training(tmp_path):
    h = handler()
    h.add_callback(ModelCheckpoint(tmp_path, monitor="val_acc"))
    with pytest.raises(ValueError, match="name must be one of .*'val_mae'.*got 'val_acc'"):
        h.train(1)
    assert h.step == 0


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed")
def test_tensorboard_logger_writes_events(tmp_path):
    h = handler()
    h.add_callback(TensorBoardLogger(tmp_path / "tb"))
    h.train(2)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_tensorboard_logger_names_the_extra_when_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install 'nnh\[tensorboard\]'"):
        TensorBoardLogger("runs/tb")
