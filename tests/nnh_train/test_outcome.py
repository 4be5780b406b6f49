"""Outcome: a value or an error reduced to bytes that always pickle, so that every rank can
raise together; RankError keeps its rank and traceback across processes."""

from __future__ import annotations

import pickle
import threading

import pytest

from nnh_train.outcome import Outcome, RankError, pack_error, pack_value


class Unrebuildable(Exception):
    """Pickles, but does not unpickle (its __init__ wants two arguments)."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"unrebuildable {a}/{b}")


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - the test wants it with its traceback
        return caught


def crossed(outcome: Outcome) -> Outcome:
    """What another rank receives."""
    return pickle.loads(pickle.dumps(outcome))


def test_a_value_crosses_and_raises_nothing():
    outcome = crossed(pack_value({"a": [1, 2.5]}))
    assert outcome.ok and outcome.value() == {"a": [1, 2.5]}
    outcome.raise_on_failure("unused", 0, None)


def test_a_value_that_cannot_be_pickled_becomes_an_error_every_rank_gets():
    outcome = crossed(pack_value(threading.Lock()))
    assert not outcome.ok
    assert "cannot send a lock to other ranks" in outcome.traceback_text
    assert isinstance(outcome.exception(), TypeError)


def test_an_error_crosses_with_its_traceback_and_is_raised_as_rank_error():
    outcome = crossed(pack_error(raised(KeyError("missing"))))
    assert not outcome.ok and "KeyError: 'missing'" in outcome.traceback_text
    with pytest.raises(RankError, match="failed on rank 2") as info:
        outcome.raise_on_failure("failed on rank 2", 2, None)
    error = info.value
    assert error.rank == 2 and error.message == "failed on rank 2"
    assert "KeyError: 'missing'" in str(error) and "raised" in error.traceback_text
    assert isinstance(error.__cause__, KeyError)  # the copy that crossed


def test_the_live_exception_is_the_cause_where_there_is_one():
    live = raised(ValueError("here"))
    with pytest.raises(RankError) as info:
        crossed(pack_error(live)).raise_on_failure("failed", 0, live)
    assert info.value.__cause__ is live


def test_an_error_that_does_not_unpickle_crosses_as_text():
    outcome = crossed(pack_error(raised(Unrebuildable(1, 2))))
    assert outcome.payload == b"" and outcome.exception() is None
    assert "Unrebuildable: unrebuildable 1/2" in outcome.traceback_text
    with pytest.raises(RankError) as info:
        outcome.raise_on_failure("failed", 1, None)
    assert info.value.__cause__ is None and "unrebuildable 1/2" in str(info.value)


def test_rank_error_pickles():
    error = pickle.loads(pickle.dumps(RankError("failed on rank 3", 3, "Traceback ...")))
    assert (error.message, error.rank, error.traceback_text) == (
        "failed on rank 3", 3, "Traceback ...",
    )  # fmt: skip
    assert str(error) == "failed on rank 3\nTraceback ..."
