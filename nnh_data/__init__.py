"""nnh_data: rank-aware sharded streaming datasets with deterministic augmentation parameters."""

from nnh_data.audit import AuditReport, EpochAudit, ExactlyOnceError
from nnh_data.augment import (
    GEOMETRY_NAMES,
    PARAM_NAMES,
    AugmentationConfig,
    crop_box,
    gen_augmentation_params,
    gen_augmentation_params_batch,
    gen_distributed_augmentation_params,
    get_preset,
    list_presets,
    stream_distributed_augmentation_chain,
)
from nnh_data.decoders import SampleDecoder
from nnh_data.gather import gather_for_metrics
from nnh_data.image_decode import decode_crop
from nnh_data.loaders import (
    RankCache,
    RankCachedSampler,
    SharedEpochDataset,
    create_distributed_loader,
    create_rank_cached_dataloader,
    rank_share,
)
from nnh_data.mixing import Source, plan_counts
from nnh_data.packed import PackedField
from nnh_data.precompute import (
    PrecomputedParams,
    PrecomputeSpec,
    load_precomputed_params,
    verify_precomputed_params,
    write_precomputed_params,
)
from nnh_data.ranges import DistributedRangeSplitter
from nnh_data.seeding import RankAwareSeedGenerator
from nnh_data.shard_cache import CacheEntry, ShardCache
from nnh_data.shards import (
    ShardError,
    ShardIndex,
    ShardInfo,
    StaleIndexError,
    build_shard_index,
    expand_sources,
    iter_shard_samples,
)
from nnh_data.streaming import ShardedStreamingDataset, merge_states, state_from_loader
from nnh_data.streaming_loader import streaming_loader
from nnh_data.transforms import PADDING_MODES, AugmentModule, AugmentParams, apply_augmentation
from nnh_data.writer import write_shards

__all__ = [
    "PADDING_MODES",
    "GEOMETRY_NAMES",
    "PARAM_NAMES",
    "PackedField",
    "AugmentModule",
    "AugmentParams",
    "AugmentationConfig",
    "AuditReport",
    "CacheEntry",
    "DistributedRangeSplitter",
    "EpochAudit",
    "ExactlyOnceError",
    "PrecomputeSpec",
    "PrecomputedParams",
    "RankAwareSeedGenerator",
    "RankCache",
    "RankCachedSampler",
    "ShardCache",
    "ShardError",
    "ShardIndex",
    "ShardInfo",
    "ShardedStreamingDataset",
    "SampleDecoder",
    "SharedEpochDataset",
    "Source",
    "StaleIndexError",
    "apply_augmentation",
    "build_shard_index",
    "create_distributed_loader",
    "create_rank_cached_dataloader",
    "crop_box",
    "decode_crop",
    "expand_sources",
    "gather_for_metrics",
    "gen_augmentation_params",
    "gen_augmentation_params_batch",
    "gen_distributed_augmentation_params",
    "get_preset",
    "iter_shard_samples",
    "list_presets",
    "load_precomputed_params",
    "merge_states",
    "plan_counts",
    "rank_share",
    "state_from_loader",
    "stream_distributed_augmentation_chain",
    "streaming_loader",
    "verify_precomputed_params",
    "write_precomputed_params",
    "write_shards",
]
