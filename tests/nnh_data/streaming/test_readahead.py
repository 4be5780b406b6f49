"""Read-ahead thread: order, errors at the right place, prompt shutdown."""

from __future__ import annotations

import threading
import time

import pytest

from nnh_data.streaming.readahead import read_ahead


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_results_come_in_order(depth):
    assert list(read_ahead(lambda x: x * 2, range(50), depth)) == [(i, 2 * i) for i in range(50)]


def _fail_at_three(x: int) -> int:
    if x == 3:
        raise OSError("boom at 3")
    return x


@pytest.mark.timeout(10)
@pytest.mark.parametrize("depth", [0, 2])
def test_an_error_is_raised_where_its_result_would_be(depth):
    got = []
    with pytest.raises(OSError, match="boom at 3"):
        for item, _ in read_ahead(_fail_at_three, range(10), depth):
            got.append(item)
    assert got == [0, 1, 2]


@pytest.mark.timeout(10)
def test_errors_of_the_item_stream_propagate():
    def items():
        yield 1
        raise ValueError("bad plan")

    with pytest.raises(ValueError, match="bad plan"):
        list(read_ahead(lambda x: x, items(), 2))


@pytest.mark.timeout(10)
def test_closing_early_stops_the_thread():
    fetched = []

    def slow(x):
        fetched.append(x)
        time.sleep(0.01)
        return x

    it = read_ahead(slow, range(10_000), 2)
    assert next(it) == (0, 0)
    it.close()
    deadline = time.monotonic() + 5
    while any(t.name == "nnh-read-ahead" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "read-ahead thread still running"
        time.sleep(0.01)
    assert len(fetched) < 10
