"""Argument checks shared by the public API: each raises ``ValueError`` naming the argument,
the value given and what is allowed."""

from __future__ import annotations

import math
import operator
from typing import Any

__all__ = ["check_choice", "check_int", "check_pair"]


def check_int(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """Return ``value`` as an ``int`` if it is an integer (not a bool) within ``[low, high]``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got bool {value!r}")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name} must be an integer, got {type(value).__name__} {value!r}"
        ) from None
    if low is not None and as_int < low or high is not None and as_int > high:
        raise ValueError(f"{name} must be in {_describe(low, high)}, got {as_int}")
    return as_int


def check_pair(name: str, value: Any) -> tuple[float, float]:
    """Return ``value`` as a ``(low, high)`` pair of finite floats with ``low <= high``."""
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (low, high) pair of numbers, got {value!r}") from None
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"{name} must hold finite numbers, got {value!r}")
    if low > high:
        raise ValueError(f"{name} must have low <= high, got {value!r}")
    return low, high


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def _describe(low: int | None, high: int | None) -> str:
    if high is None:
        return f"[{low}, inf)"
    if low is None:
        return f"(-inf, {high}]"
    if high < low:
        return "an empty range (nothing is allowed)"
    return f"[{low}, {high}]"
