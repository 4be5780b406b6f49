"""The id sketch: differences named exactly when few, counted within a margin when many, in any
order and split any way (sums), with multiplicities and sources."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nnh_data.audit.id_sketch import ID_BITS, IdSketch, decode, encode


def difference(consumed: Counter, planned: Counter) -> tuple[Counter, Counter]:
    """(extra, missing) as Counters of (id, source), read from a sketch."""
    sketch = IdSketch()
    for counter, sign in ((consumed, 1), (planned, -1)):
        keys = list(counter.elements())
        if keys:
            ids, sources = zip(*keys)
            sketch.add(encode(np.array(ids), np.array(sources)), sign=sign)
    diff = sketch.difference()
    assert diff.exact
    extra = Counter({decode(e): n for e, n in diff.extra.items()})
    missing = Counter({decode(e): n for e, n in diff.missing.items()})
    assert diff.extra_count == sum(extra.values()) and diff.missing_count == sum(missing.values())
    return extra, missing


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 3)), max_size=300),
    st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 3)), max_size=60),
    st.lists(st.integers(0, 299), max_size=60),
)
def test_small_differences_are_named_exactly(planned, extra_keys, dropped):
    planned = Counter(planned)
    consumed = planned.copy()
    keys = list(planned)
    for j in dropped:
        if keys and consumed[keys[j % len(keys)]] > 0:
            consumed[keys[j % len(keys)]] -= 1
    consumed.update(extra_keys)
    extra, missing = difference(+consumed, planned)
    assert extra == +(consumed - planned) and missing == +(planned - consumed)


def test_multiplicities_and_sources_are_kept_apart():
    planned = Counter({(5, 0): 1, (5, 1): 3, (9, 2): 2})
    consumed = Counter({(5, 0): 4, (5, 1): 1, (9, 2): 2})
    extra, missing = difference(consumed, planned)
    assert extra == {(5, 0): 3} and missing == {(5, 1): 2}


def test_sums_do_not_depend_on_order_or_split():
    ids = np.random.default_rng(0).permutation(10_000)
    whole, parts = IdSketch(), IdSketch()
    whole.add(encode(ids))
    for chunk in np.array_split(ids[::-1], 7):
        parts.add(encode(chunk))
    assert np.array_equal(whole.cells, parts.cells)
    parts.add(encode(np.sort(ids)), sign=-1)
    assert not parts.cells.any()


@pytest.mark.parametrize("differences", [2_000, 40_000])
def test_many_differences_are_estimated(differences):
    rng = np.random.default_rng(differences)
    planned = np.arange(200_000)
    dropped = rng.choice(planned, differences // 2, replace=False)
    kept = np.setdiff1d(planned, dropped)
    twice = rng.choice(kept, differences // 2, replace=False)
    sketch = IdSketch()
    sketch.add(encode(planned), sign=-1)
    sketch.add(encode(np.concatenate([kept, twice])))
    diff = sketch.difference()
    assert not diff.exact
    for got in (diff.missing_count, diff.extra_count):
        assert abs(got - differences // 2) <= 0.35 * differences // 2


def test_encode_checks_its_range():
    with pytest.raises(ValueError, match="sample ids"):
        encode(np.array([1 << ID_BITS]))
    with pytest.raises(ValueError, match="sources"):
        encode(np.array([1]), np.array([1 << 16]))
