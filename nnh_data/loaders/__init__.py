"""Map-style datasets across ranks: the plain distributed loader (:mod:`.distributed`), the
rank-cached loader (:mod:`.rank_cached`) and exact evaluation over ranks (:mod:`.gather`). The
guard that stops a framework from splitting an already split dataset again is the flat
:mod:`nnh_data.resplit_guard`: the streaming dataset calls it too."""

from nnh_data.loaders.distributed import SharedEpochDataset, create_distributed_loader
from nnh_data.loaders.gather import gather_for_metrics
from nnh_data.loaders.rank_cached import (
    RankCache,
    RankCachedSampler,
    create_rank_cached_dataloader,
    rank_share,
)

__all__ = [
    "RankCache",
    "RankCachedSampler",
    "SharedEpochDataset",
    "create_distributed_loader",
    "create_rank_cached_dataloader",
    "gather_for_metrics",
    "rank_share",
]
