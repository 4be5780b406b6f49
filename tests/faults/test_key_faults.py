"""Shards that share keys: the same ``__key__`` in two shards is warned once (naming a key and
both shards) and counted in ``ds.stats()['duplicate_keys']``, per sample and per batch, with and
without DataLoader workers; shards of distinct keys count none."""

from __future__ import annotations

import shutil
import warnings
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nnh_data import ShardedStreamingDataset, streaming_loader
from tests.support import numbered_samples, write_tar

pytestmark = pytest.mark.timeout(120)


def _shards(tmp_path, kind: str) -> list[str]:
    """Three tar shards of 20 samples: the third a copy of the first (``copy``), or holding
    keys 30-49 of which 30-39 are the second shard's too (``overlap``)."""
    firsts = {"copy": (0, 20, 0), "overlap": (0, 20, 30)}[kind]
    paths = [tmp_path / f"s-{i}.tar" for i in range(3)]
    for path, first in zip(paths[:2], firsts):
        write_tar(path, numbered_samples(first, 20, 64), pax=False)
    if kind == "copy":
        shutil.copy(paths[0], paths[2])
    else:
        write_tar(paths[2], numbered_samples(firsts[2], 20, 64), pax=False)
    return [str(p) for p in paths]


@pytest.mark.parametrize("mode", ["samples", "batches", "worker"])
@pytest.mark.parametrize("kind", ["copy", "overlap"])
def test_a_key_in_two_shards_is_warned_once_and_counted(kind, mode, tmp_path, deliver):
    """``worker``: batches from one DataLoader worker, which reads every shard."""
    urls = _shards(tmp_path, kind)
    ds = ShardedStreamingDataset(urls, shuffle_window=16, seed=3)
    shared = 20 if kind == "copy" else 10
    for epoch in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if mode == "samples":
                ds.set_epoch(epoch)
                keys = Counter(s["__key__"] for s in ds)
            else:
                (keys,) = deliver(ds, (epoch,), workers=int(mode == "worker"))
        assert keys.total() == 60 and len(keys) == 60 - shared
        told = [str(w.message) for w in caught if "is in two shards" in str(w.message)]
        if mode != "worker":  # a worker's warning goes to its stderr
            assert len(told) == (1 if epoch == 0 else 0)
        if told:
            assert urls[2] in told[0] and (urls[0] if kind == "copy" else urls[1]) in told[0]
        assert ds.stats()["duplicate_keys"] == shared


def test_parquet_files_of_one_stem_in_two_folders_share_their_keys(tmp_path):
    """Without a ``__key__`` column a row's key is its file's stem and row number."""
    urls = []
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        urls.append(str(tmp_path / folder / "part-0.parquet"))
        pq.write_table(pa.table({"x": list(range(12))}), urls[-1], row_group_size=5)
    ds = ShardedStreamingDataset(urls, shuffle=False)
    with pytest.warns(UserWarning, match="key 'part-0/0' is in two shards"):
        assert len(list(streaming_loader(ds, 4))) == 6
    assert ds.stats()["duplicate_keys"] == 12


def test_shards_of_distinct_keys_count_none_and_warn_nothing(tmp_path, deliver):
    urls = []
    for i in range(4):
        urls.append(str(tmp_path / f"s-{i}.tar"))
        write_tar(tmp_path / f"s-{i}.tar", numbered_samples(i * 10, 10, 32), pax=False)
    ds = ShardedStreamingDataset(urls, shuffle_window=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (keys,) = deliver(ds, workers=2)
    assert keys.total() == len(keys) == 40
    assert ds.stats()["duplicate_keys"] == 0

