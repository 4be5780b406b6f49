"""``nnh-torchrun``: torchrun, with an exit code that says preempted and SIGUSR1 on every torch.

    nnh-torchrun --standalone --nproc-per-node 4 train.py ...   # torchrun's arguments, unchanged
    python -m nnh_train.torchrun --nnodes 2 ... train.py ...

torchrun's agent passes SIGTERM, SIGINT, SIGHUP and SIGQUIT on to its ranks (to each rank's
process group), waits for them (30 s, then SIGKILL; ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` on
recent torch) and exits 1 with a traceback. SIGUSR1, which Slurm's ``--signal`` sends, is passed
on only from torch 2.9 and only with ``--signals-to-handle=...,SIGUSR1``; before, it kills the
agent at once (exit 138) and orphans the ranks. And whatever the ranks did, a rank exit code
other than 0 makes torchrun exit 1: a scheduler cannot tell a preemption save from a crash.

This runs the same launcher (``torch.distributed.run.main``) with the same arguments, and:

- handles SIGUSR1 as the agent handles SIGTERM (passed on to the ranks, then the agent stops),
  on every torch >= 2.2;
- exits with :data:`~nnh_train.preemption.PREEMPTED_EXIT_CODE` (75) when its ranks exited after
  a preemption save (each records itself in a file named by ``NNH_PREEMPTED_RECORD``), with one
  line instead of torch's traceback; 130 after Ctrl-C (SIGINT), 128 + N after another signal N;
- otherwise fails as torchrun does (exit 1 and torch's report of the failed ranks).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from types import FrameType

from nnh_train.preemption import PREEMPTED_EXIT_CODE, PREEMPTED_RECORD_ENV

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default ``sys.argv[1:]``); the launcher's exit code."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    signal.signal(signal.SIGUSR1, _raise_signal_exception)
    with tempfile.TemporaryDirectory(prefix="nnh-torchrun-") as folder:
        record = os.path.join(folder, "preempted")
        os.environ[PREEMPTED_RECORD_ENV] = record
        try:
            torchrun.main(argv)
        except (SignalException, ChildFailedError) as exc:
            code = _exit_code(exc, os.path.exists(record))
            if code is None:
                raise
            return code
    return 0


def _raise_signal_exception(signum: int, frame: FrameType | None) -> None:
    """What torch's agent does for the signals it handles: the agent then stops its ranks
    with the same signal and raises on."""
    from torch.distributed.elastic.multiprocessing import SignalException

    sigval = signal.Signals(signum)
    raise SignalException(f"process {os.getpid()} got signal {sigval.name}", sigval=sigval)


def _exit_code(exc: BaseException, preempted: bool) -> int | None:
    """75 when the ranks saved after a preemption, a signal's status when the agent got one
    (saying so on stderr), None for a failure to report as torchrun does."""
    if preempted and all(f.exitcode == PREEMPTED_EXIT_CODE for f in _failures(exc)):
        print(f"nnh-torchrun: the ranks saved after a preemption signal; exit code "
              f"{PREEMPTED_EXIT_CODE}", file=sys.stderr, flush=True)  # fmt: skip
        return PREEMPTED_EXIT_CODE
    sigval = getattr(exc, "sigval", None)
    if sigval is None:
        return None
    print(f"nnh-torchrun: stopped by {signal.Signals(sigval).name}", file=sys.stderr, flush=True)
    return 128 + int(sigval)


def _failures(exc: BaseException) -> list:
    return list(getattr(exc, "failures", {}).values())


if __name__ == "__main__":
    sys.exit(main())
