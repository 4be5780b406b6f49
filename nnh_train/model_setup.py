"""The model a handler trains: built from a class or taken as given, and wrapped for DDP.

Design. :class:`~nnh_train.NNHandler` builds ``DistributedDataParallel`` itself, so the one DDP
option users most need, ``find_unused_parameters``, is the handler's: its argument, else the
``DDP_FIND_UNUSED_PARAMETERS`` environment variable (a job script can set it without a code
change), else False, DDP's default, which costs nothing per step. DDP's own error for parameters
without gradients advises an argument of ``DistributedDataParallel``, which a handler's user never
calls; :func:`unused_parameters_named` puts the handler's two switches in front of it. The
trade-off: other DDP options go through ``ddp_kwargs`` untouched, with PyTorch's own messages.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["FIND_UNUSED_ENV", "build_model", "unused_parameters_named", "wrap_model"]

FIND_UNUSED_ENV = "DDP_FIND_UNUSED_PARAMETERS"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def build_model(model: Any, kwargs: dict[str, Any]) -> nn.Module:
    """``model`` itself (an ``nn.Module``, without ``kwargs``) or ``model(**kwargs)``."""
    if isinstance(model, nn.Module):
        if kwargs:
            raise ValueError(f"model keyword arguments {sorted(kwargs)} given with a built model")
        return model
    built = model(**kwargs) if callable(model) else None
    if not isinstance(built, nn.Module):
        raise ValueError(
            f"model_class_or_instance must be an nn.Module or build one, got {model!r}"
        )
    return built


def wrap_model(
    module: nn.Module, distributed: bool, device: torch.device, find_unused: bool | None,
    ddp_kwargs: Mapping[str, Any],
) -> nn.Module:  # fmt: skip
    """``module`` in ``DistributedDataParallel`` under DDP (``module`` itself otherwise), with
    ``find_unused_parameters`` from ``find_unused``, else from :data:`FIND_UNUSED_ENV`."""
    if not distributed:
        return module
    kwargs = {"device_ids": [device.index] if device.type == "cuda" else None,
              "find_unused_parameters": _env_flag(FIND_UNUSED_ENV), **ddp_kwargs}  # fmt: skip
    if find_unused is not None:
        kwargs["find_unused_parameters"] = bool(find_unused)
    return DistributedDataParallel(module, **kwargs)


@contextmanager
def unused_parameters_named() -> Iterator[None]:
    """DDP's error for parameters that got no gradient advises an argument of
    ``DistributedDataParallel``, which the handler builds: name the handler's switches."""
    try:
        yield
    except RuntimeError as exc:
        if "find_unused_parameters" not in str(exc):
            raise
        raise RuntimeError(
            "DDP found parameters that took no part in the loss (PyTorch's message below). "
            "NNHandler builds DistributedDataParallel itself: pass NNHandler(..., "
            f"find_unused_parameters=True) or set {FIND_UNUSED_ENV}=1 (a walk over the "
            "autograd graph every step), or use or remove those parameters.\n\n" + str(exc)
        ) from exc


def _env_flag(name: str) -> bool:
    text = os.environ.get(name, "").strip().lower()
    if text not in _TRUE + _FALSE:
        raise ValueError(f"environment variable {name} must be one of {_TRUE + _FALSE}, "
                         f"got {os.environ[name]!r}")  # fmt: skip
    return text in _TRUE
