"""The GPU decode stage: workers hand JPEG bytes out, the main process decodes each batch's
crops on the GPU.

With ``decode=None`` (or ``"bytes"``) a streaming loader's workers send each batch's images as
one :class:`~nnh_data.packed.PackedField` of bytes, and its ``__aug__`` columns. A
:class:`GpuCropDecoder` turns that batch's image field into the ``(B, 3, size, size)`` uint8
crops of :func:`~nnh_data.images.decode_crop` on the device: the frame header of every file is
read on the CPU (microseconds) to place its crop's box, nvImageCodec decodes the boxes of the
whole batch in one call (nvJPEG, on the hardware JPEG decoders of A100, H100 and H200 where
present; region = the known crop, so the rows below it are never decoded), and the resize
(antialiased bilinear, in float), the flip and :func:`~nnh_data.augment.transforms.
apply_augmentation` (the photometric parameters; the geometry is the crop just taken) run there
too. Where nvImageCodec is missing, torchvision's ``decode_jpeg(device="cuda")`` decodes whole
files and the crops are sliced from them. Files that are not plain JPEGs (PNG, CMYK, ...) are
decoded on the CPU by :func:`decode_crop` and moved. An explicit stage rather than a loader
option: it runs where the model runs, after the loader has handed the batch over.

``decoder="pillow"`` with ``device="cpu"`` runs the same stage on the CPU (the full decode of
the reference, then the same crops, resize and flip): the tests check its boxes and layout
against the CPU path on machines without CUDA.
"""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from nnh_data.augment.params import PARAM_NAMES, crop_box
from nnh_data.augment.transforms import apply_augmentation
from nnh_data.checks import check_choice, check_int
from nnh_data.images.crop_decoder import decode_crop, is_jpeg, jpeg_backend_names
from nnh_data.images.decoders import geometry_rows
from nnh_data.images.jpeg_frame import read_frame

__all__ = ["GPU_DECODERS", "GpuCropDecoder", "crop_boxes"]

GPU_DECODERS = ("auto", "nvimgcodec", "torchvision", "pillow")
_AUGMENT_NAMES = (*PARAM_NAMES, "seed")  # what apply_augmentation needs; the crop is taken


def crop_boxes(
    images: Sequence[bytes], params: Mapping[str, Any]
) -> list[tuple[int, int, int, int] | None]:
    """Each image's crop box (``crop_box`` of its ``__aug__`` row and its frame's size), or None
    for an image that is not a plain JPEG (decoded on the CPU instead)."""
    return _boxes(images, geometry_rows(params, len(images)))


def _boxes(
    images: Sequence[bytes], rows: list[dict[str, Any]]
) -> list[tuple[int, int, int, int] | None]:
    frames = [read_frame(data) if is_jpeg(data) else None for data in images]
    return [
        None if frame is None else crop_box(row, frame.width, frame.height)
        for frame, row in zip(frames, rows)
    ]


@dataclass(frozen=True)
class GpuCropDecoder:
    """Decode a batch's image ``field`` into ``(B, 3, size, size)`` uint8 crops on ``device``.

    Args:
        size: the output side in pixels.
        field: the batch's image field (JPEG bytes, a ``PackedField`` or a list).
        device: where the crops are made (``"cuda"``, ``"cuda:1"``; ``"cpu"`` with
            ``decoder="pillow"`` or ``"nvimgcodec"`` for a check without a GPU).
        decoder: ``"auto"`` (nvImageCodec, else torchvision), or one of ``GPU_DECODERS``.
        augment: also run ``apply_augmentation`` with the batch's photometric parameters
            (where its ``__aug__`` has them).

    Example:
        >>> stage = GpuCropDecoder(224)
        >>> stage.device, stage.decoder
        ('cuda', 'auto')
        >>> for batch in map(stage, streaming_loader(ds, batch_size=256)):  # doctest: +SKIP
        ...     images = batch["jpg"]  # (256, 3, 224, 224) uint8 on the GPU
    """

    size: int
    field: str = "jpg"
    device: str = "cuda"
    decoder: str = "auto"
    augment: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", check_int("size", self.size, low=1))
        check_choice("decoder", self.decoder, GPU_DECODERS)

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The batch with its image field decoded (the other fields as they were)."""
        images = [bytes(value) for value in batch[self.field]]
        params = batch.get("__aug__", {})
        rows = geometry_rows(params, len(images))
        boxes = _boxes(images, rows)
        crops = self._crops(images, boxes)
        out = torch.stack([
            self._resized(crop, data, row) for crop, data, row in zip(crops, images, rows)
        ])  # fmt: skip
        if self.augment and all(name in params for name in _AUGMENT_NAMES):
            out = apply_augmentation(out, {name: params[name] for name in _AUGMENT_NAMES})
        return {**batch, self.field: out}

    def _crops(
        self, images: list[bytes], boxes: list[tuple[int, int, int, int] | None]
    ) -> list[torch.Tensor | None]:
        """The (3, h, w) uint8 pixels of each box on the device (None where ``box`` is)."""
        jpegs = [i for i, box in enumerate(boxes) if box is not None]
        crops: list[torch.Tensor | None] = [None] * len(images)
        decoded = _DECODERS[self._decoder_name()](
            [images[i] for i in jpegs], [boxes[i] for i in jpegs], self.device
        )
        for i, crop in zip(jpegs, decoded):
            crops[i] = crop
        return crops

    def _decoder_name(self) -> str:
        if self.decoder != "auto":
            return self.decoder
        return "nvimgcodec" if "nvimgcodec" in jpeg_backend_names() else "torchvision"

    def _resized(
        self, crop: torch.Tensor | None, data: bytes, params: dict[str, Any]
    ) -> torch.Tensor:
        """One crop resized to ``size x size`` and flipped (a CPU decode where ``crop`` is None)."""
        if crop is None:
            pixels = torch.from_numpy(decode_crop(data, params, self.size))
            return pixels.permute(2, 0, 1).to(self.device)
        x = F.interpolate(crop[None].float(), size=(self.size, self.size), mode="bilinear",
                          antialias=True, align_corners=False)  # fmt: skip
        x = x[0].round_().clamp_(0, 255).to(torch.uint8)
        return x.flip(2) if params.get("flip", 0) else x


def _nvimgcodec(images: list[bytes], boxes: list[Any], device: str) -> list[torch.Tensor]:
    """The boxes decoded by nvImageCodec in one batched call (nvJPEG on a GPU; its CPU backend
    for ``device="cpu"``), as (3, h, w) tensors on ``device``."""
    from nnh_data.images.jpeg_backends import import_nvimgcodec

    nvimgcodec = import_nvimgcodec()
    decoder = _nv_batch_decoder(nvimgcodec, os.getpid(), device)
    streams = [
        nvimgcodec.CodeStream(data).get_sub_code_stream(
            region=nvimgcodec.Region(top, left, bottom, right)
        )
        for data, (left, top, right, bottom) in zip(images, boxes)
    ]
    params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.SRGB)
    decoded = decoder.decode(streams, params=params)
    if any(image is None for image in decoded):
        raise RuntimeError(
            "nvImageCodec could not decode an image of the batch: install nvJPEG for the GPU "
            "(pip install nvidia-nvjpeg-cu12) or pass decoder='torchvision'"
        )
    if device == "cpu":
        return [torch.from_numpy(np.asarray(image.cpu())).permute(2, 0, 1) for image in decoded]
    return [torch.as_tensor(image, device=device).permute(2, 0, 1) for image in decoded]


@functools.cache
def _nv_batch_decoder(nvimgcodec: Any, pid: int, device: str) -> Any:
    """One nvImageCodec decoder per process (``pid``: a forked worker makes its own) and device."""
    if device == "cpu":
        return nvimgcodec.Decoder(
            device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
            backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)],
        )
    index = torch.device(device).index
    return nvimgcodec.Decoder(device_id=torch.cuda.current_device() if index is None else index)


def _torchvision(images: list[bytes], boxes: list[Any], device: str) -> list[torch.Tensor]:
    """Whole files decoded by torchvision's ``decode_jpeg`` on ``device``, the boxes sliced."""
    from torchvision.io import ImageReadMode, decode_jpeg

    data = [torch.frombuffer(bytearray(image), dtype=torch.uint8) for image in images]
    decoded = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    return [
        image[:, top:bottom, left:right]
        for image, (left, top, right, bottom) in zip(decoded, boxes)
    ]


def _pillow(images: list[bytes], boxes: list[Any], device: str) -> list[torch.Tensor]:
    """The reference's full decode on the CPU, the boxes sliced (the stage's CPU check)."""
    out = []
    for data, (left, top, right, bottom) in zip(images, boxes):
        with Image.open(io.BytesIO(data)) as image:
            pixels = np.asarray(image.convert("RGB"))
        crop = torch.from_numpy(np.ascontiguousarray(pixels[top:bottom, left:right]))
        out.append(crop.permute(2, 0, 1).to(device))
    return out


_DECODERS = {"nvimgcodec": _nvimgcodec, "torchvision": _torchvision, "pillow": _pillow}
