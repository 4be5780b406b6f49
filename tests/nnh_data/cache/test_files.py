"""nnh_data.cache.files: the layout's names as tables, locks, counters, and the node lock across a
fork."""

from __future__ import annotations

import json
import os
import secrets
import stat
import threading
import time

import pytest

from nnh_data.cache.files import (
    PLAN_HEADER_BYTES,
    Counters,
    Part,
    locked_file,
    new_part_path,
    node_lock,
    open_if_unlocked,
    parse_part,
    plan_header,
    prepare_folder,
    shard_name,
    summed_counts,
)
from nnh_data.cache.store import ShardCache
from tests.nnh_data.cache.helpers import FORK

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("url", "name"),
    [
        ("s3://b/a.tar", "a.tar"),
        ("s3://b/dir/", "dir"),  # a trailing slash
        ("https://h/x?y=1&z", "x_y_1_z"),  # unsafe characters
        ("s3://b/" + "n" * 90 + ".tar", "n" * 76 + ".tar"),  # the last 80 characters
        ("", "shard"),
    ],
)
def test_shard_name_table(url, name):
    assert shard_name(url) == name


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("k.10.123.ab12cd34.part", ("k", 10)),
        ("k.10.123.ab12cd34.tmp", None),  # not a part
        ("k.x.123.ab12cd34.part", None),  # no size
        ("k.10.part", None),
        (".k.10.123.ab.part", None),  # a hidden file: six fields
    ],
)
def test_parse_part_table(name, expected):
    part = parse_part("/c/tmp", name)
    assert part == (None if expected is None else Part(f"/c/tmp/{name}", *expected))


def test_a_new_part_is_parsed_back(tmp_path):
    key = "f" * 32
    path = new_part_path(str(tmp_path), key, 4096)
    folder, name = os.path.split(path)
    assert folder == str(tmp_path / "tmp") and parse_part(folder, name) == Part(path, key, 4096)
    assert new_part_path(str(tmp_path), key, 4096) != path  # each claim its own


@pytest.mark.parametrize(("position", "ahead"), [(0, 0), (12, 345), (10**19, 10**19)])
@pytest.mark.parametrize("released", [False, True])
def test_a_plan_header_has_a_fixed_width(position, ahead, released):
    plan_id = secrets.token_hex(4)
    header = plan_header(position, ahead, plan_id, released)
    assert len(header) == PLAN_HEADER_BYTES and header.endswith(b"\n")
    assert header.split() == [str(position).encode(), str(ahead).encode(), plan_id.encode(),
                              b"R" if released else b"L"]  # fmt: skip


def test_prepare_folder_lays_the_folder_out(tmp_path):
    path = prepare_folder(tmp_path / "a" / "cache")
    assert path == str(tmp_path / "a" / "cache")
    assert sorted(os.listdir(path)) == ["lock", "procs", "shards", "stats", "tmp"]
    assert prepare_folder(path) == path  # again: nothing changes
    modes = {name: stat.S_IMODE(os.stat(os.path.join(path, name)).st_mode)
             for name in ["", "lock", "procs", "shards", "stats", "tmp"]}  # fmt: skip
    assert modes == {"": 0o700, "lock": 0o600, "procs": 0o700, "shards": 0o700, "stats": 0o700,
                     "tmp": 0o700}  # fmt: skip


OTHER_UID = 65534  # nobody


def _give(path, uid=OTHER_UID) -> None:
    os.chown(path, uid, uid)


def _made_by_another_user(path) -> None:  # with mode 0777, as the issue found it
    os.mkdir(path)
    os.chmod(path, 0o777)
    _give(path)


def _group_writable(path) -> None:
    os.mkdir(path, 0o700)
    os.chmod(path, 0o770)


def _like_tmp(path) -> None:
    os.mkdir(path)
    os.chmod(path, 0o1777)


def _another_users_subfolder(path) -> None:
    prepare_folder(path)
    os.mkdir(os.path.join(path, "shards", "ab"), 0o700)
    _give(os.path.join(path, "shards", "ab"))


def _another_users_lock(path) -> None:
    prepare_folder(path)
    _give(os.path.join(path, "lock"))


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (_made_by_another_user, "belongs to uid 65534"),
        (_group_writable, "has mode 770, writable by other users"),
        (_another_users_subfolder, "ab belongs to uid 65534"),
        (_another_users_lock, "lock belongs to uid 65534"),
        (_like_tmp, "has mode 1777"),
    ],
    ids=["other-user-0777", "group-writable", "other-users-shard-folder", "other-users-lock",
         "sticky-like-tmp"],
)
def test_a_folder_other_users_can_write_is_left_for_a_private_subfolder(tmp_path, make, problem):
    """As ssh's StrictModes: a cache folder that another user can write (or that holds what they
    wrote) is not used; its private subfolder ``uid-<uid>`` is, with a warning naming both."""
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    path = str(tmp_path / "shared")
    make(path)
    with pytest.warns(UserWarning, match="can be written by other users") as caught:
        used = prepare_folder(path)
    private = os.path.join(path, f"uid-{os.geteuid()}")
    message = str(caught[0].message)
    assert used == private and problem in message and private in message
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
    with pytest.warns(UserWarning, match="can be written by other users"):
        assert prepare_folder(path) == private  # every time, the same folder


def test_a_private_subfolder_another_user_made_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    path = tmp_path / "shared"
    _made_by_another_user(path)
    private = path / f"uid-{os.geteuid()}"
    _made_by_another_user(private)
    with pytest.raises(ValueError, match="cache_dir .* can be written by other users .* and so "
                                         "can its private subfolder"):  # fmt: skip
        prepare_folder(path)


# ---------------------------------------------------------------- locks and counters


def test_a_locked_file_is_not_taken_until_let_go(tmp_path):
    path = str(tmp_path / "f")
    fd = locked_file(path, b"abc")
    assert open_if_unlocked(path) is None  # a live writer's
    os.close(fd)
    taken = open_if_unlocked(path)
    assert taken is not None and os.pread(taken, 10, 0) == b"abc"
    os.close(taken)
    assert open_if_unlocked(str(tmp_path / "gone")) is None
    with pytest.raises(FileExistsError):
        locked_file(path)


def test_counters_are_summed_over_processes(tmp_path):
    cache_dir = prepare_folder(tmp_path / "cache")
    with open(os.path.join(cache_dir, "stats", "999999999.json"), "w") as f:
        json.dump({"hits": 3, "downloads": 1}, f)  # a process that ended
    counters = Counters.of(cache_dir)
    assert Counters.of(cache_dir) is counters
    counters.add("hits")
    counters.add("evictions", 2)
    assert counters.current() == {"downloads": 0, "hits": 1, "around": 0, "evictions": 2}
    assert summed_counts(cache_dir) == {"downloads": 1, "hits": 4, "around": 0, "evictions": 2}


# ---------------------------------------------------------------- the node lock


def _hold_the_lock(cache: ShardCache, held: threading.Event, seconds: float) -> None:
    with node_lock(cache.cache_dir):
        held.set()
        time.sleep(seconds)


def _take_the_lock(cache_dir: str) -> None:
    with node_lock(cache_dir):
        pass


def test_a_fork_never_copies_a_held_node_lock(tmp_path):
    """A fork while a thread holds the node lock waits for it: a child that inherited the
    lock would hold it for as long as it lives, and block on it itself."""
    cache = ShardCache(tmp_path / "cache")
    held = threading.Event()
    holder = threading.Thread(target=_hold_the_lock, args=(cache, held, 0.5))
    holder.start()
    held.wait(5)
    child = FORK.Process(target=_take_the_lock, args=(cache.cache_dir,))
    child.start()
    child.join(timeout=20)
    holder.join()
    alive = child.is_alive()
    if alive:
        child.kill()
        child.join()
    assert not alive and child.exitcode == 0
