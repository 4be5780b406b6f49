"""Shards on any fsspec filesystem: finding them, indexing them, reading sample ranges, writing.

:mod:`.sources` expands URLs, globs and brace patterns; :mod:`.index` counts each shard's
samples once and keeps the counts in a sidecar; :mod:`.reading` reads a range of samples as
columns, through :mod:`.tar` or :mod:`.parquet`, retrying remote reads (:mod:`.retries`);
:mod:`.tar_salvage` finds what a damaged tar still holds; :mod:`.writer` writes tar shards.
"""

from nnh_data.errors import ShardError, StaleIndexError
from nnh_data.shards.index import ShardIndex, ShardInfo, build_shard_index
from nnh_data.shards.reading import iter_shard_samples
from nnh_data.shards.sources import expand_sources
from nnh_data.shards.writer import write_shards

__all__ = [
    "ShardError",
    "ShardIndex",
    "ShardInfo",
    "StaleIndexError",
    "build_shard_index",
    "expand_sources",
    "iter_shard_samples",
    "write_shards",
]
