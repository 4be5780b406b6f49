"""Data-path stats: per epoch, over the process and its DataLoader workers (fork and spawn):
samples handed out, samples and bytes read (what the readers really read, counted apart), times,
remote GETs and cache counts (S3 on loopback), skipped samples, the loop's wait; summed over
real ranks in one collective; one line for a log."""

from __future__ import annotations

import multiprocessing
import os
import time

import fsspec
import pytest

from nnh_data import ShardedStreamingDataset, build_shard_index, streaming_loader
from nnh_data.shards.reading import ShardReader
from nnh_data.streaming.stats import DECODE_SAMPLING, describe, sum_over_ranks, timed
from tests.support import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")


@pytest.fixture
def urls(tar_shards):
    return tar_shards([40, 33, 0, 27], size=64)  # 100 samples


def epoch_of(ds: ShardedStreamingDataset, loader, epoch: int) -> dict:
    ds.set_epoch(epoch)
    for _ in loader:
        pass
    return ds.stats()


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_counts_what_was_read(urls, workers):
    ds = ShardedStreamingDataset(urls, shuffle=False)
    loader = streaming_loader(ds, batch_size=8, num_workers=workers)
    first, second = epoch_of(ds, loader, 0), epoch_of(ds, loader, 1)
    assert first == pytest.approx(second, abs=0.5)  # counted per epoch, not since the start
    assert first["samples"] == 100 and first["skipped"] == 0
    tar_bytes = sum(os.path.getsize(u) for u in urls)
    assert 100 * 2 * 64 < first["bytes"] <= tar_bytes  # two 64-byte fields a sample, headers
    assert first["gets"] == 0  # local files
    assert first["read_s"] > 0 and first["decode_s"] > 0 and first["params_s"] > 0


@pytest.mark.timeout(120)
def test_spawned_persistent_workers_count_too(urls):
    ds = ShardedStreamingDataset(urls, seed=1, shuffle_window=16)
    loader = streaming_loader(ds, batch_size=8, num_workers=2, multiprocessing_context="spawn")
    for epoch in range(2):
        stats = epoch_of(ds, loader, epoch)
        assert stats["samples"] >= 100  # whole windows: a worker may read past its range


def test_decode_is_timed_on_a_sample_of_the_parts(urls):
    def slow(sample):
        time.sleep(0.002)
        return sample

    ds = ShardedStreamingDataset(urls, seed=0, shuffle_window=4, decode=slow)
    stats = epoch_of(ds, streaming_loader(ds, batch_size=8), 0)
    parts = 100 // 4 + 1
    assert parts > DECODE_SAMPLING  # some parts are timed, most not
    assert 0.1 <= stats["decode_s"] <= 10  # 100 calls of 2 ms, estimated from the timed ones


def test_skipped_samples_and_the_loops_wait(urls):
    def picky(sample):
        if sample["__index__"] % 10 == 3:
            raise ValueError("undecodable")
        return sample

    ds = ShardedStreamingDataset(urls, shuffle=False, on_error="skip", decode=picky)
    ds.set_epoch(0)
    slow = (time.sleep(0.01) or b for b in streaming_loader(ds, batch_size=8))
    with pytest.warns(UserWarning, match="undecodable"):
        for _ in timed(slow, ds.data_stats):
            pass
    stats = ds.stats()
    assert stats["skipped"] == 10 == sum(ds.error_counts.values())
    assert stats["wait_s"] >= 0.1  # 13 batches, 10 ms each


def test_remote_gets_and_the_cache(tar_shards, moto_s3, tmp_path):
    local = tar_shards([30, 30, 30], size=64)
    bucket = moto_s3.bucket("stats")
    fs = fsspec.filesystem("s3", **moto_s3.storage_options, skip_instance_cache=True)
    for path in local:
        fs.put_file(path, f"{bucket}/{os.path.basename(path)}")
    index = build_shard_index(f"{bucket}/*.tar", storage_options=moto_s3.storage_options)
    plain = ShardedStreamingDataset(index, shuffle=False, storage_options=moto_s3.storage_options)
    stats = epoch_of(plain, plain, 0)
    assert stats["gets"] == 3 and stats["cache_misses"] == 0  # one ranged GET per shard
    cached = ShardedStreamingDataset(index, shuffle=False, cache_dir=tmp_path / "cache",
                                     cache_prefetch=0, storage_options=moto_s3.storage_options)
    first, second = epoch_of(cached, cached, 0), epoch_of(cached, cached, 1)
    assert (first["gets"], first["cache_misses"], first["cache_hits"]) == (0, 3, 0)
    assert (second["gets"], second["cache_misses"], second["cache_hits"]) == (0, 0, 3)
    assert first["samples"] == second["samples"] == 90


def _ranks_sum(rank: int, world_size: int, urls: list[str]) -> dict:
    ds = ShardedStreamingDataset(urls, shuffle=False)
    local = epoch_of(ds, streaming_loader(ds, batch_size=8), 0)
    return {"local": local, "sum": sum_over_ranks(local)}


@pytest.mark.timeout(120)
def test_sum_over_real_ranks(urls):
    ranks = run_distributed(_ranks_sum, 2, urls, timeout=100)
    assert ranks[0]["sum"] == ranks[1]["sum"]
    assert ranks[0]["sum"]["samples"] == 100 == sum(r["local"]["samples"] for r in ranks)
    assert ranks[0]["sum"]["bytes"] == sum(r["local"]["bytes"] for r in ranks)


def test_describe_is_one_line(urls):
    ds = ShardedStreamingDataset(urls)
    stats = epoch_of(ds, ds, 0)
    line = describe(stats)
    assert "\n" not in line and line.startswith("data: 100 samples, 0.")
    assert "handed out" not in line and "duplicate" not in line
    line = describe({**stats, "samples": 200, "duplicate_keys": 3})  # read twice, three repeated
    assert line.startswith("data: 100 samples handed out, 200 read (") and line.endswith(
        "; 3 duplicate keys")


def _counting_reads(monkeypatch) -> multiprocessing.Value:
    """Samples every ShardReader reads, in this process and the workers forked from it."""
    count = multiprocessing.get_context("fork").Value("q", 0)
    real = ShardReader._read

    def counted(self, info, start, stop, *args, **kwargs):
        with count.get_lock():
            count.value += stop - start
        return real(self, info, start, stop, *args, **kwargs)

    monkeypatch.setattr(ShardReader, "_read", counted)
    return count


@pytest.mark.parametrize("workers", [0, 2])
def test_samples_read_are_the_reads_and_handed_out_the_share(urls, workers, monkeypatch):
    """100 samples in one shuffle window (1,024): each worker's half is scattered over the
    whole window, so each worker reads all of it. ``samples`` is what the readers read, no
    more, and ``handed_out`` is the epoch."""
    reads = _counting_reads(monkeypatch)
    ds = ShardedStreamingDataset(urls, seed=3)
    context = {"multiprocessing_context": "fork"} if workers else {}
    stats = epoch_of(ds, streaming_loader(ds, 8, num_workers=workers, **context), 0)
    assert stats["handed_out"] == 100
    assert stats["samples"] == reads.value == 100 * max(workers, 1)


def _rank_share(rank: int, world_size: int, urls: list[str]) -> dict:
    ds = ShardedStreamingDataset(urls, seed=3)
    return epoch_of(ds, streaming_loader(ds, 8, num_workers=2), 0)


@pytest.mark.timeout(120)
def test_each_rank_hands_out_its_share_and_says_what_it_read(urls):
    for stats in run_distributed(_rank_share, 2, urls, timeout=100):
        assert (stats["handed_out"], stats["samples"]) == (50, 200)  # 2 workers, whole window


def test_nothing_is_counted_before_a_pass(urls):
    stats = ShardedStreamingDataset(urls).stats()
    assert set(stats.values()) == {0}
