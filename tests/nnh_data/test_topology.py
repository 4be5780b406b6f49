"""Where a process sits: rank and world size (arguments, then a process group, then the
launcher's environment, then alone), its DataLoader worker, and a build done once on rank 0."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from nnh_data.topology import (
    built_on_rank0,
    dist_info,
    dist_ready,
    env_int,
    in_worker_process,
    worker_info,
)
from tests.support import free_port, run_forked

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def no_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "WORKER", "NUM_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_env_int_parses_and_names_the_variable():
    assert env_int("X", env={}) is None
    assert env_int("X", env={"X": "7"}) == 7
    with pytest.raises(ValueError) as caught:
        env_int("WORLD_SIZE", env={"WORLD_SIZE": "two"})
    assert str(caught.value) == "environment variable WORLD_SIZE must be an integer, got 'two'"
    with pytest.raises(ValueError) as caught:
        env_int("WORLD_SIZE", low=1, env={"WORLD_SIZE": "0"})
    assert str(caught.value) == "environment variable WORLD_SIZE must be >= 1, got 0"


def test_dist_info_takes_arguments_then_the_environment_then_one_process(no_launcher):
    assert dist_info() == (0, 1) and not dist_ready()
    no_launcher.setenv("RANK", "2")
    no_launcher.setenv("WORLD_SIZE", "4")
    assert dist_info() == (2, 4)
    assert dist_info(rank=1) == (1, 4) and dist_info(rank=0, world_size=1) == (0, 1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\], got 3"):
        dist_info(rank=3, world_size=2)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE is 2 but RANK is not set: set both"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK must be below WORLD_SIZE=2, got 2"),
        ({"WORLD_SIZE": "-1", "RANK": "0"}, "WORLD_SIZE must be >= 1, got -1"),
        ({"WORLD_SIZE": "2", "RANK": "first"}, "RANK must be an integer, got 'first'"),
    ],
)
def test_launch_mistakes_are_errors_naming_the_variable(no_launcher, env, message):
    for name, value in env.items():
        no_launcher.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        dist_info()


def test_worker_info_from_the_environment_or_one_process(no_launcher):
    assert worker_info() == (0, 1) and not in_worker_process()
    no_launcher.setenv("WORKER", "2")
    no_launcher.setenv("NUM_WORKERS", "3")
    assert worker_info() == (2, 3)
    assert not in_worker_process()  # the variables name a worker; this is still no process
    no_launcher.setenv("WORKER", "3")
    with pytest.raises(ValueError, match=r"environment variable WORKER must be in \(-inf, 2\]"):
        worker_info()


class _WhereAmI(IterableDataset):
    def __iter__(self):
        yield (*worker_info(), in_worker_process(), os.getpid())


def test_worker_info_inside_dataloader_workers(no_launcher):
    items = list(DataLoader(_WhereAmI(), batch_size=None, num_workers=2))
    assert sorted(tuple(item[:3]) for item in items) == [(0, 2, True), (1, 2, True)]
    assert len({item[3] for item in items} - {os.getpid()}) == 2


def _in_a_group(rank: int, world_size: int, port: int, folder: str) -> tuple:
    """Rank ``rank`` of a gloo group (stale launcher variables set after it started): what
    dist_info says, and what built_on_rank0 gives back from a build and from a failing one."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=30))  # fmt: skip
    os.environ["RANK"], os.environ["WORLD_SIZE"] = "5", "9"

    def build(fail: bool) -> dict:
        with open(os.path.join(folder, f"built-{fail}-by-{dist.get_rank()}"), "w"):
            pass
        if fail:
            raise OSError("the bucket said no")
        return {"index": [1, 2, 3]}

    try:
        built_on_rank0(lambda: build(True))
        failed = None
    except OSError as exc:
        failed = f"raised: {exc}"
    info = (dist_info(), dist_info(rank=0, world_size=1), dist_ready())
    return info, built_on_rank0(lambda: build(False)), failed


def test_a_group_comes_before_the_environment_and_rank0_builds_for_all(tmp_path):
    port = free_port()
    got = run_forked(_in_a_group, [(r, 2, port, str(tmp_path)) for r in range(2)], timeout=60)
    built, failed = {"index": [1, 2, 3]}, "raised: the bucket said no"
    assert got == [(((0, 2), (0, 1), True), built, failed), (((1, 2), (0, 1), True), built, failed)]
    assert sorted(os.listdir(tmp_path)) == ["built-False-by-0", "built-True-by-0"]
    assert built_on_rank0(lambda: 42) == 42  # no group: just the build
