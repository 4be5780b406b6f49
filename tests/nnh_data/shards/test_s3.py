"""Shards on S3 through s3fs, against a real S3 API (moto's server on loopback)."""

from __future__ import annotations

import io
import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nnh_data.errors import ShardError
from nnh_data.shards.reading import build_shard_index, fetch_shard_range, iter_shard_samples
from nnh_data.shards.writer import write_shards

pytestmark = pytest.mark.timeout(120)


def samples(n: int) -> list[dict]:
    return [{"__key__": f"{i:04d}", "bin": bytes([i]) * 700, "cls": str(i)} for i in range(n)]


def test_write_index_and_read_tar_shards_on_s3(moto_s3):
    bucket = moto_s3.bucket("tars")
    options = moto_s3.storage_options
    written = write_shards(
        samples(9), f"{bucket}/train/s-%03d.tar", max_count=4, storage_options=options
    )
    index = build_shard_index(f"{bucket}/train/s-*.tar", storage_options=options)
    assert [info.url for info in index.shards] == [info.url for info in written.shards]
    assert index.shards == written.shards and index.path == f"{bucket}/train/nnh-index.json"
    read = [s for info in index.shards for s in iter_shard_samples(info, storage_options=options)]
    assert [s["__key__"] for s in read] == [f"{i:04d}" for i in range(9)]
    assert read[5]["bin"] == bytes([5]) * 700 and read[5]["cls"] == b"5"
    info = index.shards[1]
    assert len(fetch_shard_range(info, 1, 3, storage_options=options)) == (
        info.offsets[3] - info.offsets[1]
    )


def test_parquet_and_sidecar_on_s3(moto_s3):
    bucket = moto_s3.bucket("tables")
    options = moto_s3.storage_options
    fs = fsspec.filesystem("s3", **options)
    for part in range(2):
        buffer = io.BytesIO()
        pq.write_table(pa.table({"id": list(range(part * 5, part * 5 + 5))}), buffer)
        fs.pipe(f"{bucket}/p-{part}.parquet", buffer.getvalue())
    source = f"{bucket}/p-{{0..1}}.parquet"
    index = build_shard_index(source, storage_options=options)
    rows = [
        s["id"] for info in index.shards for s in iter_shard_samples(info, storage_options=options)
    ]
    assert rows == list(range(10))
    saved = json.loads(fs.cat_file(f"{bucket}/nnh-index.json"))
    assert set(saved["shards"]) == {"p-0.parquet", "p-1.parquet"}
    assert build_shard_index(source, storage_options=options) == index


def test_unreadable_shard_on_s3_names_its_url(moto_s3):
    bucket = moto_s3.bucket("broken")
    options = moto_s3.storage_options
    fsspec.filesystem("s3", **options).pipe(f"{bucket}/bad.tar", b"not a tar" * 100)
    with pytest.raises(ShardError) as caught:
        build_shard_index(f"{bucket}/bad.tar", storage_options=options)
    assert caught.value.url == f"{bucket}/bad.tar"


@pytest.mark.parametrize("pattern", ["train/s-*.tar", "train"])  # a glob, a folder
def test_the_index_lists_the_bucket_once(pattern, moto_s3, s3_proxy):
    """The glob's (or the folder's) listing gives the sizes and versions too: one listing
    request, not a second one for the stats (10,000 objects take seconds to list)."""
    bucket = moto_s3.bucket("listed")
    write_shards(samples(9), f"{bucket}/train/s-%03d.tar", max_count=2,
                 storage_options=moto_s3.storage_options)  # fmt: skip
    bucket_path = "/" + bucket[len("s3://") :]
    s3_proxy.reset()
    index = build_shard_index(f"{bucket}/{pattern}", storage_options=s3_proxy.storage_options)
    assert index.total_samples == 9 and len(index.shards) == 5
    assert s3_proxy.gets[bucket_path] == 1  # list requests go to the bucket's path
