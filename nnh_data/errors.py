"""The exceptions nnh raises, under one base: ``except NNHError`` catches every one of them.

Each keeps the built-in base it always had (``RuntimeError``, ``ValueError``), so code that
catches those still does. ``nnh_train.errors`` adds the trainer's under the same base.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nnh_data.audit.epoch_audit import AuditReport

__all__ = [
    "ExactlyOnceError",
    "NNHError",
    "ShardError",
    "StaleIndexError",
    "TarFormatError",
    "UnsendableError",
]


class NNHError(Exception):
    """The base of every exception nnh raises on purpose."""


class ShardError(NNHError, RuntimeError):
    """An unreadable shard: ``url`` and ``position`` (e.g. "sample 3, byte 10240") say where."""

    # One-argument construction is kept because DataLoader re-raises a worker's error as
    # ``type(error)(message)``.
    def __init__(self, url: str, position: str = "", reason: str = "") -> None:
        super().__init__(url, position, reason)
        self.url = url
        self.position = position
        self.reason = reason

    def __str__(self) -> str:
        if not self.reason:
            return self.url
        return f"{self.url}: {self.reason} (at {self.position})"


class StaleIndexError(ShardError):
    """The shard's bytes are not what its index entry says: it was rewritten after indexing.

    Never skipped by ``on_error="skip"``: reading on would yield fewer or more samples than the
    shard holds. Rebuild the index (``nnh-data index --rebuild SOURCE`` or
    ``build_shard_index(..., rebuild=True)``).
    """

    def __init__(self, url: str, position: str = "", reason: str = "") -> None:
        if reason and "rebuild" not in reason:
            reason += (
                ": the shard changed since it was indexed; rebuild the index with "
                "`nnh-data index --rebuild SOURCE` or build_shard_index(..., rebuild=True)"
            )
        super().__init__(url, position, reason)


class TarFormatError(NNHError, ValueError):
    """A tar archive that cannot be parsed; ``offset`` is the byte position in the parsed block."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(offset, reason)
        self.offset = offset
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.reason} at byte {self.offset}"


class UnsendableError(NNHError, RuntimeError):
    """A batch or an exception that a DataLoader worker could not send to the main process (it
    does not pickle), raised there; the message names the worker, the shard and the sample."""


class ExactlyOnceError(NNHError, RuntimeError):
    """An epoch's samples were not each consumed exactly once; ``report`` has the numbers."""

    def __init__(self, report: AuditReport) -> None:
        super().__init__(str(report))
        self.report = report
