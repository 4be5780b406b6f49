"""Shards on any fsspec filesystem: finding them, indexing them, reading sample ranges, writing.

:mod:`.sources` expands URLs, globs and brace patterns; :mod:`.index` counts each shard's
samples once and keeps the counts in a sidecar; :mod:`.reading` reads a range of samples as
columns, through :mod:`.tar` or :mod:`.parquet`, retrying remote reads (:mod:`.retries`);
:mod:`.tar_salvage` finds what a damaged tar still holds; :mod:`.writer` writes tar shards.
"""

from nnh_data.errors import ShardError, StaleIndexError
from nnh_data.shards.index import ShardIndex, ShardInfo, build_shard_index
from nnh_data.shards.reading import (
    ShardReader,
    decode_shard_columns,
    decode_shard_range,
    decode_tar_each,
    fetch_shard_range,
    iter_shard_samples,
    split_shard_range,
)
from nnh_data.shards.sources import expand_sources
from nnh_data.shards.writer import write_shards

__all__ = [
    "ShardError",
    "ShardIndex",
    "ShardInfo",
    "ShardReader",
    "StaleIndexError",
    "build_shard_index",
    "decode_shard_columns",
    "decode_shard_range",
    "decode_tar_each",
    "expand_sources",
    "fetch_shard_range",
    "iter_shard_samples",
    "split_shard_range",
    "write_shards",
]
