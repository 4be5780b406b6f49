"""Local tar blocks read into reused buffers (``ShardReader.fetch_block``) give exactly what
fresh bytes per block give: the same rows, values of type ``bytes``, the same warnings and
errors, with any read-ahead depth, damage, salvage and DataLoader workers; and the buffers per
reader stay bounded (issue 24)."""

from __future__ import annotations

import copy
import gc
import io
import os
import pickle
import sys
import tarfile
import threading
import warnings
import weakref
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from nnh_data import ShardedStreamingDataset, Source, streaming_loader
from nnh_data.errors import ShardError
from nnh_data.order.mixing import SourceDraws
from nnh_data.packed import PackedField
from nnh_data.shards.reading import ShardReader, build_shard_index
from nnh_data.streaming import source_reader
from nnh_data.streaming.error_policy import ErrorPolicy
from nnh_data.streaming.source_reader import SourceReader
from nnh_data.streaming.stages import COLUMNS, SKIPPED, VALUE_COLUMNS
from tests.support import numbered_samples, sample_bytes, write_tar

pytestmark = pytest.mark.timeout(120)

COUNTS = [70, 45, 60]
SIZES = [900, 1500, 2500]  # bytes of "bin" per shard: blocks cut at different samples


def shards(tmp_path) -> list[str]:
    urls, first = [], 0
    for i, (count, size) in enumerate(zip(COUNTS, SIZES)):
        urls.append(str(tmp_path / f"s-{i:06d}.tar"))
        write_tar(urls[-1], numbered_samples(first, count, size), pax=False)
        first += count
    return urls


def member_offset(url: str, member: int) -> int:
    with tarfile.open(url) as tar:
        return tar.getmembers()[member].offset


def damage(url: str, how: str) -> None:
    """Damage a shard: a wrong header checksum in sample 20, cut in sample 30's data, or
    rewritten with other samples of the same size (its index then stale)."""
    if how == "checksum":
        at = member_offset(url, 2 * 20)
        with open(url, "r+b") as f:
            f.seek(at + 148)
            f.write(b"7777777\0")
    elif how == "truncated":
        os.truncate(url, member_offset(url, 2 * 30) + 700)
    elif how == "rewritten":
        size = os.path.getsize(url)
        write_tar(url, numbered_samples(0, COUNTS[1] + 1, SIZES[1] - 40), pax=False)
        assert os.path.getsize(url) == size


def plain(column) -> list:
    if isinstance(column, np.ndarray):
        return column.tolist()
    if hasattr(column, "to_pylist"):
        return column.to_pylist()
    return list(column)


def read_all(urls, index, on_error, rows, readahead, monkeypatch, fresh: bool):
    """Every part of a pass (draws and pads), the warnings and the error; with ``fresh``, each
    block read as new bytes (``fetch``) instead of into a reused buffer; and the most read
    buffers a reader held."""
    readers: list[ShardReader] = []

    class Recorded(ShardReader):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            readers.append(self)

        if fresh:
            fetch_block = ShardReader.fetch

    monkeypatch.setattr(source_reader, "ShardReader", Recorded)
    counts = tuple(info.num_samples for info in index.shards)
    errors = ErrorPolicy(on_error, urls, torch.zeros(len(urls), dtype=torch.int64))
    draws = SourceDraws(counts, seed=5, draws=sum(counts), window=16)
    source = SourceReader(index, draws, errors=errors, readahead=readahead)
    got, error = [], None
    gc.disable()  # a buffer is free once nothing holds it, not once a collection finds so
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for part in source.parts(0, [(0, sum(counts))], [3, 77], rows):
                columns = {name: plain(c) for name, c in part.rows.items()}
                unread = columns.get(SKIPPED, [False] * len(part.keys))
                for name in ("bin", "cls"):  # every value read is bytes
                    values = columns.get(name, [])
                    assert all(type(v) is bytes for v, u in zip(values, unread) if not u)
                got.append((columns, {k: plain(v) for k, v in part.labels.items()}))
        except ShardError as exc:
            error = type(exc), str(exc)
        finally:
            gc.enable()
    held = max(len(reader._buffers) for reader in readers)
    return got, [str(w.message) for w in caught], error, errors.counts(), held


def failing_reads(monkeypatch) -> None:
    """Local reads of blocks that start in every 7th 4 KiB fail (EIO), fresh or not."""
    for name in ("pread", "preadv"):
        read = getattr(os, name)

        def failing(fd, into, offset, read=read):
            if offset // 4096 % 7 == 3:
                raise OSError(5, "Input/output error")
            return read(fd, into, offset)

        monkeypatch.setattr(os, name, failing)


@pytest.mark.parametrize("how", ["none", "checksum", "gaps", "truncated", "rewritten", "eio"])
@pytest.mark.parametrize("readahead", [0, 1, 2, 4])
@pytest.mark.parametrize("skip", [False, True])
def test_reused_buffers_give_what_fresh_bytes_give(tmp_path, monkeypatch, how, readahead, skip):
    monkeypatch.setattr(source_reader, "_LOCAL_TAR_READ_BYTES", 16 << 10)  # ~10 samples
    urls = shards(tmp_path)
    if how == "gaps":  # damaged before indexing: the index cuts the sample out
        damage(urls[1], "checksum")
        with pytest.warns(UserWarning, match="1 sample lost"):
            index = build_shard_index(urls, on_error="skip")
    else:  # damaged after indexing
        index = build_shard_index(urls)
        damage(urls[1], how)
    if how == "eio":
        failing_reads(monkeypatch)
    on_error = "skip" if skip else "raise"
    rows = COLUMNS if readahead % 2 else VALUE_COLUMNS
    args = (urls, index, on_error, rows, readahead, monkeypatch)
    *reused, held = read_all(*args, fresh=False)
    *fresh, _ = read_all(*args, fresh=True)
    assert reused == fresh
    assert 1 <= held <= (1 if readahead == 0 else readahead + 2)
    got, _, error, _ = reused
    if how in ("none", "gaps") or (skip and how == "checksum"):
        assert error is None and len(got) > 2


SOURCE_SIZES = {"a": 3000, "b": 700}  # bytes of "bin" per source (both number from 0)
_KEPT: list[dict] = []  # the samples ``kept`` was given, in this worker


def small_blocks(worker: int) -> None:
    """DataLoader ``worker_init_fn``: ~10 samples per read block, in this worker too."""
    source_reader._LOCAL_TAR_READ_BYTES = 32 << 10
    _KEPT.clear()


def kept(sample: dict) -> tuple:
    """A ``decode`` that keeps every sample dict: a block read into the buffer of one before
    must leave them as they were. Says whether this sample and every tenth kept one hold
    their own bytes."""
    _KEPT.append(sample)
    own = all(_own(s) for s in [sample, *_KEPT[::10]])
    return sample["__source__"], sample["__index__"], sample["__pad__"], own


def _own(sample: dict) -> bool:
    g = int(sample["__key__"])
    size = SOURCE_SIZES[sample["__source__"]]
    values = sample["bin"], sample["cls"]
    return all(type(v) is bytes for v in values) and values == (sample_bytes(g, size), b"%d" % g)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("context", "readahead"), [("fork", 0), ("fork", 3), ("spawn", 1)])
def test_workers_over_epochs_hand_out_their_own_bytes(tar_shards, context, readahead):
    """Two mixed sources (a reader each) in two persistent workers over two epochs: every
    sample holds its own bytes, also those a ``decode`` kept, and each epoch holds what it
    holds read in one process."""
    sources = [Source(tar_shards([150, 110], name=name, size=size), choose=200, name=name)
               for name, size in SOURCE_SIZES.items()]  # fmt: skip
    ds = ShardedStreamingDataset(sources, seed=3, shuffle_window=40,
                                 readahead=readahead, decode=kept)  # fmt: skip
    loader = DataLoader(ds, batch_size=8, collate_fn=list, num_workers=2, persistent_workers=True,
                        multiprocessing_context=context, worker_init_fn=small_blocks)  # fmt: skip
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        handed = [item for batch in loader for item in batch]
        assert all(own for *_, own in handed)
        drawn = Counter(item[:3] for item in handed)
        assert drawn == Counter(item[:3] for item in at_once(ds, epoch))
        assert Counter(name for name, _, pad in drawn.elements() if not pad) == {"a": 200, "b": 200}


def at_once(ds: ShardedStreamingDataset, epoch: int) -> list:
    """The samples of epoch ``epoch`` read in this process, without read-ahead."""
    ds = ShardedStreamingDataset(ds.sources, seed=ds.seed, shuffle_window=ds.window, decode=kept)
    ds.set_epoch(epoch)
    return list(ds)


def handed_ids(batch) -> list[tuple]:
    """The (source, id) of each sample of a batch (of samples, or a dataset's own batch) that
    holds its own bytes; one that does not fails the test."""
    if isinstance(batch, dict):
        batch = [dict(zip(batch, row)) for row in zip(*batch.values())]
    for sample in batch:
        assert _own(sample), sample["__key__"]
    return [(s["__source__"], int(s["__index__"])) for s in batch if not s["__pad__"]]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("batch_size", [None, 8])
def test_a_stateful_loader_resumed_mid_epoch_reads_the_rest_with_their_own_bytes(
    tar_shards, batch_size
):
    """Samples, or the dataset's own batches, read with read-ahead in two workers: resumed
    after 13 batches, the rest holds its own bytes and completes the epoch."""
    sources = [Source(tar_shards([150, 110], name=name, size=size), choose=200, name=name)
               for name, size in SOURCE_SIZES.items()]  # fmt: skip

    def loader() -> StatefulDataLoader:
        ds = ShardedStreamingDataset(sources, seed=5, shuffle_window=40, readahead=2,
                                     batch_size=batch_size)  # fmt: skip
        return StatefulDataLoader(ds, batch_size=None if batch_size else 8, num_workers=2,
                                  collate_fn=handed_ids, worker_init_fn=small_blocks)  # fmt: skip

    first = loader()
    batches = iter(first)
    handed = [item for _ in range(13) for item in next(batches)]
    state = first.state_dict()
    del batches, first
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [item for batch in resumed for item in batch]
    whole = handed_ids(list(ShardedStreamingDataset(sources, seed=5, shuffle_window=40)))
    assert len(handed) == 13 * 8 and Counter(handed + rest) == Counter(whole)


def recorded_readers(monkeypatch) -> list[ShardReader]:
    """The readers that passes make from now on (to look at their read buffers)."""
    readers: list[ShardReader] = []

    class Recorded(ShardReader):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            readers.append(self)

    monkeypatch.setattr(source_reader, "ShardReader", Recorded)
    return readers


def test_batches_kept_for_a_whole_pass_keep_their_own_bytes(tar_shards, monkeypatch):
    """A dataset's own batches, and the streaming loader's at 0 workers, hold tar values as
    Arrow views of the read buffers (no copy per value): a buffer a kept batch views is not
    read into again, and past 16 such buffers a block is read into memory of its own. Batches
    kept for a whole pass of ~30 blocks each hold their own bytes (a block of fewer than 32
    members is parsed member by member, into bytes: source "a" here)."""
    readers = recorded_readers(monkeypatch)
    monkeypatch.setattr(source_reader, "_LOCAL_TAR_READ_BYTES", 64 << 10)
    sources = [Source(tar_shards(counts, name=name, size=SOURCE_SIZES[name], pax=False), name=name)
               for name, counts in [("a", [150, 110]), ("b", [400, 400])]]  # fmt: skip

    def dataset(**kwargs) -> ShardedStreamingDataset:
        return ShardedStreamingDataset(sources, seed=5, shuffle_window=40, **kwargs)

    own = list(dataset(batch_size=8))
    collated = list(streaming_loader(dataset(), 8))
    whole = Counter(handed_ids(list(dataset())))
    for batches in (own, collated):
        assert Counter(i for batch in batches for i in handed_ids(batch)) == whole
    assert max(len(reader._buffers) for reader in readers) == 16  # the kept batches hold them


KEPT = {  # a part of each batch a loop keeps: its labels; its first payload, sliced
    "cls": lambda batch: batch["cls"],
    "bin": lambda batch: batch["bin"][:1],
}


@pytest.mark.parametrize("name", list(KEPT))
def test_values_kept_over_a_pass_hold_no_read_buffer(tar_shards, monkeypatch, name):
    """Values of up to 12 bytes (labels: "cls") are held in their Arrow views themselves, and a
    slice of a field copies its own values: either, kept from every batch of a pass, holds no
    read block (else keeping a few bytes of each batch held every block of the pass in memory),
    and the reader reads every block into the few buffers it reuses."""
    readers = recorded_readers(monkeypatch)
    monkeypatch.setattr(source_reader, "_LOCAL_TAR_READ_BYTES", 64 << 10)
    urls = tar_shards([400, 400], size=1000, pax=False)  # 25 samples per block
    ds = ShardedStreamingDataset(urls, seed=5, shuffle_window=40, batch_size=8)
    gc.disable()  # a buffer is free once nothing holds it, not once a collection finds so
    try:
        kept = [KEPT[name](batch) for batch in ds]
        (reader,) = readers
        buffers = reader._buffers
        assert len(buffers) < 16
        assert all(sys.getrefcount(buffers[i]) <= 2 for i in range(len(buffers)))  # all free
    finally:
        gc.enable()
    samples = list(ShardedStreamingDataset(urls, seed=5, shuffle_window=40))
    expected = [s[name] for s in (samples if name == "cls" else samples[::8])]
    assert [v for field in kept for v in field.tolist()] == expected


def _pickled(field: PackedField) -> PackedField:
    return pickle.loads(pickle.dumps(field))


def _saved(field: PackedField) -> PackedField:
    file = io.BytesIO()
    torch.save({"field": field}, file)
    file.seek(0)
    return torch.load(file, weights_only=False)["field"]


# the ways to read a kept batch's field, each giving its values as a list
READS = {
    "index": lambda f: [f[i] for i in range(len(f))],
    "negative index": lambda f: [f[i - len(f)] for i in range(len(f))],
    "slices": lambda f: f[:3].tolist() + list(f[3:]),
    "iteration": list,
    "tolist": PackedField.tolist,
    "data": lambda f: [f.data[a:b].numpy().tobytes() for a, b in zip(f.offsets, f.offsets[1:])],
    "pickle": lambda f: _pickled(f).tolist(),
    "torch.save": lambda f: _saved(f).tolist(),
    "copy": lambda f: copy.copy(f).tolist(),
    "deepcopy": lambda f: copy.deepcopy(f).tolist(),
}


@pytest.mark.parametrize("readahead", [0, 3])
@pytest.mark.parametrize("collated", [False, True])
def test_kept_batches_read_late_in_every_way_give_their_own_values(
    tar_shards, monkeypatch, readahead, collated
):
    """A dataset's own batches (or the streaming loader's, at 0 workers) kept for a pass of
    22 blocks (more than the 16 buffers a reader keeps), each read only after the pass, in
    one of the ways a ``PackedField`` is read: every value is its sample's."""
    readers = recorded_readers(monkeypatch)
    monkeypatch.setattr(source_reader, "_LOCAL_TAR_READ_BYTES", 64 << 10)  # 25 samples
    urls = tar_shards([300, 250], size=1000, pax=False)
    ds = ShardedStreamingDataset(urls, seed=2, shuffle_window=60, readahead=readahead,
                                 batch_size=None if collated else 8)  # fmt: skip
    batches = list(streaming_loader(ds, 8) if collated else ds)
    wrong = []
    for j, batch in enumerate(batches):
        how = list(READS)[j % len(READS)]
        ids = [int(key) for key in batch["__key__"]]
        got = READS[how](batch["bin"]), READS[how](batch["cls"])
        if got != ([sample_bytes(g, 1000) for g in ids], [b"%d" % g for g in ids]):
            wrong.append((j, how))
    assert len(batches) == 550 // 8 + 1 and wrong == []
    assert max(len(reader._buffers) for reader in readers) == 16  # the kept batches hold them


def all_free(reader: ShardReader) -> bool:
    """Whether nothing but ``reader`` holds its read buffers."""
    buffers = reader._buffers
    return all(sys.getrefcount(buffers[i]) <= 2 for i in range(len(buffers)))


def first_batches(ds: ShardedStreamingDataset, epoch: int, count: int) -> list:
    """The first ``count`` items of epoch ``epoch`` (a pass left unfinished when there are
    more), read in a frame of their own (see the test below)."""
    ds.set_epoch(epoch)
    return [batch for _, batch in zip(range(count), ds)]


@pytest.mark.parametrize("readahead", [0, 2])
def test_passes_let_go_of_their_read_buffers(tar_shards, monkeypatch, readahead):
    """Each pass reads into its own reader's buffers: once its batches are dropped, a pass
    that ended, or one left half read, holds none of them, and its reader is let go of (no
    memory kept across epochs)."""
    readers = recorded_readers(monkeypatch)
    monkeypatch.setattr(source_reader, "_LOCAL_TAR_READ_BYTES", 64 << 10)
    urls = tar_shards([300, 250], size=1000, pax=False)
    ds = ShardedStreamingDataset(urls, seed=2, shuffle_window=60, readahead=readahead,
                                 batch_size=8)  # fmt: skip
    kept = []
    for epoch, count in enumerate([99, 99, 40]):
        kept.append(first_batches(ds, epoch, count))
    assert list(map(len, kept)) == [69, 69, 40]
    passes = [reader for reader in readers if reader._buffers]  # not a salvage's reader
    assert len(passes) == 3 and not any(map(all_free, passes))  # the kept batches view them
    del kept
    for thread in threading.enumerate():  # a pass left half read stops its read-ahead
        if thread.name == "nnh-read-ahead":
            thread.join(timeout=10)
    gc.collect()
    assert all(map(all_free, passes))
    left = list(map(weakref.ref, passes))
    del passes
    readers.clear()
    gc.collect()
    assert all(reader() is None for reader in left)


def test_batches_the_caller_drops_hold_no_read_buffer(tar_shards, monkeypatch):
    """A caller iterating the dataset itself, epoch after epoch, that drops the batches of a
    pass lets go of them, and so of the read buffers they view."""
    readers = recorded_readers(monkeypatch)
    monkeypatch.setattr(source_reader, "_LOCAL_TAR_READ_BYTES", 64 << 10)
    urls = tar_shards([300], size=1000, pax=False)
    ds = ShardedStreamingDataset(urls, seed=2, shuffle_window=60, batch_size=8)
    first = list(ds)
    ds.set_epoch(1)
    second = list(ds)
    assert len(first) == len(second) == 38
    del first, second
    gc.collect()
    assert len(readers) == 2 and all(map(all_free, readers))


def test_the_streaming_loader_collates_a_source_read_again_in_order(tar_shards):
    """An unshuffled source drawn three times (its cycles one part each, of the same keys and
    values): the streaming loader's batches, at 0 workers, hold each draw's own values."""
    urls = tar_shards([40], size=1000, pax=False)
    ds = ShardedStreamingDataset(Source(urls, choose=120), shuffle=False)
    batches = list(streaming_loader(ds, 16))
    ids = [[int(key) for key in batch["__key__"]] for batch in batches]
    assert sum(ids, []) == [*range(40)] * 3
    for batch, held in zip(batches, ids):
        assert batch["bin"].tolist() == [sample_bytes(g, 1000) for g in held]
