"""Progress through a training epoch: a tqdm bar on a terminal, plain lines in a log file.

Design. tqdm redraws its bar with carriage returns. On a terminal that is what one wants; in a
Slurm log file or a pipe every redraw stays, on one endless line that ``grep`` calls binary.
So when stderr is not a terminal (nor a notebook, where tqdm draws a widget) progress is one
plain line every ``every`` batches and at the epoch's last, by default about ten an epoch::

    epoch 2/5 batch 120/400 loss 0.4312 3.1k samples/s

(the loss of the last step, the samples over all ranks per second since the previous line).
The environment variable ``TQDM_DISABLE`` (any value, as tqdm reads it) silences both. After
the epoch, its summary (:func:`epoch_summary`) goes to the handler's ``log_fn`` instead: it is
the run's record, not its progress, and belongs in a log whatever stderr is.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from tqdm.auto import tqdm
from tqdm.autonotebook import tqdm as auto_tqdm
from tqdm.std import tqdm as std_tqdm

from nnh_data.checks import check_int
from nnh_data.streaming.stats import describe as describe_data

__all__ = ["LINES_PER_EPOCH", "UNKNOWN_TOTAL_EVERY", "EpochProgress", "epoch_summary"]

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


def epoch_summary(logs: Mapping[str, Any], epochs: int) -> list[str]:
    """The lines that sum up an epoch of ``epochs`` from its ``epoch_logs``: its figures and
    speed, then a streaming dataset's figures (``data_*``, over all ranks) when it has them.

    Example:
        >>> epoch_summary({"epoch": 2, "step": 10, "train_loss": 0.51, "val_loss": None,
        ...                "samples_per_s": 1200.0, "data_wait": 0.25}, 5)
        ['epoch 2/5: train_loss 0.51 | 1200 samples/s, data wait 25%']
    """
    figures = ", ".join(
        f"{name} {value:.4g}" for name, value in logs.items()
        if value is not None and name not in ("epoch", "step", "samples_per_s", "data_wait")
        and not name.startswith("data_")
    )  # fmt: skip
    speed = logs["samples_per_s"]
    tail = "" if speed is None else f" | {speed:.0f} samples/s, data wait {logs['data_wait']:.0%}"
    lines = [f"epoch {logs['epoch']}/{epochs}: {figures}{tail}"]
    if "data_samples" in logs:
        data = {k[5:]: v for k, v in logs.items() if k.startswith("data_") and k != "data_wait"}
        lines.append(describe_data(data))
    return lines
