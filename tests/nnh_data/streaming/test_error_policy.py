"""ErrorPolicy: raise or skip an unreadable sample, warn once per shard, count what was lost
where every process sees it, and salvage what a failed block still holds."""

from __future__ import annotations

import tarfile
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nnh_data.columns import as_list
from nnh_data.errors import ShardError, StaleIndexError
from nnh_data.shards.reading import build_shard_index, fetch_shard_range
from nnh_data.streaming.error_policy import ErrorPolicy
from nnh_data.streaming.stages import COLUMNS, LEFT_OUT, SKIPPED, VALUE_COLUMNS
from tests.support import run_forked

URLS = ["s3://b/a.tar", "s3://b/b.tar"]


def policy(on_error: str, lost=None) -> ErrorPolicy:
    return ErrorPolicy(on_error, URLS, torch.zeros(2, dtype=torch.int64).share_memory_(), lost)


def test_raise_raises_and_skip_warns_once_per_shard():
    error = ShardError(URLS[0], "sample 3, byte 1536", "bad tar header checksum")
    with pytest.raises(ShardError) as caught:
        policy("raise").skip(error)
    assert caught.value is error
    skipping = policy("skip")
    with pytest.warns(UserWarning) as warned:
        skipping.skip(error)
        skipping.skip(ShardError(URLS[0], "sample 4", "again"))
        skipping.skip(ShardError(URLS[1], "sample 0", "other"))
    assert [str(w.message) for w in warned] == [
        f"skipping unreadable samples: {error}",
        f"skipping unreadable samples: {URLS[1]}: other (at sample 0)",
    ]
    with pytest.raises(ValueError, match="on_error must be one of 'raise', 'skip'"):
        policy("ignore")


def test_a_stale_index_is_never_skipped():
    with pytest.raises(StaleIndexError):
        policy("skip").skip(StaleIndexError(URLS[0], "footer", "rewritten"))


def _count(errors: ErrorPolicy, shard: int) -> None:
    errors.count(shard, 2)


def test_counts_are_shared_with_other_processes_and_hold_the_index_losses():
    errors = policy("skip", lost=[None, 0])
    assert errors.counts() == {URLS[1]: 0}  # damaged at indexing, loss unknown: listed
    run_forked(_count, [(errors, 0), (errors, 0)])
    errors.count(1)
    assert errors.counts() == {URLS[0]: 4, URLS[1]: 1}
    assert policy("skip", lost=[3, None]).counts() == {URLS[0]: 3}


def test_readable_drops_flagged_rows_and_counts_them():
    errors = policy("skip")
    batch = {"x": np.arange(4), "__shard__": [URLS[0], URLS[1], URLS[1], URLS[0]],
             SKIPPED: [False, True, True, False]}  # fmt: skip
    kept = errors.readable(batch)
    assert kept["x"].tolist() == [0, 3] and SKIPPED not in kept
    assert errors.counts() == {URLS[1]: 2}
    all_bad = {"x": [1], "__shard__": [URLS[0]], SKIPPED: [True]}
    assert errors.readable(all_bad) is LEFT_OUT
    plain = {"x": [1], "__shard__": [URLS[0]]}
    assert errors.readable(plain) is plain


def test_decode_errors_name_the_shard_and_key():
    def decode(sample):
        raise OSError("truncated JPEG")

    sample = {"__shard__": URLS[0], "__key__": "000007"}
    with pytest.raises(ShardError) as caught:
        policy("raise").decoded(decode, sample)
    assert str(caught.value) == (
        f"{URLS[0]}: decode raised OSError('truncated JPEG') (at sample '000007')"
    )
    errors = policy("skip")
    with pytest.warns(UserWarning, match="truncated JPEG"):
        assert errors.decoded(decode, sample) is LEFT_OUT
    batch = {"__shard__": [URLS[1], URLS[1]], "__key__": ["a", "b"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert errors.decoded(decode, batch) is LEFT_OUT
    assert errors.counts() == {URLS[0]: 1, URLS[1]: 2}
    assert errors.decoded(lambda s: "ok", sample) == "ok"


def test_a_tar_block_keeps_every_sample_but_the_damaged_one(tar_shards):
    (url,) = tar_shards([6], pax=False)
    info = build_shard_index(url).shards[0]
    with tarfile.open(url) as tar:
        at = tar.getmembers()[2 * 2].offset  # sample 2
    with open(url, "r+b") as f:
        f.seek(at + 148)
        f.write(b"7777777\0")
    payload = fetch_shard_range(info, 0, 6)
    error = ShardError(url, "sample 2", "bad tar header checksum")
    errors = ErrorPolicy("skip", [url], torch.zeros(1, dtype=torch.int64))
    with pytest.warns(UserWarning, match=f"sample 2, byte {at}"):
        rows = errors.salvaged(info, payload, 0, 6, error, VALUE_COLUMNS)
    assert _readable(rows, "__key__") == ["00000000", "00000001", None, "00000003", "00000004",
                                          "00000005"]  # fmt: skip
    with pytest.raises(ShardError):
        ErrorPolicy("raise", [url], torch.zeros(1)).salvaged(
            info, payload, 0, 6, error, VALUE_COLUMNS
        )


def _readable(columns: dict, name: str) -> list:
    """Column ``name`` of salvaged rows, None where a row is flagged unreadable."""
    flags = columns.get(SKIPPED, [False] * len(columns[name]))
    return [None if skipped else v for v, skipped in zip(as_list(columns[name]), flags)]


@pytest.fixture
def parquet_info(tmp_path):
    """ids 0-29 in row groups of 10; reading row group 1 fails."""
    path = str(tmp_path / "p.parquet")
    pq.write_table(pa.table({"id": list(range(30)), "t": ["x"] * 30}), path, row_group_size=10)
    return build_shard_index(path).shards[0]


def _fetch_but_group_one(info, start, stop):
    if start < 20 and stop > 10:
        raise ShardError(info.url, f"row group 1 (sample {start})", "unreadable Parquet file")
    return fetch_shard_range(info, start, stop)


def test_a_parquet_block_is_read_again_one_row_group_at_a_time(parquet_info):
    info = parquet_info
    error = ShardError(info.url, "row group 0 (sample 5)", "unreadable Parquet file")
    errors = ErrorPolicy("skip", [info.url], torch.zeros(1, dtype=torch.int64))
    with pytest.warns(UserWarning, match=r"row group 1 \(sample 10\)"):
        rows = errors.salvaged(info, error, 5, 25, error, VALUE_COLUMNS, _fetch_but_group_one)
    assert _readable(rows, "id") == [*range(5, 10), *[None] * 10, *range(20, 25)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        columns = errors.salvaged(info, error, 5, 25, error, COLUMNS, _fetch_but_group_one)
    assert isinstance(columns["id"], np.ndarray)  # the column keeps its type
    assert columns[SKIPPED] == [False] * 5 + [True] * 10 + [False] * 5
    kept = errors.readable({**columns, "__shard__": [info.url] * 20})
    assert kept["id"].tolist() == [*range(5, 10), *range(20, 25)]
    assert errors.counts() == {info.url: 10}
    nothing = errors.salvaged(info, error, 10, 20, error, VALUE_COLUMNS, _fetch_but_group_one)
    assert nothing == {SKIPPED: [True] * 10}
