"""Map-style datasets across ranks: the plain distributed loader (:mod:`.distributed`), the
rank-cached loader (:mod:`.rank_cached`) and exact evaluation over ranks (:mod:`.gather`). The
guard that stops a framework from splitting an already split dataset again is the flat
:mod:`nnh_data.resplit_guard`: the streaming dataset calls it too."""

from nnh_data.loaders.distributed import (
    SharedEpochDataset,
    create_distributed_loader,
    default_num_workers,
)
from nnh_data.loaders.gather import gather_for_metrics
from nnh_data.loaders.rank_cached import (
    SPLITS,
    RankCache,
    RankCachedSampler,
    create_rank_cached_dataloader,
    nbytes,
    rank_share,
)

__all__ = [
    "SPLITS",
    "RankCache",
    "RankCachedSampler",
    "SharedEpochDataset",
    "create_distributed_loader",
    "create_rank_cached_dataloader",
    "default_num_workers",
    "gather_for_metrics",
    "nbytes",
    "rank_share",
]
