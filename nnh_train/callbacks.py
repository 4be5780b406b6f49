"""Hooks into :class:`~nnh_train.NNHandler`'s loop, and the four callbacks most runs need.

Design. A callback is an object with up to five methods, each given the handler:
``on_train_begin``, ``on_epoch_begin``, ``on_batch_end`` (after each optimizer step),
``on_epoch_end`` and ``on_train_end``. Every rank calls every hook, so a hook may enter a
collective (``handler.save`` does). Decisions read only the handler's history and
``epoch_logs``, which are identical on every rank by construction (computed from the same gathered
numbers in the same order), so ranks agree on when to save or stop without exchanging anything, and
the callbacks keep no state of their own: a resumed run decides as the uninterrupted one would.
Writers (CSV, TensorBoard) write on rank 0 only and never enter a collective there. The folders a
callback writes (``run_dirs``) are locked for the run by the handler, so a second run on one of
them is refused instead of mixing its files with the first's (:mod:`nnh_train.run_lock`).
"""

from __future__ import annotations

import csv
import math
import os
import warnings
from typing import Any, Protocol

from nnh_data.atomic import atomic_write
from nnh_data.checks import check_choice, check_int

__all__ = [
    "HOOKS",
    "Callback",
    "CSVLogger",
    "EarlyStopping",
    "ModelCheckpoint",
    "TensorBoardLogger",
    "Trainer",
    "call_hook",
    "checked_callback",
    "run_dirs_of",
]

_MODES = ("min", "max")
HOOKS = ("on_train_begin", "on_epoch_begin", "on_batch_end", "on_epoch_end", "on_train_end")


class Trainer(Protocol):
    """What the callbacks here read and call on :class:`~nnh_train.NNHandler` (named by this
    protocol so that this module does not import the handler, which imports it)."""

    rank: int
    epoch: int
    step: int
    step_loss: float
    epoch_logs: dict[str, Any]
    should_stop: bool

    def history(self, name: str) -> list[float]: ...

    def save(self, path: str | os.PathLike) -> None: ...


class Callback:
    """Base class: override the hooks you need; each receives the handler."""

    def on_train_begin(self, handler: Trainer) -> None:
        """Before the first step of :meth:`NNHandler.train` (after a resume is loaded)."""

    def on_epoch_begin(self, handler: Trainer) -> None:
        """Before the first batch of each epoch; ``handler.epoch`` is the epoch's index."""

    def on_batch_end(self, handler: Trainer) -> None:
        """After each optimizer step; ``handler.step`` counts them, ``handler.step_loss`` is the
        step's loss averaged over ranks."""

    def on_epoch_end(self, handler: Trainer) -> None:
        """After an epoch and its validation; ``handler.epoch`` counts the epochs done and
        ``handler.epoch_logs`` holds the epoch's figures."""

    def on_train_end(self, handler: Trainer) -> None:
        """When :meth:`NNHandler.train` returns normally."""

    def run_dirs(self) -> list[str]:
        """The folders this callback writes: :meth:`NNHandler.train` locks them on rank 0 for
        the run, so a second run on one of them is refused (:mod:`nnh_train.run_lock`)."""
        return []


def checked_callback(callback: Any) -> Any:
    """``callback`` when it is a :class:`Callback` or has at least one of :data:`HOOKS` as a
    method (a duck-typed callback: the hooks it lacks are skipped, and it writes no run folder
    unless it has ``run_dirs``); otherwise a ``ValueError`` naming the hooks."""
    if isinstance(callback, Callback) or any(callable(getattr(callback, h, None)) for h in HOOKS):
        return callback
    raise ValueError(
        f"callback must be an nnh_train.Callback or have at least one of the hooks "
        f"{', '.join(HOOKS)}, got {type(callback).__name__} with none of them"
    )


def call_hook(callback: Any, hook: str, handler: Trainer) -> None:
    """Call ``callback``'s ``hook`` with the handler, if it has that hook."""
    method = getattr(callback, hook, None)
    if method is not None:
        method(handler)


def run_dirs_of(callback: Any) -> list[str]:
    """The folders ``callback`` writes (:meth:`Callback.run_dirs`; none for a duck-typed
    callback without that method)."""
    run_dirs = getattr(callback, "run_dirs", None)
    return list(run_dirs()) if callable(run_dirs) else []


def _improved(value: float, best: float, mode: str, min_delta: float = 0.0) -> bool:
    return value < best - min_delta if mode == "min" else value > best + min_delta


class ModelCheckpoint(Callback):
    """Save ``best.pt`` when ``monitor`` improves and ``last.pt`` every epoch, in folder ``path``.

    With ``every_n_steps`` ``last.pt`` is also written every that many optimizer steps, so a run
    killed without warning (SIGKILL, node failure) resumes mid-epoch. The best value is read from
    the handler's history, so it survives a resume. Every rank calls ``handler.save`` (rank 0
    writes), and the saving decisions are the same on every rank.

    Example:
        >>> handler.add_callback(ModelCheckpoint("runs/exp1", monitor="val_loss"))
        >>> handler.train(10, resume="runs/exp1/last.pt" if os.path.exists(...) else None)
    """

    def __init__(
        self, path: str | os.PathLike, monitor: str = "val_loss", mode: str = "min",
        save_last: bool = True, every_n_steps: int | None = None,
    ) -> None:  # fmt: skip
        self.path = os.fspath(path)
        self.monitor = monitor
        self.mode = check_choice("mode", mode, _MODES)
        self.save_last = bool(save_last)
        self.every_n_steps = (
            None if every_n_steps is None else check_int("every_n_steps", every_n_steps, low=1)
        )

    def run_dirs(self) -> list[str]:
        return [self.path]

    @property
    def best_path(self) -> str:
        return os.path.join(self.path, "best.pt")

    @property
    def last_path(self) -> str:
        return os.path.join(self.path, "last.pt")

    def on_train_begin(self, handler: Trainer) -> None:
        handler.history(self.monitor)  # an unknown name fails here, before any training

    def on_batch_end(self, handler: Trainer) -> None:
        if self.every_n_steps and handler.step % self.every_n_steps == 0:
            handler.save(self.last_path)

    def on_epoch_end(self, handler: Trainer) -> None:
        value = handler.epoch_logs.get(self.monitor)
        earlier = handler.history(self.monitor)[:-1]
        if (
            value is not None
            and not math.isnan(value)
            and all(_improved(value, old, self.mode) for old in earlier if not math.isnan(old))
        ):
            handler.save(self.best_path)
        if self.save_last:
            handler.save(self.last_path)


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved by ``min_delta`` in its last ``patience``
    values (validations, for ``val_*`` names).

    The decision reads the history, which is identical on every rank, so every rank stops after
    the same epoch.

    Example:
        >>> handler.add_callback(EarlyStopping("val_loss", patience=3))
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        patience: int = 3,
        mode: str = "min",
        min_delta: float = 0.0,
    ) -> None:
        self.monitor = monitor
        self.patience = check_int("patience", patience, low=1)
        self.mode = check_choice("mode", mode, _MODES)
        if not min_delta >= 0:
            raise ValueError(f"min_delta must be a number >= 0, got {min_delta!r}")
        self.min_delta = float(min_delta)

    def on_train_begin(self, handler: Trainer) -> None:
        handler.history(self.monitor)

    def on_epoch_end(self, handler: Trainer) -> None:
        if handler.epoch_logs.get(self.monitor) is None:
            return
        values = [v for v in handler.history(self.monitor) if not math.isnan(v)]
        best_at = 0
        for i, value in enumerate(values):
            if _improved(value, values[best_at], self.mode, self.min_delta):
                best_at = i
        if len(values) - 1 - best_at >= self.patience:
            handler.should_stop = True


class CSVLogger(Callback):
    """One row per epoch of ``handler.epoch_logs`` in the CSV file ``path`` (rank 0).

    A fresh run (no step taken yet) starts a new file: one left by an earlier run is moved
    aside to ``<name>.<n>.csv`` (the first free ``n``) with a warning, so rows of two runs never
    share a header. A resumed run continues the file and drops the rows past the step it
    resumed at (written by the interrupted run after its checkpoint), so each epoch has one row.
    When the columns change (a metric added), the file is rewritten under all of them.

    Example:
        >>> handler.add_callback(CSVLogger("runs/exp1/history.csv"))
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)

    def run_dirs(self) -> list[str]:
        return [os.path.dirname(os.path.abspath(self.path))]

    def on_train_begin(self, handler: Trainer) -> None:
        if handler.rank != 0 or not os.path.exists(self.path):
            return
        if handler.step == 0:
            aside = _free_name(self.path)
            os.replace(self.path, aside)
            warnings.warn(f"CSVLogger: {self.path!r} holds an earlier run's rows and this run is "
                          f"fresh: moved them to {aside!r}", stacklevel=2)  # fmt: skip
            return
        fields, rows = _read_csv(self.path)
        kept = [row for row in rows if _step_of(row) <= handler.step]
        if len(kept) < len(rows):
            _write_csv(self.path, fields, kept)

    def on_epoch_end(self, handler: Trainer) -> None:
        if handler.rank != 0:
            return
        row = {k: "" if v is None else v for k, v in handler.epoch_logs.items()}
        fields, rows = _read_csv(self.path, rows=False)
        if fields and all(name in fields for name in row):
            with open(self.path, "a", newline="") as fh:
                csv.DictWriter(fh, fieldnames=fields).writerow(row)
            return
        fields, rows = _read_csv(self.path)
        _write_csv(self.path, fields + [name for name in row if name not in fields], rows + [row])


def _read_csv(path: str, rows: bool = True) -> tuple[list[str], list[dict[str, str]]]:
    """The header and (with ``rows``) the rows of CSV file ``path``; nothing when absent."""
    if not os.path.exists(path):
        return [], []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader) if rows else []


def _write_csv(path: str, fields: list[str], rows: list[dict[str, Any]]) -> None:
    """Replace ``path`` by these rows at once (a temporary file renamed over it)."""
    with atomic_write(path, "w") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows)


def _step_of(row: dict[str, str]) -> float:
    """The ``step`` a row was written at (0 when the row has none: it is kept)."""
    try:
        return float(row.get("step") or 0)
    except ValueError:
        return 0.0


def _free_name(path: str) -> str:
    """``<stem>.<n><ext>`` beside ``path`` for the first ``n`` not taken."""
    stem, ext = os.path.splitext(path)
    n = 1
    while os.path.exists(f"{stem}.{n}{ext}"):
        n += 1
    return f"{stem}.{n}{ext}"


class TensorBoardLogger(Callback):
    """Write the step loss and each epoch's figures as TensorBoard scalars under ``log_dir``
    (rank 0). Needs the ``tensorboard`` package: ``pip install 'nnh[tensorboard]'``.

    Example:
        >>> handler.add_callback(TensorBoardLogger("runs/exp1/tb"))
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "TensorBoardLogger needs the tensorboard package: pip install 'nnh[tensorboard]'"
            ) from exc
        self.log_dir = os.fspath(log_dir)
        self._writer_class = SummaryWriter
        self._writer: Any = None

    def run_dirs(self) -> list[str]:
        return [self.log_dir]

    def on_train_begin(self, handler: Trainer) -> None:
        if handler.rank == 0:
            self._writer = self._writer_class(self.log_dir)

    def on_batch_end(self, handler: Trainer) -> None:
        if self._writer is not None:
            self._writer.add_scalar("step/loss", handler.step_loss, handler.step)

    def on_epoch_end(self, handler: Trainer) -> None:
        if self._writer is None:
            return
        for name, value in handler.epoch_logs.items():
            if value is not None and name != "epoch":
                self._writer.add_scalar(f"epoch/{name}", value, handler.epoch)
        self._writer.flush()

    def on_train_end(self, handler: Trainer) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
