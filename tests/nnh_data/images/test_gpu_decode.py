"""The GPU decode stage: its boxes and layout against the CPU path on any machine (the stage run
on the CPU), and on CUDA (skipped without it) its crops against decode_crop."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import webdataset as wds

from nnh_data import (
    SampleDecoder,
    ShardedStreamingDataset,
    crop_box,
    gen_augmentation_params_batch,
    get_preset,
    streaming_loader,
)
from nnh_data.images.crop_decoder import decode_crop
from nnh_data.images.gpu_decode import GpuCropDecoder, crop_boxes
from nnh_data.packed import PackedField
from tests.support import encoded, picture

SIZES = [(640, 480), (333, 251), (97, 131), (1200, 700), (480, 640), (256, 256)]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def batch_of(images: list[bytes], preset: str = "imagenet") -> dict:
    """A batch as a streaming loader hands it out with ``decode=None``: packed bytes and the
    ``__aug__`` columns as tensors."""
    columns = gen_augmentation_params_batch(np.arange(len(images)), config=get_preset(preset))
    aug = {k: torch.as_tensor(np.asarray(v)) for k, v in columns.items() if k != "seed"}
    aug["seed"] = torch.as_tensor(columns["seed"].astype(np.int64))
    return {"jpg": PackedField.pack(images), "cls": list(range(len(images))), "__aug__": aug}


@pytest.fixture
def images() -> list[bytes]:
    out = [encoded(picture(w, h, seed=i)) for i, (w, h) in enumerate(SIZES)]
    others = [encoded(picture(300, 200, seed=9), "PNG"), encoded(picture(300, 200), mode="CMYK")]
    return out + others


def cpu_path(images: list[bytes], batch: dict, size: int) -> np.ndarray:
    aug = batch["__aug__"]
    rows = [{k: aug[k][i].item() for k in ("crop_x", "crop_y", "crop_w", "crop_h", "flip")}
            for i in range(len(images))]  # fmt: skip
    return np.stack([decode_crop(d, p, size) for d, p in zip(images, rows)]).transpose(0, 3, 1, 2)


def test_boxes_are_the_cpu_paths(images):
    batch = batch_of(images)
    boxes = crop_boxes(images, batch["__aug__"])
    for i, (w, h) in enumerate(SIZES):
        row = {k: batch["__aug__"][k][i].item() for k in ("crop_x", "crop_y", "crop_w", "crop_h")}
        assert boxes[i] == crop_box(row, w, h)
    assert boxes[-2:] == [None, None]  # PNG and CMYK: decoded on the CPU


@pytest.mark.parametrize("decoder", ["pillow", "nvimgcodec"])
def test_the_stage_on_the_cpu_matches_the_cpu_path(images, decoder):
    if decoder == "nvimgcodec":
        pytest.importorskip("nvidia.nvimgcodec")
    batch = batch_of(images)
    out = GpuCropDecoder(56, device="cpu", decoder=decoder, augment=False)(batch)
    assert out["cls"] == batch["cls"] and out["__aug__"] is batch["__aug__"]
    crops = out["jpg"]
    assert crops.shape == (len(images), 3, 56, 56) and crops.dtype == torch.uint8
    want = cpu_path(images, batch, 56)
    for got, expected in zip(crops.numpy(), want):
        assert psnr(got, expected) >= 30


@pytest.mark.parametrize("decoder", ["pillow", "nvimgcodec"])
def test_the_stage_after_a_loader_hands_the_cpu_paths_batches(tmp_path, decoder):
    """Workers hand bytes out (``decode=None``), the stage decodes: the same keys, layout and
    crops as the workers decoding with ``SampleDecoder("torchrgb8", crop_size=...)``."""
    if decoder == "nvimgcodec":
        pytest.importorskip("nvidia.nvimgcodec")
    with wds.ShardWriter(str(tmp_path / "s-%04d.tar"), maxcount=5, verbose=0) as sink:
        for i, (w, h) in enumerate(SIZES * 2):
            sink.write({"__key__": f"k{i:02d}", "jpg": encoded(picture(w, h, seed=i)), "cls": b"1"})

    def batches(decode):
        ds = ShardedStreamingDataset(str(tmp_path / "s-{0000..0002}.tar"), seed=3, batch_size=4,
                                     aug_config=get_preset("imagenet"), decode=decode,
                                     index_path=str(tmp_path / "index.json"))  # fmt: skip
        return list(streaming_loader(ds, batch_size=4, num_workers=1))

    stage = GpuCropDecoder(48, device="cpu", decoder=decoder, augment=False)
    cpu, raw = batches(SampleDecoder("torchrgb8", crop_size=48)), batches(None)
    assert len(cpu) == len(raw) == 3
    for want, got in zip(cpu, map(stage, raw)):
        assert list(got["__key__"]) == list(want["__key__"])
        assert got["jpg"].shape == want["jpg"].shape == (4, 3, 48, 48)
        for a, b in zip(got["jpg"].numpy(), want["jpg"].numpy()):
            assert psnr(a, b) >= 30


def test_augmentation_runs_on_the_stages_output(images):
    batch = batch_of(images[:3], "moderate")
    plain = GpuCropDecoder(40, device="cpu", decoder="pillow", augment=False)(batch)["jpg"]
    augmented = GpuCropDecoder(40, device="cpu", decoder="pillow")(batch)["jpg"]
    assert augmented.shape == plain.shape and augmented.dtype == torch.uint8
    assert not torch.equal(augmented, plain)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="decoder"):
        GpuCropDecoder(32, decoder="opencv")
    with pytest.raises(ValueError, match="size"):
        GpuCropDecoder(0)


@needs_cuda
@pytest.mark.parametrize("decoder", ["auto", "torchvision"])
def test_cuda_crops_match_the_cpu_path(images, decoder):
    if decoder == "torchvision":
        pytest.importorskip("torchvision")
    batch = batch_of(images)
    crops = GpuCropDecoder(64, decoder=decoder, augment=False)(batch)["jpg"]
    assert crops.is_cuda and crops.shape == (len(images), 3, 64, 64)
    for got, expected in zip(crops.cpu().numpy(), cpu_path(images, batch, 64)):
        assert psnr(got, expected) >= 30
