"""nnh_data.cache.store: the cache folder's bookkeeping (hits, misses, pins, eviction by the plans,
claims of dead downloads, checks, the disk's limit), with real processes and a real S3 API (moto
on loopback), the policy end to end, and the ``nnh-data cache`` command."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest

from nnh_data.cache import download as cache_download
from nnh_data.cache import store as cache_store
from nnh_data.cache.files import signature
from nnh_data.cache.policy import (
    read_schedule,
    shard_key,
)
from nnh_data.cache.store import ShardCache
from nnh_data.cli import main
from tests.nnh_data.cache.helpers import (
    FORK,
    child_main,
    digest,
    files_bytes,
    load_bench,
    open_and_hold,
    part_names,
    random_file,
    read_shard,
    read_through_cache,
    s3_shards,
    slow_info,
    wait_until,
)
from tests.nnh_data.cache.test_policy import BAD_LIMITS
from tests.support import run_forked

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- arguments


def test_cache_dir_must_be_a_writable_folder(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cache_dir must be a folder"):
        ShardCache(tmp_path / "file")
    with pytest.raises(ValueError, match="cache_dir must be a writable folder"):
        ShardCache("/proc/nnh-cache")  # not writable, even by root
    cache = ShardCache(tmp_path / "new" / "cache", limit="1GB")
    assert sorted(os.listdir(cache.cache_dir)) == ["lock", "procs", "shards", "stats", "tmp"]
    assert cache.stats()["files"] == 0 and cache.limit == 10**9
    with pytest.raises(ValueError, match="cache_prefetch"):
        cache.session(prefetch=-1)


@pytest.mark.parametrize("bad", BAD_LIMITS)
def test_a_bad_limit_names_cache_limit(bad, tmp_path):
    with pytest.raises(ValueError, match="cache_limit"):
        ShardCache(tmp_path, limit=bad if bad is not None else "none")


# ---------------------------------------------------------------- hits, misses, pins


def test_miss_then_hit_entries_evict_and_clear(tmp_path):
    data = [random_file(tmp_path / f"s{i}.tar", 1000 + i) for i in range(3)]
    infos = [slow_info(tmp_path / f"s{i}.tar") for i in range(3)]
    cache = ShardCache(tmp_path / "cache", limit="1MB")
    with cache.session() as session:
        assert [read_shard(session, info) for info in infos] == data
    with cache.session() as session:
        assert read_shard(session, infos[1]) == data[1]
        assert session.open(infos[1]) is session.open(infos[1])  # one file, two pins
        assert not cache.evict(infos[1].url)  # pinned
        session.release(infos[1])
        assert not cache.evict(infos[1].url)  # still pinned once
        session.release(infos[1])
        assert cache.evict(infos[1].url) and not cache.evict(infos[1].url)
    entries = sorted(cache.entries(), key=lambda e: e.url)
    assert [(e.url, e.size, e.version) for e in entries] == [
        (infos[i].url, infos[i].size, "v1") for i in (0, 2)
    ]
    assert open(entries[1].path, "rb").read() == data[2]
    assert entries[0].key == shard_key(infos[0].url, infos[0].size, "v1")
    stats = cache.stats()
    assert {k: stats[k] for k in ("files", "bytes", "downloads", "hits", "around")} == {
        "files": 2,
        "bytes": 2002,
        "downloads": 3,
        "hits": 2,
        "around": 0,
    }
    cache.clear()
    assert cache.entries() == [] and cache.stats()["downloads"] == 3  # counters are history
    assert cache.verify() == []


def test_a_pinned_shard_survives_eviction_and_a_full_cache_reads_around(tmp_path):
    data = [random_file(tmp_path / f"s{i}.tar", 1000) for i in range(4)]
    infos = [slow_info(tmp_path / f"s{i}.tar") for i in range(4)]
    cache = ShardCache(tmp_path / "cache", limit=2500)
    with cache.session() as holder, cache.session() as reader:
        pinned = holder.open(infos[0])
        assert read_shard(reader, infos[1]) == data[1]  # 2 of 2.5 shards
        assert read_shard(reader, infos[2]) == data[2]  # evicts s1 (unpinned), never s0
        assert {e.url for e in cache.entries()} == {infos[0].url, infos[2].url}
        assert reader.open(infos[2]) is not None  # now s0 and s2 are pinned
        with pytest.warns(UserWarning, match="smaller than what its readers need"):
            assert reader.open(infos[3]) is None  # no room without evicting a pinned shard
        assert read_shard(reader, infos[3]) == data[3]  # around, without a second warning
        pinned.seek(0)
        assert pinned.read() == data[0]
        assert cache.stats()["around"] == 2 and cache.stats()["files"] == 2


def test_plans_keep_what_a_reader_needs_next(tmp_path):
    """A demand read evicts the shard no plan needs soon, not the one another reader needs
    next."""
    data = [random_file(tmp_path / f"s{i}.tar", 1000) for i in range(3)]
    infos = [slow_info(tmp_path / f"s{i}.tar") for i in range(3)]
    for needed, spare in ((0, 1), (1, 0)):
        cache = ShardCache(tmp_path / f"cache{needed}", limit=2500)
        with cache.session() as plain:  # no plan: what it reads is never needed again
            assert [read_shard(plain, info) for info in infos[:2]] == data[:2]
        with cache.session(prefetch=0) as other, cache.session(prefetch=0) as reader:
            other.set_plan([infos[needed], infos[spare]], [10, 50])
            other.advance(5)
            assert read_shard(reader, infos[2]) == data[2]
            assert {e.url for e in cache.entries()} == {infos[needed].url, infos[2].url}


# ---------------------------------------------------------------- dead downloads, boots, the disk


@pytest.mark.parametrize("waiter", [True, False])
def test_a_killed_download_leaves_no_entry(tmp_path, monkeypatch, waiter):
    """SIGKILL mid-download: nobody reads the part; a waiting process takes over and finishes
    the read; the part is gone after the next claim, or after verify()."""
    data = random_file(tmp_path / "s.tar", 1 << 20)
    monkeypatch.setenv("NNH_TEST_READ_DELAY", "0.05")
    monkeypatch.setattr(cache_download, "CHUNK_BYTES", 64 << 10)  # 16 slow reads
    cache_dir = str(tmp_path / "cache")
    cache = ShardCache(cache_dir)
    info = slow_info(tmp_path / "s.tar")
    writer = FORK.Process(target=open_and_hold, args=(cache_dir, info))
    writer.start()
    try:
        wait_until(lambda: part_names(cache_dir))
        results = FORK.Queue()
        if waiter:
            args = (read_through_cache, 0, (cache_dir, None, [info], {}, [0]), results)
            reader = FORK.Process(target=child_main, args=args)
            reader.start()
            time.sleep(0.2)  # it waits on the part's lock by now (or finds it dead later)
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.join()
    assert cache.entries() == []
    if waiter:
        _, digests, error = results.get(timeout=60)
        reader.join()
        assert error is None, error
        assert digests == {0: digest(data)}
        assert part_names(cache_dir) == [] and cache.verify() == []
    else:
        assert len(part_names(cache_dir)) == 1  # left by the dead writer, read by nobody
        (problem,) = cache.verify()
        assert "dead download" in problem and part_names(cache_dir) == []
    assert [e.url for e in cache.entries()] == ([info.url] if waiter else [])


def _records(cache: ShardCache) -> dict[str, tuple[str, dict]]:
    """url -> (record path, record) of each cached shard."""
    out = {}
    for entry in cache.entries():
        path = os.path.join(os.path.dirname(entry.path), f"{entry.key}.json")
        with open(path) as f:
            out[entry.url] = (path, json.load(f))
    return out


def _checked_copies(tmp_path, monkeypatch, count: int = 2):
    """``count`` shards downloaded, then read once with their content checked and its
    signature recorded (no time slack: the test's writes come later)."""
    monkeypatch.setattr(cache_store, "_MTIME_SLACK_NS", 0)
    data = [random_file(tmp_path / f"s{i}.tar", 5000 + i) for i in range(count)]
    infos = [slow_info(tmp_path / f"s{i}.tar") for i in range(count)]
    cache = ShardCache(tmp_path / "cache")
    cache.warm(infos)
    time.sleep(0.01)
    with cache.session() as session:
        assert [read_shard(session, info) for info in infos] == data
    assert all("checked" in meta for _, meta in _records(cache).values())
    return cache, infos, data


def _crc_counted(monkeypatch) -> list[int]:
    calls = []
    real = cache_store.file_crc
    monkeypatch.setattr(cache_store, "file_crc", lambda fd: calls.append(fd) or real(fd))
    return calls


def test_a_checked_copy_is_read_without_reading_it_twice(tmp_path, monkeypatch):
    """Once a copy's content matched its record, every process skips the CRC while the file's
    signature (boot, inode, size, times) stays."""
    cache, infos, data = _checked_copies(tmp_path, monkeypatch)
    crcs = _crc_counted(monkeypatch)
    with cache.session() as session:
        assert [read_shard(session, info) for info in infos] == data
    assert crcs == [] and cache.stats()["hits"] == 4 and cache.verify() == []


@pytest.mark.parametrize("keep_mtime", [True, False])
def test_a_copy_overwritten_with_bytes_of_its_size_is_downloaded_again(
    tmp_path, monkeypatch, keep_mtime
):
    """Other bytes of the same size written over a checked copy (its modification time set
    back, or not): the next read finds the CRC-32 changed, warns naming the shard, and reads
    the remote's bytes; the other copy is a hit."""
    cache, infos, data = _checked_copies(tmp_path, monkeypatch)
    (victim,) = [e for e in cache.entries() if e.url == infos[0].url]
    before = os.stat(victim.path)
    with open(victim.path, "r+b") as f:
        f.write(b"\0" * 100)
    if keep_mtime:
        os.utime(victim.path, ns=(before.st_atime_ns, before.st_mtime_ns))
    with cache.session() as session, pytest.warns(UserWarning) as caught:
        assert [read_shard(session, info) for info in infos] == data
    (warning,) = caught
    assert "changed since it was downloaded" in str(warning.message)
    assert infos[0].url in str(warning.message)
    assert cache.stats()["downloads"] == 3 and cache.stats()["hits"] == 3
    assert cache.verify() == []


def test_verify_reads_every_copy_whatever_its_signature(tmp_path, monkeypatch):
    """A change the signature cannot show (here: the record's signature rewritten after it, as
    for bytes changed under the file system) is found by verify, which computes every CRC."""
    cache, infos, _ = _checked_copies(tmp_path, monkeypatch)
    (victim,) = [e for e in cache.entries() if e.url == infos[0].url]
    with open(victim.path, "r+b") as f:
        f.write(b"\0" * 100)
    path, meta = _records(cache)[infos[0].url]
    with open(path, "w") as f:
        json.dump({**meta, "checked": signature(os.stat(victim.path))}, f)
    (problem,) = cache.verify()
    assert victim.path in problem and "changed since it was downloaded" in problem
    assert [e.url for e in cache.entries()] == [infos[1].url]


def test_an_earlier_boots_copy_is_checked_before_use(tmp_path, monkeypatch):
    """After a restart (shards are not fsynced) every copy's CRC is computed again: a copy that
    lost bytes is downloaded again without a warning (a crash, not a writer), the others are
    hits and their signature is renewed; a truncated copy is found by verify."""
    cache, infos, data = _checked_copies(tmp_path, monkeypatch)
    for url, (path, meta) in _records(cache).items():  # as after a crash: an earlier boot
        earlier = ["an-earlier-boot", *meta["checked"][1:]]
        with open(path, "w") as f:
            json.dump({**meta, "boot_id": earlier[0], "checked": earlier}, f)
        if url == infos[0].url:
            (entry,) = [e for e in cache.entries() if e.url == url]
            with open(entry.path, "r+b") as f:
                f.write(b"\0" * 4096)
            os.utime(entry.path, ns=(0, os.stat(entry.path).st_mtime_ns))
    crcs = _crc_counted(monkeypatch)
    with cache.session() as session, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [read_shard(session, info) for info in infos] == data
    assert len(crcs) == 2  # each copy once
    assert cache.stats()["downloads"] == 3 and cache.stats()["hits"] == 3  # s0 fetched again
    assert cache.verify() == []
    entry = cache.entries()[0]
    with open(entry.path, "r+b") as f:
        f.truncate(100)
    (problem,) = cache.verify()
    assert "size 100" in problem and len(cache.entries()) == 1


OTHER_UID = 65534  # nobody


@pytest.mark.parametrize(
    ("what", "change"),
    [
        ("shard", lambda path: os.chown(path, OTHER_UID, OTHER_UID)),
        ("shard", lambda path: os.chmod(path, 0o666)),
        ("record", lambda path: os.chown(path, OTHER_UID, OTHER_UID)),
        ("record", lambda path: os.chmod(path, 0o646)),
    ],
    ids=["shard-of-another-user", "shard-writable-by-all", "record-of-another-user",
         "record-writable-by-others"],
)
def test_a_copy_another_user_can_have_written_is_not_read(tmp_path, monkeypatch, what, change):
    """A shard or record that belongs to another user, or that others can write, is removed
    and the shard downloaded again, even when its content matches."""
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    cache, infos, data = _checked_copies(tmp_path, monkeypatch, count=1)
    (entry,) = cache.entries()
    record = os.path.join(os.path.dirname(entry.path), f"{entry.key}.json")
    change(entry.path if what == "shard" else record)
    with cache.session() as session, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert read_shard(session, infos[0]) == data[0]
    assert cache.stats()["downloads"] == 2
    (warning,) = caught
    reason = "cannot be trusted" if what == "shard" else "has no record of its own"
    assert reason in str(warning.message)
    status = os.stat(cache.entries()[0].path)
    assert status.st_uid == os.geteuid() and not status.st_mode & 0o022


def test_the_disk_caps_the_limit(tmp_path, monkeypatch):
    """``limit`` or what the disk can take (the free space plus what the cache holds, less a
    reserve of 1 GiB or a twentieth of a smaller disk), whichever is smaller."""
    data = random_file(tmp_path / "s.tar", 1000)
    cache = ShardCache(tmp_path / "cache", limit="1GB")
    with cache.session() as session:
        assert read_shard(session, slow_info(tmp_path / "s.tar")) == data
    disk = shutil._ntuple_diskusage(total=100_000, used=0, free=50_000)
    monkeypatch.setattr(cache_store.shutil, "disk_usage", lambda path: disk)
    assert cache.stats()["limit"] == 50_000 + 1000 - 5_000
    assert ShardCache(tmp_path / "cache", limit=10_000).stats()["limit"] == 10_000
    assert ShardCache(tmp_path / "cache").stats()["limit"] == 46_000


# ---------------------------------------------------------------- many processes, S3


def test_four_processes_on_a_cold_cache_fetch_each_shard_once(moto_s3, tar_shards, tmp_path):
    paths = tar_shards([20] * 6, size=4000)
    infos = s3_shards(moto_s3, paths, "cold")
    expected = {i: digest(open(p, "rb").read()) for i, p in enumerate(paths)}
    cache_dir = str(tmp_path / "cache")
    barrier = FORK.Barrier(4)
    orders = [np.roll(np.arange(6), k).tolist() for k in range(4)]
    args = [(cache_dir, None, infos, moto_s3.storage_options, o, barrier) for o in orders]
    assert run_forked(read_through_cache, args) == [expected] * 4
    stats = ShardCache(cache_dir).stats()
    assert (stats["downloads"], stats["hits"], stats["around"], stats["files"]) == (6, 18, 0, 6)


def test_the_folder_never_holds_more_than_the_limit(moto_s3, tar_shards, tmp_path):
    """4 processes read 12 shards in different orders, prefetching, through a cache of 3.5
    shards; sampled every 20 ms, the folder never holds more than the limit plus one shard."""
    paths = tar_shards([10] * 12, size=20_000)
    infos = s3_shards(moto_s3, paths, "small")
    size = max(info.size for info in infos)
    limit = int(3.5 * size)
    cache_dir = str(tmp_path / "cache")
    ShardCache(cache_dir, limit)
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], files_bytes(cache_dir))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    orders = [np.random.default_rng(k).permutation(12).tolist() for k in range(4)]
    args = [(cache_dir, limit, infos, moto_s3.storage_options, o, None, 1) for o in orders]
    try:
        results = run_forked(read_through_cache, args)
    finally:
        stop.set()
        sampler.join()
    expected = {i: digest(open(p, "rb").read()) for i, p in enumerate(paths)}
    assert results == [expected] * 4
    assert 0 < peak[0] <= limit + size
    assert files_bytes(cache_dir) <= limit


def test_parquet_goes_through_the_cache(moto_s3, parquet_shards, tmp_path):
    paths = parquet_shards([7, 5])
    infos = s3_shards(moto_s3, paths, "tables")
    cache = ShardCache(tmp_path / "cache")
    for _ in range(2):
        with cache.session(storage_options=moto_s3.storage_options) as session:
            rows = []
            for info in infos:
                rows += pq.read_table(session.open(info)).column("id").to_pylist()
                session.release(info)
            assert rows == list(range(12))
    assert (cache.stats()["downloads"], cache.stats()["hits"]) == (2, 2)


# ---------------------------------------------------------------- the policy, end to end


def test_the_cache_follows_the_plans_on_the_trace(tmp_path):
    """The 96-shard trace replayed through a real cache (8 sessions, one per worker, in global
    time order; each pins the shard it reads): epochs 1-3 fetch what the simulation of the
    same policy fetches, within 5%, so at most 0.8x / 0.7x what LRU fetches, and epoch 0
    leaves nearly the simulation's shards cached."""
    bench = load_bench()
    trace = bench.demand_trace()
    infos = []
    for shard in range(bench.SHARDS):
        random_file(tmp_path / f"s{shard}.tar", 1000)
        infos.append(slow_info(tmp_path / f"s{shard}.tar"))
    for capacity, bound in ((24, 0.8), (48, 0.7)):
        cache = ShardCache(tmp_path / f"c{capacity}", capacity * 1000)
        fetched, left = _replay(trace, infos, cache)
        fetches, starts = bench.simulate(trace, capacity, "plans")
        simulated = sum(fetches[1:])
        assert abs(fetched - simulated) <= 0.05 * simulated, (capacity, fetched, simulated)
        assert fetched <= bound * bench.count_fetches(trace, capacity, "lru")
        assert len(left & {infos[s].url for s in starts[1]}) >= 0.9 * capacity


def _replay(trace, infos, cache) -> tuple[int, set[str]]:
    """Fetches (downloads and reads around the cache) of epochs 1 on, and the URLs cached
    when epoch 1 starts."""
    sessions = [cache.session(prefetch=0, num_workers=trace.num_workers)
                for _ in range(trace.readers)]  # fmt: skip
    current = [None] * trace.readers
    epoch_of_plans, before, left = -1, None, set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for g, reader, shard, epoch in trace.events:
            if epoch != epoch_of_plans:
                epoch_of_plans = epoch
                if epoch == 1:
                    before, left = cache.stats(), {e.url for e in cache.entries()}
                _plan_epoch(trace, infos, sessions, epoch)
            for r, session in enumerate(sessions):
                session.advance(-(-(g - r % trace.num_workers) // trace.num_workers))
            if current[reader] is not None:
                sessions[reader].release(current[reader])
            current[reader] = infos[shard] if sessions[reader].open(infos[shard]) else None
    after = cache.stats()
    for session in sessions:
        session.close()
    return sum(after[k] - before[k] for k in ("downloads", "around")), left


def _plan_epoch(trace, infos, sessions, epoch) -> None:
    for reader, session in enumerate(sessions):
        reads = [r for e in (epoch, epoch + 1) if e < len(trace.schedules)
                 for r in trace.schedules[e][reader]]  # fmt: skip
        session.set_plan([infos[s] for s, _ in reads], [t for _, t in reads])


# ---------------------------------------------------------------- the command


def test_cli_warm_stats_verify_clear(moto_s3, tar_shards, tmp_path, capsys):
    paths = tar_shards([10] * 8, size=1000)
    infos = s3_shards(moto_s3, paths, "warm")
    cache_dir = str(tmp_path / "cache")
    options = json.dumps(moto_s3.storage_options)
    source = infos[0].url.rsplit("/", 1)[0] + "/*.tar"
    argv = ["cache", "warm", source, "--cache-dir", cache_dir, "--storage-options", options,
            "--world-size", "4", "--ranks", "0-1", "--num-workers", "2",
            "--shuffle-window", "16"]  # fmt: skip
    assert main(argv) == 0
    assert "warmed" in capsys.readouterr().out
    counts = [info.num_samples for info in infos]
    first = {
        shard
        for rank in (0, 1)
        for worker in (0, 1)
        for shard, _ in read_schedule(
            counts,
            seed=0,
            epoch=0,
            window=16,
            world_size=4,
            rank=rank,
            num_workers=2,
            worker=worker,
        )  # fmt: skip
    }
    assert {e.url for e in ShardCache(cache_dir).entries()} == {infos[s].url for s in first}
    assert main(["cache", "stats", cache_dir, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["files"] == len(first) and stats["downloads"] == len(first)
    assert {"bytes", "limit", "in_flight", "hits", "around", "evictions"} <= set(stats)
    assert main(["cache", "stats", cache_dir]) == 0
    assert f"files: {len(first)}" in capsys.readouterr().out
    victim = ShardCache(cache_dir).entries()[0]
    with open(victim.path, "r+b") as f:
        f.truncate(10)
    assert main(["cache", "verify", cache_dir]) == 0
    assert "1 problem(s)" in capsys.readouterr().out
    assert main(["cache", "clear", cache_dir]) == 0
    assert ShardCache(cache_dir).entries() == []
    small = ["--limit", str(2 * max(i.size for i in infos) + 1)]
    assert main(argv + small) == 0
    assert "warmed 2 of" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["cache", "stats", "/nonexistent"], "cache_dir must be a shard cache folder"),
        (["cache", "warm", "x.tar", "--cache-dir", "{tmp}", "--limit", "lots"], "cache_limit"),
        (["cache", "warm", "x.tar", "--cache-dir", "{tmp}", "--ranks", "5"], "--ranks"),
    ],
)
def test_cli_errors_are_one_line(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and message in err and err.count("\n") == 1
