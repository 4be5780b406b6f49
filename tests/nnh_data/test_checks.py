"""The argument checks of the public API: what each accepts, and the message naming the
argument, the value and what is allowed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nnh_data.checks import check_choice, check_int, check_pair


@pytest.mark.parametrize(
    ("value", "bounds", "expected"),
    [(3, {}, 3), (0, {"low": 0}, 0), (np.int64(7), {"high": 7}, 7), (np.uint8(2), {}, 2),
     (-5, {"low": -5, "high": -5}, -5), (2**70, {"low": 0}, 2**70)],
)  # fmt: skip
def test_check_int_returns_python_ints(value, bounds, expected):
    got = check_int("n", value, **bounds)
    assert got == expected and type(got) is int


@pytest.mark.parametrize(
    ("value", "bounds", "message"),
    [
        (True, {}, "n must be an integer, got bool True"),
        (3.0, {}, "n must be an integer, got float 3.0"),
        ("3", {}, "n must be an integer, got str '3'"),
        (None, {}, "n must be an integer, got NoneType None"),
        (-1, {"low": 0}, "n must be in [0, inf), got -1"),
        (9, {"high": 8}, "n must be in (-inf, 8], got 9"),
        (5, {"low": 1, "high": 4}, "n must be in [1, 4], got 5"),
        (0, {"low": 1, "high": 0}, "n must be in an empty range (nothing is allowed), got 0"),
    ],
)
def test_check_int_names_the_argument_value_and_range(value, bounds, message):
    with pytest.raises(ValueError) as caught:
        check_int("n", value, **bounds)
    assert str(caught.value) == message


def test_check_pair_gives_ordered_finite_floats():
    assert check_pair("p", (1, 2.5)) == (1.0, 2.5)
    assert check_pair("p", np.array([-1, -1])) == (-1.0, -1.0)
    cases = [
        (3, "p must be a (low, high) pair of numbers, got 3"),
        ((1, 2, 3), "p must be a (low, high) pair of numbers, got (1, 2, 3)"),
        (("a", 1), "p must be a (low, high) pair of numbers, got ('a', 1)"),
        ((0, math.inf), "p must hold finite numbers, got (0, inf)"),
        ((math.nan, 1), "p must hold finite numbers, got (nan, 1)"),
        ((2, 1), "p must have low <= high, got (2, 1)"),
    ]
    for value, message in cases:
        with pytest.raises(ValueError) as caught:
            check_pair("p", value)
        assert str(caught.value) == message


def test_check_choice_lists_what_is_allowed():
    assert check_choice("mode", "b", ("a", "b")) == "b"
    with pytest.raises(ValueError) as caught:
        check_choice("mode", "c", ("a", "b"))
    assert str(caught.value) == "mode must be one of 'a', 'b', got 'c'"
    with pytest.raises(ValueError, match="got None"):
        check_choice("mode", None, ("a",))
