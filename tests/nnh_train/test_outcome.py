"""nnh_train.outcome: a call's value or error packed as bytes and text that always pickle, so
that it can cross to other ranks; ``RankError`` raised from it on every rank."""

from __future__ import annotations

import pickle
import threading

import pytest

from nnh_train.errors import RankError
from nnh_train.outcome import Outcome, pack_error, pack_value
from tests.support import Unrebuildable


def _raised(exc: BaseException) -> BaseException:
    """``exc`` with a traceback, as a caught exception has."""
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - any exception, as pack_error takes
        return caught


@pytest.mark.parametrize("value", [None, 3, {"a": [1, 2.5]}, ("x", b"y"), ValueError("v")])
def test_a_value_crosses_intact(value):
    outcome = pickle.loads(pickle.dumps(pack_value(value)))
    assert outcome.ok and outcome.traceback_text == ""
    got = outcome.value()
    assert (type(got), repr(got)) == (type(value), repr(value))
    outcome.raise_on_failure("unused", 0, None)  # an ok outcome raises nothing


@pytest.mark.parametrize("value", [lambda: 1, threading.Lock()])
def test_a_value_that_cannot_be_pickled_becomes_an_error_naming_its_type(value):
    outcome = pack_value(value)
    assert not outcome.ok
    kind = type(value).__name__
    assert f"TypeError: cannot send a {kind} to other ranks: " in outcome.traceback_text
    with pytest.raises(RankError) as raised:
        pickle.loads(pickle.dumps(outcome)).raise_on_failure("broadcast failed", 2, None)
    assert (raised.value.message, raised.value.rank) == ("broadcast failed", 2)
    assert isinstance(raised.value.__cause__, TypeError)
    assert str(raised.value) == f"broadcast failed\n{outcome.traceback_text}"


def test_an_error_crosses_with_its_traceback_and_a_copy():
    outcome = pickle.loads(pickle.dumps(pack_error(_raised(KeyError("went wrong")))))
    assert not outcome.ok
    assert "in _raised" in outcome.traceback_text
    assert outcome.traceback_text.endswith("KeyError: 'went wrong'\n")
    copy = outcome.exception()
    assert type(copy) is KeyError and copy.args == ("went wrong",)
    with pytest.raises(RankError) as raised:
        outcome.raise_on_failure("step failed", 1, None)
    assert raised.value.__cause__.args == ("went wrong",)
    assert raised.value.traceback_text == outcome.traceback_text


def test_an_error_that_does_not_unpickle_still_sends_its_text():
    """It pickles but cannot be rebuilt: only the text crosses, and the failing rank chains
    its own live exception."""
    local = _raised(Unrebuildable(0, 7))
    outcome = pickle.loads(pickle.dumps(pack_error(local)))
    assert (outcome.payload, outcome.exception()) == (b"", None)
    assert "Unrebuildable: unrebuildable 0/7" in outcome.traceback_text
    with pytest.raises(RankError) as elsewhere:
        outcome.raise_on_failure("failed on rank 0", 0, None)
    assert elsewhere.value.__cause__ is None
    with pytest.raises(RankError) as here:
        outcome.raise_on_failure("failed on rank 0", 0, local)
    assert here.value.__cause__ is local


def test_rank_error_pickles_with_its_fields():
    error = pickle.loads(pickle.dumps(RankError("failed", 3, "Traceback ...\nKeyError: 'k'\n")))
    assert (error.message, error.rank) == ("failed", 3)
    assert error.traceback_text == "Traceback ...\nKeyError: 'k'\n"
    assert str(error) == "failed\nTraceback ...\nKeyError: 'k'\n"


def test_an_outcome_is_frozen():
    with pytest.raises(AttributeError):
        Outcome(True).ok = False  # type: ignore[misc]


def test_the_live_exception_is_the_cause_where_there_is_one():
    live = _raised(ValueError("here"))
    with pytest.raises(RankError) as info:
        pickle.loads(pickle.dumps(pack_error(live))).raise_on_failure("failed", 0, live)
    assert info.value.__cause__ is live
