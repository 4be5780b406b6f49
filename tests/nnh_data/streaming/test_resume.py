"""Mid-epoch resume in a new process: same and different world size, plain DataLoader
(num_workers=0) and torchdata's StatefulDataLoader (num_workers=2). Handed-out samples plus
resumed samples must be the epoch, each exactly once."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections import Counter

import pytest
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from nnh_data.streaming.dataset import ShardedStreamingDataset, merge_states, state_from_loader

COUNTS = [13, 0, 21, 8]
SETTINGS = {"seed": 11, "shuffle_window": 5}

RESUME = """
import json, pickle, sys
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from nnh_data.streaming.dataset import ShardedStreamingDataset

def ids(batch):
    return [(s["__index__"], s["__pad__"]) for s in batch]

args = json.loads(sys.argv[1])
out = []
for rank in range(args["world"]):
    world = args["world"]
    ds = ShardedStreamingDataset(args["urls"], rank=rank, world_size=world, **args["settings"])
    kw = {"batch_size": args["batch"], "num_workers": args["workers"], "collate_fn": ids}
    if "loader_state" in args:
        loader = StatefulDataLoader(ds, **kw)
        with open(args["loader_state"][rank], "rb") as f:
            loader.load_state_dict(pickle.load(f))
    else:
        with open(args["state"]) as f:
            ds.load_state_dict(json.load(f))
        loader = DataLoader(ds, **kw)
    out.append({"length": len(ds), "items": [item for batch in loader for item in batch]})
print(json.dumps(out))
"""


def _ids(batch):
    return [(s["__index__"], s["__pad__"]) for s in batch]


def _resume(tmp_path, **args) -> list[dict]:
    """Run RESUME in a fresh interpreter; per rank: len() after loading and the items."""
    args = {"settings": SETTINGS, "workers": 0, **args}
    done = subprocess.run(
        [sys.executable, "-c", RESUME, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _check_union(handed: list, resumed: list[dict], total: int) -> None:
    counts = {len(rank["items"]) for rank in resumed}
    assert len(counts) == 1, counts  # equal counts per new rank
    rest = [i for rank in resumed for i, pad in rank["items"] if not pad]
    real = [i for i, pad in handed if not pad] + rest
    assert sorted(real) == list(range(total)), Counter(real).most_common(3)


def _take(loader, batches: int) -> list:
    it = iter(loader)
    return [item for _ in range(batches) for item in next(it)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("fmt", "new_world"), [("tar", 3), ("tar", 2), ("parquet", 5)])
def test_plain_loader_resumes_in_a_new_process(
    fmt, new_world, tar_shards, parquet_shards, tmp_path
):
    urls = tar_shards(COUNTS) if fmt == "tar" else parquet_shards(COUNTS)
    handed, states, tails = [], [], []
    for rank in range(3):
        ds = ShardedStreamingDataset(urls, rank=rank, world_size=3, **SETTINGS)
        loader = DataLoader(ds, batch_size=4, collate_fn=_ids)
        taken = _take(loader, 2)
        handed += taken
        states.append(ds.state_dict())
        full = [item for batch in DataLoader(ds, batch_size=4, collate_fn=_ids) for item in batch]
        tails.append([i for i, pad in full[len(taken) :] if not pad])
    assert all(state == states[0] for state in states)  # one state describes every rank
    (tmp_path / "state.json").write_text(json.dumps(states[0]))
    resumed = _resume(tmp_path, urls=urls, world=new_world, batch=4, state="state.json")
    assert [rank["length"] for rank in resumed] == [len(rank["items"]) for rank in resumed]
    _check_union(handed, resumed, sum(COUNTS))
    if new_world == 3:  # same world size: each rank continues exactly where it stopped
        assert [[i for i, pad in r["items"] if not pad] for r in resumed] == tails


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings(
    "ignore:This DataLoader will create", "ignore:.set_vital. is deprecated"
)
def test_stateful_loader_with_two_workers_resumes_in_a_new_process(tar_shards, tmp_path):
    urls = tar_shards(COUNTS)
    handed, loader_states = [], []
    for rank in range(2):
        ds = ShardedStreamingDataset(urls, rank=rank, world_size=2, **SETTINGS)
        loader = StatefulDataLoader(ds, batch_size=3, num_workers=2, collate_fn=_ids)
        handed += _take(loader, 3)
        loader_states.append(loader.state_dict())
        del loader
    paths = []
    for rank, state in enumerate(loader_states):
        paths.append(f"loader-{rank}.pkl")
        (tmp_path / paths[-1]).write_bytes(pickle.dumps(state))
    same = _resume(tmp_path, urls=urls, world=2, batch=3, workers=2, loader_state=paths)
    _check_union(handed, same, sum(COUNTS))

    merged = [state_from_loader(state) for state in loader_states]
    assert merged[0] == merged[1] and json.loads(json.dumps(merged[0])) == merged[0]
    (tmp_path / "state.json").write_text(json.dumps(merged[0]))
    elastic = _resume(tmp_path, urls=urls, world=3, batch=3, workers=2, state="state.json")
    _check_union(handed, elastic, sum(COUNTS))


def test_state_is_json_safe_and_checked(tar_shards):
    urls = tar_shards([6, 6])
    ds = ShardedStreamingDataset(urls, seed=2)
    it = iter(ds)
    [next(it) for _ in range(5)]
    state = ds.state_dict()
    assert json.loads(json.dumps(state)) == state and state["consumed"] == [5]
    other = ShardedStreamingDataset(urls, seed=2)
    other.load_state_dict(state)
    assert other.state_dict() == state and len(other) == 7
    assert len(list(other)) == 7 and len(other) == 12  # the loaded state serves one pass
    with pytest.raises(ValueError, match=r"state\['seed'\] is 2 but this dataset has 3"):
        ShardedStreamingDataset(urls, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match=r"state\['version'\] must be 1"):
        ds.load_state_dict({**state, "version": 0})


def test_a_worker_state_only_resumes_its_own_layout(tar_shards):
    ds = ShardedStreamingDataset(tar_shards([6, 6]), world_size=2, rank=0)
    state = {**ds.state_dict(), "num_workers": 2, "consumed": [3, None]}
    ds.load_state_dict(state)
    with pytest.raises(ValueError, match="merge_states"):
        list(ds)  # this process is worker 0 of 1, not of 2
    with pytest.raises(ValueError, match=r"no count for workers \[1\]"):
        merge_states([state])
    merged = merge_states([state, {**state, "consumed": [None, 2]}])
    assert merged["consumed"] == [3, 2]


def _damaged(state: dict, **edits) -> dict:
    """``state`` with keys set (a value of ``...`` deletes the key)."""
    out = {**state, **edits}
    return {k: v for k, v in out.items() if v is not ...}


@pytest.mark.parametrize(
    ("edits", "message"),
    [
        ({"world_size": -1}, r"state\['world_size'\] must be in \[1, inf\), got -1"),
        (  # one DataLoader worker's state resumes only its own layout
            {"world_size": 2, "num_workers": 2, "consumed": [5, None]},
            r"state\['world_size'\] is 2 but this dataset has world_size=1",
        ),
        ({"epoch": 3.0}, r"state\['epoch'\] must be an integer, got float 3.0"),
        ({"epoch": -2}, r"state\['epoch'\] must be in \[0, "),
        ({"shards": None}, r"state\['shards'\] must be .*strict=False"),
        ({"shards": ...}, r"missing keys \['shards'\]"),
        ({"unit": ...}, r"missing keys \['unit'\]"),
        ({"note": "edited"}, r"unknown keys \['note'\]"),
        ({"base": [[0, 25]]}, r"state\['base'\]\[0\]\[1\] must be in \[1, 20\], got 25"),
        ({"consumed": [21]}, r"state\['consumed'\]\[0\] must be in \[0, 20\], got 21"),
    ],
)
def test_damaged_state_is_refused_at_load_naming_the_field(tar_shards, edits, message):
    urls = tar_shards([10, 10])
    ds = ShardedStreamingDataset(urls, seed=1)
    it = iter(ds)
    handed = [next(it)["__index__"] for _ in range(5)]
    state = ds.state_dict()
    fresh = ShardedStreamingDataset(urls, seed=1)
    with pytest.raises(ValueError, match=message):
        fresh.load_state_dict(_damaged(state, **edits))
    fresh.load_state_dict(state)  # the refused load left nothing behind
    rest = [s["__index__"] for s in fresh]
    assert sorted(handed + rest) == list(range(20))


def test_state_without_fingerprint_loads_only_when_not_strict(tar_shards):
    urls = tar_shards([10, 10])
    ds = ShardedStreamingDataset(urls, seed=1)
    it = iter(ds)
    handed = [next(it)["__index__"] for _ in range(7)]
    old = _damaged(ds.state_dict(), shards=..., unit=..., batch_size=...)  # an older version
    with pytest.raises(ValueError, match="strict=False"):
        ShardedStreamingDataset(urls, seed=1).load_state_dict(old)
    fresh = ShardedStreamingDataset(urls, seed=1)
    with pytest.warns(UserWarning, match="no shard fingerprint"):
        fresh.load_state_dict(old, strict=False)
    assert sorted(handed + [s["__index__"] for s in fresh]) == list(range(20))


@pytest.mark.timeout(120)
def test_stateful_loader_with_workers_loads_states_and_names_a_damaged_field(tar_shards):
    urls = tar_shards([10, 10])
    kw = {"batch_size": 3, "num_workers": 2, "collate_fn": _ids}
    loader = StatefulDataLoader(ShardedStreamingDataset(urls, seed=1), **kw)
    handed = _take(loader, 3)
    state = loader.state_dict()
    resumed = StatefulDataLoader(ShardedStreamingDataset(urls, seed=1), **kw)
    resumed.load_state_dict(state)
    rest = [item for batch in resumed for item in batch]
    assert sorted(i for i, _ in handed + rest) == list(range(20))
    for worker in state["_snapshot"]["_worker_snapshots"].values():
        worker["dataset_state"]["world_size"] = -1
    damaged = StatefulDataLoader(ShardedStreamingDataset(urls, seed=1), **kw)
    damaged.load_state_dict(state)
    with pytest.raises(ValueError, match=r"state\['world_size'\] must be in \[1, inf\)"):
        list(damaged)
