"""nnh_data: rank-aware sharded streaming datasets with deterministic augmentation parameters."""

from nnh_data.augment import (
    PARAM_NAMES,
    AugmentationConfig,
    gen_augmentation_params,
    gen_augmentation_params_batch,
    gen_distributed_augmentation_params,
    get_preset,
    list_presets,
    stream_distributed_augmentation_chain,
)
from nnh_data.ranges import DistributedRangeSplitter
from nnh_data.seeding import RankAwareSeedGenerator

__all__ = [
    "PARAM_NAMES",
    "AugmentationConfig",
    "DistributedRangeSplitter",
    "RankAwareSeedGenerator",
    "gen_augmentation_params",
    "gen_augmentation_params_batch",
    "gen_distributed_augmentation_params",
    "get_preset",
    "list_presets",
    "stream_distributed_augmentation_chain",
]
