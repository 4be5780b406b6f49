"""One run per run directory: a second run is refused while the first lives, naming the folder
and the owner, and allowed once the first was SIGKILLed (its DataLoader workers still alive).
The same refusal under DDP is in test_handler_ddp.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from nnh_train import ModelCheckpoint, NNHandler, RunDirLockedError
from nnh_train.run_lock import (
    acquire_run_dirs,
    check_run_dirs,
    release_run_dirs,
    run_dirs_held,
)
from tests.support import ROOT, Net, data

FIRST_RUN = """
import sys, time, torch
from torch import nn
from nnh_train import Callback, ModelCheckpoint, NNHandler
from tests.support import Net, data

class Slow(Callback):
    def on_train_begin(self, handler):
        print("training", flush=True)
    def on_batch_end(self, handler):
        time.sleep(0.2)

h = NNHandler(Net, device="cpu", use_distributed=False)
h.log_fn = lambda line: None
h.set_optimizer(torch.optim.SGD, lr=0.01)
h.set_loss_fn(nn.functional.mse_loss)
h.set_train_loader(data(400), batch_size=4, num_workers=2)  # persistent forked workers
h.add_callback(ModelCheckpoint(sys.argv[1]))
h.add_callback(Slow())
h.train(100)
"""


def second_run(folder) -> NNHandler:
    h = NNHandler(Net, device="cpu", use_distributed=False)
    h.log_fn = lambda line: None
    h.set_optimizer(torch.optim.SGD, lr=0.01)
    h.set_loss_fn(nn.functional.mse_loss)
    h.set_train_loader(data(8), batch_size=4, num_workers=0)
    h.add_callback(ModelCheckpoint(folder))
    return h


@pytest.mark.timeout(90)
def test_a_second_run_is_refused_until_the_first_is_killed(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    first = subprocess.Popen([sys.executable, "-c", FIRST_RUN, str(tmp_path)], env=env,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        assert first.stdout.readline().strip() == "training"
        h = second_run(tmp_path)
        with pytest.raises(RunDirLockedError, match=f"{tmp_path}.* in use by another run "
                                                    f"\\(pid {first.pid} on host "):  # fmt: skip
            h.train(1)
        assert h.step == 0
        os.kill(first.pid, signal.SIGKILL)  # the rank only: its loader workers live on a while
        first.wait(timeout=30)
        h.train(1)  # at once
        assert h.step == 2 and (tmp_path / "last.pt").exists()
    finally:
        with contextlib.suppress(ProcessLookupError):  # the workers may be gone already
            os.killpg(first.pid, signal.SIGKILL)
        first.stdout.close()


def test_the_lock_is_counted_within_a_process_and_released(tmp_path):
    acquire_run_dirs([tmp_path])
    h = second_run(tmp_path)
    h.train(1)  # the same process: taken again
    release_run_dirs([tmp_path])
    probe = subprocess.run([sys.executable, "-c", "import sys; from nnh_train.run_lock import "
                            "acquire_run_dirs as a; a([sys.argv[1]])", str(tmp_path)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert probe.returncode == 0, probe.stderr  # nothing left held


def test_a_refused_folder_leaves_the_others_unlocked(tmp_path):
    held = subprocess.Popen([sys.executable, "-c", "import sys, time; from nnh_train.run_lock "
                             "import acquire_run_dirs as a; a([sys.argv[1]]); print('held', "
                             "flush=True); time.sleep(60)", str(tmp_path / "b")],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert held.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(RunDirLockedError, match=f"pid {held.pid}"):
            acquire_run_dirs([tmp_path / "a", tmp_path / "b"])
        assert time.monotonic() - started < 5  # refused, not waited for
        acquire_run_dirs([tmp_path / "a"])  # was released: count 1 again
        release_run_dirs([tmp_path / "a"])
    finally:
        held.kill()
        held.wait()
        held.stdout.close()


def test_a_run_holds_its_folders_until_it_ends(tmp_path):
    folder = str(tmp_path / "run")
    with run_dirs_held([folder, folder], rank=0):  # callbacks sharing a folder: held once
        script = f"from nnh_train.run_lock import acquire_run_dirs; acquire_run_dirs([{folder!r}])"
        held = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)  # fmt: skip
        assert held.returncode != 0 and "RunDirLockedError" in held.stderr
    acquire_run_dirs([folder])  # released: free again
    release_run_dirs([folder])


def _probe(folder) -> subprocess.CompletedProcess:
    """Another process trying to lock ``folder``."""
    script = f"from nnh_train.run_lock import acquire_run_dirs; acquire_run_dirs([{folder!r}])"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)  # fmt: skip


def test_a_folder_deleted_under_its_run_is_made_again_and_locked(tmp_path):
    """check_run_dirs: a folder still held is left alone; one deleted is made again and locked
    (with a warning), so another process is refused there; folders not held are skipped."""
    folder = str(tmp_path / "run")
    with run_dirs_held([folder], rank=0):
        check_run_dirs([folder, str(tmp_path / "not-held")])  # nothing to do
        shutil.rmtree(folder)
        with pytest.warns(RuntimeWarning, match="was deleted while this run held it: made it"):
            check_run_dirs([folder])
        assert os.path.isdir(folder)
        probe = _probe(folder)
        assert probe.returncode != 0 and f"(pid {os.getpid()} " in probe.stderr
    assert _probe(folder).returncode == 0  # released at the end of the run


def test_a_folder_another_run_used_since_its_deletion_stops_this_run(tmp_path):
    """Deleted, then used by another run (which made its lock file, and may have ended): the
    run stops with RunDirLockedError naming the folder and that run, rather than write there."""
    folder = str(tmp_path / "run")
    with run_dirs_held([folder], rank=0):
        shutil.rmtree(folder)
        assert _probe(folder).returncode == 0  # another run took it, and ended
        with pytest.raises(RunDirLockedError, match=f"run directory {folder!r} was deleted while "
                                                    "this run held it, and another run has used "
                                                    "it since \\(pid "):  # fmt: skip
            check_run_dirs([folder])
