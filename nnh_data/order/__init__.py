"""The epoch order and its split: pure functions from integers to integers.

An epoch's order is a function of (seed, epoch) over the concatenated shards (:mod:`.epoch`),
cut into one contiguous range per rank (:mod:`.ranges`), then per DataLoader worker; several
sources are drawn and interleaved by :mod:`.mixing`; :mod:`.resume` turns a position in that
order into a small JSON-safe state and back. Nothing here reads a file.
"""

from nnh_data.order.epoch import (
    UNEVEN,
    EpochOrder,
    Intervals,
    RankSpan,
    WorkerPlan,
    base_size,
    coalesce,
    hashed_permutation,
    rank_span,
    remaining,
    virtual_to_positions,
    worker_plan,
    worker_range,
)
from nnh_data.order.mixing import Source, plan_counts
from nnh_data.order.ranges import DistributedRangeSplitter
from nnh_data.order.resume import merge_states, state_from_loader

__all__ = [
    "UNEVEN",
    "DistributedRangeSplitter",
    "EpochOrder",
    "Intervals",
    "RankSpan",
    "Source",
    "WorkerPlan",
    "base_size",
    "coalesce",
    "hashed_permutation",
    "merge_states",
    "plan_counts",
    "rank_span",
    "remaining",
    "state_from_loader",
    "virtual_to_positions",
    "worker_plan",
    "worker_range",
]
