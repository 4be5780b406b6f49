"""ShardedStreamingDataset: exactly once, equal per rank, order, fields, errors, S3.

Ranks are simulated in one process (explicit rank/world_size). The full grid of world sizes x
worker counts runs workers in-process through the one place that discovers them
(``streaming.get_worker_info``); a subset runs real DataLoader workers and must agree with it.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from torch.utils.data import DataLoader

from nnh_data.augment.params import gen_augmentation_params, gen_distributed_augmentation_params
from nnh_data.errors import ShardError
from nnh_data.order.mixing import Source
from nnh_data.shards.reading import build_shard_index
from nnh_data.streaming.dataset import ShardedStreamingDataset
from nnh_data.topology import dist_info
from tests.support import simulated, write_tar

LAYOUTS = {"uneven": [7, 1, 12, 3], "empty": [5, 0, 6, 0, 0], "one": [9], "few": [4, 3]}
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def streamed(params: dict) -> dict:
    """``gen_augmentation_params`` output as the dataset's ``__aug__`` holds it: the seed as the
    int64 of its 64 bits (one form in both modes, what a collated tensor holds)."""
    seed = int(params["seed"], 16)
    return {**params, "seed": seed - (1 << 64) if seed >= 1 << 63 else seed}


def _value(sample: dict) -> int:
    """The global id the fixtures wrote into the sample."""
    return int(sample["cls"]) if "cls" in sample else sample["id"]


def _check_epoch(per_rank: list[list[dict]], total: int, lengths: list[int]) -> None:
    """Equal counts equal to len(), every sample once, pads flagged, fields match ids."""
    assert {len(samples) for samples in per_rank} == {lengths[0]} and len(set(lengths)) == 1
    real = [s["__index__"] for samples in per_rank for s in samples if not s["__pad__"]]
    assert sorted(real) == list(range(total)), Counter(real).most_common(3)
    for samples in per_rank:
        for s in samples:
            assert _value(s) == s["__index__"] == s["__aug__"]["sample_id"]


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_sample_once_equal_per_rank(fmt, layout, shards, monkeypatch):
    urls = shards(fmt, LAYOUTS[layout])
    index = build_shard_index(urls)
    for world in range(1, 6):
        for workers in range(4):
            datasets = [
                ShardedStreamingDataset(index, rank=r, world_size=world, seed=3, shuffle_window=4)
                for r in range(world)
            ]
            per_rank = [simulated(ds, workers, monkeypatch) for ds in datasets]
            _check_epoch(per_rank, index.total_samples, [len(ds) for ds in datasets])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fmt", "layout", "world", "workers"),
    [
        ("tar", "uneven", 2, 3),
        ("tar", "few", 3, 2),
        ("parquet", "empty", 2, 2),
        ("parquet", "one", 1, 3),
    ],
)
def test_real_workers_match_the_simulation(fmt, layout, world, workers, shards, monkeypatch):
    index = build_shard_index(shards(fmt, LAYOUTS[layout]))
    per_rank = []
    for r in range(world):
        ds = ShardedStreamingDataset(index, rank=r, world_size=world, seed=5, shuffle_window=4)
        real = list(DataLoader(ds, batch_size=None, num_workers=workers))
        assert Counter(s["__index__"] for s in real) == Counter(
            s["__index__"] for s in simulated(ds, workers, monkeypatch)
        )
        per_rank.append(real)
    _check_epoch(per_rank, index.total_samples, [len(per_rank[0])] * world)


def test_drop_truncates_every_rank_to_the_shortest(tar_shards):
    index = build_shard_index(tar_shards([10]))
    per_rank = [
        list(ShardedStreamingDataset(index, rank=r, world_size=3, uneven="drop")) for r in range(3)
    ]
    assert [len(s) for s in per_rank] == [3, 3, 3]
    ids = [s["__index__"] for samples in per_rank for s in samples]
    assert len(set(ids)) == 9 and not any(s["__pad__"] for samples in per_rank for s in samples)


def test_pads_repeat_samples_with_their_parameters(tar_shards):
    index = build_shard_index(tar_shards([5]))
    last = list(ShardedStreamingDataset(index, rank=2, world_size=3, seed=1))
    assert [s["__pad__"] for s in last] == [False, True]
    pad = last[-1]
    assert pad["__aug__"] == streamed(gen_augmentation_params(pad["__index__"], base_seed=1))


@pytest.mark.parametrize("batch_size", [None, 2])
@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_pads_are_the_planned_samples_when_the_last_window_is_read_in_part(fmt, batch_size, shards):
    index = build_shard_index(shards(fmt, LAYOUTS["empty"]))
    for rank in range(5):
        ds = ShardedStreamingDataset(index, rank=rank, world_size=5, seed=3, shuffle_window=4,
                                     batch_size=batch_size)  # fmt: skip
        out = list(ds)
        if batch_size:
            assert all(len(b["__key__"]) == len(b["__index__"]) for b in out)
            out = [{"__index__": i, "__pad__": p, "id": int(v)} for b in out for i, p, v in
                   zip(b["__index__"].tolist(), b["__pad__"].tolist(), b.get("cls", b.get("id")))
                   ]  # fmt: skip
        assert [_value(s) for s in out] == [s["__index__"] for s in out]
        plan = [(i, p) for c in ds.planned_labels()
                for i, p in zip(c["__index__"].tolist(), c["__pad__"].tolist())]  # fmt: skip
        assert [(s["__index__"], s["__pad__"]) for s in out] == plan, rank


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_order_is_deterministic_and_changes_with_epoch_and_seed(fmt, shards):
    index = build_shard_index(shards(fmt, [30, 25, 40]))

    def order(**kw):
        return [s["__index__"] for s in ShardedStreamingDataset(index, shuffle_window=8, **kw)]

    first = order(seed=1)
    assert first == order(seed=1) and sorted(first) == list(range(95))
    assert first != order(seed=1, epoch=1) and first != order(seed=2)
    assert order(shuffle=False) == list(range(95))
    ds = ShardedStreamingDataset(index, seed=1, shuffle_window=8)
    ds.set_epoch(1)
    assert [s["__index__"] for s in ds] == order(seed=1, epoch=1)


def test_windows_keep_reads_local(tar_shards):
    """Consecutive samples come from at most a couple of shards per window."""
    index = build_shard_index(tar_shards([20] * 10))
    urls = [s["__shard__"] for s in ShardedStreamingDataset(index, seed=4, shuffle_window=10)]
    windows = [set(urls[i : i + 10]) for i in range(0, 200, 10)]
    assert max(len(w) for w in windows) <= 2 and len(set(urls)) == 10


def test_sample_fields(tar_shards):
    urls = tar_shards([4, 4])
    aug = ShardedStreamingDataset(urls, seed=7, epoch=2)
    for s in aug:
        g = s["__index__"]
        assert s["__key__"] == f"{g:08d}" and s["__shard__"] == urls[g // 4]
        assert s["__aug__"] == streamed(gen_augmentation_params(g, base_seed=7, epoch=2))
    ranked = ShardedStreamingDataset(urls, seed=7, rank=1, world_size=2, rank_aware_params=True)
    for s in ranked:
        expected = gen_distributed_augmentation_params(s["__index__"], 1, None, 7, 2, 0)
        assert s["__aug__"] == streamed(expected)


def test_local_shards_are_read_without_a_thread_by_default(tar_shards):
    urls = tar_shards([3, 4])
    assert ShardedStreamingDataset(urls).readahead == 0
    threaded = ShardedStreamingDataset(urls, readahead=3)
    assert [s["__index__"] for s in threaded] == [
        s["__index__"] for s in ShardedStreamingDataset(urls)
    ]


def test_decode_is_applied_to_every_sample(tar_shards):
    ds = ShardedStreamingDataset(tar_shards([3, 2]), decode=lambda s: (s["__index__"], s["cls"]))
    assert sorted(ds) == [(g, str(g).encode()) for g in range(5)]


@pytest.mark.parametrize("mixed", [False, True])
def test_parquet_samples_hold_their_own_files_columns(tmp_path, mixed):
    # samples are built from columns joined over files: a column of one file only is no key
    # (not a None) in the other file's samples, in one source and across mixed sources
    pq.write_table(pa.table({"id": [0, 1, 2, 3], "x": [b"a", b"b", None, b"d"]}),
                   tmp_path / "a.parquet", row_group_size=2)  # fmt: skip
    pq.write_table(pa.table({"id": [4, 5, 6], "y": [1.5, 2.5, 3.5]}), tmp_path / "b.parquet")
    urls = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    source = [Source(urls[:1]), Source(urls[1:])] if mixed else urls
    samples = list(ShardedStreamingDataset(source, seed=2, shuffle_window=5))
    fields = {s["id"]: sorted(k for k in s if not k.startswith("__")) for s in samples}
    assert fields == {g: ["id", "x"] if g < 4 else ["id", "y"] for g in range(7)}
    assert [s["x"] for s in sorted(samples, key=lambda s: s["id"])[:4]] == [b"a", b"b", None, b"d"]
    if not mixed:
        assert list(samples[0]) == ["id", *fields[samples[0]["id"]][1:], "__key__",
                                    "__shard__", "__index__", "__pad__", "__aug__"]  # fmt: skip


@pytest.mark.parametrize("mixed", [False, True], ids=["one", "mixed"])
def test_tar_samples_of_different_fields_keep_only_their_own(tmp_path, mixed):
    # every tar sample comes with the fields it has (none added as None), also when the
    # samples of a block, of a window or of the mixed sources differ
    samples = [{"__key__": f"k{g:03d}", "cls": b"%d" % g, **({"jpg": b"j"} if g % 3 else {}),
                **({"txt": b"t"} if g % 4 == 1 else {})} for g in range(40)]  # fmt: skip
    urls = []
    for i, part in enumerate((samples[:25], samples[25:])):
        write_tar(tmp_path / f"h-{i}.tar", part, pax=False)
        urls.append(str(tmp_path / f"h-{i}.tar"))
    source = [Source(build_shard_index([u])) for u in urls] if mixed else urls
    got = list(ShardedStreamingDataset(source, seed=1))
    own = {s["__key__"]: set(s) for s in samples}
    assert sorted(s["__key__"] for s in got) == sorted(own)
    for sample in got:
        fields = {k for k in sample if not k.startswith("__") or k == "__key__"}
        assert fields == own[sample["__key__"]], sample["__key__"]
        assert None not in sample.values()


def test_webdataset_shardwriter_and_pyarrow_interop(tmp_path):
    with wds.ShardWriter(str(tmp_path / "w-%04d.tar"), maxcount=6, verbose=0) as sink:
        for g in range(15):
            sink.write({"__key__": f"s{g:03d}", "seg.png": b"p%d" % g, "json": b"{}"})
    samples = list(ShardedStreamingDataset(str(tmp_path / "w-*.tar"), shuffle=False))
    assert [s["__key__"] for s in samples] == [f"s{g:03d}" for g in range(15)]
    assert samples[4]["seg.png"] == b"p4" and samples[4]["json"] == b"{}"
    table = pa.table({"x": list(range(10)), "name": [f"n{i}" for i in range(10)]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=4)
    rows = list(ShardedStreamingDataset(str(tmp_path / "t.parquet"), shuffle=False))
    assert [(r["x"], r["name"]) for r in rows] == [(i, f"n{i}") for i in range(10)]


def _truncate(path: str, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def test_corrupt_tar_raises_with_the_shard_and_position(tar_shards):
    urls = tar_shards([4, 4])
    index = build_shard_index(urls)
    _truncate(urls[1], os.path.getsize(urls[1]) // 2)
    with pytest.raises(ShardError, match=r"shard-000001\.tar.*\(at sample \d+, byte \d+\)"):
        list(ShardedStreamingDataset(index, shuffle=False))


def test_skip_counts_and_warns_once_per_shard(tar_shards, parquet_shards):
    urls = tar_shards([4, 4, 4])
    index = build_shard_index(urls)
    _truncate(urls[1], 512 * 5)
    ds = ShardedStreamingDataset(index, shuffle=False, on_error="skip")
    with pytest.warns(UserWarning, match="shard-000001") as caught:
        ids = [s["__index__"] for s in ds]
    assert len(caught) == 1 and ds.error_counts == {urls[1]: 4}
    assert ids == [0, 1, 2, 3, 8, 9, 10, 11]
    pq_urls = parquet_shards([6, 6])
    pq_index = build_shard_index(pq_urls)
    _truncate(pq_urls[0], 20)
    ds = ShardedStreamingDataset(pq_index, shuffle=False, on_error="skip")
    with pytest.warns(UserWarning, match="part-000000"):
        assert [s["__index__"] for s in ds] == list(range(6, 12))
    assert ds.error_counts == {pq_urls[0]: 6}


def test_a_parquet_file_rewritten_between_passes_is_read_afresh(tmp_path):
    """Open Parquet files are kept between reads of one pass only."""
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"x": [1, 2, 3]}), path)
    index = build_shard_index(path)
    ds = ShardedStreamingDataset(index, shuffle=False)
    assert [s["x"] for s in ds] == [1, 2, 3]
    pq.write_table(pa.table({"x": [7, 8, 9]}), path)  # same size, so the index still holds
    assert [s["x"] for s in ds] == [7, 8, 9]


def test_skip_keeps_a_shard_found_unreadable_while_indexing(tar_shards):
    urls = tar_shards([4, 4, 4])
    _truncate(urls[1], 512 * 5)
    with pytest.raises(ShardError, match=r"shard-000001\.tar"):
        ShardedStreamingDataset(urls, shuffle=False)
    with pytest.warns(UserWarning, match="shard-000001"):
        ds = ShardedStreamingDataset(urls, shuffle=False, on_error="skip")
    assert ds.index.shards[1].num_samples == 0 and ds.index.shards[1].error
    assert [s["__index__"] for s in ds] == list(range(8))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"uneven": "even"}, "uneven must be one of 'pad', 'drop', got 'even'"),
        ({"on_error": "ignore"}, "on_error must be one of 'raise', 'skip', got 'ignore'"),
        ({"rank": 2, "world_size": 2}, r"rank must be in \[0, 1\], got 2"),
        ({"shuffle_window": 0}, r"shuffle_window must be in \[1, inf\), got 0"),
        ({"seed": -1}, r"seed must be in \[0, 18446744073709551615\], got -1"),
        ({"seed": 2**64}, r"seed must be in \[0, 18446744073709551615\], got 18446744073709551616"),
        ({"aug_config": {"rotation_range": (0, 1)}}, "aug_config must be an AugmentationConfig"),
        ({"decode": "rgb"}, "decode must be one of 'pil', 'rgb8'.*got 'rgb'"),
        ({"decode": 3}, "decode must be a callable, a decoder name, a mapping .* or None, got 3"),
    ],
)
def test_arguments_are_validated(tar_shards, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShardedStreamingDataset(tar_shards([2]), **kwargs)


def test_dist_info_prefers_arguments_then_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert dist_info() == (3, 4)
    assert dist_info(rank=1, world_size=2) == (1, 2)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert dist_info() == (0, 1)


@pytest.mark.timeout(120)
def test_reads_from_s3_through_moto(moto_s3, tar_shards):
    import s3fs

    bucket = moto_s3.bucket("streaming-test")
    fs = s3fs.S3FileSystem(**moto_s3.storage_options, skip_instance_cache=True)
    for url in tar_shards([5, 7, 3]):
        fs.put(url, f"{bucket}/data/{os.path.basename(url)}")
    source = f"{bucket}/data/shard-{{000000..000002}}.tar"
    options = moto_s3.storage_options
    datasets = [
        ShardedStreamingDataset(source, rank=r, world_size=2, storage_options=options)
        for r in range(2)
    ]
    assert datasets[0].readahead == 2  # remote: the next block is fetched in a thread
    per_rank = [list(ds) for ds in datasets]
    _check_epoch(per_rank, 15, [8, 8])
    assert per_rank[0][0]["__shard__"].startswith(f"{bucket}/data/")
    assert all(s["bin"][:8] == s["__index__"].to_bytes(8, "little") for s in per_rank[1])


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE must be an integer, got 'two'"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE is 2 but RANK is not set"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK must be below WORLD_SIZE=2"),
        ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK must be >= 0"),
    ],
)
def test_bad_launch_environment_names_the_variable(monkeypatch, tar_shards, env, message):
    monkeypatch.delenv("RANK", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        ShardedStreamingDataset(tar_shards([2]))


def test_a_second_pass_at_the_same_epoch_warns_once(tar_shards, capfd):
    index = build_shard_index(tar_shards([6, 5]))
    ds = ShardedStreamingDataset(index, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, again, third = list(ds), list(ds), list(ds)  # forgot set_epoch
        ds.set_epoch(1)
        list(ds), list(ds)
        repeat = ShardedStreamingDataset(index, shuffle=False)  # meant to repeat
        list(repeat), list(repeat)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert first == again == third
    assert len(messages) == 1 and "iterated again at epoch 0" in messages[0]
    assert "ds.set_epoch(epoch)" in messages[0]
    workers = ShardedStreamingDataset(index, seed=2)
    loader = DataLoader(workers, batch_size=None, num_workers=1, persistent_workers=True,
                        multiprocessing_context="spawn")  # not forked: pytest records warnings
    for epoch in (0, 0, 0, 1):
        workers.set_epoch(epoch)
        list(loader)
    assert capfd.readouterr().err.count("iterated again at epoch 0") == 1  # from worker 0
