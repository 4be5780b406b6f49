"""Augmentation: each sample's parameters from the counter-based generator (:mod:`.params`), and
applying them to images on the CPU or the GPU (:mod:`.transforms`)."""

from nnh_data.augment.params import (
    GEOMETRY_NAMES,
    PARAM_NAMES,
    AugmentationConfig,
    crop_box,
    gen_augmentation_params,
    gen_augmentation_params_batch,
    gen_distributed_augmentation_params,
    get_preset,
    list_presets,
    param_names,
    stream_distributed_augmentation_chain,
)
from nnh_data.augment.transforms import (
    PADDING_MODES,
    AugmentModule,
    AugmentParams,
    apply_augmentation,
)

__all__ = [
    "GEOMETRY_NAMES",
    "PADDING_MODES",
    "PARAM_NAMES",
    "AugmentModule",
    "AugmentParams",
    "AugmentationConfig",
    "apply_augmentation",
    "crop_box",
    "gen_augmentation_params",
    "gen_augmentation_params_batch",
    "gen_distributed_augmentation_params",
    "get_preset",
    "list_presets",
    "param_names",
    "stream_distributed_augmentation_chain",
]
