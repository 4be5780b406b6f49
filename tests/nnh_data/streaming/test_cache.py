"""ShardedStreamingDataset with ``cache_dir``: remote shards read through the node-local shard
cache give exactly the stream read without it (samples, order, ids, parameters, pads, tar and
Parquet, samples and batches, mixing, resume, workers), fetch each shard once per node, and
never serve a stale or broken copy. S3 is moto on loopback; the ranks of a node are forked
processes with DataLoader workers, reading through a proxy that counts the GETs."""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import fsspec
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from nnh_data import (
    ShardCache,
    ShardedStreamingDataset,
    ShardIndex,
    Source,
    build_shard_index,
    merge_states,
)
from tests.support import free_port, run_forked, sample_bytes

SETTINGS = {"seed": 3, "shuffle_window": 5}
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings(
        "ignore:This DataLoader will create", "ignore:.set_vital. is deprecated"
    ),
]


# ---------------------------------------------------------------- helpers


def _upload(moto_s3, paths: list[str], name: str) -> ShardIndex:
    """Local shards copied to a new bucket; their index there."""
    bucket = moto_s3.bucket(name)
    fs = fsspec.filesystem("s3", **moto_s3.storage_options, skip_instance_cache=True)
    for path in paths:
        fs.put_file(path, f"{bucket}/{os.path.basename(path)}")
    extension = paths[0].rsplit(".", 1)[-1]
    return build_shard_index(f"{bucket}/*.{extension}", storage_options=moto_s3.storage_options)


def _plain(value):
    """An item as plain Python values (numpy and tensors as lists), so streams compare with ==."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.ndarray, np.generic, torch.Tensor)):
        return value.tolist()
    return value


def _epochs(ds: ShardedStreamingDataset, epochs=(0, 1)) -> list[list]:
    """The items of each epoch, iterated in this process."""
    out = []
    for epoch in epochs:
        ds.set_epoch(epoch)
        out.append([_plain(item) for item in ds])
    return out


def _ranks(source, world_size: int = 2, epochs=(0, 1), **kwargs) -> list[list[list]]:
    """Per rank, the items of each epoch (every rank iterated in this process)."""
    return [_epochs(ShardedStreamingDataset(source, rank=r, world_size=world_size, **SETTINGS,
                                            **kwargs), epochs)
            for r in range(world_size)]  # fmt: skip


def _loader_order(ds: ShardedStreamingDataset, workers: int, monkeypatch) -> list:
    """What ``DataLoader(ds, batch_size=None, num_workers=workers)`` yields: each worker's
    items, taken in turn (a finished worker drops out), computed in this process."""
    lists = []
    for k in range(workers):
        with monkeypatch.context() as patch:
            patch.setenv("WORKER", str(k))
            patch.setenv("NUM_WORKERS", str(workers))
            lists.append([_plain(item) for item in ds])
    return [lst[i] for i in range(max(map(len, lists))) for lst in lists if i < len(lst)]


def _stored(cache_dir) -> list[str]:
    return sorted(e.url for e in ShardCache(cache_dir).entries())


# ---------------------------------------------------------------- one process


@pytest.mark.parametrize("batch_size", [None, 4])
@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_the_cache_does_not_change_the_stream(
    fmt, batch_size, moto_s3, tar_shards, parquet_shards, tmp_path
):
    """2 ranks x 2 epochs: with the cache, every item (ids, fields, parameters, pads, keys)
    is the one read without it; every shard is downloaded once, epoch 1 reads the copies."""
    counts = [13, 9, 0, 11, 7, 12, 10, 5]
    paths = tar_shards(counts) if fmt == "tar" else parquet_shards(counts, row_group_size=3)
    index = _upload(moto_s3, paths, f"equal-{fmt}")
    kw = {"storage_options": moto_s3.storage_options, "batch_size": batch_size}
    plain = _ranks(index, **kw)
    cache_dir = tmp_path / "cache"
    assert _ranks(index, cache_dir=cache_dir, **kw) == plain
    some = plain[0][0][0]
    assert {"__index__", "__aug__", "__pad__", "__shard__"} <= set(some)
    assert any(np.any(item["__pad__"]) for rank in plain for item in rank[0])  # 67 samples
    stats = ShardCache(cache_dir).stats()
    read = sorted(info.url for info in index.shards if info.num_samples)  # not the empty one
    assert _stored(cache_dir) == read
    assert stats["downloads"] == len(read) and stats["around"] == 0 and stats["hits"] > 0


def test_mixed_sources_through_the_cache(moto_s3, tar_shards, parquet_shards, tmp_path):
    tars = _upload(moto_s3, tar_shards([8, 11, 6, 9]), "mixed-tar")
    tables = _upload(moto_s3, parquet_shards([7, 5, 9], row_group_size=4), "mixed-parquet")
    sources = [Source(tars, weight=0.7, name="tar"), Source(tables, weight=0.3, name="pq")]
    kw = {"epoch_size": 50, "storage_options": moto_s3.storage_options}
    plain = _ranks(sources, **kw)
    assert _ranks(sources, cache_dir=tmp_path / "cache", **kw) == plain
    assert {item["__source__"] for rank in plain for item in rank[1]} == {"tar", "pq"}
    assert len(_stored(tmp_path / "cache")) == 7


@pytest.mark.parametrize("batch_size", [None, 3])
def test_a_cached_dataset_resumes_mid_epoch(batch_size, moto_s3, tar_shards, tmp_path):
    index = _upload(moto_s3, tar_shards([9, 12, 7, 10, 8]), "resume")
    kw = {"storage_options": moto_s3.storage_options, "batch_size": batch_size, "epoch": 1}
    for rank in range(2):
        kw["rank"], kw["world_size"] = rank, 2
        first = ShardedStreamingDataset(index, cache_dir=tmp_path / "cache", **SETTINGS, **kw)
        it = iter(first)
        taken = [_plain(next(it)) for _ in range(5)]
        state = first.state_dict()
        resumed = ShardedStreamingDataset(index, cache_dir=tmp_path / "cache", **SETTINGS, **kw)
        resumed.load_state_dict(state)
        whole = [_plain(item) for item in ShardedStreamingDataset(index, **SETTINGS, **kw)]
        assert taken + [_plain(item) for item in resumed] == whole


def test_local_shards_are_read_in_place(tar_shards, tmp_path):
    urls = tar_shards([6, 9, 4])
    assert _ranks(urls, cache_dir=tmp_path / "cache") == _ranks(urls)
    cache = ShardCache(tmp_path / "cache")
    assert cache.entries() == [] and cache.stats()["downloads"] == 0


def _tiny_cache_pass(index: ShardIndex, options: dict, cache_dir: str, limit: int):
    """In a fresh process (the warning is given once per process): both epochs of rank 1 of
    2 through a cache smaller than one shard, and the warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = ShardedStreamingDataset(index, rank=1, world_size=2, storage_options=options,
                                     cache_dir=cache_dir, cache_limit=limit, **SETTINGS)
        items = _epochs(ds)
    return items, [(w.category, str(w.message)) for w in caught]


@pytest.mark.timeout(120)
def test_a_cache_smaller_than_a_shard_reads_around_it(moto_s3, tar_shards, tmp_path):
    index = _upload(moto_s3, tar_shards([10, 12, 8, 11]), "tiny")
    options = moto_s3.storage_options
    limit = min(info.size for info in index.shards) // 2
    cache_dir = str(tmp_path / "cache")
    ((items, caught),) = run_forked(_tiny_cache_pass, [(index, options, cache_dir, limit)],
                                    timeout=90)  # fmt: skip
    assert items == _ranks(index, storage_options=options)[1]
    assert any(c is UserWarning and "cache_limit" in m for c, m in caught), caught
    cache = ShardCache(cache_dir)
    assert cache.entries() == [] and cache.stats()["downloads"] == 0
    assert cache.stats()["around"] > 0


@pytest.mark.parametrize(
    ("fmt", "damage"),
    [("tar", "truncate"), ("tar", "zero"), ("parquet", "truncate"), ("parquet", "zero")],
)
def test_a_damaged_copy_is_read_again_from_the_remote(
    fmt, damage, moto_s3, tar_shards, parquet_shards, tmp_path
):
    """Epoch 0 fills the cache; the copies are then cut short (or overwritten with zeros,
    same size); epoch 1 must still give the right samples, and says which copies it replaced."""
    counts = [10, 12, 8, 11]
    paths = tar_shards(counts) if fmt == "tar" else parquet_shards(counts, row_group_size=3)
    index = _upload(moto_s3, paths, f"damaged-{fmt}-{damage}")
    options = moto_s3.storage_options
    ds = ShardedStreamingDataset(index, storage_options=options, cache_dir=tmp_path / "cache",
                                 **SETTINGS)  # fmt: skip
    plain = _epochs(ShardedStreamingDataset(index, storage_options=options, **SETTINGS))
    assert _epochs(ds, [0]) == plain[:1]
    for entry in ShardCache(tmp_path / "cache").entries():
        with open(entry.path, "r+b") as f:
            if damage == "truncate":
                f.truncate(entry.size // 2)
            else:
                f.write(b"\0" * entry.size)
    said = "has size" if damage == "truncate" else "changed since it was downloaded"
    with pytest.warns(UserWarning, match=f"the cached copy of .* {said}"):
        assert _epochs(ds, [1]) == plain[1:]


def test_a_rewritten_object_is_read_anew(moto_s3, tar_shards, tmp_path):
    """Same URL, same size, new bytes, index rebuilt: the cached dataset reads the new bytes."""
    index = _upload(moto_s3, tar_shards([6, 5, 7], size=600), "rewritten")
    options = moto_s3.storage_options
    cache_dir = tmp_path / "cache"
    _epochs(ShardedStreamingDataset(index, storage_options=options, cache_dir=cache_dir), [0])
    fs = fsspec.filesystem("s3", **options, skip_instance_cache=True)
    old = index.shards[0]
    before = fs.cat_file(old.url)
    after = before.replace(sample_bytes(2, 600), sample_bytes(99, 600))
    assert len(after) == len(before) and after != before
    fs.pipe(old.url, after)
    new_index = build_shard_index(old.url.rsplit("/", 1)[0] + "/*.tar", storage_options=options)
    assert new_index.shards[0].version != old.version
    items = _epochs(ShardedStreamingDataset(new_index, storage_options=options,
                                            cache_dir=cache_dir), [0])[0]  # fmt: skip
    assert items == _epochs(ShardedStreamingDataset(new_index, storage_options=options), [0])[0]
    (second,) = [item for item in items if item["__index__"] == 2]
    assert second["bin"] == sample_bytes(99, 600)
    versions = {e.version for e in ShardCache(cache_dir).entries() if e.url == old.url}
    assert new_index.shards[0].version in versions


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"cache_dir": "{tmp}/c", "cache_limit": "lots"}, "cache_limit"),
        ({"cache_dir": "{tmp}/c", "cache_limit": -1}, "cache_limit"),
        ({"cache_limit": "1GB"}, "cache_limit"),  # a limit without a folder
        ({"cache_dir": "{tmp}/file"}, "cache_dir"),
        ({"cache_dir": "/proc/nnh-cache"}, "cache_dir"),  # not writable, even by root
        ({"cache_dir": 3}, "cache_dir"),
        ({"cache_dir": "{tmp}/c", "cache_prefetch": -1}, "cache_prefetch"),
        ({"cache_dir": "{tmp}/c", "cache_prefetch": "x"}, "cache_prefetch"),
    ],
)
def test_bad_cache_arguments_are_named(kwargs, name, tar_shards, tmp_path):
    urls = tar_shards([3, 4])
    (tmp_path / "file").write_text("not a folder")
    kwargs = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=name):
        ShardedStreamingDataset(urls, **kwargs)


# ---------------------------------------------------------------- workers and ranks


@pytest.mark.timeout(180)
def test_persistent_workers_through_the_cache(moto_s3, tar_shards, tmp_path):
    index = _upload(moto_s3, tar_shards([9, 12, 7, 10, 8, 11]), "persistent")

    def run(**kw) -> list[list]:
        ds = ShardedStreamingDataset(index, storage_options=moto_s3.storage_options,
                                     **SETTINGS, **kw)  # fmt: skip
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
        out = []
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            out.append([_plain(item) for item in loader])
        return out

    assert run(cache_dir=tmp_path / "cache") == run()
    assert ShardCache(tmp_path / "cache").stats()["downloads"] == 6


def _node_rank(rank: int, world_size: int, port: int, index: ShardIndex, options: dict,
               cache_dir: str) -> list[list]:  # fmt: skip
    """One rank of a node: 2 DataLoader workers over 2 epochs, in step with the other ranks."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))  # fmt: skip
    try:
        ds = ShardedStreamingDataset(index, rank=rank, world_size=world_size,
                                     storage_options=options, cache_dir=cache_dir, **SETTINGS)
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        out = []
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            out.append([])
            for item in loader:
                out[-1].append(_plain(item))
                dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_four_ranks_with_workers_fetch_each_shard_once(
    moto_s3, s3_proxy, tar_shards, tmp_path, monkeypatch
):
    """4 ranks x 2 workers on one cache folder, 2 epochs, through the counting proxy: each
    shard's bytes are fetched exactly once in all, and each rank's stream is the one read
    without a cache."""
    index = _upload(moto_s3, tar_shards([12, 9, 14, 10, 8, 13, 11, 7], size=200), "node")
    cache_dir, port = str(tmp_path / "cache"), free_port()
    s3_proxy.reset()
    args = [(rank, 4, port, index, s3_proxy.storage_options, cache_dir) for rank in range(4)]
    streams = run_forked(_node_rank, args, timeout=180)
    fetched = dict(s3_proxy.get_bytes)
    for rank, stream in enumerate(streams):
        ds = ShardedStreamingDataset(index, rank=rank, world_size=4,
                                     storage_options=moto_s3.storage_options, **SETTINGS)
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            assert stream[epoch] == _loader_order(ds, 2, monkeypatch), (rank, epoch)
    sizes = {"/" + info.url[len("s3://") :]: info.size for info in index.shards}
    assert {path: fetched.get(path, 0) for path in sizes} == sizes
    assert set(fetched) <= set(sizes)  # nothing but the shards, nothing twice
    assert ShardCache(cache_dir).stats()["downloads"] == len(sizes)


def test_a_warm_cache_resumes_another_world_size_without_downloads(
    moto_s3, tar_shards, tmp_path, monkeypatch
):
    """Job 1 (2 ranks x 2 workers, cached) reads epoch 0, then part of epoch 1; its workers'
    states are merged. Job 2 (3 ranks) resumes on the same warm cache: no download, and the
    two jobs' samples are epoch 1, each once, as job 2 reads them without a cache."""
    counts = [9, 12, 7, 10, 8, 11]
    index = _upload(moto_s3, tar_shards(counts), "warm")
    kw = {"storage_options": moto_s3.storage_options, **SETTINGS}
    cache_dir = tmp_path / "cache"
    handed, states = [], []
    for rank in range(2):
        ds = ShardedStreamingDataset(index, rank=rank, world_size=2, cache_dir=cache_dir, **kw)
        rank_states = []
        for worker in range(2):
            with monkeypatch.context() as patch:
                patch.setenv("WORKER", str(worker))
                patch.setenv("NUM_WORKERS", "2")
                ds.set_epoch(0)
                list(ds)
                ds.set_epoch(1)
                it = iter(ds)
                handed += [_plain(next(it)) for _ in range(3 + worker)]
                rank_states.append(ds.state_dict())
        states.append(merge_states(rank_states))
    assert states[0] == states[1]
    downloads = ShardCache(cache_dir).stats()["downloads"]
    assert downloads == len(counts)

    def job2(**extra) -> list:
        out = []
        for rank in range(3):
            ds = ShardedStreamingDataset(index, rank=rank, world_size=3, **kw, **extra)
            ds.load_state_dict(states[0])
            out += [_plain(item) for item in ds]
        return out

    resumed = job2(cache_dir=cache_dir)
    assert ShardCache(cache_dir).stats()["downloads"] == downloads
    assert resumed == job2()
    real = [item["__index__"] for item in handed + resumed if not item["__pad__"]]
    assert sorted(real) == list(range(sum(counts)))
