"""Local tar blocks read into reused buffers (``ShardReader.fetch_block``) give exactly what
fresh bytes per block give: the same rows, values of type ``bytes``, the same warnings and
errors, with any read-ahead depth, damage, salvage and DataLoader workers; and the buffers per
reader stay bounded (issue 24)."""

from __future__ import annotations

import gc
import os
import tarfile
import warnings

import numpy as np
import pytest
import torch

from nnh_data import source_reader
from nnh_data.error_policy import ErrorPolicy
from nnh_data.mixing import SourceDraws
from nnh_data.shard_index import ShardError
from nnh_data.shards import ShardReader, build_shard_index
from nnh_data.source_reader import SourceReader
from nnh_data.stages import COLUMNS, SKIPPED, VALUE_COLUMNS
from tests.support import numbered_samples, write_tar

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
                unread = columns.get(SKIPPED, [False] * len(columns["__key__"]))
                for name in ("bin", "cls"):  # every value read is bytes
                    assert all(type(v) is bytes for v, u in zip(columns[name], unread) if not u)
                got.append((columns, {k: plain(v) for k, v in part.labels.items()}))
        except ShardError as exc:
            error = type(exc), str(exc)
        finally:
            gc.enable()
    held = max(len(reader._buffers) for reader in readers)
    return got, [str(w.message) for w in caught], error, errors.counts(), held


@pytest.mark.parametrize("how", ["none", "checksum", "gaps", "truncated", "rewritten"])
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
