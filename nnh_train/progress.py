"""Progress through a training epoch: a tqdm bar on a terminal, plain lines in a log file.

Design. tqdm redraws its bar with carriage returns. On a terminal that is what one wants; in a
Slurm log file or a pipe every redraw stays, on one endless line that ``grep`` calls binary.
So when stderr is not a terminal (nor a notebook, where tqdm draws a widget) progress is one
plain line every ``every`` batches and at the epoch's last, by default about ten an epoch::

    epoch 2/5 batch 120/400 loss 0.4312 3.1k samples/s

(the loss of the last step, the samples over all ranks per second since the previous line).
The environment variable ``TQDM_DISABLE`` (any value, as tqdm reads it) silences both.
"""

from __future__ import annotations

import os
import sys
import time
from types import TracebackType

from tqdm.auto import tqdm
from tqdm.autonotebook import tqdm as auto_tqdm
from tqdm.std import tqdm as std_tqdm

from nnh_data.checks import check_int

__all__ = ["LINES_PER_EPOCH", "UNKNOWN_TOTAL_EVERY", "EpochProgress"]

LINES_PER_EPOCH = 10
"""Plain lines per epoch by default: one every ``max(1, batches // 10)`` batches."""
UNKNOWN_TOTAL_EVERY = 100
"""Batches between plain lines by default when the loader has no length."""


class EpochProgress:
    """Rank 0's progress through an epoch of ``total`` batches (None: unknown) from batch
    ``done`` on; ``enabled=False`` (the other ranks) shows nothing.

    Example:
        >>> with EpochProgress("epoch 1/3", total=len(loader), done=0) as progress:
        ...     for batch in loader:
        ...         loss = step(batch)
        ...         progress.update(1, len(batch), loss)
    """

    def __init__(
        self, desc: str, total: int | None, done: int, every: int | None = None,
        enabled: bool = True,
    ) -> None:  # fmt: skip
        self.desc, self.total, self.done = desc, total, done
        self.every = _every(total) if every is None else check_int("every", every, low=1)
        bar = enabled and _interactive()
        self.lines = enabled and not bar and not os.environ.get("TQDM_DISABLE")
        self._bar = None
        if bar:
            self._bar = tqdm(total=total, initial=done, desc=desc, leave=False,
                             dynamic_ncols=True)  # fmt: skip
        self._since = (time.perf_counter(), 0.0)  # the last line's time, samples since it

    def update(self, batches: int, samples: float, loss: float) -> None:
        """After a step over ``batches`` batches and ``samples`` samples (all ranks) whose
        loss was ``loss``."""
        before, self.done = self.done, self.done + batches
        if self._bar is not None:
            self._bar.update(batches)
            self._bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
        started, counted = self._since
        self._since = (started, counted + samples)
        crossed = self.done // self.every > before // self.every
        if self.lines and (crossed or self.done == self.total):
            self._print(loss)

    def _print(self, loss: float) -> None:
        now = time.perf_counter()
        started, counted = self._since
        rate = std_tqdm.format_sizeof(counted / (now - started)) if now > started else "?"
        total = "" if self.total is None else f"/{self.total}"
        print(f"{self.desc} batch {self.done}{total} loss {loss:.4g} {rate} samples/s",
              file=sys.stderr, flush=True)  # fmt: skip
        self._since = (now, 0.0)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> EpochProgress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _interactive() -> bool:
    """Whether a tqdm bar is readable here: stderr is a terminal, or this is a notebook."""
    return sys.stderr.isatty() or auto_tqdm is not std_tqdm


def _every(total: int | None) -> int:
    return UNKNOWN_TOTAL_EVERY if total is None else max(1, total // LINES_PER_EPOCH)
