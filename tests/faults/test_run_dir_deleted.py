"""A run folder deleted (``rm -rf``) while its run holds the lock: the lock file goes with it.
The running job notices at its next epoch end or save: it makes the folder again and locks it
when nobody used it meanwhile (a second run is then refused), and stops with
``RunDirLockedError`` when another run has started there; ``metrics.csv`` never holds rows of
two runs. The first run is a real process paused at chosen epoch starts; the folder is deleted
while it waits at epoch 1's."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

from nnh_train import CSVLogger, NNHandler, RunDirLockedError
from tests.support import ROOT, Net, data

pytestmark = pytest.mark.timeout(120)

FIRST_RUN = """
import os, sys, time, torch
from torch import nn
from nnh_train import Callback, CSVLogger, NNHandler
from tests.support import Net, data

folder, gates = sys.argv[1], sys.argv[2]

class Gate(Callback):  # waits at the start of epoch e >= 1 until the test makes gates/<e>
    def on_epoch_begin(self, handler):
        if handler.epoch:
            print(f"waiting {handler.epoch}", flush=True)
            while not os.path.exists(os.path.join(gates, str(handler.epoch))):
                time.sleep(0.02)

h = NNHandler(Net, device="cpu", use_distributed=False)
h.log_fn = lambda line: None
h.set_optimizer(torch.optim.SGD, lr=0.01)
h.set_loss_fn(nn.functional.mse_loss)
h.add_metric("first", lambda output, target: 1.0)  # a column only this run writes
h.set_train_loader(data(16), batch_size=4)
h.add_callback(CSVLogger(os.path.join(folder, "metrics.csv")))
h.add_callback(Gate())
h.train(3)
"""


@contextmanager
def _first_run(folder: Path, gates: Path) -> Iterator[subprocess.Popen]:
    """The first run, training in ``folder``, stopped at epoch 1's start: it said so."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    first = subprocess.Popen([sys.executable, "-c", FIRST_RUN, str(folder), str(gates)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        assert first.stdout.readline().strip() == "waiting 1"
        shutil.rmtree(folder)
        yield first
    finally:
        first.kill()
        first.communicate()


def _second_run(folder: Path, epochs: int = 2) -> None:
    h = NNHandler(Net, device="cpu", use_distributed=False)
    h.log_fn = lambda line: None
    h.set_optimizer(torch.optim.SGD, lr=0.01)
    h.set_loss_fn(nn.functional.mse_loss)
    h.set_train_loader(data(8), batch_size=4)
    h.add_callback(CSVLogger(folder / "metrics.csv"))
    h.train(epochs)


def _rows(folder: Path) -> list[dict[str, str]]:
    with open(folder / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _open(gates: Path, epoch: int) -> None:
    (gates / str(epoch)).touch()


def test_a_run_whose_folder_another_run_took_stops(tmp_path):
    """Deleted after the first run's epoch 1; a second run trains there to its end; the first
    run, at its next epoch end, stops with an error naming the folder and the other run, and
    writes no row: ``metrics.csv`` holds the second run's two rows only."""
    folder, gates = tmp_path / "run", tmp_path / "gates"
    gates.mkdir()
    with _first_run(folder, gates) as first:
        _second_run(folder)
        _open(gates, 1)
        _open(gates, 2)
        _, err = first.communicate(timeout=60)
    assert first.returncode != 0
    assert "RunDirLockedError" in err and f"run directory {str(folder)!r} was deleted" in err
    assert "another run has used it since (pid " in err
    rows = _rows(folder)
    assert [row["epoch"] for row in rows] == ["1", "2"] and "train_first" not in rows[0]


def test_a_deleted_folder_is_made_again_and_kept_locked(tmp_path):
    """Deleted while the first run waits at epoch 1: its epoch end makes the folder again and
    locks it, with a warning; a second run there is then refused, naming the first; the first
    run ends normally and ``metrics.csv`` holds its rows from then on."""
    folder, gates = tmp_path / "run", tmp_path / "gates"
    gates.mkdir()
    with _first_run(folder, gates) as first:
        _open(gates, 1)
        assert first.stdout.readline().strip() == "waiting 2"
        with pytest.raises(RunDirLockedError, match=f"in use by another run \\(pid {first.pid} "):
            _second_run(folder)
        _open(gates, 2)
        _, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    assert "was deleted while this run held it: made it again and locked it" in err
    rows = _rows(folder)
    assert [row["epoch"] for row in rows] == ["2", "3"] and "train_first" in rows[0]
