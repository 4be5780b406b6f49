"""What a streaming dataset does with an unreadable sample: raise, or skip it and count it.

``on_error="raise"`` raises the :class:`~nnh_data.shard_index.ShardError` that names the shard
and the sample. ``"skip"`` leaves the sample out, warns once per shard and process, and counts
it in a shared-memory tensor, so the training process sees what its DataLoader workers skipped.
A sample is counted when its turn to be handed out comes (another worker may read the same
block for other samples), so each is counted once. A stale index (:class:`StaleIndexError`) is
never skipped: the data behind every later position would be wrong.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from nnh_data.batching import Columns, take
from nnh_data.checks import check_choice
from nnh_data.shard_index import ShardError, ShardInfo, StaleIndexError
from nnh_data.shards import decode_tar_each
from nnh_data.stages import LEFT_OUT, SKIPPED

__all__ = ["ON_ERROR", "ErrorPolicy"]

ON_ERROR = ("raise", "skip")


class ErrorPolicy:
    """The ``on_error`` policy over shards ``urls``; counts live in ``counts`` (a tensor in
    shared memory, one slot per URL) so every process that holds it sees them."""

    def __init__(self, on_error: str, urls: Sequence[str], counts: torch.Tensor) -> None:
        self.on_error = check_choice("on_error", on_error, ON_ERROR)
        self.urls = list(urls)
        self._number = {url: i for i, url in enumerate(self.urls)}
        self._counts = counts
        self._warned: set[str] = set()

    def counts(self) -> dict[str, int]:
        """Samples skipped per shard URL (only those with some)."""
        return {url: n for url, n in zip(self.urls, self._counts.tolist()) if n}

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
        self, info: ShardInfo, payload: object, start: int, stop: int, exc: ShardError
    ) -> list[dict | None]:
        """Samples ``[start, stop)`` of a block that failed to decode as a whole: those that
        can be read one at a time, ``None`` for the others; or ``exc`` raised."""
        if not isinstance(payload, bytes) or isinstance(exc, StaleIndexError):
            self.skip(exc)
            return [None] * (stop - start)
        if self.on_error == "raise":
            raise exc
        samples = decode_tar_each(info, payload, start, stop)
        for item in samples:
            if isinstance(item, ShardError):
                self.skip(item)
        return [None if isinstance(s, ShardError) else s for s in samples]

    def readable(self, batch: Columns) -> Any:
        """``batch`` without the rows flagged unreadable (counted now), or ``LEFT_OUT``."""
        flags = batch.pop(SKIPPED, None)
        if flags is None:
            return batch
        for flag, url in zip(flags, batch["__shard__"]):
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
