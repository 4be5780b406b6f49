"""The history of a run: each epoch's training figures, each validation's, and the share of each
epoch spent waiting for batches; and the epoch in progress.

Design. One :class:`History` holds six parallel records (``train_losses``, ``val_losses``,
``train_metrics``, ``val_metrics``, ``val_epochs``, ``data_waits``), filled from sums over real
samples that every rank computed from the same gathered rows in the same order
(:mod:`nnh_train.step_agreement`), so the history is identical on every rank and so are the
decisions callbacks draw from it. Its :meth:`~History.state_dict` is the checkpoint's
``"history"`` entry exactly as checkpoint version 1 writes it, and
:meth:`~History.load_state_dict` reads that entry back, also from checkpoints written before
``data_waits`` was recorded. The trade-off: records are plain lists of floats (what
``torch.load(weights_only=True)`` reads back), not a table, so a record is appended to in as
many places as it has lists, all of them here. The epoch in progress is a :class:`RunningEpoch`:
its batches done and its sums, added step by step in rank order, which a mid-epoch checkpoint
holds (``batches_done``, ``sums``) and which become the epoch's record when it ends.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from itertools import zip_longest
from typing import Any

__all__ = ["History", "Panel", "RunningEpoch"]

Panel = tuple[str, list[float], list[float]]
"""A plot panel: its title, the values per epoch and the values per validation."""


class History:
    """What every epoch and validation of a run recorded.

    Attributes:
        train_losses: the training loss of each epoch, over its real samples.
        val_losses: the loss of each validation.
        train_metrics, val_metrics: ``{name: [value per epoch / validation]}``.
        val_epochs: the epoch (counted from 1) after which each validation ran.
        data_waits: the share of each epoch spent waiting for batches (None: not measured).

    Example:
        >>> history = History()
        >>> history.add_metric("mae")
        >>> history.record_epoch([6.0, 3.0, 1.5], ["mae"], data_wait=0.25)
        >>> history.record_validation(1, [4.0, 4.0, 2.0], ["mae"])
        >>> history.get("train_loss"), history.get("val_mae"), history.val_epochs
        ([2.0], [0.5], [1])
    """

    def __init__(self) -> None:
        self.train_losses: list[float] = []
        self.val_losses: list[float] = []
        self.train_metrics: dict[str, list[float]] = {}
        self.val_metrics: dict[str, list[float]] = {}
        self.val_epochs: list[int] = []
        self.data_waits: list[float | None] = []

    def add_metric(self, name: str) -> None:
        """Keep a record of metric ``name``, in training and in validation."""
        self.train_metrics[name], self.val_metrics[name] = [], []

    def record_epoch(
        self, sums: list[float], metrics: Iterable[str], data_wait: float | None
    ) -> None:
        """Append an epoch: its loss and ``metrics`` from ``sums`` ([loss x count, count,
        metric x count...], ``[]`` for an epoch without samples) and its ``data_wait``."""
        loss, means = _means(sums, metrics)
        self.train_losses.append(loss)
        for name, value in means.items():
            self.train_metrics[name].append(value)
        self.data_waits.append(data_wait)

    def record_validation(self, epoch: int, sums: list[float], metrics: Iterable[str]) -> None:
        """Append a validation after ``epoch`` (counted from 1), from ``sums`` as in
        :meth:`record_epoch`."""
        loss, means = _means(sums, metrics)
        self.val_losses.append(loss)
        self.val_epochs.append(epoch)
        for name, value in means.items():
            self.val_metrics[name].append(value)

    def latest(self, validated: bool) -> dict[str, float | None]:
        """The last epoch's figures: ``train_loss``, ``train_<metric>``..., ``val_loss``,
        ``val_<metric>``... (the validation's None when it did not validate)."""
        figures: dict[str, float | None] = {"train_loss": self.train_losses[-1]}
        figures.update({f"train_{n}": v[-1] for n, v in self.train_metrics.items()})
        figures["val_loss"] = self.val_losses[-1] if validated else None
        figures.update({f"val_{n}": v[-1] if validated else None
                        for n, v in self.val_metrics.items()})  # fmt: skip
        return figures

    def get(self, name: str) -> list[float]:
        """The record ``name``: ``train_loss``, ``val_loss``, ``train_<metric>`` or
        ``val_<metric>``."""
        table = {"train_loss": self.train_losses, "val_loss": self.val_losses}
        table.update({f"train_{n}": v for n, v in self.train_metrics.items()})
        table.update({f"val_{n}": v for n, v in self.val_metrics.items()})
        if name not in table:
            raise ValueError(f"name must be one of {sorted(table)}, got {name!r}")
        return table[name]

    def loss_panels(self) -> list[Panel]:
        """The loss, and below it the data wait when some epoch measured it."""
        panels = [("loss", self.train_losses, self.val_losses)]
        if any(w is not None for w in self.data_waits):
            waits = [math.nan if w is None else w for w in self.data_waits]
            panels.append(("data wait (share of the epoch)", waits, []))
        return panels

    def metric_panels(self, metrics: Iterable[str]) -> list[Panel]:
        """One panel per metric in ``metrics``."""
        return [(name, self.train_metrics[name], self.val_metrics[name]) for name in metrics]

    def state_dict(self) -> dict[str, Any]:
        """The records, as a checkpoint's ``"history"`` entry."""
        return {
            "train_losses": self.train_losses,
            "val_losses": self.val_losses,
            "train_metrics": self.train_metrics,
            "val_metrics": self.val_metrics,
            "val_epochs": self.val_epochs,
            "data_waits": self.data_waits,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the records of a checkpoint's ``"history"`` entry (one without
        ``data_waits`` gets None for each epoch)."""
        self.train_losses, self.val_losses = state["train_losses"], state["val_losses"]
        self.train_metrics, self.val_metrics = state["train_metrics"], state["val_metrics"]
        self.val_epochs = state["val_epochs"]
        self.data_waits = state.get("data_waits", [None] * len(self.train_losses))


class RunningEpoch:
    """The epoch in progress, and the timing of the last epoch whose batches all ran.

    Attributes:
        batches: the batches done in the epoch (on this rank).
        sums: [loss x count, count, metric x count...] over the real samples of every rank so
            far (``[]`` before the first step).
        timing: (seconds, seconds waiting for batches) of the last epoch run to its end (NaN
            before one).

    Example:
        >>> epoch = RunningEpoch()
        >>> epoch.add([6.0, 3.0], batches=2), epoch.add([2.0, 1.0], batches=2), epoch.sums
        (2.0, 2.0, [8.0, 4.0])
    """

    def __init__(self) -> None:
        self.batches = 0
        self.sums: list[float] = []
        self.timing = (math.nan, math.nan)

    def add(self, step: list[float], batches: int) -> float:
        """Add a step of ``batches`` batches and sums ``step``; the step's loss (NaN: no real
        sample)."""
        self.sums = [a + b for a, b in zip_longest(self.sums, step, fillvalue=0.0)]
        self.batches += batches
        return step[0] / step[1] if step[1] else math.nan

    def wait_share(self) -> float | None:
        """The share of the timed epoch spent waiting for batches (None: not timed)."""
        seconds, waited = self.timing
        return waited / seconds if seconds > 0 else None

    def samples_per_s(self) -> float | None:
        """The epoch's real samples (all ranks) per second of the timed epoch."""
        seconds, _ = self.timing
        return self.sums[1] / seconds if self.sums and seconds > 0 else None

    def reset(self) -> None:
        """Start the next epoch."""
        self.batches, self.sums = 0, []

    def state_dict(self) -> dict[str, Any]:
        """``batches_done`` and ``sums``, as a checkpoint holds them."""
        return {"batches_done": self.batches, "sums": list(self.sums)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a checkpoint's ``batches_done`` and ``sums``."""
        self.batches, self.sums = state["batches_done"], list(state["sums"])


def _means(sums: list[float], metrics: Iterable[str]) -> tuple[float, dict[str, float]]:
    """(loss, {metric: mean}) from [loss x count, count, metric x count...] sums ([] for
    none: NaN for each)."""
    names = list(metrics)
    loss_sum, count, *rest = sums + [0.0] * (2 + len(names) - len(sums))
    mean = [value / count if count else math.nan for value in (loss_sum, *rest)]
    return mean[0], dict(zip(names, mean[1:]))
