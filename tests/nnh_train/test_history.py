"""The run's history (nnh_train/history.py): epoch and validation records from sums, as tables,
and the checkpoint's ``"history"`` entry as version 1 writes it, read back."""

from __future__ import annotations

import math

import pytest
import torch

from nnh_train.checkpoint import load_checkpoint, save_checkpoint
from nnh_train.history import History, RunningEpoch

V1_KEYS = ["train_losses", "val_losses", "train_metrics", "val_metrics", "val_epochs", "data_waits"]


def history(*metrics: str) -> History:
    h = History()
    for name in metrics:
        h.add_metric(name)
    return h


@pytest.mark.parametrize("sums, metrics, loss, means", [
    ([6.0, 3.0, 1.5], ["mae"], 2.0, {"mae": 0.5}),
    ([6.0, 3.0, 1.5, 9.0], ["mae", "acc"], 2.0, {"mae": 0.5, "acc": 3.0}),
    ([6.0, 3.0], [], 2.0, {}),
    ([], ["mae"], math.nan, {"mae": math.nan}),  # an epoch without samples
    ([0.0, 0.0, 0.0], ["mae"], math.nan, {"mae": math.nan}),  # only pads
])  # fmt: skip
def test_an_epoch_is_recorded_as_means_over_its_samples(sums, metrics, loss, means):
    h = history(*metrics)
    h.record_epoch(sums, metrics, data_wait=0.5)
    assert h.train_losses == [pytest.approx(loss, nan_ok=True)]
    assert {n: v[0] for n, v in h.train_metrics.items()} == pytest.approx(means, nan_ok=True)
    assert h.data_waits == [0.5] and h.val_losses == [] and h.val_epochs == []


def test_validations_record_their_epoch():
    h = history("mae")
    for epoch in (1, 2, 3):
        h.record_epoch([2.0 * epoch, 2.0, 2.0], ["mae"], data_wait=None)
    h.record_validation(2, [8.0, 4.0, 4.0], ["mae"])
    assert h.val_epochs == [2] and h.val_losses == [2.0] and h.val_metrics == {"mae": [1.0]}
    assert h.get("train_loss") == [1.0, 2.0, 3.0] and h.get("val_mae") == [1.0]


@pytest.mark.parametrize("validated, expected", [
    (True, {"train_loss": 1.0, "train_mae": 1.0, "val_loss": 2.0, "val_mae": 1.0}),
    (False, {"train_loss": 1.0, "train_mae": 1.0, "val_loss": None, "val_mae": None}),
])  # fmt: skip
def test_latest_figures_in_the_order_of_the_epoch_logs(validated, expected):
    h = history("mae")
    h.record_epoch([2.0, 2.0, 2.0], ["mae"], data_wait=None)
    h.record_validation(1, [8.0, 4.0, 4.0], ["mae"])
    latest = h.latest(validated)
    assert latest == expected and list(latest) == list(expected)


def test_an_unknown_name_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"name must be one of \['train_loss', 'train_mae', "
                                         r"'val_loss', 'val_mae'\], got 'val_acc'"):  # fmt: skip
        history("mae").get("val_acc")


def test_panels_show_the_data_wait_only_when_measured():
    h = history("mae")
    h.record_epoch([2.0, 2.0, 2.0], ["mae"], data_wait=None)
    assert [title for title, *_ in h.loss_panels()] == ["loss"]
    h.record_epoch([2.0, 2.0, 2.0], ["mae"], data_wait=0.25)
    (_, train, val), (title, waits, none) = h.loss_panels()
    assert train == [1.0, 1.0] and val == [] and title.startswith("data wait")
    assert math.isnan(waits[0]) and waits[1] == 0.25 and none == []
    assert h.metric_panels(["mae"]) == [("mae", [1.0, 1.0], [])]


# The "history" entry of a checkpoint as version 1 (the format before History) wrote it.
V1 = {
    "train_losses": [3.0, 2.5, 2.0],
    "val_losses": [2.75],
    "train_metrics": {"mae": [1.5, 1.25, 1.0]},
    "val_metrics": {"mae": [1.1]},
    "val_epochs": [2],
    "data_waits": [0.1, None, 0.3],
}


def test_a_version_1_history_loads_and_saves_as_it_was(tmp_path):
    save_checkpoint({"history": V1}, tmp_path / "v1.pt")  # as the handler wrote it
    h = History()
    h.load_state_dict(load_checkpoint(tmp_path / "v1.pt")["history"])
    assert (h.train_losses, h.val_epochs, h.get("val_mae")) == ([3.0, 2.5, 2.0], [2], [1.1])
    assert list(h.state_dict()) == V1_KEYS and h.state_dict() == V1
    torch.save(h.state_dict(), tmp_path / "again.pt")
    assert torch.load(tmp_path / "again.pt", weights_only=True) == V1


def test_a_history_without_data_waits_gets_none_per_epoch():
    h = History()
    h.load_state_dict({k: v for k, v in V1.items() if k != "data_waits"})
    assert h.data_waits == [None, None, None]


def test_the_running_epoch_adds_steps_and_checkpoints_as_version_1():
    epoch = RunningEpoch()
    assert epoch.samples_per_s() is None and epoch.wait_share() is None  # not timed yet
    assert epoch.add([4.0, 2.0, 1.0], batches=2) == 2.0
    assert math.isnan(epoch.add([0.0, 0.0, 0.0], batches=1))  # a step of pads only
    epoch.timing = (2.0, 0.5)
    assert (epoch.batches, epoch.sums) == (3, [4.0, 2.0, 1.0])
    assert (epoch.samples_per_s(), epoch.wait_share()) == (1.0, 0.25)
    state = epoch.state_dict()
    assert state == {"batches_done": 3, "sums": [4.0, 2.0, 1.0]}
    epoch.reset()
    assert (epoch.batches, epoch.sums, epoch.timing) == (0, [], (2.0, 0.5))
    epoch.load_state_dict({**state, "epoch": 4})  # read from a whole checkpoint
    assert (epoch.batches, epoch.sums) == (3, [4.0, 2.0, 1.0])
