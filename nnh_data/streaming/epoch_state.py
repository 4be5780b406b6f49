"""Where a dataset is in its epoch: the epoch, the resume state, the pass a worker runs.

The epoch lives in shared memory with the DataLoader workers (so ``set_epoch`` reaches
persistent ones), beside a flag set while workers iterate (then the main process cannot know
their progress, and refuses to give a state) and what the last pass started at (to warn about a
loop that forgot ``set_epoch``). A state loaded with ``load_state_dict`` waits as ``pending``
until the next pass starts from it. The position arithmetic is :mod:`nnh_data.order.resume`'s
and :mod:`nnh_data.order.epoch`'s; this object only keeps what the dataset must remember
between calls, so the dataset itself holds settings, not a resume protocol.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nnh_data.order.epoch import WorkerPlan, base_size, rank_span, worker_plan
from nnh_data.order.global_batches import GlobalBatches, RankShare
from nnh_data.order.resume import (
    check_matches,
    check_state,
    global_start,
    make_state,
    pass_base,
    pass_start,
    workers_iterated_error,
)
from nnh_data.streaming.global_reader import GlobalPlan
from nnh_data.streaming.pipeline import Pass
from nnh_data.streaming.stats import Meter
from nnh_data.topology import in_worker_process

__all__ = ["EpochState", "GlobalEpochState", "Layout", "epoch_state"]


@dataclass(frozen=True)
class Layout:
    """What splits an epoch over ranks, and what a state records of its dataset."""

    total: int  # samples per epoch over all ranks, pads not counted
    world_size: int
    rank: int
    uneven: str
    seed: int
    window: int
    fingerprint: str
    batch_size: int | None


class EpochState:
    """The epoch, the pending resume state and the current pass of one dataset.

    ``shared`` is a 4-element int64 tensor in shared memory: the epoch, the "workers iterated"
    flag, the epoch of the last pass started, and whether a repeated pass was warned about.
    """

    def __init__(self, layout: Layout, epoch: int, shared: torch.Tensor) -> None:
        self.layout = layout
        self.loader_batch = 1
        self.pending: dict | None = None
        self.current: Pass | None = None
        self._shared = shared
        self._shared[0], self._shared[2] = epoch, -1

    @property
    def epoch(self) -> int:
        """The epoch the next pass iterates (shared with the DataLoader workers)."""
        return int(self._shared[0])

    @property
    def unit(self) -> int:
        """Items per loader batch: worker ranges are cut in multiples of it."""
        return self.layout.batch_size or self.loader_batch

    @property
    def settings(self) -> dict[str, Any]:
        """What a state records (:data:`nnh_data.order.resume.SETTING_KEYS`)."""
        lay = self.layout
        return {"seed": lay.seed, "total": lay.total, "window": lay.window,
                "uneven": lay.uneven, "shards": lay.fingerprint,
                "batch_size": lay.batch_size, "unit": self.unit}  # fmt: skip

    def set_epoch(self, epoch: int) -> None:
        """Iterate ``epoch`` next; a new epoch drops a pending state and the current pass."""
        if epoch != self.epoch:
            self._shared[0] = epoch
            self.pending, self.current = None, None

    def length(self) -> int:
        """Items this rank yields in the next pass (see ``ShardedStreamingDataset.__len__``)."""
        lay = self.layout
        base = pass_base(self.pending, lay.total, lay.uneven)
        length = rank_span(base_size(base), lay.world_size, lay.rank, lay.uneven).length
        return length if lay.batch_size is None else -(-length // lay.batch_size)

    def set_loader_batch(self, batch_size: int) -> None:
        """Cut worker ranges in whole loader batches of ``batch_size`` items."""
        self.loader_batch = batch_size

    def state_dict(self) -> dict[str, Any]:
        """The JSON-safe progress of this epoch; refused in the main process after workers
        iterated (their progress is not visible here)."""
        if self.pending is not None:
            return copy.deepcopy(self.pending)
        if int(self._shared[1]) and not in_worker_process():
            raise workers_iterated_error()
        run = self.current
        if run is None or run.epoch != self.epoch:
            run = Pass(self.epoch, [(0, self.layout.total)], self.layout.world_size, 1, 0)
        return make_state(self.settings, epoch=run.epoch, **self._position(run),
                          world_size=run.world_size, num_workers=run.num_workers,
                          worker=run.worker, handed_out=run.progress.handed_out())  # fmt: skip

    def _position(self, run: Pass) -> dict[str, Any]:
        """Where ``run`` started, as a state records it."""
        return {"base": run.base}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool) -> None:
        """Check ``state`` against this dataset; the next pass resumes from it."""
        state = check_state(state, strict=strict)
        check_matches(state, self.settings, world_size=self.layout.world_size, strict=strict)
        self._shared[0], self._shared[1] = state["epoch"], 0
        self.pending, self.current = state, None

    def start(self, worker: int, num_workers: int, meter: Meter) -> tuple[Pass, WorkerPlan]:
        """Start a pass of ``worker`` of ``num_workers``: from the pending state when it is of
        this epoch, else from the epoch's beginning; the pass and its plan."""
        self._shared[1] = int(in_worker_process())
        state, self.pending = self.pending, None
        if state is not None and state["epoch"] != self.epoch:
            state = None  # set_epoch moved on (seen by a persistent worker)
        self._note_pass(resumed=state is not None, worker=worker)
        base, plan, consumed = self._plan(state, num_workers, worker)
        run = self.current = Pass(self.epoch, base, self.layout.world_size, num_workers, worker,
                                  meter=meter)  # fmt: skip
        run.progress.consumed = consumed
        return run, plan

    def plans(self, states: Sequence[Mapping[str, Any] | None]) -> Iterator[WorkerPlan]:
        """The plan of worker ``k`` of ``len(states)`` resumed from ``states[k]`` (None: the
        epoch's beginning)."""
        for k, state in enumerate(states):
            if state is not None:
                check_matches(check_state(state), self.settings)
            yield self._plan(state, len(states), k)[1]

    def upcoming(self, worker: int, num_workers: int) -> WorkerPlan:
        """The plan of ``worker`` in the next epoch, from its beginning (for the cache)."""
        lay = self.layout
        return worker_plan([(0, lay.total)], lay.world_size, lay.rank, num_workers, worker,
                           lay.uneven, 0, self.unit)  # fmt: skip

    def _plan(
        self, state: Mapping[str, Any] | None, num_workers: int, worker: int
    ) -> tuple[list, WorkerPlan, int]:
        lay = self.layout
        base, consumed = pass_start(
            state, total=lay.total, uneven=lay.uneven, world_size=lay.world_size,
            num_workers=num_workers, worker=worker, unit=self.unit,
        )  # fmt: skip
        plan = worker_plan(base, lay.world_size, lay.rank, num_workers, worker, lay.uneven,
                           consumed, self.unit)  # fmt: skip
        return base, plan, consumed

    def _note_pass(self, resumed: bool, worker: int) -> None:
        """Warn once per dataset when a shuffled pass starts at the epoch of the pass before
        (a hand-written loop that forgot ``set_epoch``): it repeats that order and those
        parameters. Worker 0 (or the main process) keeps the count for the pass."""
        if worker != 0:
            return
        epoch, (last, warned) = self.epoch, self._shared[2:4].tolist()
        self._shared[2] = epoch
        if resumed or last != epoch or warned or not self.layout.window:
            return
        self._shared[3] = 1
        warnings.warn(
            f"ShardedStreamingDataset iterated again at epoch {epoch}: the same order and "
            "augmentation parameters as the pass before; call ds.set_epoch(epoch) before each "
            "epoch (a set meant to repeat, for evaluation: ShardedStreamingDataset(..., "
            "shuffle=False))", RuntimeWarning, stacklevel=5,
        )  # fmt: skip


class GlobalEpochState(EpochState):
    """An :class:`EpochState` of global batches (:mod:`nnh_data.order.global_batches`): a pass
    starts at a global step (and item), not at a base of positions; a state records that
    step; a loader batch divides a rank's share of a step (by default it is that share)."""

    def __init__(
        self, layout: Layout, epoch: int, shared: torch.Tensor, global_batch_size: int,
        partitions: int,
    ) -> None:  # fmt: skip
        super().__init__(layout, epoch, shared)
        self.batches = GlobalBatches(layout.total, global_batch_size, partitions, layout.uneven)
        self.loader_batch = global_batch_size // layout.world_size
        self.current_plan: GlobalPlan | None = None
        _ = self.share  # the world size and a dataset's batch_size checked now

    @property
    def share(self) -> RankShare:
        """This rank's share of every global batch, in loader batches."""
        lay = self.layout
        return RankShare(self.batches, lay.world_size, lay.rank, self.unit)

    @property
    def settings(self) -> dict[str, Any]:
        return {**super().settings, "global_batch_size": self.batches.global_batch_size,
                "partitions": self.batches.partitions}  # fmt: skip

    def set_loader_batch(self, batch_size: int) -> None:
        """Loader batches of ``batch_size`` items: it must divide a rank's share of a step
        (and what a pending state took of its step)."""
        before, self.loader_batch = self.loader_batch, batch_size
        try:
            _ = self.share
            self._pass_start()
        except ValueError:
            self.loader_batch = before
            raise

    def length(self) -> int:
        share, lay = self.share, self.layout
        length = share.length - self._pass_start()
        return length if lay.batch_size is None else -(-length // lay.batch_size)

    def load_state_dict(self, state: Mapping[str, Any], strict: bool) -> None:
        """Check ``state`` against this dataset, and that it resumes at this world size (a
        state stopped inside a global step resumes only at its own); the next pass resumes
        from it."""
        super().load_state_dict(state, strict)
        try:
            self._pass_start(loader_batch=False)
        except ValueError:
            self.pending = None
            raise

    def start(self, worker: int, num_workers: int, meter: Meter) -> tuple[Pass, GlobalPlan]:
        run, plan = super().start(worker, num_workers, meter)
        self.current_plan = plan
        return run, plan

    def upcoming(self, worker: int, num_workers: int) -> GlobalPlan:
        return GlobalPlan(self.share, 0, num_workers, worker)

    def _plan(
        self, state: Mapping[str, Any] | None, num_workers: int, worker: int
    ) -> tuple[list, GlobalPlan, int]:
        start, skip = global_start(state, world_size=self.layout.world_size,
                                   num_workers=num_workers, worker=worker,
                                   unit=self.unit)  # fmt: skip
        return [], GlobalPlan(self.share, start, num_workers, worker, skip), skip

    def _position(self, run: Pass) -> dict[str, Any]:
        plan = self.current_plan if run is self.current else None
        return {"start": divmod(0 if plan is None else plan.start, self.share.share)}

    def _pass_start(self, loader_batch: bool = True) -> int:
        """The rank item the next pass starts at (for a one-worker state: where the pass it
        belongs to started); a ``ValueError`` when the pending state does not resume at this
        world size (and, with ``loader_batch``, this loader batch)."""
        state = self.pending
        if state is None:
            return 0
        if None in state["consumed"]:
            return state["start"][0] * self.share.share + state["start"][1]
        return global_start(state, world_size=self.layout.world_size, num_workers=1, worker=0,
                            unit=self.unit if loader_batch else None)[0]  # fmt: skip


def epoch_state(
    layout: Layout, epoch: int, shared: torch.Tensor, steps: tuple[int, int] | None
) -> EpochState:
    """The epoch state of a dataset: of global batches of ``steps`` = (global batch size,
    partitions), or of the plain split (None)."""
    if steps is None:
        return EpochState(layout, epoch, shared)
    return GlobalEpochState(layout, epoch, shared, *steps)
