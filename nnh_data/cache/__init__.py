"""The node-local cache of remote shards: one download per shard per node, evicted by the known
future order, and the pass that reads a worker's blocks through it.

Read in this order: ``policy`` (which shards to keep: pure functions of the readers' plans),
``files`` (the folder's layout, locks, records and counters), ``store`` (:class:`ShardCache`:
the folder's bookkeeping under the node lock), ``download`` (a shard's bytes from the remote),
``session`` (one reader's plan, pins and prefetch) and ``cached_pass`` (a pass's blocks read
through a session).
"""

from nnh_data.cache.store import CacheEntry, ShardCache

__all__ = ["CacheEntry", "ShardCache"]
