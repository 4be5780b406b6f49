"""nnh_data: rank-aware sharded streaming datasets with deterministic augmentation parameters."""

from nnh_data.audit import AuditReport, EpochAudit, ExactlyOnceError
from nnh_data.augment import (
    GEOMETRY_NAMES,
    PADDING_MODES,
    PARAM_NAMES,
    AugmentationConfig,
    AugmentModule,
    AugmentParams,
    apply_augmentation,
    crop_box,
    gen_augmentation_params,
    gen_augmentation_params_batch,
    gen_distributed_augmentation_params,
    get_preset,
    list_presets,
    stream_distributed_augmentation_chain,
)
from nnh_data.cache import CacheEntry, ShardCache
from nnh_data.errors import NNHError, UnsendableError
from nnh_data.images import SampleDecoder, decode_crop
from nnh_data.loaders import (
    RankCache,
    RankCachedSampler,
    SharedEpochDataset,
    create_distributed_loader,
    create_rank_cached_dataloader,
    gather_for_metrics,
    rank_share,
)
from nnh_data.order import DistributedRangeSplitter, Source, plan_counts
from nnh_data.packed import PackedField
from nnh_data.precompute import (
    PrecomputedParams,
    PrecomputeSpec,
    load_precomputed_params,
    verify_precomputed_params,
    write_precomputed_params,
)
from nnh_data.seeding import RankAwareSeedGenerator
from nnh_data.shards import (
    ShardError,
    ShardIndex,
    ShardInfo,
    StaleIndexError,
    build_shard_index,
    expand_sources,
    iter_shard_samples,
    write_shards,
)
from nnh_data.streaming import (
    ShardedStreamingDataset,
    merge_states,
    state_from_loader,
    streaming_loader,
)

__all__ = [
    "PADDING_MODES",
    "GEOMETRY_NAMES",
    "NNHError",
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
    "UnsendableError",
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
