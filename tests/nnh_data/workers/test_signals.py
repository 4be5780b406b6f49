"""Loader workers and their rank's signals, with real processes: a rank (a python process in its
own process group, as torchrun starts it) iterates a loader of ``create_distributed_loader``
with a persistent worker; the test signals the whole group, as torchrun's agent and Slurm do.
A rank interrupted while it receives a batch leaves no traceback from its worker."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nnh_data.workers.signals import shielded_worker_init
from tests.support import ROOT, processes_mentioning

RANK = textwrap.dedent("""
    import os, signal, sys, torch
    from torch.utils.data import TensorDataset
    from nnh_data.loaders.distributed import create_distributed_loader

    def mark(worker_id):  # the user's worker_init_fn
        open(os.path.join(sys.argv[1], f"init-{worker_id}"), "w").close()

    if __name__ == "__main__":
        folder, context, handles_term = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
        if handles_term:
            signal.signal(signal.SIGTERM, lambda *a: print("rank: SIGTERM", flush=True))
        signal.signal(signal.SIGUSR1, lambda *a: print("rank: SIGUSR1", flush=True))
        signal.signal(signal.SIGINT, lambda *a: print("rank: SIGINT", flush=True))
        kwargs = {"batch_size": 2, "num_workers": 1, "multiprocessing_context": context,
                  "worker_init_fn": mark}
        loader, _ = create_distributed_loader(TensorDataset(torch.arange(64)), kwargs, "cpu",
                                              log_fn=lambda line: None)
        batches = iter(loader)
        next(batches)
        print("ready", flush=True)
        sys.stdin.readline()  # the test signals the group meanwhile
        print("read", sum(len(x) for x, in batches) + 2, flush=True)
""")


def start_rank(folder: Path, context: str, handles_term: bool) -> subprocess.Popen:
    (folder / "rank.py").write_text(RANK)
    command = [sys.executable, str(folder / "rank.py"), str(folder), context,
               str(int(handles_term))]  # fmt: skip
    rank = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert rank.stdout.readline() == "ready\n", rank.stderr.read()
    return rank


@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_outlive_the_signals_their_rank_handles(tmp_path, context):
    rank = start_rank(tmp_path, context, handles_term=True)
    for number in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        os.killpg(rank.pid, number)
    out, err = rank.communicate("go\n", timeout=60)
    assert rank.returncode == 0, err
    assert "read 64" in out and "killed by signal" not in err, (out, err)
    assert (tmp_path / "init-0").exists()  # the user's worker_init_fn ran too
    assert processes_mentioning(str(tmp_path)) == []  # the exit did not wait on the worker


@pytest.mark.timeout(120)
def test_workers_end_with_their_rank(tmp_path):
    rank = start_rank(tmp_path, "fork", handles_term=True)
    rank.kill()
    rank.communicate(timeout=30)
    assert processes_mentioning(str(tmp_path), timeout=15) == []  # torch's watchdog: 5 s
    rank = start_rank(tmp_path, "fork", handles_term=False)
    os.killpg(rank.pid, signal.SIGTERM)  # a rank that does not handle SIGTERM dies of it
    rank.communicate(timeout=30)
    assert rank.returncode == -signal.SIGTERM
    assert processes_mentioning(str(tmp_path), timeout=15) == []


def test_shielded_init_wraps_once_and_pickles():
    shielded = shielded_worker_init(len)
    assert shielded_worker_init(shielded) is shielded
    assert pickle.loads(pickle.dumps(shielded)).fn is len
    assert shielded_worker_init(None).fn is None



DROPPED_BATCH = textwrap.dedent("""
    import socket, sys, torch
    from multiprocessing import resource_sharer
    from torch.utils.data import DataLoader, TensorDataset
    from nnh_data.loaders.distributed import create_distributed_loader

    detach = resource_sharer.DupFd.detach

    def interrupted_then_detach(self):
        # A worker sends each tensor as a file descriptor that the rank fetches from the
        # worker's resource sharer thread. The rank is interrupted as it starts receiving: it
        # closes the connection with the sharer's first message unread, a reset. Then it asks
        # again; the sharer serves in order, so the reset connection has been handled.
        with socket.socket(socket.AF_UNIX) as rank:
            rank.connect(self._id[0])
            rank.recv(1, socket.MSG_PEEK)
        resource_sharer.DupFd.detach = detach
        return detach(self)

    if __name__ == "__main__":
        data = TensorDataset(torch.arange(8.0))
        kwargs = {"batch_size": 2, "num_workers": 1, "multiprocessing_context": "fork"}
        if sys.argv[1] == "1":  # nnh's loader: its worker is shielded
            loader, _ = create_distributed_loader(data, kwargs, "cpu", log_fn=lambda line: None)
        else:
            loader = DataLoader(data, **kwargs)
        resource_sharer.DupFd.detach = interrupted_then_detach
        print(sum(len(x) for x, in loader))
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shielded", [False, True])
def test_a_batch_dropped_by_an_interrupted_rank_prints_nothing_in_the_worker(tmp_path, shielded):
    """The worker's side of a Ctrl-C that lands while its rank receives a batch."""
    (tmp_path / "rank.py").write_text(DROPPED_BATCH)
    done = subprocess.run(
        [sys.executable, str(tmp_path / "rank.py"), str(int(shielded))], capture_output=True,
        text=True, timeout=50, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout == "8\n", done.stderr
    if shielded:
        assert done.stderr == ""
    else:  # the defect, as the worker's resource sharer reports it
        assert "ConnectionResetError" in done.stderr and "_serve" in done.stderr
