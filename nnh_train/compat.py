"""Code written for the original NNHandler, ported to nnh with its import lines changed.

Design. The original's public names and options live here, not in :mod:`nnh_train.handler`:
its enums (:class:`ModelType`, :class:`LoggingMode`, :class:`DataLoaderType`), its constructor
options (:class:`OriginalOptions`: a log file, DDP arguments, the model type), ``auto_save``'s
per-epoch checkpoints (:class:`AutoSave`), ``NNHandler.load(path, device)`` (the model class is
recorded in every checkpoint by import path, :func:`model_record`, and found again among the
modules already imported, :func:`model_from_record`), ``plot_losses(True)`` and the methods
mixed into ``NNHandler`` by :class:`OriginalAPI`. Each original option is honoured where nnh has
the same thing, or refused by name with the nnh replacement in the message (never forwarded to
the model). The trade-off: an option whose meaning nnh cannot give (a score-based training loop,
model source code stored in checkpoints) fails at the call instead of being half-emulated.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from nnh_train.callbacks import Callback, Trainer
from nnh_train.checkpoint_fields import check_recorded_model
from nnh_train.resume_state import read_checkpoint

__all__ = [
    "ORIGINAL_OPTIONS",
    "AutoSave",
    "ClassOrInstanceMethod",
    "DataLoaderType",
    "LoggingMode",
    "ModelType",
    "OriginalAPI",
    "OriginalOptions",
    "cache_from_loader_type",
    "handler_from_checkpoint",
    "is_device",
    "model_from_record",
    "model_record",
    "plot_request",
    "train_precision",
]


class ModelType(enum.Enum):
    """The original's task types. nnh trains every model as ``loss_fn(model(x), y)`` over
    ``(x, y, ...)`` batches: CLASSIFICATION and REGRESSION are that; the others are refused."""

    CLASSIFICATION = "classification"
    GENERATIVE = "generative"
    REGRESSION = "regression"
    SCORE_BASED = "score_based"


class LoggingMode(enum.Enum):
    """Where the handler's log lines go (rank 0): the console, a file or both."""

    CONSOLE = "console"
    FILE = "file"
    BOTH = "both"


class DataLoaderType(enum.Enum):
    """``set_train_loader(..., dataloader_type=)``: RANK_CACHED is ``cache=True``."""

    STANDARD = "standard"
    RANK_CACHED = "rank_cached"


ORIGINAL_OPTIONS = ("model_type", "logger_mode", "logger_filename", "logger_filemode",
                    "logger_level", "save_model_code", "ddp_kwargs")  # fmt: skip
"""The original constructor's own options: taken out of the model's keyword arguments."""

_UNSUPPORTED_TYPES = {
    ModelType.GENERATIVE: "nnh passes batch[1] as the target; for a model that reconstructs "
    "its input, give batches (x, x) or a dataset of single tensors (its own target)",
    ModelType.SCORE_BASED: "nnh has no SDE training loop; train with a loss_fn(output, target) "
    "over your own batches, or write the step yourself around handler.module",
}


def _enum(kind: type[enum.Enum], name: str, value: Any) -> enum.Enum:
    """``value`` as a member of ``kind`` (a member, or its value as a string)."""
    if isinstance(value, kind):
        return value
    try:
        return kind(str(getattr(value, "value", value)).lower())
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in kind)
        raise ValueError(
            f"{name} must be a {kind.__name__} or one of {allowed}, got {value!r}"
        ) from None


@dataclass(frozen=True)
class OriginalOptions:
    """The original constructor's options, checked once (see :data:`ORIGINAL_OPTIONS`).

    ``model_type`` CLASSIFICATION or REGRESSION; ``logger_mode`` with ``logger_filename``,
    ``logger_filemode`` and ``logger_level`` gives ``handler.logger`` (rank 0), which receives the
    handler's log lines; ``ddp_kwargs`` go to ``DistributedDataParallel``; ``save_model_code``
    must be False (nnh checkpoints hold no code, they name the class).
    """

    model_type: Any = ModelType.CLASSIFICATION
    logger_mode: Any = None
    logger_filename: str = "NNHandler.log"
    logger_filemode: str = "a"
    logger_level: int = logging.INFO
    save_model_code: bool = False
    ddp_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        kind = _enum(ModelType, "model_type", self.model_type)
        if kind in _UNSUPPORTED_TYPES:
            raise ValueError(f"model_type={kind} is not supported: {_UNSUPPORTED_TYPES[kind]}")
        if self.logger_mode is not None:
            _enum(LoggingMode, "logger_mode", self.logger_mode)
        if self.save_model_code:
            raise ValueError(
                "save_model_code=True is not supported: nnh checkpoints hold no code (they are "
                "read with torch.load(weights_only=True)); they record the model class's import "
                "path, and NNHandler.load(path) builds it again when its module is imported"
            )
        if not isinstance(self.ddp_kwargs, Mapping):
            raise ValueError(f"ddp_kwargs must be a dict, got {self.ddp_kwargs!r}")

    @classmethod
    def split(cls, kwargs: dict[str, Any]) -> tuple[OriginalOptions, dict[str, Any]]:
        """(the original options in ``kwargs``, the rest: the model's keyword arguments)."""
        ours = {key: kwargs[key] for key in ORIGINAL_OPTIONS if key in kwargs}
        if ours.get("ddp_kwargs", {}) is None:  # the original's default
            ours["ddp_kwargs"] = {}
        rest = {key: value for key, value in kwargs.items() if key not in ours}
        return cls(**ours), rest

    def logger(self, rank: int) -> logging.Logger | None:
        """The handler's logger on rank 0 (None elsewhere or without ``logger_mode``), made
        outside logging's registry, so that each handler has its own."""
        if self.logger_mode is None or rank != 0:
            return None
        mode = _enum(LoggingMode, "logger_mode", self.logger_mode)
        logger = logging.Logger("nnh_train.NNHandler", self.logger_level)
        streams = []
        if mode in (LoggingMode.CONSOLE, LoggingMode.BOTH):
            streams.append(logging.StreamHandler(sys.stdout))
        if mode in (LoggingMode.FILE, LoggingMode.BOTH):
            folder = os.path.dirname(os.path.abspath(self.logger_filename))
            os.makedirs(folder, exist_ok=True)
            streams.append(logging.FileHandler(self.logger_filename, mode=self.logger_filemode))
        for stream in streams:
            stream.setFormatter(logging.Formatter("[%(levelname)s|%(asctime)s] %(message)s"))
            logger.addHandler(stream)
        return logger


def cache_from_loader_type(kwargs: dict[str, Any], cache: bool) -> bool:
    """``cache`` after taking the original's ``dataloader_type`` out of the loader arguments."""
    if "dataloader_type" not in kwargs:
        return cache
    kind = _enum(DataLoaderType, "dataloader_type", kwargs.pop("dataloader_type"))
    return cache or kind is DataLoaderType.RANK_CACHED


_TRAIN_DEFAULTS = {"use_amp": False, "seed": None, "gradient_clipping_norm": None,
                   "ema_decay": 0.0, "progress_bar": True, "debug_print_interval": None,
                   "save_on_last_epoch": True, "epoch_train_and_val_pbar": False}  # fmt: skip
_TRAIN_REPLACED = {
    "gradient_clipping_norm": "nnh's NNHandler does not clip gradients",
    "ema_decay": "keep torch.optim.swa_utils.AveragedModel(handler.module) in a Callback",
    "progress_bar": "set the environment variable TQDM_DISABLE=1",
    "debug_print_interval": "read handler.step_loss in a Callback's on_batch_end",
    "save_on_last_epoch": "auto_save always saves after the last epoch",
    "epoch_train_and_val_pbar": "nnh shows one progress bar per epoch",
}


def train_precision(options: Mapping[str, Any], precision: str, device: torch.device) -> str:
    """The precision to train at, after the original ``train()``'s own options: ``use_amp``
    is fp16 autocast with a GradScaler on CUDA (as the original; a warning elsewhere),
    ``seed`` seeds torch; the others are accepted at their defaults and refused otherwise,
    naming what replaces them."""
    unknown = sorted(set(options) - set(_TRAIN_DEFAULTS))
    if unknown:
        raise TypeError(f"train() got unexpected keyword arguments {unknown}")
    for name, value in options.items():
        if name in _TRAIN_REPLACED and value != _TRAIN_DEFAULTS[name]:
            raise ValueError(f"train({name}={value!r}) of the original NNHandler is not in nnh: "
                             f"{_TRAIN_REPLACED[name]}")  # fmt: skip
    if options.get("seed") is not None:
        torch.manual_seed(options["seed"])
    if not options.get("use_amp"):
        return precision
    if device.type != "cuda":
        warnings.warn("use_amp=True needs CUDA (as in the original NNHandler): training in "
                      f"{precision}; precision='bf16' autocasts on the CPU",
                      stacklevel=3)  # fmt: skip
        return precision
    return "fp16"


# ---------------------------------------------------------------------- the model's record


def model_record(model: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint records of the model: its class's import path (``module:qualname``)
    and the keyword arguments it was built with (None when it was given built, or when they are
    not plain values that ``torch.load(weights_only=True)`` reads back)."""
    built = isinstance(model, nn.Module)
    cls = type(model) if built else model
    name = f"{cls.__module__}:{cls.__qualname__}" if isinstance(cls, type) else None
    plain = not built and _is_plain(dict(kwargs))
    return {"model_class": name, "model_kwargs": dict(kwargs) if plain else None}


def _is_plain(value: Any) -> bool:
    if isinstance(value, (str, int, float, bool, type(None), torch.Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def model_from_record(state: Mapping[str, Any], path: str) -> tuple[type, dict[str, Any]]:
    """The model class and keyword arguments checkpoint ``state`` (read from ``path``) recorded.

    The class is looked up among the modules already imported (the script that defines it,
    ``__main__`` in a notebook, or its package): a checkpoint never makes this process import
    code.
    """
    name, kwargs = state.get("model_class"), state.get("model_kwargs")
    fix = f"pass the model: NNHandler.load({path!r}, Net, **model_kwargs)"
    if name is None or kwargs is None:
        why = "a built model" if name else "no model class"
        raise ValueError(f"checkpoint {path!r} records {why}, not a class and its arguments: "
                         f"{fix}")  # fmt: skip
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name)
    cls = module
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"checkpoint {path!r} was saved with model class {name}, which is not "
                         f"imported in this process: import {module_name}, or {fix}")  # fmt: skip
    return cls, dict(kwargs)


class ClassOrInstanceMethod:
    """A method that receives the class when called on it and the instance when called on
    one: the original NNHandler's ``NNHandler.load(path)`` builds a handler, and
    ``handler.load(path)`` loads into that handler."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        functools.update_wrapper(self, func)

    def __get__(self, instance: Any, owner: type) -> Callable[..., Any]:
        return functools.partial(self.func, owner if instance is None else instance)


H = TypeVar("H")


def handler_from_checkpoint(
    cls: type[H], path: str | os.PathLike, model_class_or_instance: Any = None,
    device: torch.device | str | None = None, use_distributed: bool | None = None,
    **model_kwargs: Any,
) -> H:  # fmt: skip
    """``NNHandler.load`` on the class: a ``cls`` handler with the state of checkpoint
    ``path``, for the model given, or the one the checkpoint records (a device in the model's
    place, as the original's ``NNHandler.load(path, device)``, is the device), once its sizes
    are checked against the checkpoint's tensors on the meta device."""
    if is_device(model_class_or_instance):
        if device is not None:
            raise ValueError(f"device given twice: {model_class_or_instance!r} and {device!r}")
        model_class_or_instance, device = None, model_class_or_instance
    if model_class_or_instance is None:
        state = read_checkpoint(path)
        recorded, kwargs = model_from_record(state, os.fspath(path))
        model_class_or_instance, model_kwargs = recorded, {**kwargs, **model_kwargs}
        check_recorded_model(recorded, model_kwargs, state["model"], os.fspath(path))
    handler = cls(model_class_or_instance, device, use_distributed, **model_kwargs)
    handler.load_state(path)
    return handler


def is_device(value: Any) -> bool:
    """True for a ``torch.device`` or a string (``NNHandler.load(path, "cuda")``): no model
    class or module is either."""
    return isinstance(value, (str, torch.device))


# ---------------------------------------------------------------------- plots


def plot_request(
    path: Any, save_path: str | os.PathLike | None, log_y_scale: bool
) -> tuple[str | None, bool]:
    """(where to save, or None to show; log scale) from ``plot_losses``'s arguments: ours
    (``path``) or the original's (``log_y_scale``, ``save_path``), whose first argument is
    the bool ``log_y_scale``."""
    if isinstance(path, bool):
        path, log_y_scale = None, path or log_y_scale
    if path is not None and save_path is not None:
        raise ValueError(f"give path or save_path, not both (got {path!r} and {save_path!r})")
    target = path if path is not None else save_path
    return (None if target is None else os.fspath(target)), bool(log_y_scale)


# ---------------------------------------------------------------------- auto_save


class AutoSave(Callback):
    """The original's ``auto_save``: ``handler.save`` into ``folder / name.format(**logs)``
    every ``interval`` epochs (-1: only the last) and after the last epoch trained; with
    ``overwrite`` the file saved before is removed. ``name`` takes ``epoch`` (1-based) and
    the epoch's figures (``train_loss`` or ``loss``, ``val_loss``, metrics); ``.pth`` is added
    when missing.

    Example:
        >>> handler.auto_save(1, "runs/exp1", "model_epoch_{epoch:02d}.pth", overwrite=True)
    """

    def __init__(self, interval: int, folder: str | os.PathLike, name: str, overwrite: bool):
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < -1:
            raise ValueError(f"interval must be an int >= 1, -1 (the last epoch) or 0/None "
                             f"(off), got {interval!r}")  # fmt: skip
        self.interval, self.folder = interval, os.fspath(folder)
        self.name, self.overwrite = name, bool(overwrite)
        self._saved_epoch = -1
        self.last_saved: str | None = None

    def run_dirs(self) -> list[str]:
        return [self.folder]

    def on_epoch_end(self, handler: Trainer) -> None:
        if self.interval > 0 and handler.epoch % self.interval == 0:
            self._save(handler)

    def on_train_end(self, handler: Trainer) -> None:
        if handler.epoch_logs and handler.epoch != self._saved_epoch:
            self._save(handler)

    def _save(self, handler: Trainer) -> None:
        logs = {k: v for k, v in handler.epoch_logs.items() if v is not None}
        logs.update({k[len("train_"):]: v for k, v in logs.items() if k.startswith("train_")})
        try:
            name = self.name.format(**logs)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"auto_save name {self.name!r} cannot be filled from this epoch's "
                             f"figures {sorted(logs)}: {exc!r}") from exc  # fmt: skip
        path = os.path.join(self.folder, name if name.endswith(".pth") else f"{name}.pth")
        handler.save(path)
        if self.overwrite and self.last_saved not in (None, path) and handler.rank == 0:
            if os.path.exists(self.last_saved):
                os.remove(self.last_saved)
        self.last_saved, self._saved_epoch = path, handler.epoch


# ---------------------------------------------------------------------- methods of NNHandler

_SAMPLE = "use handler.sample(fn, *args), which runs fn(handler.module, *args) on rank 0"
_REPLACED = {
    "model_code": "checkpoints hold no code; they record the model class's import path, and "
    "NNHandler.load(path) builds the model again when its module is imported",
    "initialize_from_checkpoint": "use NNHandler.load(path, Net, **model_kwargs)",
    "compile_model": "use handler.train(epochs, compile=True)",
    "set_model": "build a new NNHandler(Net, ...)",
    "set_sde": _SAMPLE,
    "set_sampler": _SAMPLE,
    "get_samples": _SAMPLE,
    "score": _SAMPLE,
    "initialize_logger": "use NNHandler(..., logger_mode=LoggingMode.FILE, logger_filename=...)",
    "pass_epoch_to_loss": "use a loss function that reads handler.epoch",
    "loss_fn_kwargs": "use set_loss_fn(functools.partial(loss_fn, **kwargs))",
    "ema": "use torch.optim.swa_utils.AveragedModel(handler.module)",
    "keep_eval_on_module": "keep that submodule in eval mode in the model's forward",
    "freeze_module": "use module.requires_grad_(False) before set_optimizer",
    "monitor_keys": "use handler.epoch_logs, whose keys callbacks can monitor",
    "train_loader_kwargs": "use handler.train_loader (the DataLoader built)",
    "val_loader_kwargs": "use handler.val_loader (the DataLoader built)",
}


class OriginalAPI:
    """The original NNHandler's methods and attributes that nnh's ``NNHandler`` keeps, mixed
    into it; other original names raise ``AttributeError`` naming the nnh replacement."""

    ModelType = ModelType
    LoggingMode = LoggingMode

    train_metrics: dict[str, list[float]]
    val_metrics: dict[str, list[float]]
    module: nn.Module
    callbacks: list[Callback]

    @property
    def train_metrics_history(self) -> dict[str, list[float]]:
        """The original's name of ``train_metrics``."""
        return self.train_metrics

    @property
    def val_metrics_history(self) -> dict[str, list[float]]:
        """The original's name of ``val_metrics``."""
        return self.val_metrics

    @property
    def seed(self) -> int | None:
        """The seed last given (``handler.seed = 42`` seeds torch on this rank, CUDA too)."""
        return getattr(self, "_seed", None)

    @seed.setter
    def seed(self, value: int | None) -> None:
        if value is not None:
            torch.manual_seed(value)
        self._seed = value

    def count_parameters(self, trainable_only: bool = True) -> int:
        """Parameters of the model (those that require gradients, with ``trainable_only``)."""
        return sum(p.numel() for p in self.module.parameters()
                   if p.requires_grad or not trainable_only)  # fmt: skip

    def auto_save(
        self, interval: int | None, save_path: str | os.PathLike = ".",
        name: str = "model_epoch{epoch:02d}", overwrite: bool = False,
    ) -> None:  # fmt: skip
        """Save the whole state every ``interval`` epochs as ``save_path/name`` (see
        :class:`AutoSave`); ``interval`` None or 0 turns it off. Replaces an earlier call."""
        self.callbacks[:] = [c for c in self.callbacks if not isinstance(c, AutoSave)]
        if interval:
            self.callbacks.append(AutoSave(interval, save_path, name, overwrite))

    def __getattr__(self, name: str) -> Any:
        if name in _REPLACED:
            raise AttributeError(f"NNHandler.{name} of the original NNHandler is not in nnh: "
                                 f"{_REPLACED[name]}")  # fmt: skip
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
