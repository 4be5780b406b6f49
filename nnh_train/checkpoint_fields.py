"""A checkpoint's fields checked before any of them is used, and the model it records checked
before it is built.

Design. Checkpoints are read with ``torch.load(weights_only=True)``, so a file cannot run code,
but its numbers still steer what the process does: a crafted or damaged file could say
``epoch=-5``, give no rank shares (``ranks=[]``, an ``IndexError`` deep in the resume) or name a
model class with arguments that allocate 160 GB before the first tensor is compared. So
:func:`check_fields` checks each field of a version-1 checkpoint for its type and range
(counts ``>= 0``, ``world_size >= 1``, one share per rank, each with its generator states) and
:func:`check_recorded_model` builds the recorded class on the ``meta`` device (shapes, no memory)
and compares every parameter and buffer with the checkpoint's tensors before the real build. Both
raise :class:`~nnh_train.errors.CheckpointError` naming the file, the field or parameter, the
value and the rule. The trade-off: a model whose constructor cannot run on the meta device (it
reads tensor values) is not built from its record; the message says to pass the class.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from typing import Any

import torch

from nnh_train.checkpoint import strip_prefixes
from nnh_train.errors import CheckpointError
from nnh_train.model_setup import build_model

__all__ = ["check_fields", "check_recorded_model"]

_COUNTS = ("epoch", "step", "batches_done")
_OBJECTS = ("optimizer", "scheduler", "scaler")
_HISTORY_LISTS = ("train_losses", "val_losses", "val_epochs")
_HISTORY_DICTS = ("train_metrics", "val_metrics")
_RNG_TENSORS = ("torch", "numpy", "python")
_RNG_LISTS = {"numpy_extra": 4, "python_extra": 2}


def check_fields(state: Mapping[str, Any], path: str) -> None:
    """CheckpointError naming the first field of checkpoint ``state`` (read from ``path``) whose
    type or range is not what a version-1 checkpoint holds."""
    for name in _COUNTS:
        _count(state, name, path, low=0)
    _count(state, "world_size", path, low=1)
    _check_model_state(state.get("model"), path)
    for name in _OBJECTS:
        _need(isinstance(state.get(name), (dict, type(None))), path, name, state.get(name),
              "a state dict or None")  # fmt: skip
    sums = state.get("sums")
    _need(isinstance(sums, list) and all(map(_is_number, sums)), path, "sums", sums,
          "a list of numbers")  # fmt: skip
    _check_history(state.get("history"), path)
    _check_ranks(state.get("ranks"), state["world_size"], path)
    _need(isinstance(state.get("model_class"), (str, type(None))), path, "model_class",
          state.get("model_class"), "'module:qualname' or None")  # fmt: skip
    kwargs = state.get("model_kwargs")
    _need(kwargs is None or (isinstance(kwargs, dict) and all(map(_is_name, kwargs))), path,
          "model_kwargs", kwargs, "a dict of keyword arguments or None")  # fmt: skip


def check_recorded_model(
    cls: type, kwargs: Mapping[str, Any], model_state: Mapping[str, Any], path: str
) -> None:
    """Build ``cls(**kwargs)`` on the ``meta`` device and compare its state's shapes with the
    tensors of checkpoint ``path``'s ``model_state``; CheckpointError naming the first
    parameter or buffer missing, unexpected or of another shape, or when the build fails."""
    name = f"{cls.__qualname__}(**{reprlib.repr(dict(kwargs))})"
    try:
        with torch.device("meta"):
            expected = build_model(cls, dict(kwargs)).state_dict()
    except Exception as exc:  # noqa: BLE001 - any constructor's error, named
        raise CheckpointError(
            f"checkpoint {path!r} records the model {name}, which cannot be built on the meta "
            f"device to check its size first ({type(exc).__name__}: {exc}): pass the model, "
            f"NNHandler.load({path!r}, {cls.__qualname__}, **model_kwargs)"
        ) from exc
    saved = strip_prefixes(model_state)
    for key, value in expected.items():
        if key not in saved:
            raise CheckpointError(f"checkpoint {path!r} has no tensor for {key!r} of the model "
                                  f"it records, {name}")  # fmt: skip
        if tuple(saved[key].shape) != tuple(value.shape):
            raise CheckpointError(
                f"checkpoint {path!r} records the model {name}, whose {key!r} has shape "
                f"{tuple(value.shape)} ({value.numel()} values), but holds a tensor of shape "
                f"{tuple(saved[key].shape)} for it: not building that model"
            )
    extra = sorted(set(saved) - set(expected))
    if extra:
        raise CheckpointError(f"checkpoint {path!r} holds tensors {extra[:5]} that the model it "
                              f"records, {name}, has not")  # fmt: skip


def _need(ok: bool, path: str, field: str, value: Any, rule: str) -> None:
    if not ok:
        raise CheckpointError(
            f"checkpoint {path!r} has {field}={reprlib.repr(value)}; it must be {rule} "
            "(a damaged or hand-made file?)"
        )


def _count(state: Mapping[str, Any], name: str, path: str, low: int) -> None:
    value = state.get(name)
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    _need(ok, path, name, value, f"an int >= {low}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_name(key: Any) -> bool:
    return isinstance(key, str) and key.isidentifier()


def _check_model_state(model: Any, path: str) -> None:
    ok = isinstance(model, dict) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()
    )
    _need(ok, path, "model", model, "a state dict: names to tensors")


def _check_history(history: Any, path: str) -> None:
    _need(isinstance(history, dict), path, "history", history, "a dict of records")
    for key in _HISTORY_LISTS:
        _need(isinstance(history.get(key), list), path, f"history[{key!r}]", history.get(key),
              "a list")  # fmt: skip
    for key in _HISTORY_DICTS:
        records = history.get(key)
        ok = isinstance(records, dict) and all(isinstance(v, list) for v in records.values())
        _need(ok, path, f"history[{key!r}]", records, "a dict of lists")
    waits = history.get("data_waits", [])
    _need(isinstance(waits, list), path, "history['data_waits']", waits, "a list")


def _check_ranks(ranks: Any, world_size: int, path: str) -> None:
    ok = isinstance(ranks, list) and len(ranks) == world_size
    _need(ok, path, "ranks", ranks, f"a list of one share per rank (world_size={world_size})")
    for rank, share in enumerate(ranks):
        field = f"ranks[{rank}]"
        _need(isinstance(share, dict), path, field, share, "a dict of rng, epoch_rng, loader")
        for key in ("rng", "epoch_rng"):
            _check_rng(share.get(key), path, f"{field}[{key!r}]")
        loader = share.get("loader")
        _need(isinstance(loader, (dict, type(None))), path, f"{field}['loader']", loader,
              "a loader state dict or None")  # fmt: skip


def _check_rng(rng: Any, path: str, field: str) -> None:
    ok = isinstance(rng, dict) and all(isinstance(rng.get(k), torch.Tensor) for k in _RNG_TENSORS)
    ok = ok and all(
        isinstance(rng.get(k), list) and len(rng[k]) == n for k, n in _RNG_LISTS.items()
    )
    _need(ok, path, field, rng, "the generator states nnh_train.checkpoint.rng_state gives")
