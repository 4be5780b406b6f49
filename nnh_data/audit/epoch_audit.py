"""``EpochAudit``: proof, during a real run, that the loop consumed every sample of an epoch once.

Design. Each batch an nnh loader yields carries the global ids of its samples (``__index__``,
with ``__pad__`` for the repeats that make ranks equal and, for mixed sources, ``__source__``
and ``__repeat__``), and the dataset's plan of an epoch is a pure function of its settings. So
the audit adds the ids of every batch the loop consumed to an
:class:`~nnh_data.audit.id_sketch.IdSketch` (numpy on the id column, in chunks: no Python work per
sample), and at the epoch's end subtracts what the rank's plan holds (computed without reading a
shard, resumed passes included). The sketches of all ranks, and one row of counts per rank, are
summed in one ``all_reduce``: the sum is the difference between what the ranks consumed and what
the epoch holds, so every rank reads the same verdict and, on a mismatch, raises the same
:class:`ExactlyOnceError` naming the samples missing and repeated (exactly for up to about 300
differences, estimated beyond), per rank, and the likely cause when the numbers show one (every
rank kept 1/N of its share: a framework sharded the loader a second time).

The trade-off: the check trusts the plan, so it proves that the loop consumed what the dataset
promised, not that the promise (one sample once per epoch) holds, which the dataset's own tests
prove. A pass resumed mid-epoch is checked for the rest of its epoch: give the audit the loader
state the pass resumed from (:meth:`EpochAudit.resume`).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from nnh_data.audit.id_sketch import IdSketch, SketchDifference, decode, encode
from nnh_data.errors import ExactlyOnceError
from nnh_data.loaders.rank_cached import RankCache, RankCachedSampler
from nnh_data.order.resume import loader_states
from nnh_data.streaming.dataset import ShardedStreamingDataset, streaming_dataset_of
from nnh_data.topology import dist_ready

__all__ = ["AuditReport", "EpochAudit", "RankAudit"]

_FLUSH_ROWS = 1 << 16  # ids buffered before they are added to the sketch
_LABELS = ("__index__", "__pad__", "__source__")  # what the audit reads of a batch
_EXAMPLES = 5
_ROW = ("error", "rank", "world", "epoch", "fingerprint", "consumed", "pads", "planned",
        "planned_pads", "batches", "max_batch", "missing", "repeated", "exact",
        "skipped")  # fmt: skip
_UNKNOWN = -1

SECOND_CUT = (
    "every rank kept about 1/{n} of its share: the loader was split over the ranks a second "
    "time. nnh's loaders give each rank its own share already, so a framework must not shard "
    "them again. Accelerate: do not pass them to accelerator.prepare() (it wraps an "
    "IterableDataset in IterableDatasetShard or dispatches rank 0's batches, and wraps a "
    "map-style loader's batches in BatchSamplerShard); prepare the model and optimizer only and "
    "move batches to accelerator.device. Lightning: a map-style nnh loader needs "
    "Trainer(use_distributed_sampler=False)"
)
_LAYOUT = (
    "the datasets do not split the epoch over this process group ({details}): build the "
    "dataset after init_process_group (rank and world size come from it), or pass rank= and "
    "world_size= of the data-parallel group (and group= to EpochAudit)"
)
_EPOCHS = "ranks audited different epochs ({details}): call set_epoch(epoch) on every rank"
_STATES = (
    "ranks planned from different resume states: load the same loader state on every rank "
    "and give it to audit.resume() on every rank"
)
_MISSING = (
    "samples of the plan were not consumed: a loop that stopped early (max_steps, "
    "limit_train_batches, a break), a dropped batch, or a pass resumed mid-epoch that the audit "
    "was not told of (audit.resume(state) with the loader state the pass resumed from)"
)
_REPEATED = (
    "samples were consumed more often than the plan holds: a batch consumed twice, or an "
    "epoch replayed from its start after a restart (restore the loader's state_dict)"
)
_TIMES = (
    "every sample of the plan was consumed {k} times: each batch given to audit.update() {k} "
    "times, or {k} passes over the loader before one audit.verify() (verify once per pass)"
)
_BOTH = (
    "samples were both missing and repeated: the loop consumed batches of another epoch, "
    "seed or dataset than the one audited (set_epoch on the dataset the loader reads), or a "
    "restart resumed from another point than the audit was told"
)


@dataclass(frozen=True)
class RankAudit:
    """One rank's numbers: samples consumed and planned (pads apart), batches, and the
    differences between its own consumption and plan (None: too many to estimate)."""

    rank: int
    consumed: int
    planned: int
    pads: int
    planned_pads: int
    batches: int
    missing: int | None
    repeated: int | None
    exact: bool


@dataclass(frozen=True)
class AuditReport:
    """The verdict of :meth:`EpochAudit.verify`, the same on every rank.

    ``missing``/``repeated``: samples consumed fewer / more times than the epoch's plan holds,
    over all ranks (``exact`` False: estimated; None: more than can be estimated);
    ``examples``: some of them as ``(kind, source, sample id)``; ``skipped``: samples left out
    as unreadable (``on_error="skip"``), which account for as many missing ones.
    """

    epoch: int | None
    planned: int
    consumed: int
    missing: int | None
    repeated: int | None
    exact: bool
    skipped: int
    ranks: tuple[RankAudit, ...]
    examples: tuple[tuple[str, Any, int], ...]
    cause: str | None

    @property
    def ok(self) -> bool:
        """Every planned sample consumed exactly once (besides the skipped ones)."""
        return self.cause is None

    def __str__(self) -> str:
        head = (f"epoch {self.epoch}: " if self.epoch is not None else "") + (
            f"{self.consumed:,} of {self.planned:,} planned samples consumed on "
            f"{len(self.ranks)} rank(s); {_amount(self.missing, self.exact)} missing, "
            f"{_amount(self.repeated, self.exact)} repeated"
        )
        if self.skipped:
            head += f"; {self.skipped:,} skipped as unreadable"
        if not self.exact and self.missing is not None:
            head += " (estimated from the id sketch)"
        lines = [head, *map(_rank_line, self.ranks)]
        if self.examples:
            lines.append("  for example: " + ", ".join(
                f"{kind} id {i}" + ("" if source is None else f" of source {source!r}")
                for kind, source, i in self.examples))  # fmt: skip
        if self.cause:
            lines.append(f"  likely cause: {self.cause}")
        return "\n".join(lines)


def _amount(n: int | None, exact: bool) -> str:
    if n is None:
        return "an unknown number"
    return f"{n:,}" if exact else f"about {n:,}"


def _rank_line(r: RankAudit) -> str:
    return (f"  rank {r.rank}: {r.consumed:,} of {r.planned:,} samples, {r.pads:,} of "
            f"{r.planned_pads:,} pads, {r.batches:,} batches; {_amount(r.missing, r.exact)} "
            f"missing, {_amount(r.repeated, r.exact)} repeated")  # fmt: skip


class EpochAudit:
    """Checks at each epoch's end that the loop consumed every sample of the epoch once.

    ``data`` is a :class:`~nnh_data.ShardedStreamingDataset` (or a loader over one, such as
    :func:`~nnh_data.streaming.loader`'s), or a map-style loader: one of
    :func:`~nnh_data.create_distributed_loader` or
    :func:`~nnh_data.create_rank_cached_dataloader`, or any ``DataLoader`` with a
    ``DistributedSampler``, whose plan is what its sampler yields. Call :meth:`update` with
    every batch the loop consumes (as the loader yields it: a dict with ``__index__``), and
    :meth:`verify` on every rank at the epoch's end: one ``all_reduce`` over ``group`` (default:
    the whole process group; without one, the check is local). After a restart in the middle of
    an epoch, call :meth:`resume` with the loader state the pass resumed from.

    Example:
        >>> audit = EpochAudit(ds)  # doctest: +SKIP
        >>> for epoch in range(epochs):  # doctest: +SKIP
        ...     ds.set_epoch(epoch)
        ...     for batch in loader:
        ...         audit.update(batch)
        ...         train_step(batch)
        ...     print(audit.verify())  # raises ExactlyOnceError on every rank on a mismatch
    """

    def __init__(self, data: Any, *, group: dist.ProcessGroup | None = None) -> None:
        self._plan = _plan_of(data)
        self.group = group
        self._skipped_before = self._plan.skipped()
        self._reset()

    def resume(self, state: Mapping[str, Any]) -> None:
        """The pass of this epoch resumes from ``state``: a ``StatefulDataLoader.state_dict()``
        (what the loader restores), or a dataset state (what ``load_state_dict`` of the dataset
        took, e.g. merged for another world size). Only the rest of that epoch is planned."""
        self._plan.resume(state)

    def update(self, batch: Mapping[str, Any]) -> None:
        """Count one batch the loop consumed: a dict with ``__index__`` (and ``__pad__``,
        ``__source__``, ``__repeat__`` when the loader yields them); its tensors may be on any
        device (read in chunks, so not one synchronisation per batch)."""
        if not isinstance(batch, Mapping) or "__index__" not in batch:
            raise ValueError(
                "batch must be a dict with '__index__' (the sample ids nnh's loaders put in "
                f"every batch), got {type(batch).__name__}"
                + (f" with keys {sorted(batch)[:8]}" if isinstance(batch, Mapping) else "")
            )
        if self._plan.needs_source and "__source__" not in batch:
            raise ValueError(
                "batch has no '__source__', but the audited dataset mixes sources "
                f"{self._plan.names}: keep '__source__' in the batches (in decode, too)"
            )
        rows = _length(batch["__index__"])
        self._batches += 1
        self._max_batch = max(self._max_batch, rows)
        self._buffer.append({key: batch[key] for key in _LABELS if key in batch})  # not data
        self._buffered += rows
        if self._buffered >= _FLUSH_ROWS:
            self._flush()

    def verify(self) -> AuditReport:
        """Compare the epoch's consumption with its plan over all ranks (one ``all_reduce``)
        and start counting the next epoch. Call it on every rank.

        Returns:
            The report (``str(report)`` is a few lines for the log).

        Raises:
            ExactlyOnceError: on every rank, when a sample was missing or repeated.
        """
        try:
            self._flush()
            error, plan = None, self._subtract_plan()
        except Exception as exc:  # raised below, after the other ranks heard of it
            error, plan = exc, (0, 0)
        try:
            report = self._report(plan, error)
        finally:
            self._reset()
            self._plan.resume(None)
        if error is not None:
            raise error
        if not report.ok:
            raise ExactlyOnceError(report)
        return report

    # ------------------------------------------------------------------ counting

    def _reset(self) -> None:
        self._sketch = IdSketch()
        self._buffer: list[dict[str, Any]] = []
        self._buffered = self._batches = self._max_batch = 0
        self._consumed = self._pads = 0

    def _flush(self) -> None:
        """Add the buffered batches' ids to the sketch."""
        if not self._buffer:
            return
        buffer, self._buffer, self._buffered = self._buffer, [], 0
        ids = _column(buffer, "__index__").astype(np.int64, copy=False)
        pads = _column(buffer, "__pad__")
        real = np.ones(ids.size, bool) if pads is None else ~pads.astype(bool)
        sources = _column(buffer, "__source__")
        if sources is not None:
            sources = self._plan.source_numbers(sources)[real]
        self._consumed += int(real.sum())
        self._pads += ids.size - int(real.sum())
        self._sketch.add(encode(ids[real], sources))

    def _subtract_plan(self) -> tuple[int, int]:
        """Remove the rank's plan from the sketch; (planned samples, planned pads)."""
        planned = planned_pads = 0
        for labels in self._plan.labels():
            real = ~labels["__pad__"]
            planned += int(real.sum())
            planned_pads += real.size - int(real.sum())
            sources = labels.get("__source__")
            self._sketch.add(encode(labels["__index__"][real],
                                    None if sources is None else sources[real]), sign=-1)
        return planned, planned_pads

    # ------------------------------------------------------------------ the verdict

    def _report(self, plan: tuple[int, int], error: Exception | None) -> AuditReport:
        local = self._sketch.difference()
        rank, world = _group_layout(self.group)
        row = dict.fromkeys(_ROW, 0)
        row.update(error=int(error is not None), **self._plan.layout(), consumed=self._consumed,
                   pads=self._pads, planned=plan[0], planned_pads=plan[1], batches=self._batches,
                   max_batch=self._max_batch, skipped=self._plan.skipped() - self._skipped_before,
                   **_local_counts(local, self._consumed - plan[0]))  # fmt: skip
        self._skipped_before += row["skipped"]
        cells, table = self._all_reduce(self._sketch.cells, row, rank, world)
        if table[:, _ROW.index("error")].any():
            failed = np.flatnonzero(table[:, _ROW.index("error")]).tolist()
            if error is not None:
                raise error
            raise RuntimeError(f"EpochAudit: ranks {failed} failed to compute their plan (see "
                               "their errors); no verdict for this epoch")  # fmt: skip
        diff = IdSketch(cells).difference()
        if not diff.exact and table[:, _ROW.index("exact")].all():
            diff = self._gathered(local)  # every rank named its own: their sum is exact
        return self._verdict(diff, table)

    def _gathered(self, local: SketchDifference) -> SketchDifference:
        """The exact difference over all ranks from every rank's named differences: a second
        collective, only when the sum of the sketches holds too many to name but each rank's
        own does not (every rank kept a part of its share, say)."""
        parts: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, (local.extra, local.missing), group=self.group)
        net: Counter[int] = Counter()
        for extra, missing in parts:
            net.update(extra)
            net.subtract(missing)
        extra = {e: n for e, n in net.items() if n > 0}
        missing = {e: -n for e, n in net.items() if n < 0}
        return SketchDifference(extra, missing, sum(extra.values()), sum(missing.values()), True)

    def _all_reduce(
        self, cells: np.ndarray, row: dict[str, int], rank: int, world: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The sum of every rank's sketch, and every rank's row, in one ``all_reduce``."""
        table = np.zeros((world, len(_ROW)), np.int64)
        table[rank] = [row[k] for k in _ROW]
        if world == 1 or not dist_ready():
            return cells.copy(), table
        packed = torch.from_numpy(np.concatenate([cells.reshape(-1), table.reshape(-1)]))
        packed = packed.to(_collective_device(self.group))
        dist.all_reduce(packed, group=self.group)
        flat = packed.cpu().numpy()
        return flat[: cells.size].reshape(cells.shape), flat[cells.size :].reshape(table.shape)

    def _verdict(self, diff: SketchDifference, table: np.ndarray) -> AuditReport:
        col = {k: table[:, i] for i, k in enumerate(_ROW)}
        ranks = tuple(
            RankAudit(r, int(col["consumed"][r]), int(col["planned"][r]), int(col["pads"][r]),
                      int(col["planned_pads"][r]), int(col["batches"][r]),
                      _known(col["missing"][r]), _known(col["repeated"][r]),
                      bool(col["exact"][r]))
            for r in range(len(table))
        )  # fmt: skip
        skipped = int(col["skipped"].sum())
        missing, repeated = _totals(diff, int(col["consumed"].sum() - col["planned"].sum()))
        cause = _cause(col, missing, repeated, skipped, grouped=dist_ready())
        exact = diff.exact
        if cause is not None and cause.startswith(_LAYOUT[:40]):  # the plans themselves overlap
            missing, repeated, exact = None, None, False
        examples = [("missing", *self._named(e)) for e in sorted(diff.missing)[:_EXAMPLES]]
        examples += [("repeated", *self._named(e)) for e in sorted(diff.extra)[:_EXAMPLES]]
        epochs = set(col["epoch"].tolist())
        return AuditReport(
            epoch=epochs.pop() if len(epochs) == 1 and _UNKNOWN not in epochs else None,
            planned=int(col["planned"].sum()), consumed=int(col["consumed"].sum()),
            missing=missing, repeated=repeated, exact=exact, skipped=skipped, ranks=ranks,
            examples=tuple(examples), cause=cause,
        )  # fmt: skip

    def _named(self, element: int) -> tuple[Any, int]:
        sample, source = decode(element)
        return self._plan.source_name(source), sample


# ---------------------------------------------------------------- what a rank planned


class _StreamPlan:
    """The plan of a ``ShardedStreamingDataset``'s pass on this rank."""

    def __init__(self, dataset: ShardedStreamingDataset) -> None:
        self.dataset = dataset
        self.names = [s if src.name is None else src.name for s, src in enumerate(dataset.sources)]
        self.needs_source = len(self.names) > 1
        self._states: list[dict[str, Any]] | None = None

    def resume(self, state: Mapping[str, Any] | None) -> None:
        if state is None:
            self._states = None
        elif "consumed" in state:  # a dataset state
            self._states = [dict(state)]
        else:
            self._states = loader_states(state)

    def labels(self) -> Iterator[dict[str, np.ndarray]]:
        return self.dataset.planned_labels(self._pass_states())

    def _pass_states(self) -> list[dict[str, Any] | None]:
        if self._states is None or self._states[0]["epoch"] != self.dataset.epoch:
            return [None]
        return self._states

    def layout(self) -> dict[str, int]:
        ds = self.dataset
        key = [ds.index.fingerprint(), ds.total_samples, ds.seed, self._pass_states()]
        return {"rank": ds.rank, "world": ds.world_size, "epoch": ds.epoch,
                "fingerprint": _fingerprint(key)}  # fmt: skip

    def skipped(self) -> int:
        return sum(self.dataset.error_counts.values())

    def source_numbers(self, values: np.ndarray) -> np.ndarray:
        """The positions of the sources named in a batch's ``__source__``."""
        out = np.full(values.size, -1, np.int64)
        for s, name in enumerate(self.names):
            out[values == name] = s
        if (out < 0).any():
            unknown = sorted(set(values[out < 0].tolist()))[:5]
            raise ValueError(f"batch['__source__'] holds {unknown}, not a source of the audited "
                             f"dataset ({self.names})")  # fmt: skip
        return out

    def source_name(self, source: int) -> Any:
        return self.names[source] if len(self.names) > 1 else None


class _LoaderPlan:
    """The plan of a map-style loader: what its batch sampler yields, as dataset ids."""

    names = [0]
    needs_source = False

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        dataset = loader.dataset
        if isinstance(dataset, RankCache):
            self.ids, self.pads = dataset.ids, dataset.pads
        else:
            self.ids, self.pads = np.arange(len(dataset), dtype=np.int64), None

    def resume(self, state: Mapping[str, Any] | None) -> None:
        if state is not None:
            raise ValueError("EpochAudit.resume applies to ShardedStreamingDataset passes; "
                             "a map-style loader's pass is audited from its start")  # fmt: skip

    def labels(self) -> Iterator[dict[str, np.ndarray]]:
        sampler = self.loader.batch_sampler
        order = np.fromiter(chain.from_iterable(sampler), np.int64)
        pads = np.zeros(order.size, bool) if self.pads is None else self.pads[order]
        yield {"__index__": self.ids[order], "__pad__": pads}

    def layout(self) -> dict[str, int]:
        sampler = self.loader.sampler
        out = {"rank": _UNKNOWN, "world": _UNKNOWN, "epoch": getattr(sampler, "epoch", _UNKNOWN)}
        if isinstance(sampler, DistributedSampler):
            out.update(rank=sampler.rank, world=sampler.num_replicas)
        elif isinstance(sampler, RankCachedSampler):
            out.update(rank=sampler.rank)
        out["fingerprint"] = _fingerprint([len(self.ids), out["world"], out["epoch"]])
        return out

    def skipped(self) -> int:
        return 0

    def source_numbers(self, values: np.ndarray) -> np.ndarray:
        raise ValueError("batch has '__source__', but a map-style loader has one source")

    def source_name(self, source: int) -> Any:
        return None


def _plan_of(data: Any) -> _StreamPlan | _LoaderPlan:
    stream = streaming_dataset_of(data)
    if stream is not None:
        return _StreamPlan(stream)
    if isinstance(data, DataLoader):
        if isinstance(data.sampler, (DistributedSampler, RankCachedSampler)):
            return _LoaderPlan(data)
        raise ValueError(
            "data must be a ShardedStreamingDataset, a loader over one, or a map-style loader "
            "with a DistributedSampler (create_distributed_loader) or a RankCachedSampler "
            "(create_rank_cached_dataloader); got a DataLoader with a "
            f"{type(data.sampler).__name__}"
        )
    raise ValueError(
        "data must be a ShardedStreamingDataset or a DataLoader (streaming_loader, "
        f"create_distributed_loader, create_rank_cached_dataloader), got {type(data).__name__}"
    )


# ---------------------------------------------------------------- helpers


def _length(value: Any) -> int:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return int(value.shape[0]) if value.ndim else 1
    return len(value) if hasattr(value, "__len__") and not isinstance(value, str) else 1


def _as_array(value: Any) -> np.ndarray:
    """A label column as a 1-d numpy array: tensors (any device), arrays, lists, or columns
    with ``tolist()`` (a packed text field)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    elif not isinstance(value, np.ndarray) and hasattr(value, "tolist"):
        value = value.tolist()
    return np.asarray(value).reshape(-1)


def _column(batches: list[Mapping[str, Any]], key: str) -> np.ndarray | None:
    """Label ``key`` of the batches as one numpy array (tensors from any device), or None
    when no batch has it."""
    have = [key in b for b in batches]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"some batches have {key!r} and others not: give update() the batches "
                         "as the loader yields them")  # fmt: skip
    return np.concatenate([_as_array(b[key]) for b in batches])


def _local_counts(diff: SketchDifference, net: int) -> dict[str, int]:
    missing, repeated = _totals(diff, net)
    return {"missing": _UNKNOWN if missing is None else missing,
            "repeated": _UNKNOWN if repeated is None else repeated,
            "exact": int(diff.exact)}  # fmt: skip


def _known(value: Any) -> int | None:
    return None if int(value) == _UNKNOWN else int(value)


def _totals(diff: SketchDifference, net: int) -> tuple[int | None, int | None]:
    """Missing and repeated samples: exact, or estimates made to agree with the exact net
    difference ``net`` (consumed - planned = repeated - missing)."""
    if diff.exact:
        return diff.missing_count, diff.extra_count
    if diff.missing_count is None:
        return (-net, 0) if net < 0 else (None, None)
    if not diff.extra or not diff.missing:  # one kind named alone: the net is all of that kind
        return max(-net, 0), max(net, 0)
    repeated = max(0, net, round((diff.missing_count + diff.extra_count + net) / 2))
    return repeated - net, repeated  # neither below 0, and they differ by the exact net


def _cause(
    col: dict[str, np.ndarray], missing: int | None, repeated: int | None, skipped: int,
    grouped: bool,
) -> str | None:
    """Why the epoch was not consumed exactly once, or None when it was. Without a process
    group (``grouped`` False) a rank's share is checked alone, whatever its layout."""
    world = len(col["rank"])
    ranks, worlds = col["rank"].tolist(), col["world"].tolist()
    split = set(worlds) == {world} and len(set(ranks)) == world
    if grouped and any(w != _UNKNOWN for w in worlds) and not split:
        details = ", ".join(f"rank {r} reads share {a} of {b}"
                            for r, (a, b) in enumerate(zip(ranks, worlds)))  # fmt: skip
        return _LAYOUT.format(details=details)
    epochs = col["epoch"].tolist()
    if len(set(epochs)) > 1:
        return _EPOCHS.format(details=", ".join(f"rank {r}: {e}" for r, e in enumerate(epochs)))
    if len(set(col["fingerprint"].tolist())) > 1:
        return _STATES
    pads, planned_pads = int(col["pads"].sum()), int(col["planned_pads"].sum())
    samples_ok = repeated == 0 and missing == skipped
    if samples_ok and pads == planned_pads:
        return None
    if _second_cut(col, world):
        return SECOND_CUT.format(n=world)
    if samples_ok:
        return f"the ranks consumed {pads:,} pads where the plan holds {planned_pads:,}"
    if missing and repeated:
        return _BOTH
    if missing == skipped:
        k = _times_over(col)
        return _REPEATED if k is None else _TIMES.format(k=k)
    return _MISSING


def _times_over(col: dict[str, np.ndarray]) -> int | None:
    """k when every rank consumed its whole plan exactly k >= 2 times, else None."""
    consumed, planned = col["consumed"], col["planned"]
    if not planned.all() or (consumed % planned).any():
        return None
    times = set((consumed // planned).tolist())
    return times.pop() if len(times) == 1 and min(times) >= 2 else None


def _second_cut(col: dict[str, np.ndarray], world: int) -> bool:
    """Every rank consumed about 1/world of its plan (within a batch per rank)."""
    if world < 2:
        return False
    got = col["consumed"] + col["pads"]
    planned = col["planned"] + col["planned_pads"]
    close = np.abs(world * got - planned) <= world * col["max_batch"]
    return bool((got > 0).all() and close.all())


def _group_layout(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist_ready():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _fingerprint(value: Any) -> int:
    """63 bits of a hash of ``value`` (JSON), equal on every rank for equal values."""
    text = json.dumps(value, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1
