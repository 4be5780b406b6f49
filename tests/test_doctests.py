"""The docstring examples of nnh's modules run, one test per module.

Every module of ``nnh_data`` and ``nnh_train`` whose source holds an example (``>>>``) is run
with :mod:`doctest` (``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``), except those in
:data:`NOT_RUN`, each with its reason: their examples sketch a call inside a training run or a
process group. Examples run in a fresh temporary working folder with the globals and local
shards of ``tests/doctest_fixtures.py`` (``ds``, ``loader``, ``index``, the public names, ...),
without the launcher's environment variables; an example that needs processes, a GPU or remote
files is marked ``# doctest: +SKIP`` where it is written. A new module with examples is run
as soon as it exists: make its examples run, or add it here with the reason.

    python -m pytest tests/test_doctests.py -p no:cacheprovider
"""

from __future__ import annotations

import doctest
import importlib
import os
import tempfile
from pathlib import Path

import pytest

from tests.doctest_fixtures import doctest_globals
from tests.support import ROOT

NOT_RUN = {
    "nnh_train.callbacks": "sketches of handler.add_callback(...) in a training script",
    "nnh_train.checkpoint": "reads checkpoints an earlier run wrote (runs/last.pt, ddp_run.pt)",
    "nnh_train.compat": "a sketch of handler.auto_save(...) in a training script",
    "nnh_train.dd_helpers": "collectives inside a process group (rank, world_size, a batch)",
    "nnh_train.ddp_decorators": "on_rank inside a process group, around a download",
    "nnh_train.handler": "sketches of a training run (its model, data and checkpoints)",
    "nnh_train.parallel": "starts one process per device",
    "nnh_train.preemption": "signals around a training loop (loader, step)",
    "nnh_train.progress": "a training loop (loader, step)",
}
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "WORKER", "NUM_WORKERS")  # fmt: skip
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def modules_with_examples() -> list[str]:
    """The dotted names of the package modules whose source holds ``>>>``."""
    names = []
    for package in ("nnh_data", "nnh_train"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if ">>>" in path.read_text():
                parts = path.relative_to(ROOT).with_suffix("").parts
                names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = modules_with_examples()
RUN = [name for name in MODULES if name not in NOT_RUN]


def test_not_run_names_modules_with_examples():
    """An entry of NOT_RUN whose module moved or lost its examples is noticed."""
    assert sorted(set(NOT_RUN) - set(MODULES)) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", RUN)
def test_docstring_examples_run(module: str, tmp_path: Path, monkeypatch) -> None:
    for name in [*LAUNCH_VARIABLES, *(k for k in os.environ if k.startswith("SLURM_"))]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the examples' mkdtemp() folders
    mod = importlib.import_module(module)
    own = vars(mod)
    extraglobs = {k: v for k, v in doctest_globals(tmp_path).items() if k not in own}
    tests = doctest.DocTestFinder().find(mod, module, extraglobs=extraglobs)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    for test in sorted(tests, key=lambda t: t.name):
        runner.run(test, out=report.append)
    if runner.tries == 0:
        pytest.skip(f"{module}: every example is marked +SKIP")
    assert runner.failures == 0, "".join(report)
