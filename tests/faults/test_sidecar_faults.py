"""A hand-edited index sidecar: an entry that still matches its shard's size and version but
no longer holds a valid index of it (a count of 0, wrong types, an absurd count, a seek that
does not decode) is indexed again with a warning naming the sidecar and the entry, never used:
no sample dropped or invented, no TypeError/KeyError/AttributeError. The sidecar is rewritten
with the right entry, so the next open is silent."""

from __future__ import annotations

import json
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nnh_data import ShardedStreamingDataset, build_shard_index

pytestmark = pytest.mark.timeout(60)

EDITS = {
    "count 0, seek empty": {"num_samples": 0, "seek": ""},
    "count 10**12": {"num_samples": 10**12},
    "count as text": {"num_samples": "3"},
    "count negative": {"num_samples": -3},
    "count a bool": {"num_samples": True},
    "seek a number": {"seek": 5},
    "seek not base64": {"seek": "1@@@"},
    "seek of another width": {"seek": "3AAAA"},
    "seek none": {"seek": None},
    "seek missing": {"seek": ...},
    "count missing": {"num_samples": ...},
    "nullable a str": {"nullable": "id"},
    "error without lost": {"error": "x"},
    "gaps past the end": {"error": "x", "lost": 1, "lost_exact": True, "gaps": [[0, 10**9]]},
}


def _edit(sidecar, name: str, change: dict) -> None:
    saved = json.loads(sidecar.read_text())
    entry = saved["shards"][name]
    for key, value in change.items():
        if value is ...:
            del entry[key]
        else:
            entry[key] = value
    sidecar.write_text(json.dumps(saved))


@pytest.mark.parametrize("fmt", ["tar", "parquet", "arrow"])
@pytest.mark.parametrize("edit", EDITS)
def test_an_edited_entry_is_indexed_again_with_a_warning(fmt, edit, shards, tmp_path):
    urls = shards(fmt, [4, 5, 3])
    sidecar = tmp_path / "nnh-index.json"
    build_shard_index(urls)
    name = urls[1].rsplit("/", 1)[-1]
    _edit(sidecar, name, EDITS[edit])
    with pytest.warns(UserWarning, match=rf"{sidecar}'?: entry '{name}' is not a valid index"):
        index = build_shard_index(urls)
    assert [info.num_samples for info in index.shards] == [4, 5, 3]
    ds = ShardedStreamingDataset(index, shuffle=False)
    assert len(ds) == 12 and len(list(ds)) == 12
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rewritten sidecar is valid
        assert build_shard_index(urls) == index


@pytest.mark.parametrize("shards_value", [[], "x", None])
def test_a_sidecar_without_an_object_of_entries_is_ignored(shards_value, tar_shards, tmp_path):
    urls = tar_shards([2, 3])
    (tmp_path / "nnh-index.json").write_text(json.dumps({"version": 3, "shards": shards_value}))
    with pytest.warns(UserWarning, match="ignoring shard index"):
        assert build_shard_index(urls).total_samples == 5


def test_a_truly_empty_shard_is_checked_silently_and_the_sidecar_kept(tar_shards, tmp_path):
    urls = tar_shards([2, 0, 3])
    build_shard_index(urls)
    sidecar = tmp_path / "nnh-index.json"
    written = sidecar.stat().st_mtime_ns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [i.num_samples for i in build_shard_index(urls).shards] == [2, 0, 3]
    assert sidecar.stat().st_mtime_ns == written


def test_a_damaged_parquet_shard_skipped_at_indexing_opens_again_without_a_word(tmp_path):
    """Its entry (what was lost, no footer to size it) is read back as written."""
    good, damaged = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(pa.table({"id": [1, 2]}), good)
    damaged.write_bytes(b"not a parquet file" * 50)
    urls = [str(good), str(damaged)]
    with pytest.warns(UserWarning, match="samples lost"):
        first = build_shard_index(urls, on_error="skip")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        again = build_shard_index(urls, on_error="skip")
    assert [str(w.message) for w in seen if "not a valid index" in str(w.message)] == []
    assert again == first and again.total_samples == 2
