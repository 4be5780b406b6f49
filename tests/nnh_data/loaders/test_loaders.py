"""The distributed and rank-cached loaders: real gloo ranks for the guarantees, one process for
the pure parts (shares, the cache's batches against default_collate, the sampler, memory)."""

from __future__ import annotations

import collections
import itertools
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from nnh_data import (
    RankCache,
    RankCachedSampler,
    ShardedStreamingDataset,
    create_distributed_loader,
    create_rank_cached_dataloader,
    gather_for_metrics,
    gen_augmentation_params,
    rank_share,
    write_shards,
)
from nnh_data.loaders.distributed import default_num_workers
from nnh_data.loaders.rank_cached import nbytes
from tests.support import run_distributed

N = 23  # not divisible by world size x batch size for 2 or 3 ranks and batches of 4
BATCH = {"batch_size": 4, "num_workers": 0}


def quiet(line: str) -> None:
    """A log_fn that says nothing."""


class Numbered(Dataset):
    """Sample i is ``{"x": [i, -i, i, -i, ...] (width floats), "y": i}``; counts the
    ``__getitem__`` calls."""

    def __init__(self, size: int = N, width: int = 2) -> None:
        self.size, self.width, self.calls = size, width, 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        self.calls += 1
        x = torch.full((self.width,), float(i))
        x[1::2] *= -1
        return {"x": x, "y": i}


def _passes(loader, sampler, key: str) -> dict:
    """Ids per pass: epoch 0, epoch 0 again without set_epoch, then epoch 1; batch counts."""
    passes, batches = [], []
    for epoch in (0, None, 1):
        if epoch is not None:
            sampler.set_epoch(epoch)
        seen = [loader_batch for loader_batch in loader]
        passes.append(torch.cat([b[key] for b in seen]).tolist() if seen else [])
        batches.append(len(seen))
    return {"passes": passes, "batches": batches}


# ---------------------------------------------------------------- real ranks


def _rank_report(rank: int, world_size: int, pattern: str) -> dict:
    """Everything one rank sees, in one run per world size: spawning is what costs time."""
    return {
        "plain": _plain(),
        "cached": _cached(),
        "variants": _variants(),
        "stream": _stream(pattern),
    }


def _plain() -> dict:
    loader, sampler = create_distributed_loader(Numbered(), BATCH, "cpu", log_fn=quiet)
    report = _passes(loader, sampler, "y")
    loader, sampler = create_distributed_loader(Numbered(), BATCH, "cpu", quiet, is_eval=True)
    ids = list(sampler)  # the plain loader's ids: the sampler's order
    x = torch.cat([b["x"] for b in loader])
    report["tensors"] = [t.tolist() for t in gather_for_metrics(x, ids)]
    report["objects"] = gather_for_metrics([f"s{i}" for i in ids], ids)
    return report


def _cached() -> dict:
    ds = Numbered()
    loader, sampler = create_rank_cached_dataloader(ds, BATCH, "cpu", log_fn=quiet)
    calls = ds.calls
    report = _passes(loader, sampler, "__index__")
    report["pads"] = torch.cat([b["__pad__"] for b in loader]).tolist()
    report["calls"] = (calls, ds.calls)  # after the first pass, after three epochs
    loader, _ = create_rank_cached_dataloader(Numbered(), BATCH, "cpu", quiet, is_eval=True)
    x, ids = zip(*((b["x"], b["__index__"]) for b in loader))
    report["tensors"] = [t.tolist() for t in gather_for_metrics(torch.cat(x), torch.cat(ids))]
    ids = torch.cat(ids).tolist()
    report["objects"] = gather_for_metrics([f"s{i}" for i in ids], ids)
    return report


def _variants() -> dict:
    """Ids held per (split, uneven) and their batch counts; tuple samples use dataset.ids."""
    ds = TensorDataset(torch.arange(N) * 10)
    report = {}
    for split in ("contiguous", "interleaved"):
        for uneven in ("pad", "drop"):
            loader, sampler = create_rank_cached_dataloader(
                ds, BATCH, "cpu", quiet, split=split, uneven=uneven
            )
            sampler.set_epoch(3)
            values = torch.cat([x for x, in loader]).tolist()
            ids = loader.dataset.ids[list(sampler)].tolist()
            report[f"{split}/{uneven}"] = {"values": values, "ids": ids, "batches": len(loader)}
    return report


def _stream(pattern: str) -> dict:
    plain = DataLoader(ShardedStreamingDataset(pattern), batch_size=4)
    x, ids = zip(*((b["__index__"].double() * 10, b["__index__"]) for b in plain))
    report = {"tensors": [t.tolist() for t in gather_for_metrics(torch.cat(x), torch.cat(ids))]}
    ds = ShardedStreamingDataset(pattern)
    loader, sampler = create_rank_cached_dataloader(ds, BATCH, "cpu", log_fn=quiet)
    report.update(_passes(loader, sampler, "__index__"))
    report["cached_pads"] = int(loader.dataset.pads.sum())
    pairs = [(k, i) for b in loader for k, i in zip(b["__key__"], b["__index__"].tolist())]
    report["keys_match"] = all(key == f"{i:06d}" for key, i in pairs)
    return report


@pytest.fixture(scope="module")
def shard_pattern(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("loader-shards")
    samples = ({"__key__": f"{g:06d}", "cls": str(g).encode()} for g in range(N))
    write_shards(samples, str(folder / "s-%06d.tar"), max_count=9)  # shards of 9, 9 and 5
    return str(folder / "s-*.tar")


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def reports(request, shard_pattern) -> list[dict]:
    return run_distributed(_rank_report, request.param, shard_pattern, timeout=100)


def _check_epochs(reports: list[dict], expected: set[int], *, fixed_share: bool) -> None:
    """Every pass covers ``expected`` over the ranks; equal batch counts; set_epoch reorders
    (within the rank's share when ``fixed_share``)."""
    for p in range(3):
        union = set().union(*(r["passes"][p] for r in reports))
        assert union == expected, f"pass {p}"
    assert len({b for r in reports for b in r["batches"]}) == 1
    for rank, r in enumerate(reports):
        assert r["passes"][0] == r["passes"][1], f"rank {rank}: no set_epoch, same order"
        assert r["passes"][0] != r["passes"][2], f"rank {rank}: set_epoch(1), a new order"
        if fixed_share:
            assert sorted(r["passes"][0]) == sorted(r["passes"][2]), f"rank {rank}: same share"


def _check_exact(report: dict, expected: list) -> None:
    """Exactly N gathered results, in id order, each the value of its sample."""
    assert report["tensors"] == [expected, list(range(N))]


@pytest.mark.timeout(150)
def test_distributed_loader_shares_orders_and_exact_gather(reports):
    plain = [r["plain"] for r in reports]
    _check_epochs(plain, set(range(N)), fixed_share=False)
    for r in plain:
        _check_exact(r, [[i, -i] for i in range(N)])
        assert r["objects"] == ([f"s{i}" for i in range(N)], list(range(N)))


@pytest.mark.timeout(150)
def test_rank_cached_loader_shares_orders_and_reads_once(reports):
    cached = [r["cached"] for r in reports]
    _check_epochs(cached, set(range(N)), fixed_share=True)
    world = len(reports)
    assert sum(r["pads"].count(True) for r in cached) == -(-N // world) * world - N
    for rank, r in enumerate(cached):
        first, after = r["calls"]
        assert first == after == -(-N // world), f"rank {rank}: __getitem__ only in the first pass"
        _check_exact(r, [[i, -i] for i in range(N)])
        assert r["objects"] == ([f"s{i}" for i in range(N)], list(range(N)))


@pytest.mark.timeout(150)
def test_rank_cached_splits_and_uneven(reports):
    world = len(reports)
    for name in ("contiguous/pad", "contiguous/drop", "interleaved/pad", "interleaved/drop"):
        per_rank = [r["variants"][name] for r in reports]
        assert len({r["batches"] for r in per_rank}) == 1, name
        for r in per_rank:
            assert r["values"] == [i * 10 for i in r["ids"]], name  # dataset.ids name the rows
        held = [set(r["ids"]) for r in per_rank]
        if name.endswith("drop"):
            assert {len(r["ids"]) for r in per_rank} == {N // world}
            assert sum(len(h) for h in held) == len(set().union(*held)) == N // world * world
        else:
            assert set().union(*held) == set(range(N)), name
    interleaved = reports[1]["variants"]["interleaved/pad"]["ids"]
    assert all(i % world == 1 for i in interleaved if i >= world), "rank 1 holds ids 1 mod world"


@pytest.mark.timeout(150)
def test_streaming_pads_removed_and_cached_stream(reports):
    world = len(reports)
    stream = [r["stream"] for r in reports]
    for r in stream:
        _check_exact(r, [i * 10 for i in range(N)])
        assert r["keys_match"]
    _check_epochs(stream, set(range(N)), fixed_share=True)
    assert sum(r["cached_pads"] for r in stream) == -(-N // world) * world - N


# ---------------------------------------------------------------- one process


@pytest.mark.parametrize(
    "total, rank, world, split, uneven, ids, pads",
    [
        (10, 0, 3, "contiguous", "pad", [0, 1, 2, 3], [0, 0, 0, 0]),
        (10, 2, 3, "contiguous", "pad", [7, 8, 9, 0], [0, 0, 0, 1]),
        (10, 0, 3, "contiguous", "drop", [0, 1, 2], [0, 0, 0]),
        (10, 2, 3, "contiguous", "drop", [7, 8, 9], [0, 0, 0]),
        (10, 1, 3, "interleaved", "pad", [1, 4, 7, 0], [0, 0, 0, 1]),
        (10, 0, 3, "interleaved", "drop", [0, 3, 6], [0, 0, 0]),
        (2, 3, 4, "contiguous", "pad", [0], [1]),  # fewer samples than ranks: a foreign repeat
        (2, 3, 4, "contiguous", "drop", [], []),
        (0, 0, 2, "interleaved", "pad", [], []),
    ],
)
def test_rank_share_table(total, rank, world, split, uneven, ids, pads):
    got_ids, got_pads = rank_share(total, rank, world, split, uneven)
    assert got_ids.tolist() == ids
    assert got_pads.tolist() == [bool(p) for p in pads]


Point = collections.namedtuple("Point", "x label")


@pytest.mark.parametrize(
    "make",
    [
        lambda i: {"x": torch.randn(3), "n": i, "f": i / 3, "s": f"s{i}", "b": b"%d" % i,
                   "a": np.full(2, i, np.int16), "t": (torch.ones(2) * i, [i, i + 1])},
        lambda i: (torch.randn(2, 2), i),
        lambda i: Point(np.float32(i), f"p{i}"),
        lambda i: torch.tensor(i),
    ],
    ids=["dict", "tuple", "namedtuple", "tensor"],
)  # fmt: skip
def test_cache_batches_equal_default_collate(make):
    samples = [make(i) for i in range(9)]
    cache = RankCache(samples, ids=range(9), pads=[False] * 9)
    for indices in ([0], [8, 1, 1, 4], list(range(9))[::-1]):
        expected = default_collate([samples[i] for i in indices])
        got = cache.__getitems__(indices)
        if isinstance(expected, dict):
            assert got.pop("__index__").tolist() == indices
            assert not got.pop("__pad__").any()
        _assert_same(got, expected)


def _assert_same(got, expected) -> None:
    assert type(got) is type(expected), (type(got), type(expected))
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    elif isinstance(expected, dict):
        assert list(got) == list(expected)
        for key in expected:
            _assert_same(got[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            _assert_same(a, b)
    else:
        assert got == expected


def test_sampler_order_is_a_function_of_seed_and_epoch():
    sampler = RankCachedSampler(50, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(50)) and first != list(range(50))
    assert list(RankCachedSampler(50, seed=3)) == first  # any process, same order
    sampler.set_epoch(1)
    assert list(sampler) != first
    assert list(RankCachedSampler(50, seed=4)) != first
    assert list(RankCachedSampler(50, seed=3, rank=1)) != first  # ranks not in step
    assert list(RankCachedSampler(5, shuffle=False)) == [0, 1, 2, 3, 4]
    assert len(sampler) == 50 and list(RankCachedSampler(0)) == []


def test_cache_bytes_per_rank_shrink_with_world_size(monkeypatch):
    ds = Numbered(size=400, width=64)

    def cache_bytes(rank: int, world: int) -> int:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        loader, _ = create_rank_cached_dataloader(ds, BATCH, "cpu", log_fn=quiet)
        return loader.dataset.nbytes

    one = cache_bytes(0, 1)
    four = [cache_bytes(rank, 4) for rank in range(4)]
    assert one >= 400 * 64 * 4  # the x tensors alone
    assert max(four) <= 0.3 * one
    assert sum(four) == one  # 400 = 4 x 100: no repeats, nothing held twice


def test_max_bytes_fails_at_the_first_sample():
    ds = Numbered(size=1000, width=256)  # 1 KiB of x per sample: about 1 MiB in all
    message = r"rank 0's share of 1000 samples needs about 0\.9\d MiB .*max_bytes=100000"
    with pytest.raises(ValueError, match=message):
        create_rank_cached_dataloader(ds, BATCH, "cpu", quiet, max_bytes=100_000)
    assert ds.calls == 1
    loader, _ = create_rank_cached_dataloader(Numbered(), BATCH, "cpu", quiet, max_bytes=10_000)
    assert len(loader.dataset) == N


@pytest.mark.timeout(60)
def test_real_workers_read_the_share_and_feed_the_plain_loader():
    ds = Numbered()
    loader, sampler = create_rank_cached_dataloader(ds, {"batch_size": 5, "num_workers": 2}, "cpu",
                                                    quiet)  # fmt: skip
    assert ds.calls == 0  # read in the workers
    assert sorted(torch.cat([b["y"] for b in loader]).tolist()) == list(range(N))
    loader, sampler = create_distributed_loader(ds, {"batch_size": 5, "num_workers": 2}, "cpu",
                                                quiet)  # fmt: skip
    assert loader.persistent_workers
    sampler.set_epoch(2)
    assert sorted(torch.cat([b["y"] for b in loader]).tolist()) == list(range(N))


def test_defaults_come_from_the_environment_and_are_logged_once(monkeypatch):
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "2")
    lines = []
    loader, sampler = create_distributed_loader(Numbered(), {"batch_size": 2}, "cuda", lines.append)
    assert (loader.num_workers, loader.pin_memory, loader.persistent_workers) == (2, True, True)
    assert len(lines) == 1 and "num_workers=2 (SLURM_CPUS_PER_TASK)" in lines[0]
    assert sampler.shuffle and not sampler.drop_last
    monkeypatch.delenv("SLURM_CPUS_PER_TASK")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1000")
    assert default_num_workers()[0] == 0
    kwargs = {"batch_size": 2, "num_workers": 0, "pin_memory": False, "drop_last": True}
    loader, sampler = create_distributed_loader(Numbered(), kwargs, "cuda", lines.append)
    assert (loader.pin_memory, loader.persistent_workers, loader.drop_last) == (False, False, True)
    assert sampler.drop_last and "(loader_kwargs)" in lines[-1]


def test_eval_ignores_drop_last_with_a_warning():
    kwargs = {**BATCH, "drop_last": True}
    with pytest.warns(UserWarning, match="drop_last=True is ignored"):
        loader, sampler = create_distributed_loader(Numbered(), kwargs, "cpu", quiet, is_eval=True)
    assert not (loader.drop_last or sampler.drop_last or sampler.shuffle)
    with pytest.warns(UserWarning, match="drop_last=True is ignored"):
        loader, sampler = create_rank_cached_dataloader(Numbered(), kwargs, "cpu", quiet, True)
    assert not loader.drop_last and list(sampler) == list(range(N))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader, _ = create_rank_cached_dataloader(Numbered(), kwargs, "cpu", quiet)
    assert loader.drop_last and len(loader) == N // 4


def test_custom_collate_fn_gets_the_cached_samples():
    def collate(samples: list) -> list:
        return [s["y"] for s in samples]

    kwargs = {**BATCH, "collate_fn": collate}
    loader, sampler = create_rank_cached_dataloader(Numbered(), kwargs, "cpu", quiet, True)
    assert not loader.dataset.collated
    assert [y for batch in loader for y in batch] == list(range(N))


def test_on_device_cache_yields_batches_there():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loader, _ = create_rank_cached_dataloader(Numbered(), BATCH, device, quiet, on_device=True)
    batch = next(iter(loader))
    assert batch["x"].device.type == device and not loader.pin_memory
    assert sorted(torch.cat([b["y"] for b in loader]).tolist()) == list(range(N))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"split": "random"}, "split must be one of 'contiguous', 'interleaved', got 'random'"),
        ({"uneven": "repeat"}, "uneven must be one of 'pad', 'drop', got 'repeat'"),
        ({"seed": -1}, r"seed must be in \[0, inf\), got -1"),
        ({"max_bytes": 1.5}, "max_bytes must be an integer, got float 1.5"),
        ({"pin_memory": True, "on_device": True}, "pin_memory=True does not go with on_device"),
    ],
)
def test_rank_cached_arguments_are_checked(kwargs, message):
    ds = Numbered()
    with pytest.raises(ValueError, match=message):
        create_rank_cached_dataloader(ds, BATCH, "cpu", quiet, **kwargs)
    assert ds.calls == 0


@pytest.mark.parametrize("key", ["sampler", "batch_sampler"])
def test_sampler_arguments_are_refused(key):
    for create in (create_distributed_loader, create_rank_cached_dataloader):
        with pytest.raises(ValueError, match=f"loader_kwargs\\['{key}'\\] is not allowed"):
            create(Numbered(), {**BATCH, key: True}, "cpu", quiet)


@pytest.mark.parametrize("is_eval", [False, True])
def test_shuffle_in_the_loader_arguments_sets_the_samplers(is_eval):
    """``shuffle=`` as every script written for a plain DataLoader passes it."""
    for shuffle in (False, True):
        kwargs = {**BATCH, "shuffle": shuffle}
        _, sampler = create_distributed_loader(Numbered(), kwargs, "cpu", quiet, is_eval=is_eval)
        assert sampler.shuffle is shuffle
        _, sampler = create_rank_cached_dataloader(Numbered(), kwargs, "cpu", quiet, is_eval)
        assert (list(sampler) != list(range(N))) is shuffle


class EpochKeyed(Dataset):
    """Sample i of epoch e: ``(i, gen_augmentation_params(i, epoch=e)["rotation"])``, as a
    dataset whose augmentation is keyed by the epoch ``set_epoch`` gave it."""

    def __init__(self, size: int = 12) -> None:
        self.size, self.epoch = size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[int, float]:
        return i, gen_augmentation_params(i, base_seed=3, epoch=self.epoch)["rotation"]


def _params_by_id(loader) -> dict[int, float]:
    return {int(i): float(p) for ids, params in loader for i, p in zip(ids, params)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_set_epoch_reaches_persistent_workers(context):
    kwargs = {"batch_size": 4, "num_workers": 2, "multiprocessing_context": context}
    ds = EpochKeyed()
    loader, sampler = create_distributed_loader(ds, kwargs, "cpu", quiet)
    assert loader.persistent_workers and loader.dataset.dataset is ds
    seen = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        (ds if epoch != 1 else loader.dataset).set_epoch(epoch)  # the user's object or ours
        assert ds.epoch == epoch
        seen.append(_params_by_id(loader))
        fresh = EpochKeyed()
        fresh.set_epoch(epoch)
        assert seen[-1] == _params_by_id(DataLoader(fresh, batch_size=4)), f"epoch {epoch}"
    assert seen[0] != seen[1] != seen[2] != seen[0]


def test_streams_that_cannot_be_cached_fail_early(shard_pattern):
    cases = [
        (ShardedStreamingDataset(shard_pattern, batch_size=4), {}, "without batch_size"),
        (ShardedStreamingDataset(shard_pattern), {"split": "interleaved"}, "split='interleaved'"),
        (ShardedStreamingDataset(shard_pattern), {"uneven": "drop"}, "dataset has uneven='pad'"),
    ]
    for ds, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            create_rank_cached_dataloader(ds, BATCH, "cpu", quiet, **kwargs)


class Lossy(ShardedStreamingDataset):
    """A stream that loses every other sample, as ``on_error="skip"`` loses corrupt ones."""

    def __iter__(self):
        return itertools.islice(super().__iter__(), 0, None, 2)


def test_a_short_stream_is_made_up_with_flagged_repeats(shard_pattern):
    loader, sampler = create_rank_cached_dataloader(Lossy(shard_pattern), BATCH, "cpu", quiet, True)
    cache = loader.dataset
    assert len(cache) == N and cache.pads.sum() == N // 2
    real = cache.ids[~cache.pads].tolist()
    assert len(set(real)) == len(real) == N - N // 2
    assert set(cache.ids[cache.pads].tolist()) <= set(real)
    batches = list(loader)
    assert torch.cat([b["__pad__"] for b in batches]).tolist() == cache.pads.tolist()
    assert torch.cat([b["__index__"] for b in batches]).tolist() == cache.ids.tolist()


def test_nbytes_counts_data():
    sample = {"x": torch.zeros(4), "n": 3, "s": "cat", "b": b"ab", "a": np.zeros(3)}
    assert nbytes(sample) == 16 + 8 + 3 + 2 + 24
    assert nbytes([(torch.zeros(2, dtype=torch.int8),)]) == 2


class Guarded(Dataset):
    """A dataset that refuses attributes other than its epoch."""

    def __setattr__(self, name: str, value) -> None:
        if name != "epoch":
            raise AttributeError(f"{name} is read-only")
        super().__setattr__(name, value)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def test_a_dataset_without_attributes_is_told_to_use_the_wrapper():
    with pytest.warns(RuntimeWarning, match="Guarded takes no attributes.*loader.dataset"):
        loader, _ = create_distributed_loader(Guarded(), BATCH, "cpu", quiet)
    loader.dataset.set_epoch(3)
    assert loader.dataset.dataset.epoch == 3
