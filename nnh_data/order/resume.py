"""The resume protocol of :class:`~nnh_data.ShardedStreamingDataset`: states as plain dicts.

A worker yields a prefix of its range (:func:`nnh_data.order.epoch.worker_plan`), so what a rank's
loader handed out is one count per worker, and under DDP every rank has the same counts (same
step count, same layout). A state is ``{"version", "epoch", "seed", "total", "window",
"uneven", "base", "world_size", "num_workers", "batch_size", "unit", "shards", "consumed"}``:
``base`` is the list of epoch-position intervals the pass walks (the whole epoch unless it was
resumed), ``unit`` the items per loader batch worker ranges are cut in, ``shards`` the
fingerprint of the shard list, and ``consumed[k]`` the items worker ``k`` handed out.

Inside a DataLoader worker the dataset only knows its own count (the others are ``None``):
that state resumes the same worker of the same layout, which is what torchdata's
``StatefulDataLoader`` does with it. A state with every count (``num_workers=0``, or merged
with :func:`merge_states` / :func:`state_from_loader`) resumes with any world size and worker
count: the positions left over (:func:`nnh_data.order.epoch.remaining`) become the new base.

A state is data a user can edit or damage, so :func:`check_state` checks every field at load
time (type, range, consistency with the other fields; unknown keys refused) and
:func:`check_matches` its consistency with the dataset, each error naming the field: a bad
state fails at ``load_state_dict``, never later inside a DataLoader worker or as a pass that
silently yields nothing. A state without the shard fingerprint loads only with ``strict=False``.

With global batches (:mod:`nnh_data.order.global_batches`) the state is the global step: it
holds ``global_batch_size`` and ``partitions`` and, in place of ``base``, ``start = [step,
items]``, where the pass began: ``step`` global steps done, then ``items`` items of each rank's
share of the next one. A state with every count (:func:`global_start`) continues at the rank
item ``step * share + items + sum(consumed)``: at a step boundary it resumes at any world size
that fits; inside a step, only at its own world size and a loader batch that divides what the
ranks took of that step.

Every function here is pure: it checks, builds or combines dicts and intervals.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from nnh_data.checks import check_choice, check_int
from nnh_data.order.epoch import UNEVEN, Intervals, base_size, rank_span, remaining, worker_range
from nnh_data.order.global_batches import GlobalBatches, RankShare, worker_length
from nnh_data.seeding import MASK64

__all__ = [
    "GLOBAL_KEYS",
    "SETTING_KEYS",
    "STATE_VERSION",
    "check_matches",
    "check_state",
    "global_start",
    "loader_states",
    "make_state",
    "merge_states",
    "next_base",
    "pass_base",
    "pass_start",
    "state_from_loader",
    "workers_iterated_error",
]

STATE_VERSION = 1
SETTING_KEYS = ("seed", "total", "window", "uneven", "shards", "batch_size", "unit")
GLOBAL_KEYS = ("global_batch_size", "partitions")
_LAYOUT_KEYS = ("version", "epoch", "base", "world_size", *SETTING_KEYS)
_GLOBAL_LAYOUT_KEYS = ("version", "epoch", "start", "world_size", *SETTING_KEYS, *GLOBAL_KEYS)
_SHARDS_HINT = (
    " (a fingerprint of the shard names and sample counts, which define the order and the "
    "ids): resume with the same shards, in the same order, with the same contents"
)


def _layout_keys(state: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys that describe a state's pass: of global batches, or of a plain split."""
    return _GLOBAL_LAYOUT_KEYS if "global_batch_size" in state else _LAYOUT_KEYS


def _keys(state: Mapping[str, Any]) -> tuple[str, ...]:
    return (*_layout_keys(state), "num_workers", "consumed")


def make_state(
    settings: Mapping[str, Any],
    *,
    epoch: int,
    base: Sequence[tuple[int, int]] | None = None,
    start: tuple[int, int] | None = None,
    world_size: int,
    num_workers: int,
    worker: int,
    handed_out: int,
) -> dict[str, Any]:
    """The JSON-safe state of worker ``worker`` after handing out ``handed_out`` items of a pass
    over ``base`` (or, with global batches, from ``start`` = (step, items)); ``settings``
    holds the dataset's :data:`SETTING_KEYS` (and :data:`GLOBAL_KEYS` with global batches).

    Example:
        >>> s = dict(seed=0, total=8, window=4, uneven="pad", shards="x", batch_size=None, unit=1)
        >>> make_state(s, epoch=0, base=[(0, 8)], world_size=1, num_workers=2, worker=1,
        ...            handed_out=3)["consumed"]
        [None, 3]
    """
    consumed: list[int | None] = [None] * num_workers
    consumed[worker] = handed_out
    state: dict[str, Any] = {"version": STATE_VERSION, "epoch": epoch}
    state.update((key, settings[key]) for key in (*SETTING_KEYS, *GLOBAL_KEYS) if key in settings)
    if start is not None:
        state["start"] = list(start)
    else:
        state["base"] = [list(i) for i in base or ()]
    state.update(world_size=world_size, num_workers=num_workers)
    return {**state, "consumed": consumed}


def check_state(state: Mapping[str, Any], *, strict: bool = True) -> dict[str, Any]:
    """A deep copy of ``state`` after checking every field: its type, its range and its
    consistency with the other fields; a ``ValueError`` names the field, the value and what is
    allowed. Unknown keys are refused. ``strict=False`` accepts the states of older versions,
    which lack ``batch_size``, ``unit`` or the shard fingerprint ``shards`` (defaults filled in).
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"state must be a dict from state_dict(), got {type(state).__name__}")
    state = copy.deepcopy(dict(state))
    keys = _keys(state)
    unknown = [k for k in state if k not in keys]
    if unknown:
        raise ValueError(f"state has unknown keys {unknown}; a state_dict() holds {list(keys)}")
    if not strict:
        state.setdefault("batch_size", None)  # states of older per-sample passes leave it out
        state.setdefault("unit", state["batch_size"] or 1)
        state.setdefault("shards", None)  # older states: no fingerprint to check
    missing = [k for k in keys if k not in state]
    if missing:
        hint = " (the states of older versions load with strict=False)" if strict else ""
        raise ValueError(f"state is missing keys {missing}; pass a whole state_dict(){hint}")
    if state["version"] != STATE_VERSION:
        raise ValueError(f"state['version'] must be {STATE_VERSION}, got {state['version']!r}")
    _check_fields(state, strict)
    if "global_batch_size" in state:
        _check_global(state)
    else:
        _check_base(state["base"], state["total"])
        _check_consumed(state)
    return state


def _check_fields(state: dict[str, Any], strict: bool) -> None:
    """The scalar fields: types and ranges."""
    for key in ("epoch", "seed"):
        check_int(f"state[{key!r}]", state[key], low=0, high=MASK64)
    check_int("state['total']", state["total"], low=0)
    check_int("state['window']", state["window"], low=0)
    check_choice("state['uneven']", state["uneven"], UNEVEN)
    for key in ("world_size", "num_workers", "unit"):
        check_int(f"state[{key!r}]", state[key], low=1)
    if state["batch_size"] is not None:
        check_int("state['batch_size']", state["batch_size"], low=1)
        if state["unit"] != state["batch_size"]:
            raise ValueError(
                f"state['unit'] must equal state['batch_size'] ({state['batch_size']}) in a "
                f"state of batches, got {state['unit']}"
            )
    shards = state["shards"]
    if not (isinstance(shards, str) and shards or shards is None and not strict):
        raise ValueError(
            f"state['shards'] must be the shard fingerprint str of state_dict(), got {shards!r}"
            + ("; pass strict=False to load a state without one (its shard list unchecked)"
               if shards is None else "")  # fmt: skip
        )


def _check_base(base: Any, total: int) -> None:
    """``base``: increasing, disjoint ``[lo, hi]`` pairs of positions in ``[0, total]``."""
    if not isinstance(base, list) or not all(
        isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in base
    ):
        raise ValueError(f"state['base'] must be a list of [lo, hi] pairs, got {base!r}")
    previous = 0
    for i, (lo, hi) in enumerate(base):
        lo = check_int(f"state['base'][{i}][0]", lo, low=previous, high=total - 1)
        previous = check_int(f"state['base'][{i}][1]", hi, low=lo + 1, high=total)


def _check_counts(state: dict[str, Any]) -> None:
    """``consumed``: one count per worker (``None`` for unknown ones, not all)."""
    num_workers, consumed = state["num_workers"], state["consumed"]
    if (
        not isinstance(consumed, list)
        or len(consumed) != num_workers
        or consumed == [None] * num_workers
    ):
        raise ValueError(
            f"state['consumed'] must be a list of {num_workers} counts (None for unknown ones, "
            f"not all), got {consumed!r}"
        )


def _check_consumed(state: dict[str, Any]) -> None:
    """``consumed``: each count at most that worker's share of the pass."""
    _check_counts(state)
    length = rank_span(base_size(state["base"]), state["world_size"], 0, state["uneven"]).length
    for k, count in enumerate(state["consumed"]):
        if count is not None:
            a, b = worker_range(length, state["num_workers"], k, state["unit"])
            check_int(f"state['consumed'][{k}]", count, low=0, high=b - a)


def _check_global(state: dict[str, Any]) -> None:
    """A state of global batches: its layout fits, ``start`` lies in the epoch and each count
    is at most what that worker yields from there."""
    for key in GLOBAL_KEYS:
        check_int(f"state[{key!r}]", state[key], low=1)
    try:
        batches = GlobalBatches(state["total"], state["global_batch_size"], state["partitions"],
                                state["uneven"])  # fmt: skip
        share = RankShare(batches, state["world_size"], 0, state["unit"])
    except ValueError as exc:
        raise ValueError(f"state's layout does not fit its global batches: {exc}") from None
    start = state["start"]
    if not (isinstance(start, list) and len(start) == 2):
        raise ValueError(f"state['start'] must be a [step, items] pair, got {start!r}")
    step = check_int("state['start'][0]", start[0], low=0, high=share.batches.steps)
    last = share.share - 1 if step < share.batches.steps else 0
    items = check_int("state['start'][1]", start[1], low=0, high=last)
    _check_counts(state)
    for k, count in enumerate(state["consumed"]):
        if count is not None:
            most = worker_length(share, step * share.share + items, state["num_workers"], k)
            check_int(f"state['consumed'][{k}]", count, low=0, high=most)


def check_matches(
    state: Mapping[str, Any],
    settings: Mapping[str, Any],
    *,
    world_size: int | None = None,
    strict: bool = True,
) -> None:
    """Raise ``ValueError`` unless a checked ``state`` belongs to a dataset with ``settings``
    (the order-defining ones: seed, total, window, uneven, shards) and, for the state of one
    DataLoader worker, ``world_size`` (it resumes only its own layout). A state without a shard
    fingerprint (an older version) is refused unless ``strict=False`` (then it is accepted
    with a warning)."""
    for key in ("seed", "total", "window", "uneven", "shards", *GLOBAL_KEYS):
        if state.get(key) != settings.get(key) and key in GLOBAL_KEYS:
            raise ValueError(
                f"state[{key!r}] is {state.get(key)!r} but this dataset has "
                f"{settings.get(key)!r}: a pass of global batches resumes with the same "
                "global_batch_size and partitions, and a plain pass without them"
            )
        if key in GLOBAL_KEYS:
            continue
        if key == "shards" and state[key] is None:
            if strict:
                raise ValueError(
                    "state['shards'] is None: the state has no shard fingerprint, so nothing "
                    "proves it belongs to these shards; pass strict=False to load it anyway"
                )
            warnings.warn("state has no shard fingerprint: not checked", stacklevel=3)
        elif state[key] != settings[key]:
            raise ValueError(
                f"state[{key!r}] is {state[key]!r} but this dataset has {settings[key]!r}"
                + (_SHARDS_HINT if key == "shards" else "")
            )
    one_worker = None in state["consumed"]
    if one_worker and world_size is not None and state["world_size"] != world_size:
        raise ValueError(
            f"state['world_size'] is {state['world_size']} but this dataset has world_size="
            f"{world_size}; this state holds the progress of one DataLoader worker, which "
            "resumes only its own layout: merge the workers' states with merge_states() or "
            "state_from_loader() to change it"
        )


def merge_states(states: Iterable[Mapping[str, Any]], *, strict: bool = True) -> dict[str, Any]:
    """One state with every worker's count, from the states of one rank's DataLoader workers.

    Load it into a new dataset to resume with another world size or number of workers.
    ``strict=False`` accepts the states of older versions (see :func:`check_state`).

    Example:
        >>> a = {"version": 1, "epoch": 0, "seed": 0, "total": 8, "window": 4, "uneven": "pad",
        ...      "base": [[0, 8]], "world_size": 1, "num_workers": 2, "batch_size": None,
        ...      "unit": 1, "shards": "x", "consumed": [3, None]}
        >>> merge_states([a, {**a, "consumed": [None, 1]}])["consumed"]
        [3, 1]
    """
    checked = [check_state(s, strict=strict) for s in states]
    if not checked:
        raise ValueError("states must hold at least one state, got none")
    merged = checked[0]
    for other in checked[1:]:
        for key in (*_layout_keys(merged), "num_workers"):
            if other[key] != merged[key]:
                raise ValueError(f"states differ in {key!r}: {merged[key]!r} vs {other[key]!r}")
        for k, count in enumerate(other["consumed"]):
            if count is not None and merged["consumed"][k] not in (None, count):
                raise ValueError(
                    f"states disagree on worker {k}: {merged['consumed'][k]} vs {count}"
                )
            merged["consumed"][k] = count if count is not None else merged["consumed"][k]
    missing = [k for k, count in enumerate(merged["consumed"]) if count is None]
    if missing:
        raise ValueError(f"states must cover every worker; no count for workers {missing}")
    return merged


def state_from_loader(loader_state: Mapping[str, Any]) -> dict[str, Any]:
    """The dataset state inside a torchdata ``StatefulDataLoader.state_dict()``, its workers
    merged (see :func:`merge_states`).

    Example:
        >>> state = state_from_loader(loader.state_dict())  # doctest: +SKIP
        >>> new_ds.load_state_dict(state)  # any world size / num_workers  # doctest: +SKIP
    """
    return merge_states(loader_states(loader_state))


def loader_states(loader_state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The dataset states inside a torchdata ``StatefulDataLoader.state_dict()``, one per
    DataLoader worker in worker order (each with its own count only), or the one state of a
    loader without workers: what the loader restores into its dataset copies."""
    if "_snapshot" not in loader_state:  # num_workers=0
        return [check_state(loader_state["dataset_state"])]
    if loader_state["_steps_since_snapshot"]:
        raise ValueError(
            "loader_state was taken between snapshots; create the StatefulDataLoader with "
            "snapshot_every_n_steps=1 (the default)"
        )
    workers = loader_state["_snapshot"]["_worker_snapshots"].values()
    states = [check_state(w["dataset_state"]) for w in workers]
    return sorted(states, key=_worker_of)


def _worker_of(state: Mapping[str, Any]) -> int:
    """The worker a one-worker state belongs to: the one whose count it holds."""
    return next(k for k, count in enumerate(state["consumed"]) if count is not None)


def next_base(state: Mapping[str, Any] | None, total: int, uneven: str) -> Intervals:
    """The positions a pass walks after ``state`` with every worker's count (or from scratch,
    the whole epoch of ``total`` positions, when ``state`` is None).

    Example:
        >>> next_base(None, 10, "pad")
        [(0, 10)]
    """
    if state is None:
        return [(0, total)]
    base = [tuple(i) for i in state["base"]]
    layout = (state["world_size"], state["num_workers"], uneven)
    return remaining(base, *layout, state["consumed"], state["unit"])


def pass_base(state: Mapping[str, Any] | None, total: int, uneven: str) -> Intervals:
    """The base of the next pass's layout: a one-worker state's own base (it resumes that
    worker inside its layout), else :func:`next_base`."""
    if state is not None and None in state["consumed"]:
        return [tuple(i) for i in state["base"]]
    return next_base(state, total, uneven)


def pass_start(
    state: Mapping[str, Any] | None,
    *,
    total: int,
    uneven: str,
    world_size: int,
    num_workers: int,
    worker: int,
    unit: int,
) -> tuple[Intervals, int]:
    """``(base, consumed)``: what worker ``worker`` of a ``world_size`` x ``num_workers``
    layout (ranges cut in units of ``unit``) walks after ``state``, and how many items of its
    range it handed out already.

    A one-worker state (counts of other workers ``None``) resumes only the same worker of the
    same layout; anything else is a ``ValueError`` that says how to merge states instead.
    """
    if state is None or None not in state["consumed"]:
        return next_base(state, total, uneven), 0
    _check_own_worker(state, world_size, num_workers, worker, unit)
    return [tuple(i) for i in state["base"]], state["consumed"][worker]


def _check_own_worker(
    state: Mapping[str, Any], world_size: int, num_workers: int, worker: int, unit: int | None
) -> None:
    """A one-worker state resumes only its own worker of its own layout."""
    layout = (state["world_size"], state["num_workers"], state["unit"])
    if layout != (world_size, num_workers, unit) or state["consumed"][worker] is None:
        raise ValueError(
            "this state holds the progress of one DataLoader worker of world_size="
            f"{layout[0]}, num_workers={layout[1]}, batch_size={layout[2]}; it cannot resume "
            f"worker {worker} of world_size={world_size}, num_workers={num_workers}, "
            f"batch_size={unit}: merge the workers' states with merge_states() "
            "or state_from_loader() to change the layout"
        )


def global_start(
    state: Mapping[str, Any] | None,
    *,
    world_size: int,
    num_workers: int,
    worker: int,
    unit: int | None,
) -> tuple[int, int]:
    """``(start, skip)`` of a pass of global batches after ``state``: the rank item of a
    ``world_size`` layout (loader batches of ``unit``; None: not known yet, not checked) where
    the pass starts, and the items worker ``worker`` of ``num_workers`` handed out of it
    already (a one-worker state resumes only its own worker of its own layout).

    Example:
        >>> state = {"global_batch_size": 8, "world_size": 2, "start": [1, 0],
        ...          "consumed": [2, 2], "unit": 2}
        >>> global_start(state, world_size=4, num_workers=1, worker=0, unit=1)
        (4, 0)
    """
    if state is None:
        return 0, 0
    size, world = state["global_batch_size"], state["world_size"]
    share = size // world
    first = state["start"][0] * share + state["start"][1]
    if None in state["consumed"]:
        _check_own_worker(state, world_size, num_workers, worker, unit)
        return first, state["consumed"][worker]
    step, items = divmod(first + sum(state["consumed"]), share)
    if items and (world_size != world or unit is not None and items % unit):
        raise ValueError(
            f"this state stopped inside global step {step}, after {items} of the {share} items "
            f"each of its {world} ranks takes of it: it resumes only at world_size={world} with "
            f"a batch size that divides {items} (got world_size={world_size}, batch_size="
            f"{unit}); a state taken at a step boundary resumes at any world size that fits"
        )
    return step * (size // world_size) + items, 0


def workers_iterated_error() -> RuntimeError:
    """The error of ``state_dict()`` in the main process after DataLoader workers iterated the
    dataset: their progress is not visible there, so the state would replay the epoch."""
    return RuntimeError(
        "DataLoader workers iterated this dataset, and the dataset object in the main "
        "process does not see their progress: take the state from the loader instead, "
        "`loader.state_dict()` of torchdata's StatefulDataLoader (what "
        "nnh_data.streaming.loader returns), and resume with loader.load_state_dict()"
    )
