"""Deterministic augmentation parameters: configuration, presets and generators.

Each sample's parameters (rotation in degrees, brightness, noise, scale, contrast) are drawn
from the counter-based streams of :mod:`nnh_data.seeding`: draw ``j`` of the sample's seed
becomes ``low_j + (high_j - low_j) * u_j`` in the order of ``PARAM_NAMES``. The plain form is
keyed by (base_seed, epoch, depth) only, so a sample keeps its parameters whatever the number of
ranks or workers; the rank-aware form adds (rank, world_size), for repeated augmentation where
several ranks see one sample. Scalar, batch and streaming calls share one code path.

Image geometry (``crop=True`` or ``flip_prob > 0``, as in the ``imagenet`` preset) adds the
``GEOMETRY_NAMES``: a random-resized crop ``crop_x, crop_y, crop_w, crop_h`` (fractions of the
image's width and height) and ``flip`` (0 or 1). The crop is torchvision's ``RandomResizedCrop``
drawn without knowing the image: the image is the unit square, so the area fraction is exact and
the aspect ratio is relative (``crop_w / crop_h``: the crop's shape in pixels is that ratio times
the image's own width / height, and a ratio of 1 keeps the image's shape). Ten attempts draw an
area fraction ``a`` uniformly from ``crop_scale_range`` and a ratio ``r`` log-uniformly from
``crop_ratio_range``; the first with ``w = sqrt(a r) <= 1`` and ``h = sqrt(a / r) <= 1`` is kept,
else the fallback of torchvision on a square (the whole image, or the largest centred crop of
the nearest allowed ratio). Then ``crop_x = u (1 - w)``, ``crop_y = u' (1 - h)`` and
``flip = u'' < flip_prob``. These come from draws ``2**32 + k`` (``k = 0..22``: ten areas, ten
ratios, x, y, flip) of the sample's stream, far from draws 0-4 (the five parameters) and from
the noise draws of :mod:`nnh_data.augment.transforms` (5 on), and with basic IEEE operations only
(``exp`` by :func:`_exp`), so every machine computes the same bits. :func:`crop_box` turns them
into a pixel box. Configs without geometry give exactly the columns and numbers they always did.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from types import MappingProxyType
from typing import Any

import numpy as np

from nnh_data.checks import check_int, check_pair
from nnh_data.columns import rows_of
from nnh_data.order.ranges import DistributedRangeSplitter
from nnh_data.seeding import GOLDEN, as_sample_ids, sample_seeds, stream_key, uniform_draws

__all__ = [
    "GEOMETRY_NAMES",
    "PARAM_NAMES",
    "AugmentationConfig",
    "crop_box",
    "gen_augmentation_params",
    "gen_augmentation_params_batch",
    "gen_distributed_augmentation_params",
    "get_preset",
    "list_presets",
    "param_names",
    "stream_distributed_augmentation_chain",
]

PARAM_NAMES = ("rotation", "brightness", "noise", "scale", "contrast")
GEOMETRY_NAMES = ("crop_x", "crop_y", "crop_w", "crop_h", "flip")
_CROP_ATTEMPTS = 10  # torchvision's RandomResizedCrop
_GEOMETRY_DRAWS = 2 * _CROP_ATTEMPTS + 3  # areas, ratios, x, y, flip
_GEOMETRY_FIRST_DRAW = 1 << 32  # far from the parameter (0-4) and noise (5 on) draws


@dataclass(frozen=True)
class AugmentationConfig:
    """Ranges ``(low, high)`` of each parameter and the augmentation depth (part of the stream key).

    Defaults are the ``moderate`` preset, without image geometry. ``crop=True`` adds a
    random-resized crop of area fraction in ``crop_scale_range`` and relative aspect ratio in
    ``crop_ratio_range`` (module docstring); ``flip_prob`` is the probability of a horizontal
    flip. Either adds the ``GEOMETRY_NAMES`` to the parameters (the whole image when
    ``crop=False``).

    Example:
        >>> cfg = AugmentationConfig(rotation_range=(-10, 10))
        >>> AugmentationConfig.from_dict(cfg.to_dict()) == cfg
        True
    """

    rotation_range: tuple[float, float] = (-30.0, 30.0)
    brightness_range: tuple[float, float] = (0.8, 1.2)
    noise_range: tuple[float, float] = (0.0, 0.1)
    scale_range: tuple[float, float] = (0.8, 1.2)
    contrast_range: tuple[float, float] = (0.7, 1.3)
    augmentation_depth: int = 1
    crop: bool = False
    crop_scale_range: tuple[float, float] = (0.08, 1.0)
    crop_ratio_range: tuple[float, float] = (3 / 4, 4 / 3)
    flip_prob: float = 0.0

    def __post_init__(self) -> None:
        for field in (*(f"{name}_range" for name in PARAM_NAMES), *_GEOMETRY_RANGES):
            object.__setattr__(self, field, check_pair(field, getattr(self, field)))
        _check_low_bound("scale_range", self.scale_range, 0.0, strict=True)
        for field in ("noise_range", "brightness_range", "contrast_range"):
            _check_low_bound(field, getattr(self, field), 0.0, strict=False)
        depth = check_int("augmentation_depth", self.augmentation_depth, low=1)
        object.__setattr__(self, "augmentation_depth", depth)
        _check_geometry(self)

    @property
    def geometry(self) -> bool:
        """Whether the parameters hold the ``GEOMETRY_NAMES`` (a crop or a flip)."""
        return self.crop or self.flip_prob > 0

    def ranges(self) -> tuple[tuple[float, float], ...]:
        """The five ranges in ``PARAM_NAMES`` order."""
        return tuple(getattr(self, f"{name}_range") for name in PARAM_NAMES)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (lists for pairs) that ``from_dict`` turns back into this config.

        The geometry fields are left out while they hold their defaults, so a config without
        geometry is described as before they existed (stored tables keep their description).
        """
        out = {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }
        defaults = (_DEFAULT_CROP_SCALE, _DEFAULT_CROP_RATIO)
        if not self.geometry and (self.crop_scale_range, self.crop_ratio_range) == defaults:
            for field in _GEOMETRY_FIELDS:
                del out[field]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AugmentationConfig:
        """Build a config from ``to_dict`` output; unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown AugmentationConfig keys {unknown}; allowed: {sorted(known)}")
        return cls(**data)


_GEOMETRY_RANGES = ("crop_scale_range", "crop_ratio_range")
_GEOMETRY_FIELDS = ("crop", *_GEOMETRY_RANGES, "flip_prob")
_DEFAULT_CROP_SCALE, _DEFAULT_CROP_RATIO = (0.08, 1.0), (3 / 4, 4 / 3)


def _check_low_bound(field: str, pair: tuple[float, float], bound: float, *, strict: bool) -> None:
    if pair[0] < bound or (strict and pair[0] == bound):
        rule = ">" if strict else ">="
        raise ValueError(f"{field} must have low {rule} {bound}, got {pair!r}")


def _check_geometry(cfg: AugmentationConfig) -> None:
    if not isinstance(cfg.crop, bool):
        raise ValueError(f"crop must be True or False, got {cfg.crop!r}")
    low, high = cfg.crop_scale_range
    if not 0 < low or high > 1:
        raise ValueError(f"crop_scale_range must lie in (0, 1], got {cfg.crop_scale_range!r}")
    _check_low_bound("crop_ratio_range", cfg.crop_ratio_range, 0.0, strict=True)
    try:
        flip = float(cfg.flip_prob)
    except (TypeError, ValueError):
        flip = math.nan
    if isinstance(cfg.flip_prob, bool) or not 0 <= flip <= 1:
        raise ValueError(f"flip_prob must be a number in [0, 1], got {cfg.flip_prob!r}")
    object.__setattr__(cfg, "flip_prob", flip)


_NO_CHANGE = ((0.0, 0.0), (1.0, 1.0), (0.0, 0.0), (1.0, 1.0), (1.0, 1.0))
_PRESETS = MappingProxyType(
    {
        "mild": AugmentationConfig((-15, 15), (0.9, 1.1), (0, 0.05), (0.9, 1.1), (0.85, 1.15)),
        "moderate": AugmentationConfig(),
        "aggressive": AugmentationConfig((-45, 45), (0.7, 1.3), (0, 0.15), (0.7, 1.3), (0.6, 1.4)),
        # the standard ImageNet training geometry, and no photometric change
        "imagenet": AugmentationConfig(*_NO_CHANGE, crop=True, flip_prob=0.5),
    }
)


def list_presets() -> list[str]:
    """Names of the built-in presets."""
    return list(_PRESETS)


def get_preset(name: str) -> AugmentationConfig:
    """The preset config called ``name`` (``mild``, ``moderate``, ``aggressive`` or ``imagenet``:
    the random-resized crop and a flip with probability 1/2, no photometric change); immutable."""
    if name not in _PRESETS:
        raise ValueError(f"name must be one of {list_presets()}, got {name!r}")
    return _PRESETS[name]


def _config(config: AugmentationConfig | None) -> AugmentationConfig:
    if config is None:
        return _PRESETS["moderate"]
    if not isinstance(config, AugmentationConfig):
        raise ValueError(
            f"config must be an AugmentationConfig or None, got {type(config).__name__}"
        )
    return config


def param_names(config: AugmentationConfig | None = None) -> tuple[str, ...]:
    """The parameter columns of ``config`` (None: ``moderate``): ``PARAM_NAMES``, then the
    ``GEOMETRY_NAMES`` when it has image geometry."""
    cfg = _config(config)
    return (*PARAM_NAMES, *GEOMETRY_NAMES) if cfg.geometry else PARAM_NAMES


def gen_augmentation_params_batch(
    sample_ids: Sequence[int] | np.ndarray,
    rank: int = 0,
    world_size: int = 1,
    config: AugmentationConfig | None = None,
    base_seed: int = 0,
    epoch: int = 0,
    rank_aware: bool = True,
) -> dict[str, np.ndarray]:
    """Parameters of many samples at once, as columns (one array per key).

    Keys: the float64 columns of ``PARAM_NAMES`` (then, with image geometry, float64 ``crop_x``,
    ``crop_y``, ``crop_w``, ``crop_h`` and int64 ``flip``), and int64 ``sample_id``, ``rank``,
    ``epoch`` and uint64 ``seed`` (the integer of the scalar functions' hex ``seed``). With
    ``rank_aware=False`` the numbers are those of ``gen_augmentation_params`` (rank and
    world_size only checked and reported); else those of ``gen_distributed_augmentation_params``.

    Example:
        >>> p = gen_augmentation_params_batch(np.arange(4), rank_aware=False)
        >>> float(p["rotation"][2]) == gen_augmentation_params(2)["rotation"]
        True
    """
    cfg = _config(config)
    world_size = check_int("world_size", world_size, low=1)
    rank = check_int("rank", rank, low=0, high=world_size - 1)
    key_rank, key_world = (rank, world_size) if rank_aware else (None, None)
    key = stream_key(base_seed, epoch, cfg.augmentation_depth, key_rank, key_world)
    ids = as_sample_ids(sample_ids)
    seeds = sample_seeds(key, ids)
    ranges = cfg.ranges()
    draws = uniform_draws(seeds, len(PARAM_NAMES), [high - low for low, high in ranges])
    out: dict[str, np.ndarray] = {}
    for row, name, (low, _) in zip(draws, PARAM_NAMES, ranges):
        row += low
        out[name] = row
    if cfg.geometry:
        out.update(_geometry(seeds, cfg))
    out["sample_id"] = ids
    out["rank"] = np.full(ids.shape, rank, dtype=np.int64)
    out["epoch"] = np.full(ids.shape, epoch, dtype=np.int64)
    out["seed"] = seeds
    return out


def _geometry(seeds: np.ndarray, cfg: AugmentationConfig) -> dict[str, np.ndarray]:
    """The crop and flip columns of ``seeds`` (the algorithm of the module docstring)."""
    first = seeds + np.uint64((_GEOMETRY_FIRST_DRAW * GOLDEN) % (1 << 64))
    u = uniform_draws(first, _GEOMETRY_DRAWS)
    n = _CROP_ATTEMPTS
    if cfg.crop:
        (a_low, a_high), (r_low, r_high) = cfg.crop_scale_range, cfg.crop_ratio_range
        area = a_low + (a_high - a_low) * u[:n]
        log_low, log_high = math.log(r_low), math.log(r_high)
        ratio = _exp(log_low + (log_high - log_low) * u[n : 2 * n])
        w, h = np.sqrt(area * ratio), np.sqrt(area / ratio)
        fits = (w <= 1) & (h <= 1)
        first_fit = np.argmax(fits, axis=0)  # the first attempt that fits (0 when none does)
        columns = np.arange(u.shape[1])
        fallback = _fallback(r_low, r_high)
        found = fits.any(axis=0)
        w = np.where(found, w[first_fit, columns], fallback[0])
        h = np.where(found, h[first_fit, columns], fallback[1])
    else:
        w = h = np.ones(u.shape[1])
    return {
        "crop_x": u[2 * n] * (1 - w),
        "crop_y": u[2 * n + 1] * (1 - h),
        "crop_w": w,
        "crop_h": h,
        "flip": (u[2 * n + 2] < cfg.flip_prob).astype(np.int64),
    }


def _fallback(r_low: float, r_high: float) -> tuple[float, float]:
    """torchvision's fallback crop ``(w, h)`` on the unit square: the whole square when a ratio
    of 1 is allowed, else the largest centred crop of the nearest allowed ratio."""
    if r_low > 1:
        return 1.0, 1 / r_low
    if r_high < 1:
        return r_high, 1.0
    return 1.0, 1.0


# exp(r) = sum r**k / k! for |r| <= ln(2) / 2, to double precision (terms 0 to 17)
_EXP_TERMS = tuple(1 / math.factorial(k) for k in range(17, -1, -1))
_LN2_HIGH, _LN2_LOW = 0.693145751953125, 1.4286068203094173e-06  # ln 2 = high + low, high short


def _exp(x: np.ndarray) -> np.ndarray:
    """``exp(x)`` with basic IEEE operations only (correctly rounded, so every machine gives the
    same bits, where numpy's ``exp`` may use CPU-specific SIMD code): ``2**k * exp(r)``, ``k``
    the nearest integer to ``x / ln 2``, ``r`` reduced in two exact steps, ``exp(r)`` a Taylor
    polynomial in Horner form."""
    k = np.rint(x / math.log(2))
    r = (x - k * _LN2_HIGH) - k * _LN2_LOW
    acc = np.full_like(r, _EXP_TERMS[0])
    for coefficient in _EXP_TERMS[1:]:
        acc = acc * r + coefficient
    return np.ldexp(acc, k.astype(np.int64))


def crop_box(params: Mapping[str, Any], width: int, height: int) -> tuple[int, int, int, int]:
    """The pixel box ``(left, top, right, bottom)`` of a sample's crop in a ``width x height``
    image: ``round(crop_x * W), round(crop_y * H)`` to ``round((crop_x + crop_w) * W),
    round((crop_y + crop_h) * H)`` (Python's round, half to even), at least one pixel wide and
    high; the whole image when ``params`` has no crop.

    Example:
        >>> crop_box({"crop_x": 0.25, "crop_y": 0.0, "crop_w": 0.5, "crop_h": 1.0}, 100, 50)
        (25, 0, 75, 50)
    """
    if "crop_x" not in params:
        return 0, 0, width, height
    x, y = float(params["crop_x"]), float(params["crop_y"])
    left, top = round(x * width), round(y * height)
    right = round((x + float(params["crop_w"])) * width)
    bottom = round((y + float(params["crop_h"])) * height)
    left, top = min(left, width - 1), min(top, height - 1)
    return left, top, min(width, max(right, left + 1)), min(height, max(bottom, top + 1))


def _rows(columns: dict[str, np.ndarray]) -> Iterator[dict[str, Any]]:
    """Per-sample dicts of Python scalars (hex seeds) from batch columns, in column order.

    :func:`rows_of` builds them with a dict display, no Python loop body: this runs once per
    streamed sample, so it sets the per-sample cost of the streaming datasets.
    """
    if len(columns["sample_id"]) == 0:
        return iter(())
    hexed = columns["seed"].astype(">u8").tobytes().hex()  # 16 digits per seed, as seed_hex
    seeds = np.array(hexed).reshape(1).view("U16").tolist()  # cut into 16-digit strings
    values = [col.tolist() for name, col in columns.items() if name not in _CONSTANT_KEYS]
    rank, epoch = repeat(int(columns["rank"][0])), repeat(int(columns["epoch"][0]))
    return iter(rows_of(list(columns), [*values, rank, epoch, seeds]))


_CONSTANT_KEYS = ("rank", "epoch", "seed")  # the last three columns, filled without tolist()


def gen_augmentation_params(
    sample_id: int,
    config: AugmentationConfig | None = None,
    base_seed: int = 0,
    epoch: int = 0,
) -> dict[str, Any]:
    """Parameters of one sample; depend only on (base_seed, sample_id, epoch, config).

    Example:
        >>> p = gen_augmentation_params(42, base_seed=7)
        >>> sorted(p)[:3], -30 <= p["rotation"] <= 30
        (['brightness', 'contrast', 'epoch'], True)
    """
    sample_id = check_int("sample_id", sample_id, low=0)
    cols = gen_augmentation_params_batch(
        [sample_id], config=config, base_seed=base_seed, epoch=epoch, rank_aware=False
    )
    return next(_rows(cols))


def gen_distributed_augmentation_params(
    sample_id: int,
    rank: int,
    config: AugmentationConfig | None = None,
    base_seed: int = 0,
    world_size: int = 1,
    epoch: int = 0,
) -> dict[str, Any]:
    """Rank-aware parameters of one sample: differ across ranks for the same id.

    Example:
        >>> a = gen_distributed_augmentation_params(5, rank=0, world_size=2)
        >>> b = gen_distributed_augmentation_params(5, rank=1, world_size=2)
        >>> a["rotation"] != b["rotation"]
        True
    """
    sample_id = check_int("sample_id", sample_id, low=0)
    cols = gen_augmentation_params_batch(
        [sample_id], rank, world_size, config, base_seed, epoch, rank_aware=True
    )
    return next(_rows(cols))


def stream_distributed_augmentation_chain(
    num_samples: int,
    rank: int,
    world_size: int,
    config: AugmentationConfig | None = None,
    chunk_size: int = 1000,
    base_seed: int = 0,
    epoch: int = 0,
) -> Iterator[dict[str, Any]]:
    """Yield the rank-aware parameter dicts of this rank's share of ``num_samples``.

    The share is ``DistributedRangeSplitter(num_samples, world_size).get_rank_range(rank)``;
    parameters are generated ``chunk_size`` at a time, so memory is O(chunk_size). Arguments are
    validated at the call, not at the first ``next()``.

    Example:
        >>> chain = stream_distributed_augmentation_chain(10, rank=1, world_size=2)
        >>> [p["sample_id"] for p in chain]
        [5, 6, 7, 8, 9]
    """
    num_samples = check_int("num_samples", num_samples, low=0)
    start, end = DistributedRangeSplitter(num_samples, world_size).get_rank_range(rank)
    chunk_size = check_int("chunk_size", chunk_size, low=1)
    cfg = _config(config)
    stream_key(base_seed, epoch, cfg.augmentation_depth, rank, world_size)  # validates the rest
    return _chain(start, end, rank, world_size, cfg, chunk_size, base_seed, epoch)


def _chain(start, end, rank, world_size, cfg, chunk_size, base_seed, epoch):
    for lo in range(start, end, chunk_size):
        ids = np.arange(lo, min(lo + chunk_size, end), dtype=np.int64)
        yield from _rows(
            gen_augmentation_params_batch(ids, rank, world_size, cfg, base_seed, epoch)
        )
