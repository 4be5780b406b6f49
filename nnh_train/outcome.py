"""A call's value or error as plain bytes and text, so that it can cross to other ranks.

Object collectives (``broadcast_object_list``, ``all_gather_object``) pickle on the sender before
communicating: an object that cannot be pickled raises on the sender alone and leaves every other
rank waiting for the collective timeout. Pickling into an :class:`Outcome` first turns that
failure into data that every rank receives, so all of them can raise together.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass
from typing import Any

from nnh_train.errors import RankError

__all__ = ["Outcome", "RankError", "pack_error", "pack_value"]


@dataclass(frozen=True)
class Outcome:
    """A value (``ok``) or an error, reduced to bytes and text that always pickle."""

    ok: bool
    payload: bytes = b""  # the pickled value, or the pickled exception ("" when it cannot cross)
    traceback_text: str = ""

    def value(self) -> Any:
        """The value sent (only when ``ok``)."""
        return pickle.loads(self.payload)

    def exception(self) -> BaseException | None:
        """A copy of the error sent, or ``None`` when it could not be pickled and unpickled."""
        return pickle.loads(self.payload) if self.payload else None

    def raise_on_failure(self, message: str, rank: int, local: BaseException | None) -> None:
        """Raise :class:`RankError` when not ``ok``, chained to ``local`` (the live exception on
        the failing rank) or else to the copy that was sent."""
        if not self.ok:
            cause = local if local is not None else self.exception()
            raise RankError(message, rank, self.traceback_text) from cause


def pack_value(value: Any) -> Outcome:
    """An ``ok`` outcome holding ``value``, or a failed one saying why it cannot be pickled."""
    try:
        return Outcome(True, pickle.dumps(value))
    except Exception as exc:  # noqa: BLE001 - any pickling failure becomes data for every rank
        error = TypeError(f"cannot send a {type(value).__name__} to other ranks: {exc!r}")
        return pack_error(error)


def pack_error(exc: BaseException) -> Outcome:
    """A failed outcome: the traceback text, and the exception itself when it round-trips."""
    text = "".join(traceback.format_exception(exc))
    try:
        payload = pickle.dumps(exc)
        pickle.loads(payload)  # exceptions with custom __init__ often pickle but do not unpickle
    except Exception:  # noqa: BLE001 - the traceback text still carries the error
        payload = b""
    return Outcome(False, payload, text)
