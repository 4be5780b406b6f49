"""One exceptions module per package, one base: every exception nnh defines is an ``NNHError``
defined in ``nnh_data.errors`` or ``nnh_train.errors``, and keeps the built-in base it had."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import nnh_data
import nnh_train
from nnh_data.errors import NNHError

BASES = {
    "ShardError": RuntimeError,
    "StaleIndexError": RuntimeError,
    "TarFormatError": ValueError,
    "ExactlyOnceError": RuntimeError,
    "UnsendableError": RuntimeError,
    "CheckpointError": RuntimeError,
    "RunDirLockedError": RuntimeError,
    "WorkerError": RuntimeError,
    "RankError": RuntimeError,
}


def defined_exceptions() -> dict[str, type]:
    found = {}
    for package in (nnh_data, nnh_train):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            module = importlib.import_module(info.name)
            for name, obj in vars(module).items():
                if inspect.isclass(obj) and issubclass(obj, BaseException) and \
                        obj.__module__.split(".")[0] in ("nnh_data", "nnh_train"):  # fmt: skip
                    found[name] = obj
    return found


def test_every_exception_lives_in_an_errors_module_under_nnherror():
    found = defined_exceptions()
    assert set(BASES) <= set(found)
    for name, cls in found.items():
        assert cls.__module__ in ("nnh_data.errors", "nnh_train.errors"), name
        assert issubclass(cls, NNHError), name


@pytest.mark.parametrize(("name", "base"), sorted(BASES.items()))
def test_each_keeps_its_builtin_base(name, base):
    cls = defined_exceptions()[name]
    assert issubclass(cls, base) and issubclass(cls, NNHError)
