"""Checkpoint files that survive crashes and load without running code.

Design. A checkpoint is written to a temporary file in the destination's folder, flushed and
fsynced, renamed over the destination and the folder fsynced: a crash at any moment leaves either
the previous file or the new one, never half of one. Files are read with
``torch.load(weights_only=True)`` only, so nothing in a checkpoint may need pickled code: what the
trainer stores is tensors, numbers, strings, lists and dicts; random generator states are turned
into tensors here (:func:`rng_state`). The trade-off: objects such as a numpy ``RandomState`` or a
user class cannot ride along, and a truncated or corrupt file is reported as such
(:class:`CheckpointError`) instead of being half-loaded. Model state dicts are stored without
wrapper prefixes and loaded through :func:`load_model_state`, which strips the ``module.``
(DistributedDataParallel, DataParallel) and ``_orig_mod.`` (``torch.compile``) prefixes that
other tools leave in their files.
"""

from __future__ import annotations

import os
import pickle
import random
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from nnh_data.atomic import atomic_write
from nnh_train.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "load_checkpoint",
    "load_model_state",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "strip_prefixes",
]

WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def save_checkpoint(state: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write ``state`` to ``path`` atomically (temporary file, fsync, rename, fsync of the folder).

    Example:
        >>> save_checkpoint({"model": model.state_dict(), "epoch": 3}, "runs/last.pt")
    """
    with atomic_write(path, fsync=True) as file:
        torch.save(dict(state), file)



def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """The dict in checkpoint ``path``, read with ``torch.load(weights_only=True)``.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: the file is truncated, corrupt or not a weights-only checkpoint.

    Example:
        >>> state = load_checkpoint("runs/last.pt")
    """
    path = os.fspath(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile,
            pickle.UnpicklingError) as exc:  # fmt: skip
        raise CheckpointError(
            f"cannot read checkpoint {path!r} (truncated or corrupt?): {exc}"
        ) from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path!r} holds a {type(state).__name__}, not a dict")
    return state


def strip_prefixes(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` without the wrapper prefixes (``module.``, ``_orig_mod.``) that every key
    shares, removed repeatedly, so ``_orig_mod.module.x`` and ``module._orig_mod.x`` become ``x``.

    Example:
        >>> strip_prefixes({"module._orig_mod.fc.weight": 1})
        {'fc.weight': 1}
    """
    state = dict(state_dict)
    while state:
        prefix = next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in state)), None)
        if prefix is None:
            break
        state = {key[len(prefix) :]: value for key, value in state.items()}
    return state


def load_model_state(module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
    """Load ``state_dict`` into ``module`` (unwrapped), accepting keys with wrapper prefixes.

    Returns what ``module.load_state_dict`` returns (missing and unexpected keys).

    Example:
        >>> load_model_state(model, torch.load("ddp_run.pt", weights_only=True)["model"])
    """
    return module.load_state_dict(strip_prefixes(state_dict), strict=strict)


def rng_state() -> dict[str, Any]:
    """This process's random generator states (torch CPU and CUDA, numpy, Python) as tensors
    and numbers, so that ``torch.load(weights_only=True)`` reads them back."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": torch.from_numpy(keys.astype(np.int64)),
        "numpy_extra": [kind, int(position), int(has_gauss), float(gauss)],
        "python": torch.tensor(internal, dtype=torch.int64),
        "python_extra": [version, gauss_next],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the generator states saved by :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    kind, position, has_gauss, gauss = state["numpy_extra"]
    np.random.set_state(
        (kind, state["numpy"].numpy().astype(np.uint32), position, has_gauss, gauss)
    )
    version, gauss_next = state["python_extra"]
    random.setstate((version, tuple(state["python"].tolist()), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
