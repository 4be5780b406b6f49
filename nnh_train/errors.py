"""The exceptions the trainer and the DDP plumbing raise, under :class:`nnh_data.errors.NNHError`.

Each keeps its built-in base (``RuntimeError``), so code that catches that still does; ``except
NNHError`` catches these and :mod:`nnh_data`'s alike.
"""

from __future__ import annotations

from typing import Any

from nnh_data.errors import NNHError

__all__ = ["CheckpointError", "NNHError", "RankError", "RunDirLockedError", "WorkerError"]


class CheckpointError(NNHError, RuntimeError):
    """A checkpoint file that cannot be read: truncated, corrupt or holding code objects."""


class RunDirLockedError(NNHError, RuntimeError):
    """Another live process holds the run directory."""


class WorkerError(NNHError, RuntimeError):
    """A worker of :class:`~nnh_train.parallel.ParallelExecutor` raised (its traceback follows)
    or died."""


class RankError(NNHError, RuntimeError):
    """An error that happened on ``rank``, raised on every rank of the group.

    ``traceback_text`` is the original traceback; ``__cause__`` is the original exception when it
    could cross processes (pickled and unpickled), else ``None``.
    """

    def __init__(self, message: str, rank: int, traceback_text: str) -> None:
        super().__init__(f"{message}\n{traceback_text}")
        self.message = message
        self.rank = rank
        self.traceback_text = traceback_text

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.message, self.rank, self.traceback_text)
