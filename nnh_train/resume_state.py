"""What a checkpoint holds besides the model, assembled on save and handed back on resume, so
that a resumed run is the uninterrupted one.

Design. A checkpoint (:func:`checkpoint_state`, version :data:`CHECKPOINT_VERSION`) holds the
unwrapped model; the optimizer, scheduler and scaler states; the position (epoch, batches done
in it, optimizer steps) and the epoch's partial sums; the history; and one share per rank: its
random generator states, at the step and at the epoch's start (when the loader drew its order),
and its loader's state (``StatefulDataLoader.state_dict()`` for streaming datasets, else None:
the epoch's batch count is enough to replay the sampler). :class:`ResumeState` is the rank's side
of that: object states wait in it until their object exists (an optimizer set after
:meth:`~nnh_train.NNHandler.load_state`), and the rank's share waits until the next epoch starts,
where it sets the generators and the loader where the saved run had them
(:meth:`ResumeState.epoch_batches`). With the same world size the rest of the run is bitwise the
same on CPU. With another world size the generator states cannot be given out (a warning says
so), and a mid-epoch checkpoint resumes only from a stream state merged over the saved ranks;
a map-style one is refused. The trade-off: a checkpoint is one file written by rank 0 with every
rank's share in it, simple to move and read, at the cost of a gather of the shares on save.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import nn
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from nnh_data.streaming import state_from_loader
from nnh_train.batches import iterate, resumed
from nnh_train.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from nnh_train.checkpoint_fields import check_fields
from nnh_train.dd_helpers import gather_to_rank0
from nnh_train.ddp_decorators import on_rank

__all__ = [
    "CHECKPOINT_VERSION",
    "OBJECTS",
    "ResumeState",
    "checkpoint_state",
    "read_checkpoint",
    "save_on_rank0",
]

CHECKPOINT_VERSION = 1
OBJECTS = ("optimizer", "scheduler", "scaler")
"""The training objects whose states a checkpoint holds, by name (None: the run had none)."""


def checkpoint_state(
    module: nn.Module, objects: Mapping[str, Any], position: Mapping[str, Any],
    history: Mapping[str, Any], shares: list[dict[str, Any]], world_size: int,
    model_record: Mapping[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """A checkpoint of version :data:`CHECKPOINT_VERSION`.

    Args:
        module: the unwrapped model.
        objects: the states of :data:`OBJECTS`, by name (:meth:`ResumeState.object_states`).
        position: ``epoch``, ``step``, ``batches_done`` and ``sums`` (the running epoch's).
        history: :meth:`~nnh_train.history.History.state_dict`.
        shares: each rank's :meth:`ResumeState.rank_share`, in rank order.
        model_record: the model class and arguments (:func:`~nnh_train.compat.model_record`).
    """
    return {
        "version": CHECKPOINT_VERSION,
        "model": module.state_dict(),
        **{name: objects[name] for name in OBJECTS},
        **{key: position[key] for key in ("epoch", "step", "batches_done", "sums")},
        "history": history,
        "world_size": world_size,
        "ranks": shares,
        **model_record,
    }


def save_on_rank0(
    path: str | os.PathLike, share: dict[str, Any],
    assemble: Callable[[list[dict[str, Any]]], dict[str, Any]], distributed: bool,
) -> None:  # fmt: skip
    """Gather every rank's ``share`` to rank 0, which writes ``assemble(shares)`` to ``path``
    atomically; every rank waits, and an error in the write is raised on every rank (call it on
    every rank)."""
    shares = gather_to_rank0(share) if distributed else [share]

    def write_checkpoint() -> None:
        save_checkpoint(assemble(shares), path)

    if distributed:
        on_rank(0)(write_checkpoint)()
    else:
        write_checkpoint()


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Checkpoint ``path`` (:func:`~nnh_train.checkpoint.load_checkpoint`), refused when its
    version is not the one this nnh reads (ValueError) or a field is not what that version
    holds (:class:`~nnh_train.errors.CheckpointError`, :func:`~nnh_train.checkpoint_fields.
    check_fields`)."""
    state = load_checkpoint(path)
    if state.get("version") != CHECKPOINT_VERSION:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} has version {state.get('version')!r}; this "
            f"nnh reads {CHECKPOINT_VERSION}"
        )
    check_fields(state, os.fspath(path))
    return state


class ResumeState:
    """One rank's resume in progress: the object states waiting for their objects, and the
    rank's share waiting for the next epoch start.

    Attributes:
        pending: states of :data:`OBJECTS` loaded before their object was set.
        share: the generator and loader states to apply when training resumes (None when
            there is nothing to resume).
        epoch_rng: the generator states at the running epoch's start, when its loader drew
            its order.
    """

    def __init__(self) -> None:
        self.pending: dict[str, Any] = {}
        self.share: dict[str, Any] | None = None
        self.epoch_rng: dict[str, Any] | None = None

    def apply(self, name: str, live: Any) -> None:
        """Load the pending state of ``name`` into ``live``, its object, when both exist."""
        if live is not None and name in self.pending:
            live.load_state_dict(self.pending.pop(name))

    def object_states(self, live: Mapping[str, Any]) -> dict[str, Any]:
        """The state of each object of ``live`` (by name), or the pending one where the
        object is not set."""
        return {name: obj.state_dict() if obj is not None else self.pending.get(name)
                for name, obj in live.items()}  # fmt: skip

    def rank_share(self, loader: DataLoader, batches_done: int) -> dict[str, Any]:
        """What differs between ranks: generator states and the loader's position (the share
        loaded and not yet resumed, if any, as it was)."""
        if self.share is not None:
            return self.share
        stateful = batches_done and isinstance(loader, StatefulDataLoader)
        return {"rng": rng_state(), "epoch_rng": self.epoch_rng or rng_state(),
                "loader": loader.state_dict() if stateful else None}  # fmt: skip

    def hold(self, loader: DataLoader, batches_done: int) -> None:
        """Keep the rank's share as it is now, mid-epoch: the next epoch start continues from
        here (a run stopped by ``max_steps``, then trained on)."""
        self.share = self.rank_share(loader, batches_done)

    def load(
        self, state: Mapping[str, Any], path: str, rank: int, world_size: int,
        live: Mapping[str, Any],
    ) -> None:  # fmt: skip
        """Take checkpoint ``state`` (read from ``path``): this rank's share, and the object
        states, loaded at once into the objects of ``live`` that are set."""
        self.share = _share_of(state, path, rank, world_size)
        self.pending = {name: state[name] for name in OBJECTS if state[name]}
        for name, obj in live.items():
            self.apply(name, obj)

    def epoch_batches(self, loader: DataLoader, batches_done: int) -> tuple[Iterator[Any], int]:
        """The running epoch's batches from batch ``batches_done`` on, and the batch this rank
        is at, with the generators where the saved run had them (a share to resume), else as
        they are; records the generators at the epoch's start."""
        share, self.share = self.share, None
        mid_epoch = share is not None and batches_done > 0
        if share is not None:
            set_rng_state(share["epoch_rng"] if mid_epoch else share["rng"])
        self.epoch_rng = rng_state()
        if not mid_epoch:
            return iterate(loader), batches_done
        batches, at = resumed(loader, share, batches_done)
        set_rng_state(share["rng"])
        return batches, at


def _share_of(state: Mapping[str, Any], path: str, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's share of checkpoint ``state``; with another world size, fresh generator
    states and the saved ranks' stream states merged (a map-style loader mid-epoch: refused)."""
    shares = state["ranks"]
    if state["world_size"] == world_size:
        return shares[rank]
    if state["batches_done"] and shares[0]["loader"] is None:
        raise ValueError(
            f"checkpoint {path!r} was saved mid-epoch with world_size={state['world_size']} "
            f"and a map-style loader; it resumes only with that world size, not "
            f"{world_size} (a checkpoint from an epoch's end resumes with any)"
        )
    warnings.warn(f"checkpoint {path!r} has world_size={state['world_size']}, not "
                  f"{world_size}: random generator states are not restored",
                  RuntimeWarning, stacklevel=4)  # fmt: skip
    merged = None if shares[0]["loader"] is None else state_from_loader(shares[0]["loader"])
    return {"rng": rng_state(), "epoch_rng": rng_state(), "loader": None, "dataset": merged}
