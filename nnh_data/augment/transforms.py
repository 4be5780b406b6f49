"""Apply augmentation parameters to image tensors: batched, deterministic, on any device.

``apply_augmentation`` turns the parameters of :mod:`nnh_data.augment.params` into pixels in one
batched pass (no Python loop over samples; on the CPU, one pass per cache-sized group of images,
since a pass over a large batch is bound by memory bandwidth), in this order, for each image
``x`` of a batch:

1. Geometry: rotation (degrees, counter-clockwise on screen, about the image centre) and scale
   (``> 1`` zooms in) as one affine resampling, the ``affine_grid`` sampling grid (computed as
   a broadcast sum of its x and y terms) + ``grid_sample`` (bilinear,
   ``align_corners=False``, ``padding_mode`` "zeros" by default). Rotation is done in pixel
   units, so non-square images are not sheared. With image geometry in the parameters (the
   ``imagenet`` preset), the same resampling first takes the crop (the pixel box of
   :func:`~nnh_data.augment.params.crop_box`, stretched to the whole ``H x W`` output, like
   ``RandomResizedCrop`` to the input size), then flips (``flip`` 1) before rotating and
   scaling about the crop's centre. ``grid_sample`` does not low-pass, so a crop larger than the
   output aliases: to crop and shrink, decode with :func:`nnh_data.decode_crop` instead. Images
   with rotation 0, scale 1 and the whole image as crop are not resampled (a flip is then an
   exact mirror), so they stay exact.
2. Brightness: ``x = brightness * x``.
3. Contrast: ``x = contrast * x + (1 - contrast) * mean(x)``, the mean over all channels and
   pixels of the image after steps 1-2.
4. Noise: ``x = x + noise * (high - low) * z``, ``z`` standard normal, ``(low, high)`` the value
   range; ``noise`` is thus a fraction of the range (0.1 of [0, 255] is 25.5 for uint8).
5. Clamp to the value range; uint8 images are then rounded (half to even) back to uint8.

The value range is ``value_range`` if given, else [0, 255] for uint8 and [0, 1] for float
images (the torchvision convention), so normalised images need ``value_range``. Work is done
in float32 (float64 for float64 images).

Noise from the sample's own key. ``z`` is a pure function of the sample's 64-bit ``seed`` and
its image shape, so sample 42 gets the same noise in every run, batch position, rank and on
every device (bit-identical integers; float32 ``log``/``cos``/``sin`` differ across devices by
a few ulps). It continues the sample's SplitMix64 stream of :mod:`nnh_data.seeding`: with
``P = C*H*W`` and ``Q = ceil(P / 2)``, pair ``k`` (``k = 0..Q-1``) uses draw ``j = 5 + k``
(draws 0-4 are the five parameters), all mod 2**64::

    u  = mix64(seed + (j + 1) * 0x9E3779B97F4A7C15)
    u1 = ((u >> 40) + 1) * 2**-24          # top 24 bits, in (0, 1]
    u2 = (u & 0xFFFFFF) * 2**-24           # low 24 bits, in [0, 1)
    r  = sqrt(-2 * ln(u1));  t = 2 * pi * u2   # Box-Muller, float32

and ``z[k] = r * cos(t)``, ``z[Q + k] = r * sin(t)`` over the flattened (C, H, W) image
(``|z| <= 5.77``). The hash runs on the images' device as int64 tensor ops (wrapping multiply,
logical shifts by masking). Given a ``torch.Generator`` instead, ``z`` is ``torch.randn`` from
it: faster, but it depends on the batch and the generator state, not on the sample.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nnh_data.augment.params import GEOMETRY_NAMES, PARAM_NAMES, crop_box
from nnh_data.checks import check_choice, check_pair
from nnh_data.seeding import GOLDEN, MIX1, MIX2

__all__ = [
    "PADDING_MODES",
    "AugmentModule",
    "AugmentParams",
    "apply_augmentation",
    "key_noise",
    "mix64_",
]

PADDING_MODES = ("zeros", "border", "reflection")
_FIRST_NOISE_DRAW = len(PARAM_NAMES)
_M1, _M2 = MIX1, MIX2
_LOW24 = 0xFFFFFF
_CPU_CHUNK_BYTES = 1 << 20  # float pixels per thread per CPU group: about an L2 cache


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def apply_augmentation(
    images: Tensor,
    params: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    *,
    generator: torch.Generator | None = None,
    padding_mode: str = "zeros",
    value_range: tuple[float, float] | None = None,
) -> Tensor:
    """Augment a batch ``(N, C, H, W)`` or one image ``(C, H, W)`` with per-sample parameters.

    Args:
        images: uint8 or float images on any device; the result has the same dtype and device.
        params: the columns of ``gen_augmentation_params_batch``, a list of dicts of
            ``gen_augmentation_params`` (or one dict for one image), or a collated ``__aug__``
            (tensors, and ``seed`` as a list of hex strings). Needs the five parameters and
            ``seed``, one per image, and uses the ``GEOMETRY_NAMES`` (crop and flip) when
            they are there.
        generator: if given, the noise is drawn from it instead of from each sample's seed.
        padding_mode: how the geometry fills pixels from outside the image, one of
            ``PADDING_MODES``.
        value_range: ``(low, high)`` of pixel values; default [0, 255] for uint8, [0, 1] else.

    Example:
        >>> from nnh_data.augment.params import gen_augmentation_params_batch
        >>> images = torch.zeros(4, 3, 32, 32, dtype=torch.uint8)
        >>> apply_augmentation(images, gen_augmentation_params_batch(range(4))).shape
        torch.Size([4, 3, 32, 32])
    """
    check_choice("padding_mode", padding_mode, PADDING_MODES)
    low, high = _value_range(value_range, images.dtype)
    if images.dim() not in (3, 4):
        raise ValueError(f"images must be (N, C, H, W) or (C, H, W), got {tuple(images.shape)}")
    batch = images if images.dim() == 4 else images.unsqueeze(0)
    _warn_outside(batch, low, high)
    cols = _param_columns(params, batch.shape[0])
    out = torch.empty_like(batch)
    drawn = None  # drawn for the whole batch at once, so groups do not change the numbers
    if generator is not None and bool(cols["noise"].any()):
        drawn = torch.randn(batch.shape, generator=generator, device=batch.device)
    for lo, hi in _chunks(batch):
        part = {k: v[lo:hi] for k, v in cols.items()}
        z = None if drawn is None else drawn[lo:hi]
        out[lo:hi] = _augment(batch[lo:hi], part, padding_mode, (low, high), z)
    return out if images.dim() == 4 else out.squeeze(0)


def _warn_outside(batch: Tensor, low: float, high: float) -> None:
    """Warn when float pixels lie outside the value range: the final clamp would cut them (a
    normalised image needs ``value_range``)."""
    if not batch.is_floating_point() or batch.numel() == 0:
        return
    seen_low, seen_high = (float(v) for v in torch.aminmax(batch))
    if seen_low < low or seen_high > high:
        warnings.warn(
            f"images hold values in [{seen_low:.3g}, {seen_high:.3g}], outside value_range "
            f"[{low:g}, {high:g}]: they will be clamped; pass value_range=(low, high) of your "
            "pixel values (e.g. of normalised images)",
            stacklevel=3,
        )


def _chunks(batch: Tensor) -> list[tuple[int, int]]:
    """Index ranges to augment the batch in: the whole batch on a GPU; on the CPU, groups of
    about 1 MiB of float pixels per thread, so every pass over a group runs in cache (one
    pass over a large batch is bound by memory bandwidth, and is slower than a per-image loop)."""
    n = batch.shape[0]
    if batch.device.type != "cpu" or n == 0:
        return [(0, n)]
    step = max(1, torch.get_num_threads() * _CPU_CHUNK_BYTES // max(1, batch[0].numel() * 4))
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def _augment(
    batch: Tensor,
    cols: dict[str, Tensor],
    padding_mode: str,
    value_range: tuple[float, float],
    drawn: Tensor | None,
) -> Tensor:
    """Steps 1-5 on a (N, C, H, W) batch (noise ``drawn`` if given, else keyed); the result
    has the batch's dtype."""
    low, high = value_range
    dtype = torch.float64 if batch.dtype == torch.float64 else torch.float32
    x = _geometry(batch, dtype, cols, padding_mode)
    _photometric_(x, cols)
    _add_noise_(x, cols, high - low, drawn)
    x.clamp_(low, high)
    if batch.dtype == torch.uint8:
        x.round_()
    return x.to(batch.dtype)


def _value_range(
    value_range: tuple[float, float] | None, dtype: torch.dtype
) -> tuple[float, float]:
    """Validated ``(low, high)`` of the pixel values, defaulted from ``dtype``."""
    if dtype != torch.uint8 and not dtype.is_floating_point:
        raise ValueError(f"images must be uint8 or floating point, got {dtype}")
    if value_range is None:
        return (0.0, 255.0) if dtype == torch.uint8 else (0.0, 1.0)
    low, high = check_pair("value_range", value_range)
    if low == high or dtype == torch.uint8 and (low < 0 or high > 255):
        rule = "low < high, within [0, 255] for uint8"
        raise ValueError(f"value_range must have {rule}, got {value_range!r}")
    return low, high


def _param_columns(params: Any, n: int) -> dict[str, Tensor]:
    """The parameters (with the ``GEOMETRY_NAMES`` when given) as CPU float64 tensors of
    length ``n`` and ``seed`` as int64 bits."""
    rows = [params] if isinstance(params, Mapping) else params
    if isinstance(rows, str) or not all(isinstance(p, Mapping) for p in rows):
        raise ValueError(f"params must be a mapping or a sequence of mappings, got {params!r:.80}")
    names = PARAM_NAMES
    if rows and any(GEOMETRY_NAMES[0] in p for p in rows):
        names = (*PARAM_NAMES, *GEOMETRY_NAMES)
    needed = (*names, "seed")
    missing = sorted({k for p in rows for k in needed if k not in p})
    if missing:
        raise ValueError(f"params is missing keys {missing}; needs {list(needed)}")
    if not isinstance(params, Mapping):
        params = {k: [p[k] for p in params] for k in needed}
    cols = {k: torch.as_tensor(params[k], dtype=torch.float64).cpu().flatten() for k in names}
    cols["seed"] = _seed_bits(params["seed"])
    for name, col in cols.items():
        if col.numel() != n:
            raise ValueError(f"params[{name!r}] holds {col.numel()} values for {n} images")
    return cols


def _seed_bits(seeds: Any) -> Tensor:
    """Seeds (hex strings, integers, uint64/int64 arrays or tensors) as int64 tensors, same bits."""
    if isinstance(seeds, Tensor) and seeds.dtype == torch.uint64:
        return seeds.flatten().view(torch.int64)
    if isinstance(seeds, Tensor) and not seeds.dtype.is_floating_point:
        return seeds.flatten().long()
    arr = np.atleast_1d(np.asarray(seeds))
    if arr.dtype.kind in "USO":  # hex strings, or Python ints of any size
        as_ints = [int(s, 16) if isinstance(s, str) else s for s in arr.tolist()]
        arr = np.array(as_ints, dtype=np.uint64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"params['seed'] must hold hex strings or integers, got {seeds!r:.80}")
    return torch.from_numpy(arr.reshape(-1).astype(np.uint64).view(np.int64))


def _geometry(
    batch: Tensor, dtype: torch.dtype, cols: dict[str, Tensor], padding_mode: str
) -> Tensor:
    """Crop, flip, rotate and scale the images that move; a fresh ``dtype`` tensor in every
    case."""
    theta, moved, flipped = _thetas(cols, batch.shape[2], batch.shape[3])
    if 0 < len(moved) == len(theta):
        return _warp(batch.to(dtype), theta, padding_mode)
    x = batch.to(dtype, copy=True)
    if len(moved):  # resample only these, so identity rows stay exact
        index = moved.to(x.device)
        x[index] = _warp(x[index], theta[moved], padding_mode)
    if len(flipped):
        index = flipped.to(x.device)
        x[index] = x[index].flip(-1)
    return x


def _thetas(cols: dict[str, Tensor], h: int, w: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per image, the ``affine_grid`` matrix (float64, CPU) mapping output to input positions;
    the rows to resample, and the rows only to mirror."""
    angle, scale = torch.deg2rad(cols["rotation"]), cols["scale"]
    cos, sin = angle.cos() / scale, angle.sin() / scale
    # output -> input map in normalised coordinates (x right, y down); h/w keeps pixels square
    theta = torch.zeros(len(angle), 2, 3, dtype=torch.float64)
    theta[:, 0, 0], theta[:, 0, 1] = cos, -sin * h / w
    theta[:, 1, 0], theta[:, 1, 1] = sin * w / h, cos
    moved = (cols["rotation"] != 0) | (scale != 1)
    flips = torch.zeros_like(moved) if "flip" not in cols else cols["flip"] != 0
    if "crop_x" in cols:
        boxes = torch.tensor([_box(cols, i, w, h) for i in range(len(angle))], dtype=torch.float64)
        boxes = boxes.reshape(-1, 4)
        moved |= (boxes != torch.tensor([0.0, 0.0, w, h], dtype=torch.float64)).any(dim=1)
        half = torch.stack([(boxes[:, 2] - boxes[:, 0]) / w, (boxes[:, 3] - boxes[:, 1]) / h], 1)
        theta[:, :, :2] *= half[:, :, None]  # the crop's half sizes, normalised
        theta[:, 0, 2] = (boxes[:, 0] + boxes[:, 2]) / w - 1  # its centre
        theta[:, 1, 2] = (boxes[:, 1] + boxes[:, 3]) / h - 1
    theta[:, :, 0] *= torch.where(flips & moved, -1.0, 1.0)[:, None]
    return theta, moved.nonzero().flatten(), (flips & ~moved).nonzero().flatten()


def _box(cols: dict[str, Tensor], i: int, w: int, h: int) -> tuple[int, int, int, int]:
    return crop_box({k: float(cols[k][i]) for k in GEOMETRY_NAMES[:4]}, w, h)


def _warp(x: Tensor, theta: Tensor, padding_mode: str) -> Tensor:
    """One ``grid_sample`` of the batch by ``theta`` (float64, on the CPU)."""
    _, _, h, w = x.shape
    grid = _affine_grid(theta.to(x.device, x.dtype), h, w)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode=padding_mode, align_corners=False)


def _affine_grid(theta: Tensor, h: int, w: int) -> Tensor:
    """``F.affine_grid(theta, (n, c, h, w), align_corners=False)`` as one broadcast sum of its
    x, y and translation terms: ``affine_grid`` multiplies a materialised (n, h, w, 3) base grid
    instead, several times the memory traffic."""
    xs = torch.arange(w, device=theta.device, dtype=theta.dtype).mul_(2 / w).add_(1 / w - 1)
    ys = torch.arange(h, device=theta.device, dtype=theta.dtype).mul_(2 / h).add_(1 / h - 1)
    x_term = theta[:, None, None, :, 0] * xs.view(1, 1, w, 1)  # (n, 1, w, 2)
    y_term = theta[:, None, None, :, 1] * ys.view(1, h, 1, 1) + theta[:, None, None, :, 2]
    return x_term + y_term


def _photometric_(x: Tensor, cols: dict[str, Tensor]) -> None:
    """Brightness then contrast, in place: ``b*c*x + (1-c)*b*mean(x)``, exact at b = c = 1."""
    brightness, contrast = cols["brightness"], cols["contrast"]
    gain = (brightness * contrast).to(x.device, x.dtype).view(-1, 1, 1, 1)
    blend = ((1 - contrast) * brightness).to(x.device, x.dtype)
    offset = (blend * x.mean(dim=(1, 2, 3))).view(-1, 1, 1, 1)
    x.mul_(gain).add_(offset)


def _add_noise_(x: Tensor, cols: dict[str, Tensor], width: float, drawn: Tensor | None) -> None:
    """Add ``noise * width * z`` in place, ``z`` from each sample's seed (or ``drawn``)."""
    std = cols["noise"] * width
    if not bool(std.any()):
        return
    z = drawn
    if z is None:
        z = key_noise(cols["seed"].to(x.device), x[0].numel()).reshape(x.shape)
    x.addcmul_(z.to(x.dtype), std.to(x.device, x.dtype).view(-1, 1, 1, 1))


def key_noise(seeds: Tensor, count: int) -> Tensor:
    """Standard normal float32 noise ``(len(seeds), count)`` from int64 seed bits, on their device.

    Row ``i`` depends only on ``seeds[i]`` and ``count`` (algorithm in the module docstring).

    Example:
        >>> z = key_noise(torch.tensor([42, 7]), 5)
        >>> torch.equal(z[0], key_noise(torch.tensor([42]), 5)[0])
        True
    """
    n, pairs = len(seeds), (count + 1) // 2
    first = _FIRST_NOISE_DRAW + 1
    steps = torch.arange(first, first + pairs, device=seeds.device, dtype=torch.int64)
    bits = seeds.view(-1, 1) + steps.mul_(_signed(GOLDEN))
    scratch = torch.empty_like(bits)
    mix64_(bits, scratch)
    z = torch.empty(n, 2, pairs, device=seeds.device)  # radius, then angle; finally r*cos, r*sin
    radius, angle = z[:, 0], z[:, 1]
    radius.copy_(torch.bitwise_right_shift(bits, 40, out=scratch).bitwise_and_(_LOW24))
    radius.add_(1).mul_(2.0**-24).log_().mul_(-2.0).sqrt_()
    angle.copy_(bits.bitwise_and_(_LOW24)).mul_(2 * math.pi * 2.0**-24)
    cos = torch.cos(angle, out=scratch.view(torch.float32)[:, :pairs])
    angle.sin_().mul_(radius)
    radius.mul_(cos)
    return z.view(n, 2 * pairs)[:, :count]


def mix64_(z: Tensor, tmp: Tensor) -> Tensor:
    """``nnh_data.seeding.mix64`` on an int64 tensor in place (``tmp``: scratch of its shape)."""
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp).bitwise_and_((1 << (64 - shift)) - 1)
        z.bitwise_xor_(tmp)
        if mult is not None:
            z.mul_(_signed(mult))
    return z


@dataclass(frozen=True)
class AugmentParams:
    """Per-sample transform for a Dataset or ``map``: augments ``sample[key]`` on the CPU.

    Uses the sample's ``"__aug__"`` parameters (as the streaming datasets attach them) and
    returns a new dict; other fields are kept. uint8 in, uint8 out.

    Example:
        >>> from nnh_data.augment.params import gen_augmentation_params
        >>> sample = {"image": torch.zeros(3, 8, 8), "__aug__": gen_augmentation_params(42)}
        >>> AugmentParams()(sample)["image"].shape
        torch.Size([3, 8, 8])
    """

    key: str = "image"
    padding_mode: str = "zeros"
    value_range: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        check_choice("padding_mode", self.padding_mode, PADDING_MODES)
        if self.value_range is not None:
            object.__setattr__(self, "value_range", check_pair("value_range", self.value_range))

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        image = apply_augmentation(
            sample[self.key], sample["__aug__"],
            padding_mode=self.padding_mode, value_range=self.value_range,
        )  # fmt: skip
        return {**sample, self.key: image}


class AugmentModule(nn.Module):
    """``apply_augmentation`` as a module, for the GPU side of a training step.

    Example:
        >>> from nnh_data.augment.params import gen_augmentation_params_batch
        >>> aug = AugmentModule(padding_mode="border")
        >>> aug(torch.rand(2, 3, 8, 8), gen_augmentation_params_batch([0, 1])).shape
        torch.Size([2, 3, 8, 8])
    """

    def __init__(self, padding_mode: str = "zeros", value_range: tuple[float, float] | None = None):
        super().__init__()
        self.padding_mode = check_choice("padding_mode", padding_mode, PADDING_MODES)
        self.value_range = None if value_range is None else check_pair("value_range", value_range)

    def forward(
        self, images: Tensor, params: Any, generator: torch.Generator | None = None
    ) -> Tensor:
        """Augment ``images`` with ``params`` (see ``apply_augmentation``)."""
        return apply_augmentation(
            images, params, generator=generator,
            padding_mode=self.padding_mode, value_range=self.value_range,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"padding_mode={self.padding_mode!r}, value_range={self.value_range!r}"
