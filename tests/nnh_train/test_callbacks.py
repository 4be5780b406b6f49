"""Callbacks on one process: the stop and save decisions read the history, TensorBoard events.
(Agreement between ranks is tested in test_handler_ddp.py.)"""

from __future__ import annotations

import ast
import csv
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import nnh_train
from nnh_train.callbacks import CSVLogger, EarlyStopping, ModelCheckpoint, TensorBoardLogger
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


def csv_rows(path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_csv_logger_fresh_run_starts_a_file_and_a_resumed_run_drops_later_rows(tmp_path):
    path = tmp_path / "metrics.csv"
    first = handler()
    first.add_callback(CSVLogger(path))
    first.train(1)
    first.save(tmp_path / "epoch1.pt")
    first.train(3)  # rows of epochs 1, 2, 3; then the run "dies" after epoch 3
    resumed = handler()
    resumed.add_callback(CSVLogger(path))
    resumed.train(3, resume=tmp_path / "epoch1.pt")  # epochs 2 and 3 again
    rows = csv_rows(path)
    assert [row["epoch"] for row in rows] == ["1", "2", "3"]
    assert [float(row["train_loss"]) for row in rows] == resumed.train_losses
    fresh = handler()
    fresh.add_callback(CSVLogger(path))
    with pytest.warns(UserWarning, match="earlier run's rows .* moved them to .*metrics.1.csv"):
        fresh.train(1)
    assert len(csv_rows(tmp_path / "metrics.1.csv")) == 3 and len(csv_rows(path)) == 1


def test_csv_logger_rewrites_the_file_when_the_columns_change(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("epoch,step,train_loss\n1,5,0.5\n")
    state = SimpleNamespace(rank=0, step=5, epoch_logs={"epoch": 2, "step": 10, "train_loss": 0.4,
                                                        "val_loss": None})  # fmt: skip
    CSVLogger(path).on_epoch_end(state)
    assert path.read_text().splitlines() == ["epoch,step,train_loss,val_loss", "1,5,0.5,",
                                             "2,10,0.4,"]  # fmt: skip


def imports_of(module: str) -> set[str]:
    """The nnh_train modules ``module`` imports, also under TYPE_CHECKING."""
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nnh_train."):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("nnh_train."))
    return found


def test_nnh_train_modules_import_each_other_without_a_circle():
    modules = [f"nnh_train.{p.stem}" for p in Path(nnh_train.__file__).parent.glob("*.py")
               if p.stem != "__init__"]  # fmt: skip
    graph = {m: imports_of(m) for m in modules}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import circle: {' -> '.join(path + (module,))}"
        if module not in done:
            for imported in graph.get(module, ()):
                visit(imported, path + (module,))
            done.add(module)

    for module in modules:
        visit(module, ())


class KeyRecorder:
    """A callback written without nnh_train.Callback: the five hooks, no run_dirs."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_train_begin(self, handler) -> None:
        self.calls.append("train_begin")

    def on_epoch_begin(self, handler) -> None:
        self.calls.append("epoch_begin")

    def on_batch_end(self, handler) -> None:
        self.calls.append("batch_end")

    def on_epoch_end(self, handler) -> None:
        self.calls.append("epoch_end")

    def on_train_end(self, handler) -> None:
        self.calls.append("train_end")


class EpochsOnly:
    def on_epoch_end(self, handler) -> None:
        self.epochs = handler.epoch


def test_duck_typed_callbacks_are_called_and_missing_hooks_skipped():
    h, recorder, epochs = handler(), KeyRecorder(), EpochsOnly()
    h.add_callback(recorder)
    h.add_callback(epochs)
    h.train(2)
    assert recorder.calls == ["train_begin", *(["epoch_begin", *["batch_end"] * 5, "epoch_end"]
                                                * 2), "train_end"]  # fmt: skip
    assert epochs.epochs == 2


def test_an_object_with_no_hook_is_refused_at_add_callback():
    with pytest.raises(ValueError, match="at least one of the hooks on_train_begin.*got object"):
        handler().add_callback(object())
