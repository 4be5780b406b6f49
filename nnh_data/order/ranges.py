"""Exact contiguous splitting of ``total_samples`` ids over ``world_size`` ranks.

Rank ``r`` gets ``[start_r, end_r)``; the first ``total % world`` ranks get one extra sample, so
sizes differ by at most one and the ranges tile ``[0, total)`` with no gap and no overlap. Every
method is O(1): the boundaries are closed-form, nothing is materialised.
"""

from __future__ import annotations

from nnh_data.checks import check_int

__all__ = ["DistributedRangeSplitter"]


class DistributedRangeSplitter:
    """Split ``total_samples`` sample ids into ``world_size`` contiguous ranges.

    Example:
        >>> DistributedRangeSplitter(23, 4).get_all_ranges()
        [(0, 6), (6, 12), (12, 18), (18, 23)]
    """

    def __init__(self, total_samples: int, world_size: int) -> None:
        self.total_samples = check_int("total_samples", total_samples, low=0)
        self.world_size = check_int("world_size", world_size, low=1)
        self._base, self._extra = divmod(self.total_samples, self.world_size)

    def __repr__(self) -> str:
        total, world = self.total_samples, self.world_size
        return f"DistributedRangeSplitter(total_samples={total}, world_size={world})"

    def get_rank_range(self, rank: int) -> tuple[int, int]:
        """``(start, end)`` of ``rank``, end exclusive; empty when samples are fewer than ranks."""
        check_int("rank", rank, low=0, high=self.world_size - 1)
        start = rank * self._base + min(rank, self._extra)
        return start, start + self._base + (1 if rank < self._extra else 0)

    def get_all_ranges(self) -> list[tuple[int, int]]:
        """The ranges of all ranks, in rank order."""
        return [self.get_rank_range(r) for r in range(self.world_size)]

    def validate_ranges(self) -> bool:
        """True when the ranges tile ``[0, total_samples)`` with sizes differing by at most one."""
        ranges = self.get_all_ranges()
        contiguous = all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        sizes = [end - start for start, end in ranges]
        return (
            ranges[0][0] == 0
            and ranges[-1][1] == self.total_samples
            and contiguous
            and max(sizes) - min(sizes) <= 1
        )

    def get_rank_for_sample(self, sample_id: int) -> int:
        """The rank whose range holds ``sample_id``, in O(1)."""
        check_int("sample_id", sample_id, low=0, high=self.total_samples - 1)
        big = self._extra * (self._base + 1)  # ids held by the ranks with one extra sample
        if sample_id < big:
            return sample_id // (self._base + 1)
        return self._extra + (sample_id - big) // self._base
