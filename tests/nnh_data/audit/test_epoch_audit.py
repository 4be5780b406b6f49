"""EpochAudit: a run that consumed every sample once passes (plain, mixed with repeats,
epoch_size, batch mode, resumed mid-epoch with the same or another layout, map-style loaders);
a dropped batch, a repeated batch, a second cut over the ranks or datasets that ignore the group
fail on every rank with the numbers and the likely cause."""

from __future__ import annotations

import itertools
import weakref
from collections import Counter

import pytest
import torch
from torch.utils.data import Dataset

from nnh_data import (
    ShardedStreamingDataset,
    Source,
    create_distributed_loader,
    create_rank_cached_dataloader,
    gather_for_metrics,
    state_from_loader,
    streaming_loader,
)
from nnh_data.audit.epoch_audit import SECOND_CUT, EpochAudit
from nnh_data.errors import ExactlyOnceError
from nnh_data.order.resume import loader_states
from tests.support import run_distributed, simulated


@pytest.fixture
def urls(tar_shards):
    return tar_shards([40, 33, 0, 27], size=8)  # 100 samples


@pytest.fixture
def mixed(tar_shards):
    a = tar_shards([30, 30], name="a", size=8)
    b = tar_shards([20], name="b", size=8)
    return [Source(a, weight=0.6, name="a"), Source(b, weight=0.4, name="b")]  # b drawn 2x


def consume(audit: EpochAudit, loader, skip=(), again=()) -> list[dict]:
    batches = []
    for i, batch in enumerate(loader):
        if i not in skip:
            audit.update(batch)
            batches.append(batch)
        if i in again:
            audit.update(batch)
    return batches


def yielded(ds: ShardedStreamingDataset, samples) -> Counter:
    """(source position, id, pad) of what a pass yielded."""
    names = [s if src.name is None else src.name for s, src in enumerate(ds.sources)]
    return Counter((names.index(s["__source__"]) if "__source__" in s else 0, s["__index__"],
                    s["__pad__"]) for s in samples)  # fmt: skip


def planned(ds: ShardedStreamingDataset, states=(None,)) -> Counter:
    out = Counter()
    for labels in ds.planned_labels(states):
        out.update(zip(*(labels[k].tolist() for k in ("__source__", "__index__", "__pad__"))))
    return out


# ---------------------------------------------------------------- the plan is what a pass yields


@pytest.mark.parametrize("uneven", ["pad", "drop"])
@pytest.mark.parametrize("kind", ["plain", "mixed", "epoch_size", "batches"])
def test_planned_labels_are_what_each_rank_yields(urls, mixed, kind, uneven, monkeypatch):
    settings = {"plain": (urls, {}), "mixed": (mixed, {"epoch_size": 150}),
                "epoch_size": (urls, {"epoch_size": 130}), "batches": (urls, {"batch_size": 7})}
    source, extra = settings[kind]
    for rank in range(3):
        ds = ShardedStreamingDataset(source, seed=5, shuffle_window=16, rank=rank, world_size=3,
                                     uneven=uneven, epoch=1, **extra)  # fmt: skip
        got = simulated(ds, 2, monkeypatch)
        if kind == "batches":  # columns: one row per sample
            got = [{"__index__": i, "__pad__": p} for b in got
                   for i, p in zip(b["__index__"].tolist(), b["__pad__"].tolist())]  # fmt: skip
        assert planned(ds) == yielded(ds, got), (rank, kind)


def test_planned_labels_follow_a_resume_state(mixed, monkeypatch):
    ds = ShardedStreamingDataset(mixed, epoch_size=150, seed=1, shuffle_window=16)
    loader = streaming_loader(ds, batch_size=8, num_workers=2)
    head = list(itertools.islice(loader, 5))
    states = loader_states(loader.state_dict())
    assert len(states) == 2 and None in states[0]["consumed"]
    rest = planned(ds, states)
    for b in head:
        rest.update(zip(map("ab".index, b["__source__"]), b["__index__"].tolist(),
                        b["__pad__"].tolist()))  # fmt: skip
    assert rest == planned(ds)


# ---------------------------------------------------------------- one process


@pytest.mark.parametrize("workers", [0, 2])
def test_a_whole_epoch_passes_and_names_its_numbers(urls, workers):
    ds = ShardedStreamingDataset(urls, seed=3, shuffle_window=16)
    loader = streaming_loader(ds, batch_size=8, num_workers=workers)
    audit = EpochAudit(loader)
    for epoch in range(2):
        ds.set_epoch(epoch)
        consume(audit, loader)
        report = audit.verify()
        assert report.ok and report.exact and report.epoch == epoch
        assert (report.consumed, report.planned, report.missing, report.repeated) == (
            100, 100, 0, 0)
        assert report.ranks[0].batches == 13
        assert "100 of 100 planned samples" in str(report)


def test_mixed_sources_with_repeats_pass(mixed):
    ds = ShardedStreamingDataset(mixed, epoch_size=150, seed=1, shuffle_window=16)
    loader = streaming_loader(ds, batch_size=8, num_workers=2)
    audit = EpochAudit(ds)
    consume(audit, loader)
    assert audit.verify().consumed == 150


def test_a_dropped_batch_is_named_exactly(urls):
    ds = ShardedStreamingDataset(urls, seed=3, shuffle_window=16)
    loader = streaming_loader(ds, batch_size=8)
    audit = EpochAudit(ds)
    batches = list(loader)
    for i, batch in enumerate(batches):
        if i != 3:
            audit.update(batch)
    with pytest.raises(ExactlyOnceError) as info:
        audit.verify()
    report = info.value.report
    assert (report.missing, report.repeated, report.exact) == (8, 0, True)
    dropped = sorted(batches[3]["__index__"].tolist())
    assert [i for kind, _, i in report.examples] == dropped[:5]
    assert "8 missing" in str(info.value) and "a dropped batch" in report.cause
    consume(audit, loader)
    assert audit.verify().ok  # the next epoch starts from scratch


def test_a_repeated_batch_is_named_exactly(mixed):
    ds = ShardedStreamingDataset(mixed, epoch_size=150, seed=1, shuffle_window=16)
    loader = streaming_loader(ds, batch_size=8)
    audit = EpochAudit(ds)
    batches = consume(audit, loader, again={4})
    with pytest.raises(ExactlyOnceError) as info:
        audit.verify()
    report = info.value.report
    assert (report.missing, report.repeated, report.consumed) == (0, 8, 158)
    assert Counter((s, i) for kind, s, i in report.examples) <= Counter(
        zip(batches[4]["__source__"], batches[4]["__index__"].tolist()))
    assert "consumed twice" in report.cause


def test_a_large_loss_is_estimated_and_agrees_with_the_net_count(tar_shards):
    ds = ShardedStreamingDataset(tar_shards([3000, 2000], size=1), seed=0)
    loader = streaming_loader(ds, batch_size=500)
    audit = EpochAudit(ds)
    consume(audit, loader, skip={1, 2, 3})
    with pytest.raises(ExactlyOnceError) as info:
        audit.verify()
    report = info.value.report
    assert not report.exact and (report.missing, report.repeated) == (1500, 0)
    assert "about 1,500 missing" in str(report)


def test_every_batch_consumed_twice_is_estimated_without_negatives_and_named(tar_shards):
    """Beyond the exact limit the estimates agree with the exact net count and are never
    negative, on the rank line too; the cause names the repeat."""
    ds = ShardedStreamingDataset(tar_shards([3000, 2000], size=1), seed=0)
    audit = EpochAudit(ds)
    consume(audit, streaming_loader(ds, batch_size=500), again=range(10))
    with pytest.raises(ExactlyOnceError) as info:
        audit.verify()
    report = info.value.report
    assert not report.exact and (report.missing, report.repeated) == (0, 5000)
    assert (report.ranks[0].missing, report.ranks[0].repeated) == (0, 5000)
    assert "-" not in str(report).split("likely cause")[0]
    assert "consumed 2 times" in report.cause


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_pass_is_checked_for_the_rest_of_its_epoch(urls, workers):
    ds = ShardedStreamingDataset(urls, seed=3, shuffle_window=16, epoch=2)
    loader = streaming_loader(ds, batch_size=8, num_workers=workers)
    first = list(itertools.islice(loader, 5))
    state = loader.state_dict()
    del loader
    ds2 = ShardedStreamingDataset(urls, seed=3, shuffle_window=16)
    loader2 = streaming_loader(ds2, batch_size=8, num_workers=workers)
    loader2.load_state_dict(state)
    audit = EpochAudit(loader2)
    audit.resume(state)
    rest = consume(audit, loader2)
    report = audit.verify()
    assert report.epoch == 2 and report.consumed == 100 - 40
    ids = [i for b in first + rest for i in b["__index__"].tolist()]
    assert sorted(ids) == list(range(100))
    # the same pass again, the audit not told of the resume: the first 40 are missing
    loader3 = streaming_loader(ShardedStreamingDataset(urls, seed=3, shuffle_window=16),
                               batch_size=8, num_workers=workers)
    loader3.load_state_dict(state)
    audit = EpochAudit(loader3)
    consume(audit, loader3)
    with pytest.raises(ExactlyOnceError, match="audit.resume") as info:
        audit.verify()
    assert info.value.report.missing == 40


def test_a_merged_state_resumes_with_another_world_size(mixed, monkeypatch):
    ds = ShardedStreamingDataset(mixed, epoch_size=150, seed=1, shuffle_window=16)
    loader = streaming_loader(ds, batch_size=8, num_workers=2)
    head = list(itertools.islice(loader, 6))
    merged = state_from_loader(loader.state_dict())
    consumed = Counter()
    for rank in range(3):
        new = ShardedStreamingDataset(mixed, epoch_size=150, seed=1, shuffle_window=16,
                                      rank=rank, world_size=3)  # fmt: skip
        audit = EpochAudit(new)
        audit.resume(merged)
        rest = []
        for worker in range(2):
            monkeypatch.setenv("WORKER", str(worker))
            monkeypatch.setenv("NUM_WORKERS", "2")
            new.load_state_dict(merged)
            rest += list(new)
        labels = ("__index__", "__pad__", "__source__", "__repeat__")
        audit.update({key: [s[key] for s in rest] for key in labels})
        assert audit.verify().ok
        consumed.update((s["__source__"], s["__index__"]) for s in rest if not s["__pad__"])
    for b in head:
        consumed.update(zip(b["__source__"], b["__index__"].tolist()))
    monkeypatch.delenv("WORKER")
    monkeypatch.delenv("NUM_WORKERS")
    whole = ShardedStreamingDataset(mixed, epoch_size=150, seed=1, shuffle_window=16)
    assert consumed == Counter((s["__source__"], s["__index__"]) for s in whole)


def test_the_audit_keeps_ids_not_batches(urls):
    audit = EpochAudit(ShardedStreamingDataset(urls))
    image = torch.zeros(8, 3, 64, 64)
    pads = torch.zeros(8, dtype=torch.bool)
    audit.update({"image": image, "__index__": torch.arange(8), "__pad__": pads})
    alive = weakref.ref(image)
    del image
    assert alive() is None  # a buffer of 64k ids would otherwise hold 64k images


def test_map_style_loaders_in_one_process():
    data = Numbered(23)
    loader, sampler = create_distributed_loader(data, {"batch_size": 4, "num_workers": 0}, "cpu",
                                                log_fn=print)
    audit = EpochAudit(loader)
    sampler.set_epoch(1)
    consume(audit, loader, skip={2})
    with pytest.raises(ExactlyOnceError, match="4 missing"):
        audit.verify()
    cached, sampler = create_rank_cached_dataloader(data, {"batch_size": 4, "num_workers": 0},
                                                    "cpu", log_fn=len)
    audit = EpochAudit(cached)
    consume(audit, cached)
    assert audit.verify().consumed == 23


def test_wrong_inputs_fail_with_the_reason(urls, mixed):
    with pytest.raises(ValueError, match="ShardedStreamingDataset"):
        EpochAudit([1, 2, 3])
    audit = EpochAudit(ShardedStreamingDataset(urls))
    with pytest.raises(ValueError, match="__index__"):
        audit.update((torch.zeros(3), torch.zeros(3)))
    audit = EpochAudit(ShardedStreamingDataset(mixed, epoch_size=150))
    with pytest.raises(ValueError, match="__source__"):
        audit.update({"__index__": torch.arange(3)})
    loader, _ = create_distributed_loader(Numbered(5), {"num_workers": 0}, "cpu", log_fn=len)
    with pytest.raises(ValueError, match="map-style"):
        EpochAudit(loader).resume({"consumed": [1]})


class Numbered(Dataset):
    """Sample i is ``{"x": float(i), "__index__": i}``."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        return {"x": float(i), "__index__": i}


# ---------------------------------------------------------------- real ranks


def _verdict(audit: EpochAudit) -> str:
    try:
        return "ok: " + str(audit.verify())
    except ExactlyOnceError as exc:
        return "error: " + str(exc)


def _streaming_epochs(rank: int, world_size: int, urls: list[str]) -> list[str]:
    """Epoch 0 whole; epoch 1 rank 1 drops a batch; epoch 2 a second cut (each rank keeps
    every other batch); then datasets that ignore the group (each reads everything)."""
    ds = ShardedStreamingDataset(urls, seed=3, shuffle_window=16)
    loader = streaming_loader(ds, batch_size=8, num_workers=1)
    audit = EpochAudit(loader)
    out = []
    for epoch, skip in ((0, ()), (1, {2} if rank == 1 else ()), (2, range(1, 99, 2))):
        ds.set_epoch(epoch)
        consume(audit, loader, skip=set(skip))
        out.append(_verdict(audit))
    alone = ShardedStreamingDataset(urls, seed=3, rank=0, world_size=1)
    audit = EpochAudit(alone)
    consume(audit, streaming_loader(alone, batch_size=8))
    out.append(_verdict(audit))
    return out


@pytest.mark.timeout(180)
def test_real_ranks_share_one_verdict(tar_shards):
    urls = tar_shards([40, 33, 0, 28], size=8)  # 101 samples: one pad
    ranks = run_distributed(_streaming_epochs, 2, urls, timeout=150)
    assert ranks[0] == ranks[1]  # every rank raises (or passes) with the same numbers
    whole, dropped, cut, alone = ranks[0]
    assert whole.startswith("ok: epoch 0: 101 of 101") and "1 of 1 pads" in whole
    assert dropped.startswith("error: epoch 1: 93 of 101") and "8 missing, 0 repeated" in dropped
    assert "rank 1: 42 of 50 samples, 1 of 1 pads, 6 batches; 8 missing" in dropped
    assert cut.startswith("error: epoch 2") and SECOND_CUT.format(n=2)[:60] in cut
    assert alone.startswith("error: epoch 0: 202 of 202 planned samples consumed on 2 rank(s); "
                            "an unknown number missing")
    assert "rank 0 reads share 0 of 1, rank 1 reads share 0 of 1" in alone


def _map_style(rank: int, world_size: int) -> dict:
    data = Numbered(23)
    out = {}
    loader, sampler = create_distributed_loader(data, {"batch_size": 4, "num_workers": 0}, "cpu",
                                                log_fn=len)
    audit = EpochAudit(loader)
    sampler.set_epoch(3)
    consume(audit, loader)
    out["plain"] = audit.verify().consumed
    cached, sampler = create_rank_cached_dataloader(data, {"batch_size": 4, "num_workers": 0},
                                                    "cpu", log_fn=len, is_eval=True)
    audit = EpochAudit(cached)
    values, ids = [], []
    for batch in consume(audit, cached):
        keep = ~batch["__pad__"]
        values.append(batch["x"][keep] * 2)
        ids.append(batch["__index__"][keep])
    out["cached"] = audit.verify().consumed
    gathered, gathered_ids = gather_for_metrics(torch.cat(values), torch.cat(ids))
    out["gathered"] = gathered_ids.tolist()
    consume(audit, itertools.islice(cached, rank, None, world_size))  # a second cut
    out["cut"] = _verdict(audit)
    return out


@pytest.mark.timeout(120)
def test_map_style_loaders_on_real_ranks():
    ranks = run_distributed(_map_style, 2, timeout=100)
    assert ranks[0] == ranks[1]
    assert ranks[0]["plain"] == 24  # 23 and the sampler's one repeat, unflagged
    assert ranks[0]["cached"] == 23 and ranks[0]["gathered"] == list(range(23))
    assert ranks[0]["cut"].startswith("error:") and SECOND_CUT.format(n=2)[:60] in ranks[0]["cut"]
