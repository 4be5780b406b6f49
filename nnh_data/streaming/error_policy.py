"""What a streaming dataset does with an unreadable sample: raise, or skip it and count it.

``on_error="raise"`` raises the :class:`~nnh_data.shards.index.ShardError` that names the shard
and the sample. ``"skip"`` leaves the sample out, warns once per shard and process, and counts
it in a shared-memory tensor, so the training process sees what its DataLoader workers skipped.
A sample is counted when its turn to be handed out comes (another worker may read the same
block for other samples), so each is counted once. A block that fails as a whole is read again
in smaller pieces, so only the unreadable ones are lost: tar samples one at a time (the index
knows where each starts), Parquet row groups one at a time. A stale index
(:class:`StaleIndexError`) is never skipped: the data behind every later position would be
wrong. The counts also hold, once, the samples the index itself could not read
(:attr:`~nnh_data.shards.index.ShardInfo.lost`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from nnh_data.checks import check_choice
from nnh_data.columns import ARROW, Columns, as_list, concat, num_rows, take
from nnh_data.errors import ShardError, StaleIndexError
from nnh_data.shards.index import ShardInfo
from nnh_data.shards.reading import decode_tar_each
from nnh_data.streaming.stages import LEFT_OUT, SKIPPED, Rows

__all__ = ["ON_ERROR", "ErrorPolicy"]

ON_ERROR = ("raise", "skip")


class ErrorPolicy:
    """The ``on_error`` policy over shards ``urls``; counts live in ``counts`` (a tensor in
    shared memory, one slot per URL) so every process that holds it sees them."""

    def __init__(
        self,
        on_error: str,
        urls: Sequence[str],
        counts: torch.Tensor,
        lost: Sequence[int | None] | None = None,
    ) -> None:
        self.on_error = check_choice("on_error", on_error, ON_ERROR)
        self.urls = list(urls)
        self._number = {url: i for i, url in enumerate(self.urls)}
        self._counts = counts
        self._lost = list(lost) if lost is not None else [None] * len(self.urls)
        self._warned: set[str] = set()

    @classmethod
    def of_shards(
        cls, on_error: str, shards: Sequence[ShardInfo], counts: torch.Tensor
    ) -> ErrorPolicy:
        """The policy over ``shards``, with what their index could not read counted as lost."""
        lost = [None if info.error is None else info.lost for info in shards]
        return cls(on_error, [info.url for info in shards], counts, lost)

    def counts(self) -> dict[str, int]:
        """Samples lost per shard URL: those skipped while reading plus ``lost[i]``, what the
        index could not read of a damaged shard (None for a whole one). Every damaged shard
        is listed, even with 0 (its loss unknown), and every shard that skipped some."""
        found = zip(self.urls, self._counts.tolist(), self._lost)
        return {url: n + (lost or 0) for url, n, lost in found if n or lost is not None}

    def skip(self, exc: ShardError) -> None:
        """Raise ``exc``, or (``"skip"``) warn once per shard; the caller leaves the samples
        out and counts them when they come to be handed out."""
        if self.on_error == "raise" or isinstance(exc, StaleIndexError):
            raise exc
        if exc.url not in self._warned:
            self._warned.add(exc.url)
            warnings.warn(f"skipping unreadable samples: {exc}", stacklevel=3)

    def count(self, shard: int, n: int = 1) -> None:
        """Count ``n`` samples of shard number ``shard`` as skipped."""
        self._counts[shard] += n

    def salvaged(
        self,
        info: ShardInfo,
        payload: object,
        start: int,
        stop: int,
        exc: ShardError,
        rows: Rows,
        fetch: Callable[[ShardInfo, int, int], Any] | None = None,
    ) -> Any:
        """Rows ``[start, stop)`` (as ``rows``) of a block that failed to read or decode as a
        whole (``exc``): what can be read in smaller pieces (tar samples from ``payload``,
        Parquet row groups read again through ``fetch``), the others as unreadable rows; or
        ``exc`` raised."""
        if self.on_error == "raise" or isinstance(exc, StaleIndexError):
            raise exc
        if isinstance(payload, bytes):
            samples = decode_tar_each(info, payload, start, stop)
            for item in samples:
                if isinstance(item, ShardError):
                    self.skip(item)
            return rows.from_samples([None if isinstance(s, ShardError) else s for s in samples])
        if info.format == "parquet" and fetch is not None:
            return self._row_groups(info, start, stop, rows, fetch)
        self.skip(exc)
        return rows.from_samples([None] * (stop - start))

    def _row_groups(
        self, info: ShardInfo, start: int, stop: int, rows: Rows, fetch: Callable[..., Any]
    ) -> Any:
        """Rows ``[start, stop)`` of a Parquet shard read one row group at a time; those of
        unreadable groups are unreadable rows."""
        bounds = [start, *(int(o) for o in info.offsets if start < o < stop), stop]
        parts: list[Columns | int] = []  # columns, or the size of an unreadable group
        for lo, hi in zip(bounds, bounds[1:]):
            try:
                parts.append(fetch(info, lo, hi))
            except ShardError as exc:
                self.skip(exc)  # raises a StaleIndexError
                parts.append(hi - lo)
        good = next((p for p in parts if not isinstance(p, int)), None)
        if good is None:
            return rows.from_samples([None] * (stop - start))
        flags = [flag for p in parts for flag in (
            [True] * p if isinstance(p, int) else [False] * num_rows(p))]  # fmt: skip
        columns = concat([_unreadable(good, p) if isinstance(p, int) else p for p in parts])
        return {**columns, SKIPPED: flags}

    def readable(self, batch: Columns) -> Any:
        """``batch`` without the rows flagged unreadable (counted now), or ``LEFT_OUT``."""
        flags = batch.pop(SKIPPED, None)
        if flags is None:
            return batch
        for flag, url in zip(flags, as_list(batch["__shard__"])):
            if flag:
                self.count(self._number[url])
        keep = [i for i, flag in enumerate(flags) if not flag]
        return take(batch, np.array(keep, dtype=np.int64)) if keep else LEFT_OUT

    def decoded(self, decode: Callable[[Any], Any], item: Any) -> Any:
        """``decode(item)`` (a sample or a batch), its errors named by shard and key;
        ``LEFT_OUT`` when it raised and the policy skips."""
        try:
            return decode(item)
        except Exception as exc:
            return self.decode_failed(item, exc)

    def decode_failed(self, item: Any, exc: Exception) -> Any:
        """What ``decode(item)`` raising ``exc`` becomes: a ``ShardError`` naming the shard and
        key (raised), or, skipping, ``LEFT_OUT`` (the item's samples counted)."""
        shards, keys = item["__shard__"], item["__key__"]
        single = isinstance(keys, str)
        url, key = (shards, keys) if single else (shards[0], keys[0])
        error = ShardError(url, f"sample {key!r}", f"decode raised {exc!r}")
        if self.on_error == "raise":
            raise error from exc
        self.skip(error)
        for shard in [shards] if single else shards:
            self.count(self._number[shard])
        return LEFT_OUT


def _unreadable(like: Columns, n: int) -> Columns:
    """``n`` rows in the columns of ``like`` (zeros in numpy columns, nulls in Arrow arrays,
    None in lists), flagged unreadable by the caller: the block keeps its column types."""
    return {name: _placeholder(col, n) for name, col in like.items()}


def _placeholder(column: Any, n: int) -> Any:
    if isinstance(column, np.ndarray):
        return np.zeros(n, column.dtype)
    return pa.nulls(n, column.type) if isinstance(column, ARROW) else [None] * n
