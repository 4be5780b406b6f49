"""decode_crop against the reference (full Pillow decode, crop, BILINEAR resize, flip): both
JPEG backends, the scaled and unscaled paths, odd sizes, grayscale, CMYK, EXIF orientation,
PNG, and corrupt bytes (a ShardError naming the shard and key through a dataset)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

import nnh_data.images.crop_decoder as image_decode
from nnh_data import (
    SampleDecoder,
    ShardedStreamingDataset,
    ShardError,
    crop_box,
    decode_crop,
    gen_augmentation_params,
    get_preset,
)
from nnh_data.images.crop_decoder import decode_crop_reference
from tests.support import encoded, picture

BACKENDS = ["simplejpeg", "pillow"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Run the test with each JPEG decoder: simplejpeg (the ``images`` extra) and Pillow."""
    if request.param == "pillow":
        monkeypatch.setattr(image_decode, "simplejpeg", None)
    else:
        pytest.importorskip("simplejpeg")
    return request.param


@pytest.fixture
def paths(monkeypatch):
    """Which resize each call took: 'exact' (unscaled decode) or 'scaled' (a DCT scale)."""
    taken = []
    exact, fractional = image_decode._resize_exact, image_decode._resize_fractional
    monkeypatch.setattr(
        image_decode, "_resize_exact", lambda *a: taken.append("exact") or exact(*a)
    )
    monkeypatch.setattr(
        image_decode, "_resize_fractional", lambda *a: taken.append("scaled") or fractional(*a)
    )
    return taken


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def crop(x=0.1, y=0.2, w=0.7, h=0.6, flip=0) -> dict:
    return {"crop_x": x, "crop_y": y, "crop_w": w, "crop_h": h, "flip": flip}


def check(data: bytes, params: dict, size: int, min_psnr: float) -> np.ndarray:
    got, want = decode_crop(data, params, size), decode_crop_reference(data, params, size)
    assert got.shape == want.shape == (size, size, 3) and got.dtype == np.uint8
    assert got.flags.c_contiguous
    assert psnr(got, want) >= min_psnr, psnr(got, want)
    return got


@pytest.mark.parametrize(
    ("width", "height", "size"), [(120, 90, 64), (333, 251, 101), (97, 131, 97)]
)
def test_unscaled_jpeg_matches_the_reference(backend, paths, width, height, size):
    data = encoded(picture(width, height, seed=width))
    for flip in (0, 1):
        check(data, crop(flip=flip), size, 40)
    assert set(paths) == {"exact"}


@pytest.mark.parametrize(("width", "height", "size", "scale"), [
    (1024, 768, 200, 2), (1501, 1203, 67, 8), (801, 1999, 31, 8), (640, 480, 60, 4),
])  # fmt: skip
def test_scaled_jpeg_matches_the_reference(backend, paths, width, height, size, scale):
    data = encoded(picture(width, height, seed=width))
    params = crop(0.05, 0.1, 0.9, 0.85, flip=1)
    box = crop_box(params, width, height)
    assert image_decode._scale(params, width, height, size) == scale
    assert min(box[2] - box[0], box[3] - box[1]) // size >= scale  # the crop stays >= size
    check(data, params, size, 30)
    assert paths == ["scaled"]


def test_a_crop_smaller_than_twice_the_output_is_not_scaled():
    params = crop(0, 0, 0.5, 0.5)  # 200 x 150 pixels of 400 x 300
    assert image_decode._scale(params, 400, 300, 75) == 2
    assert image_decode._scale(params, 400, 300, 76) == 1


@pytest.mark.parametrize("mode", ["L", "CMYK"])
def test_grayscale_and_cmyk_jpegs(backend, mode):
    data = encoded(picture(700, 500, seed=3), mode=mode)
    with Image.open(__import__("io").BytesIO(data)) as image:
        assert image.mode == mode
    check(data, crop(flip=1), 48, 30)  # scaled (1/8)
    check(data, crop(flip=1), 200, 35)  # unscaled


def test_exif_orientation_is_ignored_like_the_reference(backend):
    """EXIF orientation is not applied (as Pillow's Image.open, webdataset and torchvision do):
    the box and the pixels are those of the stored image."""
    pixels = picture(300, 200, seed=4)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 clockwise to display"
    rotated, plain = encoded(pixels, exif=exif), encoded(pixels)
    assert rotated != plain
    got = check(rotated, crop(flip=1), 64, 40)
    assert got.shape == (64, 64, 3)
    np.testing.assert_array_equal(got, decode_crop(plain, crop(flip=1), 64))


@pytest.mark.parametrize(
    ("fmt", "mode"),
    [("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "P"), ("PNG", "L"), ("WEBP", "RGB"), ("PPM", "RGB")],
)
def test_other_formats_take_the_plain_path(paths, fmt, mode):
    data = encoded(
        picture(211, 157, seed=5), fmt, mode=mode, **({"lossless": True} if fmt == "WEBP" else {})
    )
    check(data, crop(flip=1), 50, 40)
    assert paths == ["exact"]  # whole decode, exact box, whatever the crop's size


def test_flip_mirrors_and_no_crop_means_the_whole_image(backend):
    data = encoded(picture(150, 100, seed=6))
    np.testing.assert_array_equal(
        decode_crop(data, crop(flip=1), 40), decode_crop(data, crop(flip=0), 40)[:, ::-1]
    )
    plain = gen_augmentation_params(3)  # moderate: no crop, no flip
    check(data, plain, 40, 40)
    assert crop_box(plain, 150, 100) == (0, 0, 150, 100)


def test_imagenet_parameters_match_the_reference(backend):
    data = encoded(picture(640, 480, seed=7))
    for i in range(8):
        check(data, gen_augmentation_params(i, get_preset("imagenet")), 56, 30)


def test_what_pillow_reads_with_a_warning_decodes_as_the_reference(backend):
    good = encoded(picture(90, 70, seed=8))
    extraneous = good[:-2] + b"\x12\x34\x56" + good[-2:]  # junk before the EOI marker
    np.testing.assert_array_equal(check(extraneous, crop(), 32, 40), decode_crop(good, crop(), 32))


@pytest.mark.parametrize("data", [b"\xff\xd8\xff\xe0garbage", b"not an image", b""])
def test_unreadable_bytes_raise(backend, data):
    with pytest.raises((ValueError, OSError)):
        decode_crop(data, crop(), 32)


def test_size_is_checked():
    with pytest.raises(ValueError, match="size"):
        decode_crop(encoded(picture(20, 20)), crop(), 0)


def test_a_corrupt_image_raises_a_shard_error_naming_shard_and_key(tmp_path, backend):
    good = encoded(picture(64, 48))
    pattern = str(tmp_path / "img-%04d.tar")
    with wds.ShardWriter(pattern, maxcount=10, verbose=0) as sink:
        for i in range(3):
            data = good[: len(good) // 3] if i == 1 else good  # sample 1 is truncated
            sink.write({"__key__": f"k{i}", "jpg": data, "cls": b"1"})
    url = str(tmp_path / "img-0000.tar")
    ds = ShardedStreamingDataset(url, shuffle=False, aug_config=get_preset("imagenet"),
                                 decode=SampleDecoder("rgb8", crop_size=16))  # fmt: skip
    with pytest.raises(ShardError, match=r"img-0000\.tar.*'k1'") as err:
        list(ds)
    assert isinstance(err.value.__cause__, (ValueError, OSError))
    skipping = ShardedStreamingDataset(
        url, shuffle=False, aug_config=get_preset("imagenet"), on_error="skip",
        decode=SampleDecoder("rgb8", crop_size=16),
    )  # fmt: skip
    with pytest.warns(UserWarning, match="k1"):
        assert [s["__key__"] for s in skipping] == ["k0", "k2"]
