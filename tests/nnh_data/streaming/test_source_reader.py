"""SourceReader: a source's draws read as parts, in draw order, each row the sample its label
names; ids offset and repeats keyed apart when mixing; unreadable samples as empty rows."""

from __future__ import annotations

import os
import re
import tarfile
from collections import Counter

import numpy as np
import pytest
import torch

from nnh_data.columns import as_list
from nnh_data.errors import ShardError
from nnh_data.order.mixing import SourceDraws
from nnh_data.shards.reading import build_shard_index
from nnh_data.streaming import source_reader
from nnh_data.streaming.error_policy import ErrorPolicy
from nnh_data.streaming.source_reader import SourceReader
from nnh_data.streaming.stages import COLUMNS, SKIPPED, VALUE_COLUMNS
from tests.support import sample_bytes

COUNTS = [5, 0, 7]


def reader(urls, *, draws=12, on_error="raise", **kwargs) -> SourceReader:
    index = build_shard_index(urls)
    counts = tuple(info.num_samples for info in index.shards)
    errors = ErrorPolicy(on_error, urls, torch.zeros(len(urls), dtype=torch.int64))
    return SourceReader(index, SourceDraws(counts, seed=4, draws=draws, window=4), errors=errors,
                        **kwargs)  # fmt: skip


def rows_and_labels(parts) -> tuple[list, list]:
    parts = list(parts)
    got = [g for p in parts for g in zip(p.rows["__key__"], p.rows["bin"], strict=True)]
    labels = [(int(i), bool(pad), int(k)) for p in parts
              for i, pad, k in zip(p.labels["__index__"], p.labels["__pad__"], p.keys)]  # fmt: skip
    return got, labels


@pytest.mark.parametrize("rows", [VALUE_COLUMNS, COLUMNS])
def test_parts_hold_the_draws_in_order_then_the_pads(tar_shards, rows):
    source = reader(tar_shards(COUNTS))
    got, labels = rows_and_labels(source.parts(1, [(2, 9)], [0, 11], rows))
    ids, _ = source.draws.sample_ids(1, 2, 9)
    pads = [int(source.draws.sample_ids(1, j, j + 1)[0][0]) for j in (0, 11)]
    assert [i for i, _, _ in labels] == [*ids.tolist(), *pads]
    assert [pad for _, pad, _ in labels] == [False] * 7 + [True, True]
    assert [k for _, _, k in labels] == [i for i, _, _ in labels]  # parameters keyed by id
    assert got == [(f"{i:08d}", sample_bytes(i, 16)) for i, _, _ in labels]  # the named sample


def test_mixing_offsets_the_keys_and_keys_repeats_apart(tar_shards):
    source = reader(tar_shards(COUNTS), draws=30, key_offset=100, key_stride=1000,
                    labels={"__source__": "b"}, repeats=True)  # fmt: skip
    parts = list(source.parts(0, [(0, 30)], [], VALUE_COLUMNS))
    ids = np.concatenate([p.labels["__index__"] for p in parts])
    repeat = np.concatenate([p.labels["__repeat__"] for p in parts])
    keys = np.concatenate([p.keys for p in parts])
    seen: Counter = Counter()
    for i, again, key in zip(ids.tolist(), repeat.tolist(), keys.tolist()):
        assert again == (seen[i] > 0)
        assert key == 100 + i + 1000 * seen[i]  # each repeat gets its own parameters
        seen[i] += 1
    assert sorted(seen.values()) == [2] * 6 + [3] * 6  # 30 draws of 12 samples
    assert all(label == "b" for p in parts for label in p.labels["__source__"])


def test_shard_of_and_field_names(tar_shards):
    source = reader(tar_shards(COUNTS), first_shard=3)
    assert [source.shard_of(i) for i in (0, 4, 5, 11)] == [3, 3, 5, 5]
    assert source.field_names() == ["__key__", "bin", "cls"]


def test_an_unreadable_sample_is_an_empty_row_under_skip(tar_shards):
    urls = tar_shards(COUNTS, pax=False)
    source = reader(urls, on_error="skip")
    with tarfile.open(urls[2]) as tar:
        at = tar.getmembers()[2 * 3].offset  # id 8: sample 3 of the third shard
    with open(urls[2], "r+b") as f:
        f.seek(at + 148)
        f.write(b"7777777\0")
    with pytest.warns(UserWarning, match=f"sample 3, byte {at}"):
        parts = list(source.parts(0, [(0, 12)], [], VALUE_COLUMNS))
    skipped = {
        int(i): bool(flag)
        for p in parts
        for i, flag in zip(p.labels["__index__"], p.rows.get(SKIPPED, [False] * 12))
    }
    assert sorted(skipped) == list(range(12))
    assert [i for i, flag in skipped.items() if flag] == [8]
    with pytest.raises(ShardError, match="bad tar header checksum"):
        list(reader(urls).parts(0, [(0, 12)], [], VALUE_COLUMNS))


def test_a_local_shard_gone_since_indexing_is_named_with_its_position(tar_shards):
    """Local tar shards are opened in place; one that cannot be opened fails as a read
    through its filesystem does: a ShardError naming the shard and the sample."""
    urls = tar_shards(COUNTS)
    source = reader(urls)
    os.remove(urls[2])
    gone = rf"{re.escape(urls[2])}: unreadable \(.*No such file.*\(at sample \d+"
    with pytest.raises(ShardError, match=gone):
        list(source.parts(0, [(0, 12)], [], VALUE_COLUMNS))


@pytest.mark.parametrize("readahead", [0, 3])
@pytest.mark.parametrize("rows", [VALUE_COLUMNS, COLUMNS])
def test_blocks_in_reused_buffers_keep_every_sample(tar_shards, monkeypatch, readahead, rows):
    """Local tar blocks are read into buffers reused once let go of: with many blocks per
    shard, blocks queued by a read-ahead thread and a damaged block salvaged piece by piece,
    every row is still the sample its label names."""
    monkeypatch.setattr(source_reader, "_LOCAL_TAR_READ_BYTES", 64 << 10)  # ~25 samples
    urls = tar_shards([130, 90], pax=False, size=1000)
    source = reader(urls, draws=220, on_error="skip", readahead=readahead)
    with tarfile.open(urls[1]) as tar:
        at = tar.getmembers()[2 * 20].offset  # sample 20 of the second shard: id 150
    with open(urls[1], "r+b") as f:
        f.seek(at + 148)
        f.write(b"7777777\0")
    with pytest.warns(UserWarning, match="sample 20"):
        parts = list(source.parts(0, [(0, 220)], [], rows))
    seen = []
    for part in parts:
        skipped = part.rows.get(SKIPPED, [False] * len(part.keys))
        values = as_list(part.rows["bin"])  # batch rows: Arrow views of the read buffers
        for i, g in enumerate(part.labels["__index__"].tolist()):
            seen.append(g)
            if skipped[i]:
                assert g == 150
                continue
            assert part.rows["__key__"][i] == f"{g:08d}"
            assert values[i] == sample_bytes(g, 1000)
    assert sorted(seen) == list(range(220))
