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
from nnh_data.transforms import PADDING_MODES, AugmentModule, AugmentParams, apply_augmentation

__all__ = [
    "PADDING_MODES",
    "PARAM_NAMES",
    "AugmentModule",
    "AugmentParams",
    "AugmentationConfig",
    "DistributedRangeSplitter",
    "RankAwareSeedGenerator",
    "apply_augmentation",
    "gen_augmentation_params",
    "gen_augmentation_params_batch",
    "gen_distributed_augmentation_params",
    "get_preset",
    "list_presets",
    "stream_distributed_augmentation_chain",
]
