"""The cache's eviction policy, pure: which shards a cache keeps and which it evicts, from the
readers' plans. Integers and keys in, integers out; no files, no locks.

Each reader publishes a plan: the keys it will read and the item index at which it reads each
(this pass, then the next epoch), and moves its position as it reads. A shard's next use is the
minimum over live plans of ``(t - position) * num_workers`` (:func:`next_uses`); making room for
a shard needed at distance ``d`` evicts unpinned shards by farthest next use, never one needed at
or before ``d`` (:func:`choose_victims`; ``d = 0`` for a read on demand, which goes around the
cache when no room can be made). This is Belady's rule, evicting by the known future order
instead of by recency. :func:`read_schedule` gives a DataLoader worker's plan from the epoch
order; :func:`shard_key` names one content of a shard (``hash(url, size, version)``, so a
rewritten object is a new key and never served stale); :func:`parse_size` reads
``cache_limit``. The trade-off: a decision scans every cached key and every live plan
(milliseconds for 10,000 shards), which is small next to a shard's download.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from nnh_data.order.epoch import EpochOrder, worker_plan

__all__ = ["Plan", "choose_victims", "next_uses", "parse_size", "read_schedule", "shard_key"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}  # fmt: skip
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


def parse_size(text: int | str) -> int:
    """A positive byte count from an int or text with a decimal or binary unit.

    Example:
        >>> parse_size("1.5GiB"), parse_size("50GB"), parse_size(4096)
        (1610612736, 50000000000, 4096)
    """
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    elif match and match[2].lower() in _UNITS:
        value = round(float(match[1]) * _UNITS[match[2].lower()])
    else:
        raise ValueError(
            "cache_limit must be a byte count: an int or text such as '50GB' or '1.5GiB' "
            f"(units B, kB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB), got {text!r}"
        )
    if value <= 0:
        raise ValueError(f"cache_limit must be positive, got {text!r}")
    return value


def shard_key(url: str, size: int, version: str) -> str:
    """The cache key of one content of a shard: a hash of its URL, size and version.

    Example:
        >>> len(shard_key("s3://b/a.tar", 10240, 'ETag="x"'))
        32
    """
    return hashlib.sha256(json.dumps([url, size, version]).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Plan:
    """One reader's future: it reads ``keys[j]`` from item index ``times[j]`` (non-decreasing),
    it stands at item ``position``, and it is one of ``num_workers`` readers taking turns."""

    keys: Sequence[Hashable]
    times: np.ndarray
    position: int
    num_workers: int = 1


def next_uses(plans: Sequence[Plan], keys: Sequence[Hashable]) -> np.ndarray:
    """Per key, the distance to its next read: the minimum over ``plans`` of
    ``(t - position) * num_workers`` over reads at ``t >= position`` (``inf``: never).

    Example:
        >>> plan = Plan(["a", "b", "a"], np.array([0, 5, 9]), position=3, num_workers=2)
        >>> next_uses([plan], ["a", "b", "c"]).tolist()
        [12.0, 4.0, inf]
    """
    slot = {key: i for i, key in enumerate(keys)}
    ahead: list[Hashable] = []
    distances = [np.zeros(0)]
    for plan in plans:
        start = int(np.searchsorted(plan.times, plan.position, side="left"))
        ahead += plan.keys[start:]
        distances.append((plan.times[start:] - plan.position) * float(plan.num_workers))
    # keys not asked about land in an extra last slot
    where = np.fromiter(map(slot.get, ahead, itertools.repeat(len(keys))), np.int64, len(ahead))
    best = np.full(len(keys) + 1, np.inf)
    np.minimum.at(best, where, np.concatenate(distances))
    return best[:-1]


def choose_victims(
    sizes: Sequence[int],
    uses: Sequence[float],
    need: int,
    distance: float,
    evictable: Callable[[int], bool] | None = None,
) -> list[int] | None:
    """Entries to evict to free ``need`` bytes for a shard needed at ``distance``: by farthest
    next use (``uses``), never one needed at or before ``distance`` nor one ``evictable``
    refuses (asked in that order, only as far as needed); ``None`` when that cannot free enough.

    Example:
        >>> choose_victims([1, 1, 1], [5.0, float("inf"), 2.0], need=2, distance=1.0)
        [1, 0]
        >>> choose_victims([1, 1, 1], [5.0, float("inf"), 2.0], need=2, distance=5.0) is None
        True
    """
    uses = np.asarray(uses, dtype=float)
    order = np.argsort(-uses, kind="stable")
    chosen, freed = [], 0
    for i in order[uses[order] > distance].tolist():
        if freed >= need:
            break
        if evictable is None or evictable(i):
            chosen.append(i)
            freed += sizes[i]
    return chosen if freed >= need else None


def read_schedule(
    counts: Sequence[int],
    *,
    seed: int,
    epoch: int,
    window: int,
    world_size: int,
    rank: int,
    num_workers: int,
    worker: int,
    uneven: str = "pad",
    base: Sequence[tuple[int, int]] | None = None,
    consumed: int = 0,
    unit: int = 1,
    next_epoch: bool = False,
) -> list[tuple[int, int]]:
    """``(shard, item index)`` in read order: when one worker's pass starts reading each shard.

    Item indices count the items this pass yields, from 0. A worker reads the windows its
    positions touch whole, so a shard is first read at the worker's first item in the first
    window that holds it; pads read one sample each after the real items. ``next_epoch`` appends
    the next epoch's schedule (whole epoch, same layout) after this pass's items. Arguments are
    those of :class:`nnh_data.order.epoch.EpochOrder` and :func:`nnh_data.order.epoch.worker_plan`.

    Example:
        >>> read_schedule([4, 4], seed=0, epoch=0, window=0, world_size=1, rank=0,
        ...               num_workers=1, worker=0)
        [(0, 0), (1, 4)]
    """
    order = EpochOrder(tuple(counts), seed, epoch, window)
    base = [(0, order.total)] if base is None else base
    plan = worker_plan(base, world_size, rank, num_workers, worker, uneven, consumed, unit)
    out = _window_reads(order, plan.positions, window or 1)
    real = sum(b - a for a, b in plan.positions)
    for j, position in enumerate(plan.pads):
        concat = order.concat_positions(np.array([position]))
        _append_read(out, int(order.shard_perm[order.shard_of(concat)[0]]), real + j)
    if next_epoch:
        following = read_schedule(
            counts, seed=seed, epoch=epoch + 1, window=window, world_size=world_size, rank=rank,
            num_workers=num_workers, worker=worker, uneven=uneven, unit=unit,
        )  # fmt: skip
        length = plan.length - plan.consumed
        out += [(shard, length + t) for shard, t in following]
    return out


def _window_reads(
    order: EpochOrder, positions: Sequence[tuple[int, int]], size: int
) -> list[tuple[int, int]]:
    """The reads of the whole windows that ``positions`` touch (each window once)."""
    out: list[tuple[int, int]] = []
    item, done = 0, 0
    for a, b in positions:
        lo = max(a // size * size, done)
        done = hi = min(-(-b // size) * size, order.total)
        for shard, start, stop in order.pieces(lo, hi):
            first = lo // size * size  # the window of the piece's first sample
            _append_read(out, shard, item + max(0, first - a))
            lo += stop - start
        item += b - a
    return out


def _append_read(out: list[tuple[int, int]], shard: int, t: int) -> None:
    if not out or out[-1][0] != shard:
        out.append((shard, t))
