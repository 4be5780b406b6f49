"""The node-local cache of remote shards: one download per shard per node, evicted by the known
future order, and the pass that reads a worker's blocks through it."""

from nnh_data.cache.store import CacheEntry, ShardCache

__all__ = ["CacheEntry", "ShardCache"]
