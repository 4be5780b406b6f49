"""``nnh_train.preemption`` on its own, with real signals: handlers that only set a flag, composed
with the ones installed and restored after; Ctrl-C as one line; the preemption exit and its
record for nnh-torchrun; SIGTERM when the parent dies. The launchers are in
``test_handler_preempt.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from nnh_train.preemption import (
    PREEMPTED_EXIT_CODE,
    PREEMPTED_RECORD_ENV,
    PREEMPTION_SIGNALS,
    Preemption,
    catch_signals,
)
from tests.support import ROOT


def run_python(code: str, env: dict | None = None, timeout: float = 60) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})  # fmt: skip


def test_signals_set_the_flag_call_the_handlers_they_replace_and_are_restored():
    seen = []
    before = {number: signal.getsignal(number) for number in PREEMPTION_SIGNALS}
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with catch_signals() as flag:
            assert not flag
            os.kill(os.getpid(), signal.SIGUSR1)
            assert flag.received == signal.SIGUSR1
            os.kill(os.getpid(), signal.SIGTERM)
            assert flag.received == signal.SIGTERM and seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGUSR1) == before[signal.SIGUSR1]
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]  # the user's
        with catch_signals(enabled=False) as flag:
            assert signal.getsignal(signal.SIGUSR1) == before[signal.SIGUSR1] and not flag
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)


@pytest.mark.timeout(60)
def test_ctrl_c_prints_one_line_and_ends_as_interrupted():
    proc = run_python("""
        from nnh_train.preemption import reported_interrupt
        with reported_interrupt(lambda: "rank 0: interrupted at step 3"):
            raise KeyboardInterrupt
    """)
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == -signal.SIGINT and err == "rank 0: interrupted at step 3\n", err
    proc = run_python("""
        from nnh_train.preemption import reported_interrupt
        with reported_interrupt(lambda: "never"):
            raise ValueError("a real error keeps its traceback")
    """)
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 1 and "Traceback" in err and "never" not in err


@pytest.mark.timeout(60)
def test_the_preemption_exit_records_the_rank_for_nnh_torchrun(tmp_path):
    record = tmp_path / "preempted"
    code = "from nnh_train.preemption import exit_preempted; exit_preempted(1)"
    proc = run_python(code, env={PREEMPTED_RECORD_ENV: str(record)})
    proc.communicate(timeout=50)
    assert proc.returncode == PREEMPTED_EXIT_CODE and record.read_text() == "1\n"


@pytest.mark.timeout(60)
def test_a_launched_process_gets_sigterm_when_its_parent_dies(tmp_path):
    ready, term = tmp_path / "ready", tmp_path / "term"
    child = f"""
        import signal, time
        from nnh_train.preemption import follow_launcher
        signal.signal(signal.SIGTERM, lambda *a: (open({str(term)!r}, "w"), exit()))
        follow_launcher()
        open({str(ready)!r}, "w").close()
        time.sleep(50)
    """
    parent = run_python(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {textwrap.dedent(child)!r}])
        time.sleep(50)
    """)
    deadline = time.monotonic() + 40
    while not ready.exists():
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.05)
    parent.kill()  # torchrun's agent killed outright
    parent.communicate(timeout=10)
    while not term.exists():
        assert time.monotonic() < deadline, "the child did not get SIGTERM"
        time.sleep(0.05)


def test_a_run_without_a_path_leaves_signals_alone_and_says_no_checkpoint(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    preemption = Preemption()
    with preemption.signals_caught():
        assert signal.getsignal(signal.SIGUSR1) == before and not preemption.flag
    assert preemption.interrupted(1, 7, 0, 3) == (
        "rank 1: interrupted at step 7 (epoch 1, batch 3); no checkpoint")
    path = tmp_path / "last.pt"
    path.write_bytes(b"")
    with_path = Preemption(str(path))
    with with_path.signals_caught():
        os.kill(os.getpid(), signal.SIGUSR1)
        assert with_path.flag.received == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) == before
    assert with_path.interrupted(0, 7, 2, 0).endswith(f"(epoch 3, batch 0); last checkpoint {path}")


@pytest.mark.timeout(60)
def test_a_preempted_rank_says_so_saves_and_exits(tmp_path):
    proc = run_python(f"""
        from nnh_train.preemption import Preemption
        saved = []
        Preemption({str(tmp_path / "last.pt")!r}).stop(1, 12, [0, 1], saved.append)
    """)
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == PREEMPTED_EXIT_CODE
    assert err == (f"rank 1: signal received on rank(s) [0, 1]; saving {tmp_path / 'last.pt'} "
                   f"at step 12 and exiting with code {PREEMPTED_EXIT_CODE}\n")
