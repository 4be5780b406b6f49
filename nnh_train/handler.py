"""``NNHandler``: a small DDP training loop that keeps ranks in step and resumes exactly.

Design. The handler is the loop and the user's API, built from parts that each own their state,
as torchtitan's trainer is: :class:`~nnh_train.train_step.TrainStep` (a step's forward and
backward, its precision, GradScaler and compiled forward), :class:`~nnh_train.history.History`
and :class:`~nnh_train.history.RunningEpoch` (the epochs done and the one in progress),
:class:`~nnh_train.resume_state.ResumeState` (what a checkpoint hands back to this rank) and, for
a ``train`` call, :class:`~nnh_train.preemption.Preemption`; loaders and batches go through
:mod:`~nnh_train.batches`, losses and metrics through :mod:`~nnh_train.evaluation`. Each
optimizer step has one collective (:mod:`~nnh_train.step_agreement`): an ``all_gather`` of a
short row per rank (the loss trained on, the step's sample count without pads, the loss and
metrics over those samples, and a "signal received" flag), started before the last backward and
waited for before the optimizer step, so that its latency overlaps the backward. From the same
gathered rows every rank decides the same things the same way: a non-finite loss on any rank
stops every rank before the optimizer step, with an error naming the ranks, the step and the
values; a SIGUSR1/SIGTERM on any rank (the signal handler only sets a flag) makes every rank save
the same checkpoint at the same step and exit with :data:`PREEMPTED_EXIT_CODE`; and the history
is summed in rank order from those rows, so it is identical on every rank, and so are the
callbacks' decisions that read it. The cost is that one small collective per step (measured
against a bare loop in ``tools/bench/trainer.py``); a NaN check or a preemption flag that ranks
must agree on cannot be had for less. A step that lasts longer than ``NNH_STALL_REPORT_S``
(five minutes by default) is reported on the ranks that wait in it, naming the ranks that have
not reached it (:mod:`~nnh_train.stall_report`).

Resume. A checkpoint holds the unwrapped model, optimizer, scheduler, scaler, the position (epoch,
batches done in it, optimizer steps), the epoch's partial sums, the history, and per rank the
random generator states (at the step and at the epoch's start, when the loader drew its order) and
the loader's state: ``StatefulDataLoader.state_dict()`` for streaming datasets, else the epoch
and batch count, resumed by replaying the sampler's indices without reading the skipped samples.
With the same world size the rest of the run is bitwise the same on CPU
(:mod:`~nnh_train.resume_state` assembles and hands back the checkpoint).

Batches. ``(inputs, target, ...)`` sequences call ``model(inputs)`` and ``loss_fn(output,
target)``; dicts (streaming samples) and single tensors are passed whole to both. Samples flagged
as pads (``__pad__``, the repeats of ``DistributedSampler`` and of the rank-cached loader) are
trained on (every rank takes the same steps) but left out of the epoch's loss and metrics (their
batch's figures are computed again without them), so an epoch's figures equal those of one
process on the same data.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from nnh_data.checks import check_choice, check_int
from nnh_data.loaders.gather import gather_for_metrics
from nnh_train.batches import (
    Counted,
    EpochClock,
    counted,
    data_figures,
    groups,
    loader_length,
    make_loader,
    pad_flags,
    set_epoch,
)
from nnh_train.callbacks import (
    Callback,
    ModelCheckpoint,
    call_hook,
    checked_callback,
    run_dirs_of,
)
from nnh_train.checkpoint import load_model_state
from nnh_train.compat import (
    ClassOrInstanceMethod,
    OriginalAPI,
    OriginalOptions,
    cache_from_loader_type,
    handler_from_checkpoint,
    model_record,
    plot_request,
    train_precision,
)
from nnh_train.ddp_decorators import on_rank
from nnh_train.ddp_init import get_dist_info, initialize_ddp
from nnh_train.evaluation import Scorer, predictions, run_on_rank0
from nnh_train.global_steps import GlobalSteps, global_steps
from nnh_train.history import History, RunningEpoch
from nnh_train.model_setup import build_model, unused_parameters_named, wrap_model
from nnh_train.plots import plot_history
from nnh_train.preemption import PREEMPTED_EXIT_CODE, Preemption, reported_interrupt
from nnh_train.progress import EpochProgress, epoch_summary
from nnh_train.resume_state import ResumeState, checkpoint_state, read_checkpoint, save_on_rank0
from nnh_train.run_lock import check_run_dirs, run_dirs_held
from nnh_train.stall_report import StallWatch, stall_seconds
from nnh_train.step_agreement import StepRows, gather_rows
from nnh_train.train_step import PRECISIONS, TrainStep

__all__ = ["PRECISIONS", "PREEMPTED_EXIT_CODE", "NNHandler"]

_INTERVALS = ("epoch", "step")


@dataclass(frozen=True)
class _Run:
    """The options of one ``train`` call, checked once."""

    epochs: int
    validate_every: int
    precision: str
    accumulation: int
    max_steps: int | None
    preemption: Preemption
    progress_every: int | None
    steps: GlobalSteps | None = None  # training on global batches

    def __post_init__(self) -> None:
        check_int("epochs", self.epochs, low=0)
        check_int("validate_every", self.validate_every, low=1)
        check_choice("precision", self.precision, PRECISIONS)
        check_int("gradient_accumulation_steps", self.accumulation, low=1)
        if self.max_steps is not None:
            check_int("max_steps", self.max_steps, low=0)
        if self.progress_every is not None:
            check_int("progress_every", self.progress_every, low=1)


def _recorded(name: str) -> property:
    """``handler.<name>``: that record of the handler's :class:`~nnh_train.history.History`."""
    return property(lambda self: getattr(self._history, name),
                    lambda self, value: setattr(self._history, name, value),
                    doc=f"The run's ``{name}`` (:class:`~nnh_train.history.History`).")  # fmt: skip


class NNHandler(OriginalAPI):
    """Train, validate, checkpoint and run inference with one model, alone or under DDP.

    Args:
        model_class_or_instance: an ``nn.Module``, or a class built with ``**model_kwargs``.
        device: ``'cpu'``, ``'cuda'``, ``'cuda:N'`` or a ``torch.device``; default this local
            rank's GPU when CUDA is there, else the CPU.
        use_distributed: True requires DDP, False never starts it, None (default) when launched
            with several processes (``torchrun``, ``srun``); see :func:`~nnh_train.initialize_ddp`.
        find_unused_parameters: DDP's option for models with parameters that some steps do not
            use; default the ``DDP_FIND_UNUSED_PARAMETERS`` environment variable, else False.
        model_kwargs: the model's arguments. The original NNHandler's own options
            (``model_type``, ``logger_mode``, ``logger_filename``, ``logger_filemode``,
            ``logger_level``, ``save_model_code``, ``ddp_kwargs``) are taken out and honoured or
            refused by name (:class:`~nnh_train.compat.OriginalOptions`), never given to the model.

    Attributes:
        model: the module as trained (wrapped in ``DistributedDataParallel`` under DDP).
        module: the unwrapped module (what checkpoints hold).
        rank, world_size, device: this process's place (``_rank`` is ``rank``).
        train_losses, val_losses: per epoch (validation: per validation run).
        train_metrics, val_metrics: ``{name: [value per epoch / validation]}``.
        epoch, step: epochs completed (the index of the running one) and optimizer steps done.
        epoch_logs: the last epoch's figures (None for those not computed that epoch).
        log_fn: where rank 0's log lines go (default ``print``; ``logger.info`` with
            ``logger_mode``).
        logger: the ``logging.Logger`` made from ``logger_mode`` (rank 0), else None.

    ``handler(x)`` is ``handler.model(x)``; ``handler.eval()`` and ``handler.train()`` (no
    epochs) switch the model's mode, as ``nn.Module``'s do.

    Example:
        >>> handler = NNHandler(nn.Linear, in_features=4, out_features=1)
        >>> handler.set_optimizer(torch.optim.SGD, lr=0.1)
        >>> handler.set_loss_fn(nn.functional.mse_loss)
        >>> handler.set_train_loader(TensorDataset(x, y), batch_size=32)
        >>> handler.train(5)
    """

    def __init__(
        self,
        model_class_or_instance: nn.Module | Callable[..., nn.Module],
        device: torch.device | str | None = None,
        use_distributed: bool | None = None,
        find_unused_parameters: bool | None = None,
        **model_kwargs: Any,
    ) -> None:
        options, model_kwargs = OriginalOptions.split(model_kwargs)
        info = initialize_ddp(use_distributed=use_distributed, device=device) or get_dist_info()
        self.distributed, self.rank, self.local_rank, self.world_size, self.device = info
        self.module = build_model(model_class_or_instance, model_kwargs).to(self.device)
        self._model_record = model_record(model_class_or_instance, model_kwargs)
        self.model = wrap_model(self.module, self.distributed, self.device,
                                find_unused_parameters, options.ddp_kwargs)  # fmt: skip
        self.logger = options.logger(self.rank)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.scheduler_interval = "epoch"
        self.loss_fn: Callable[..., torch.Tensor] | None = None
        self.metrics: dict[str, Callable[..., Any]] = {}
        self.callbacks: list[Callback] = []
        self.train_loader: DataLoader | None = None
        self.val_loader: DataLoader | None = None
        self._history = History()
        self.epoch = self.step = 0
        self.step_loss = math.nan
        self.epoch_logs: dict[str, Any] = {}
        self.should_stop = False
        self.log_fn: Callable[[str], Any] = print if self.logger is None else self.logger.info
        self._running = RunningEpoch()
        self._resume = ResumeState()
        self._run_dirs: list[str] = []  # the folders the callbacks write, locked by train
        self._stepper = TrainStep(self.model, self.device, self.distributed, self.world_size)
        stall_s = stall_seconds()
        self._stalls = StallWatch(self.rank, self.world_size, stall_s) if (
            self.distributed and stall_s) else None  # fmt: skip

    train_losses = _recorded("train_losses")
    val_losses = _recorded("val_losses")
    train_metrics = _recorded("train_metrics")
    val_metrics = _recorded("val_metrics")
    val_epochs = _recorded("val_epochs")
    data_waits = _recorded("data_waits")

    @property
    def _rank(self) -> int:
        return self.rank

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward: ``handler(x)`` is ``handler.model(x)``."""
        return self.model(*args, **kwargs)

    def eval(self, activate: bool = True, log: bool = False) -> NNHandler:
        """Put the model in evaluation mode (``activate=False``: training mode); the
        original NNHandler's signature."""
        self.model.train(not activate)
        if log:
            self._log(f"model set to {'eval' if activate else 'train'} mode")
        return self

    # ------------------------------------------------------------------ configuration

    def set_optimizer(self, optimizer_class: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        """Build the optimizer over the model's parameters (a loaded checkpoint's state applies).

        Example:
            >>> handler.set_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
        """
        self.optimizer = optimizer_class(self.module.parameters(), **kwargs)
        self._resume.apply("optimizer", self.optimizer)

    def set_scheduler(self, scheduler_class: type, interval: str = "epoch", **kwargs: Any) -> None:
        """Build a learning-rate scheduler on the optimizer, stepped every ``interval``:
        ``"epoch"`` (after validation; ``ReduceLROnPlateau`` gets the validation loss, else the
        training loss) or ``"step"`` (after each optimizer step).

        Example:
            >>> handler.set_scheduler(torch.optim.lr_scheduler.OneCycleLR, interval="step",
            ...                       max_lr=0.1, total_steps=epochs * len(handler.train_loader))
        """
        if self.optimizer is None:
            raise ValueError("set_scheduler needs an optimizer: call set_optimizer first")
        self.scheduler_interval = check_choice("interval", interval, _INTERVALS)
        self.scheduler = scheduler_class(self.optimizer, **kwargs)
        self._resume.apply("scheduler", self.scheduler)

    def set_loss_fn(self, fn: Callable[..., torch.Tensor]) -> None:
        """``fn(output, target) -> scalar tensor``, the mean over the batch."""
        if isinstance(fn, type) and issubclass(fn, nn.Module):
            raise ValueError(
                f"loss_fn must be a loss, got the class {fn.__name__}: pass an instance, "
                f"set_loss_fn({fn.__name__}()), or a function such as "
                "nn.functional.cross_entropy"
            )
        if not callable(fn):
            raise ValueError(f"loss_fn must be callable, got {fn!r}")
        self.loss_fn = fn

    def add_metric(self, name: str, fn: Callable[..., Any]) -> None:
        """Track ``fn(output, target)`` (a number, the batch mean) in training and validation,
        as ``train_<name>`` and ``val_<name>``, averaged over samples like the loss."""
        if not isinstance(name, str) or not name.isidentifier() or name == "loss":
            raise ValueError(f"metric name must be an identifier other than 'loss', got {name!r}")
        if name in self.metrics or not callable(fn):
            raise ValueError(f"metric {name!r} is already added or fn {fn!r} is not callable")
        self.metrics[name] = fn
        self._history.add_metric(name)

    def add_callback(self, callback: Callback) -> None:
        """Call ``callback``'s hooks during :meth:`train` (see :mod:`nnh_train.callbacks`): a
        :class:`~nnh_train.Callback`, or any object with some of its five hooks."""
        self.callbacks.append(checked_callback(callback))

    def set_train_loader(
        self, dataset: Dataset | DataLoader, batch_size: int | None = None, cache: bool = False,
        **loader_kwargs: Any,
    ) -> None:  # fmt: skip
        """Train on ``dataset`` with ``batch_size`` samples per process and step.

        A map-style dataset gets :func:`~nnh_data.loaders.distributed.create_distributed_loader`
        (or the rank-cached loader with ``cache=True``); a ``ShardedStreamingDataset``
        :func:`~nnh_data.streaming.loader` (batch-aligned worker ranges; a ``StatefulDataLoader``
        whose position checkpoints hold); a ``DataLoader`` is used as is.
        ``loader_kwargs`` go to the loader; ``shuffle`` and ``drop_last`` set the sampler's
        (the original's ``dataloader_type=DataLoaderType.RANK_CACHED`` is ``cache=True``).
        """
        cache = cache_from_loader_type(loader_kwargs, cache)
        self.train_loader = make_loader(dataset, batch_size, cache, loader_kwargs, is_eval=False,
                                        device=self.device, log_fn=self._log)  # fmt: skip

    def set_val_loader(
        self, dataset: Dataset | DataLoader, batch_size: int | None = None, cache: bool = False,
        **loader_kwargs: Any,
    ) -> None:  # fmt: skip
        """Validate on ``dataset`` (as :meth:`set_train_loader`, in evaluation order)."""
        cache = cache_from_loader_type(loader_kwargs, cache)
        self.val_loader = make_loader(dataset, batch_size, cache, loader_kwargs, is_eval=True,
                                      device=self.device, log_fn=self._log)  # fmt: skip

    # ------------------------------------------------------------------ training

    def train(
        self,
        epochs: int | bool | None = None,
        validate_every: int = 1,
        precision: str = "fp32",
        gradient_accumulation_steps: int = 1,
        max_steps: int | None = None,
        resume: str | os.PathLike | None = None,
        compile: bool | str = False,
        requeue: bool = False,
        preempt_path: str | os.PathLike | None = None,
        progress_every: int | None = None,
        global_batch_size: int | None = None,
        **original_options: Any,
    ) -> NNHandler | None:
        """Train until ``epochs`` epochs are done in total (a resumed run continues its count).

        ``train()`` and ``train(mode: bool)`` without other arguments switch the model's mode
        instead, as ``nn.Module.train`` does (and return the handler).

        Args:
            epochs: the total number of epochs.
            validate_every: validate after every that many epochs (with a val loader).
            precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast and a
                GradScaler; its skip decision reads gradients that DDP made equal on every rank).
            gradient_accumulation_steps: batches per optimizer step, gradients synchronised on
                the last one only (``no_sync``); an epoch's last group may be shorter, and each
                group equals one batch of its samples.
            max_steps: stop after this many optimizer steps in total (mid-epoch is fine:
                ``save`` then resumes there).
            resume: a checkpoint to continue from exactly (see :meth:`load_state`).
            compile: run the model through ``torch.compile``: True (inductor) or a backend
                name such as ``"aot_eager"``; checkpoints are the same either way.
            requeue: after a preemption save under Slurm, rank 0 runs
                ``scontrol requeue $SLURM_JOB_ID``.
            preempt_path: where SIGUSR1/SIGTERM saves before exiting with
                :data:`PREEMPTED_EXIT_CODE`; default the ``last.pt`` of the first
                :class:`~nnh_train.callbacks.ModelCheckpoint`; with neither, signals keep their
                usual effect.
            progress_every: when stderr is not a terminal (a Slurm log, a pipe), rank 0 prints a
                plain progress line every that many batches (and at the epoch's last) instead of a
                tqdm bar; default about ten lines an epoch
                (:class:`~nnh_train.progress.EpochProgress`).
            global_batch_size: one optimizer step per global batch of a training set of global
                batches (``ShardedStreamingDataset(..., global_batch_size=)``; default: that
                dataset's): its loader batches accumulated, the loss the mean over the global
                batch's real samples, so one process takes the steps of many
                (:mod:`~nnh_train.global_steps`).
            original_options: the original NNHandler's ``train`` options (``use_amp``,
                ``seed``, ...), honoured or refused by name
                (:func:`~nnh_train.compat.train_precision`).

        Raises:
            FloatingPointError: on every rank, when a loss is NaN or infinite on any rank; no
                rank has taken that optimizer step.

        After a preemption save the process ends at once with :data:`PREEMPTED_EXIT_CODE`:
        ``os._exit`` after flushing stdout and stderr, so ``finally`` blocks and ``atexit``
        hooks do not run (an interpreter shutdown right after a gloo collective can abort).
        """
        if epochs is None or isinstance(epochs, bool):
            options = (validate_every, precision, gradient_accumulation_steps, max_steps, resume,
                       compile, requeue, preempt_path, progress_every,
                       global_batch_size)  # fmt: skip
            if original_options or options != (1, "fp32", 1, None, None, False, False, None, None,
                                               None):  # fmt: skip
                raise ValueError("train needs epochs (an int) to train; train() and "
                                 "train(False) without other arguments set the model's mode")
            return self.eval(epochs is False)
        precision = train_precision(original_options, precision, self.device)
        preemption = Preemption(self._preempt_path(preempt_path), bool(requeue))
        run = _Run(epochs, validate_every, precision, gradient_accumulation_steps, max_steps,
                   preemption, progress_every)  # fmt: skip
        self._check_ready()
        steps = global_steps(self.train_loader, global_batch_size, self.world_size,
                             gradient_accumulation_steps)  # fmt: skip
        if steps is not None:
            run = replace(run, accumulation=steps.accumulation, steps=steps)
        self._stepper.configure(run.precision, compile)
        self._resume.apply("scaler", self._stepper.scaler)
        if resume is not None:
            self.load_state(resume)
        self.should_stop = False
        self._run_dirs = [d for c in self.callbacks for d in run_dirs_of(c)]
        with (
            run_dirs_held(self._run_dirs, self.rank),
            preemption.signals_caught(),
            reported_interrupt(lambda: preemption.interrupted(self.rank, self.step, self.epoch,
                                                              self._running.batches)),
            unused_parameters_named(),
        ):
            self._call("on_train_begin")
            while self.epoch < run.epochs and not self.should_stop and self._train_epoch(run):
                self._end_epoch(run)
            self._call("on_train_end")

    def _check_ready(self) -> None:
        needed = {"set_optimizer": self.optimizer, "set_loss_fn": self.loss_fn,
                  "set_train_loader": self.train_loader}  # fmt: skip
        missing = [name for name, value in needed.items() if value is None]
        if missing:
            raise ValueError(f"train needs {', '.join(missing)} to be called first")

    def _preempt_path(self, path: str | os.PathLike | None) -> str | None:
        """Where a preemption signal saves: ``path``, else the first ModelCheckpoint's last."""
        if path is not None:
            return os.fspath(path)
        saver = next((c for c in self.callbacks if isinstance(c, ModelCheckpoint)), None)
        return None if saver is None else saver.last_path

    def _train_epoch(self, run: _Run) -> bool:
        """Run (the rest of) the current epoch; False when ``max_steps`` or a stop ended it."""
        if run.max_steps is not None and self.step >= run.max_steps:
            return False
        self.module.train()
        self._call("on_epoch_begin")
        loader = self.train_loader
        clock = EpochClock(time.perf_counter())
        set_epoch(loader, self.epoch)
        total = loader_length(loader)
        batches = self._epoch_batches(loader)  # after it, _running.batches is where it is
        desc = f"epoch {self.epoch + 1}/{run.epochs}"
        with EpochProgress(desc, total, self._running.batches, run.progress_every,
                           enabled=self.rank == 0) as progress:  # fmt: skip
            for group in groups(batches, run.accumulation, clock):
                samples = self._train_step(group, run)
                progress.update(len(group), samples, self.step_loss)
                if run.max_steps is not None and self.step >= run.max_steps:
                    self._resume.hold(loader, self._running.batches)  # a later train() goes on
                    return False
        self._running.timing = clock.finish()
        return True

    def _epoch_batches(self, loader: DataLoader) -> Iterator[Counted]:
        """This epoch's batches from where the run stands, as (batch, size, pad mask)."""
        running = self._running
        batches, running.batches = self._resume.epoch_batches(loader, running.batches)
        seen = running.batches * (loader.batch_size or 1)
        return counted(batches, pad_flags(loader), seen)

    def _train_step(self, group: list[Counted], run: _Run) -> int:
        """One optimizer step over ``group``; the real samples it trained on, over all ranks."""
        flag = run.preemption.flag
        samples = None if run.steps is None else run.steps.samples(self._running.batches)
        where = f"step {self.step} (epoch {self.epoch}, batch {self._running.batches})"
        watch = nullcontext() if self._stalls is None else self._stalls.in_step(self.step, where)
        with watch:  # a step longer than NNH_STALL_REPORT_S names the ranks not in it
            rows = StepRows(self._stepper.forward_backward(group, self._scorer(), flag, samples)())
        error = rows.non_finite_error(where)
        if error is not None:
            self.optimizer.zero_grad(set_to_none=True)
            raise error
        step_scheduler = self.scheduler_interval == "step"
        self._stepper.optimizer_step(self.optimizer, self.scheduler if step_scheduler else None)
        self.step_loss = self._running.add(rows.sums(), len(group))
        self.step += 1
        self._call("on_batch_end")
        if rows.signalled():
            run.preemption.stop(self.rank, self.step, rows.signalled(), self.save)
        return rows.samples()

    def _end_epoch(self, run: _Run) -> None:
        """Record the epoch, validate, step the scheduler, then call the epoch-end hooks."""
        running = self._running
        self._history.record_epoch(running.sums, self.metrics, running.wait_share())
        validated = self.val_loader is not None and (self.epoch + 1) % run.validate_every == 0
        if validated:
            self._validate()
        self._step_epoch_scheduler(validated)
        self.epoch_logs = self._logs(validated)
        self.epoch += 1
        self._running.reset()
        for line in epoch_summary(self.epoch_logs, run.epochs):
            self._log(line)
        if self._run_dirs:  # deleted under the run: made again, or this run stops
            on_rank(0)(check_run_dirs)(self._run_dirs)
        self._call("on_epoch_end")

    def _validate(self) -> None:
        sums = self._scorer().loader_sums(self.module, self.val_loader, self.epoch)
        rows = gather_rows(sums, self.distributed, self.world_size)()
        totals = [sum(column) for column in zip(*rows)]
        self._history.record_validation(self.epoch + 1, totals, self.metrics)

    def _step_epoch_scheduler(self, validated: bool) -> None:
        if self.scheduler is None or self.scheduler_interval != "epoch":
            return
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.scheduler.step(self.val_losses[-1] if validated else self.train_losses[-1])
        else:
            self.scheduler.step()

    def _logs(self, validated: bool) -> dict[str, Any]:
        logs = {"epoch": self.epoch + 1, "step": self.step, **self._history.latest(validated),
                "samples_per_s": self._running.samples_per_s(), "data_wait": self.data_waits[-1]}
        waited = self._running.timing[1]
        return {**logs, **data_figures(self.train_loader, waited, self.distributed)}  # all_reduce

    def history(self, name: str) -> list[float]:
        """The recorded values of ``name``: ``train_loss``, ``val_loss``, ``train_<metric>`` or
        ``val_<metric>`` (one per epoch; ``val_*`` one per validation)."""
        return self._history.get(name)

    # ------------------------------------------------------------------ checkpoints

    def save(self, path: str | os.PathLike) -> None:
        """Write a checkpoint to ``path``: rank 0 writes atomically, every rank waits, an error
        in the write is raised on every rank. Call it on every rank.

        Example:
            >>> handler.save("runs/exp1/last.pt")
        """
        share = self._resume.rank_share(self.train_loader, self._running.batches)
        save_on_rank0(path, share, self._checkpoint, self.distributed)

    def _checkpoint(self, shares: list[dict[str, Any]]) -> dict[str, Any]:
        """This run's checkpoint, with every rank's share (rank 0, saving), once the run's
        folders are checked (:func:`~nnh_train.run_lock.check_run_dirs`)."""
        check_run_dirs(self._run_dirs)
        position = {"epoch": self.epoch, "step": self.step, **self._running.state_dict()}
        objects = self._resume.object_states(self._objects())
        return checkpoint_state(self.module, objects, position, self._history.state_dict(),
                                shares, self.world_size, self._model_record)  # fmt: skip

    def _objects(self) -> dict[str, Any]:
        """The training objects whose states checkpoints hold (None where not set)."""
        scaler = self._stepper.scaler
        return {"optimizer": self.optimizer, "scheduler": self.scheduler, "scaler": scaler}

    def load_state(self, path: str | os.PathLike) -> None:
        """Continue from checkpoint ``path`` (every rank reads it onto its own device).

        Model weights load at once (keys with ``module.``/``_orig_mod.`` prefixes are accepted);
        optimizer, scheduler and scaler states load into those objects, now or when they are
        set; the loader position and generator states apply when training resumes. A
        mid-epoch checkpoint of a streaming dataset resumes with another world size too (the
        rest of the epoch split again); a map-style one needs the same world size.
        """
        state = read_checkpoint(path)
        load_model_state(self.module, state["model"])
        self._resume.load(state, os.fspath(path), self.rank, self.world_size, self._objects())
        self.epoch, self.step = state["epoch"], state["step"]
        self._running.load_state_dict(state)
        self._history.load_state_dict(state["history"])

    @ClassOrInstanceMethod
    def load(self_or_cls, *args: Any, **kwargs: Any) -> NNHandler:  # noqa: N805
        """On the class, a new handler with the state of a checkpoint; on a handler, that
        state loaded into it (:meth:`load_state`), which is returned.

        ``NNHandler.load(path, model_class_or_instance=None, device=None,
        use_distributed=None, **model_kwargs)``: without a model (or with a device in its
        place, as the original NNHandler's ``NNHandler.load(path, device)``), the model class
        and arguments the checkpoint records are used; the class must be imported in this
        process (the script or package that defines it), since a checkpoint never makes this
        process import code.

        Example:
            >>> handler = NNHandler.load("runs/exp1/best.pt", Net, hidden=64)
            >>> handler = NNHandler.load("runs/exp1/best.pt", "cuda")  # Net imported
            >>> handler.load("runs/exp1/last.pt")  # into this handler
        """
        if isinstance(self_or_cls, NNHandler):
            self_or_cls.load_state(*args, **kwargs)
            return self_or_cls
        return handler_from_checkpoint(self_or_cls, *args, **kwargs)

    # ------------------------------------------------------------------ inference and plots

    def predict(self, dataset_or_loader: Dataset | DataLoader, batch_size: int = 64) -> Any:
        """The model's outputs (tensors) for every sample, in dataset order, on rank 0.

        Every rank runs its share (pads dropped); the rows are gathered with
        :func:`~nnh_data.loaders.gather.gather_for_metrics`. Call it on every rank; ranks other
        than 0 get ``None``. In one process any ``DataLoader`` works, in the loader's order.

        Example:
            >>> outputs = handler.predict(test_set)  # (len(test_set), ...) on rank 0
        """
        given = isinstance(dataset_or_loader, DataLoader)
        loader = make_loader(dataset_or_loader, None if given else batch_size, False, {},
                             is_eval=True, device=self.device, log_fn=self._log)  # fmt: skip
        outputs, ids = predictions(self.module, loader, self.device, self._stepper.autocast,
                                   self.distributed)  # fmt: skip
        values, _ = gather_for_metrics(outputs, ids)
        return values if self.rank == 0 else None

    def sample(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(module, *args, **kwargs)`` on rank 0 (eval mode, no gradients), its result on
        every rank; an error there is raised on every rank.

        Example:
            >>> images = handler.sample(lambda m, n: m.generate(n), 16)
        """
        return run_on_rank0(self.module, fn, args, kwargs, self.distributed)

    def log_likelihood(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(module, *args, **kwargs)`` on rank 0, as :meth:`sample`.

        Example:
            >>> nll = handler.log_likelihood(lambda m, x: m.log_prob(x).mean(), batch)
        """
        return run_on_rank0(self.module, fn, args, kwargs, self.distributed)

    def plot_losses(
        self, path: str | os.PathLike | bool | None = None,
        save_path: str | os.PathLike | None = None, log_y_scale: bool = False,
    ) -> None:  # fmt: skip
        """Training and validation loss per epoch, and below it the share of each epoch spent
        waiting for batches, as a PNG at ``path`` (rank 0 writes; its folder is created), or
        shown without a path. The original NNHandler's arguments work
        too: ``plot_losses(log_y_scale: bool, save_path=None)``.

        Example:
            >>> handler.plot_losses("runs/exp1/loss.png")
        """
        path, log_y = plot_request(path, save_path, log_y_scale)
        if self.rank == 0:
            plot_history(self._history.loss_panels(), self.val_epochs, path, log_y)

    def plot_metrics(
        self, path: str | os.PathLike | bool | None = None,
        save_path: str | os.PathLike | None = None, log_y_scale: bool = False,
    ) -> None:  # fmt: skip
        """One panel per metric, training and validation per epoch, as :meth:`plot_losses`."""
        path, log_y = plot_request(path, save_path, log_y_scale)
        if self.rank == 0 and self.metrics:
            plot_history(self._history.metric_panels(self.metrics), self.val_epochs, path, log_y)

    # ------------------------------------------------------------------ helpers

    def _scorer(self) -> Scorer:
        """The loss and metrics as set now, at the run's precision."""
        return Scorer(self.loss_fn, self.metrics, self.device, self._stepper.autocast)

    def _call(self, hook: str) -> None:
        for callback in self.callbacks:
            call_hook(callback, hook, self)

    def _log(self, line: str) -> None:
        if self.rank == 0:
            self.log_fn(line)
