"""Map-style datasets across ranks: the distributed and rank-cached loaders
(:mod:`.distributed`), exact evaluation over ranks (:mod:`.gather`), and the guard that stops a
framework from splitting an already split dataset again (:mod:`.resplit_guard`)."""

from nnh_data.loaders.distributed import (
    RankCache,
    RankCachedSampler,
    SharedEpochDataset,
    create_distributed_loader,
    create_rank_cached_dataloader,
    rank_share,
)
from nnh_data.loaders.gather import gather_for_metrics

__all__ = [
    "RankCache",
    "RankCachedSampler",
    "SharedEpochDataset",
    "create_distributed_loader",
    "create_rank_cached_dataloader",
    "gather_for_metrics",
    "rank_share",
]
