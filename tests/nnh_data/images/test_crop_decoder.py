"""decode_crop against the reference (full Pillow decode, crop, BILINEAR resize, flip): every
installed JPEG backend alone and the cost model's choice among them, the scaled and unscaled
paths, baseline and progressive files, 4:2:0, 4:2:2 and 4:4:4, odd sizes, grayscale, CMYK, EXIF
orientation, crops touching each edge, PNG and WebP, truncated and corrupt bytes (a ShardError
naming the shard and key through a dataset), and the same bytes in another process."""

from __future__ import annotations

import hashlib
import io
import math
import subprocess
import sys
from pathlib import Path

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
from nnh_data.images.jpeg_backends import JpegBackend, cheapest, crop_job, installed_backends
from tests.support import encoded, picture

BACKENDS = ["simplejpeg", "nvimgcodec", "pillow", "chosen"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Run the test with each JPEG backend alone (simplejpeg and nvImageCodec: the ``images``
    extra; Pillow, the fallback) and with the cost model choosing among all installed."""
    if request.param != "chosen":
        only = installed(request.param)
        monkeypatch.setattr(image_decode, "installed_backends", lambda: (only,))
    return request.param


def installed(name: str) -> JpegBackend:
    """The backend ``name``; the test skips where its package is not installed."""
    (only,) = [b for b in installed_backends() if b.name == name] or [None]
    if only is None:
        pytest.skip(f"{name} is not installed")
    return only


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
    region = cheapest(crop_job(data, params, size), image_decode.installed_backends()).region
    assert paths == ["exact" if region else "scaled"]


def test_a_crop_smaller_than_twice_the_output_is_not_scaled():
    params = crop(0, 0, 0.5, 0.5)  # 200 x 150 pixels of 400 x 300
    assert image_decode._scale(params, 400, 300, 75) == 2
    assert image_decode._scale(params, 400, 300, 76) == 1


@pytest.mark.parametrize("mode", ["L", "CMYK"])
def test_grayscale_and_cmyk_jpegs(backend, mode):
    data = encoded(picture(700, 500, seed=3), mode=mode)
    with Image.open(io.BytesIO(data)) as image:
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


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_corrupt_image_raises_a_shard_error_naming_shard_and_key(tmp_path, backend, damage):
    good = encoded(picture(64, 48))
    bad = {"truncated": good[: len(good) // 3], "garbage": good[:20] + bytes(range(256)) * 4}
    pattern = str(tmp_path / "img-%04d.tar")
    with wds.ShardWriter(pattern, maxcount=10, verbose=0) as sink:
        for i in range(3):
            data = bad[damage] if i == 1 else good
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


@pytest.mark.parametrize("options", [
    {"progressive": True}, {"subsampling": 0}, {"subsampling": 1}, {"restart_marker_rows": 1},
    {"progressive": True, "subsampling": 0},
], ids=["progressive", "444", "422", "restarts", "progressive-444"])  # fmt: skip
def test_progressive_and_chroma_layouts(backend, options):
    data = encoded(picture(901, 677, seed=11), **options)
    for size in (50, 200, 400):  # scales 8, 2 and 1 of a crop of about 810 x 400 pixels
        check(data, crop(0.05, 0.3, 0.9, 0.6, flip=1), size, 30)


LAYOUTS = {
    "baseline-420": {}, "progressive": {"progressive": True}, "444": {"subsampling": 0},
    "422": {"subsampling": 1}, "restarts": {"restart_marker_rows": 1}, "gray": {"mode": "L"},
}  # fmt: skip


@pytest.mark.parametrize("name", BACKENDS[:-1])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("size", [40, 90, 200])  # scales 8, 4 and 1 of the crop below
def test_each_backend_serves_plain_jpegs_bit_identically(name, layout, size):
    """Each backend decodes its part itself (no fallback) and gives the full decode's pixels at
    the job's scale: the rows down to the crop's bottom, or the crop's box."""
    only = installed(name)
    data = encoded(picture(733, 491, seed=14), **LAYOUTS[layout])
    job = crop_job(data, crop(0.1, 0.15, 0.8, 0.75), size)
    pixels = only.decode(data, job)
    assert pixels is not None and pixels.dtype == np.uint8
    left, top, right, bottom = job.box
    if only.region:
        np.testing.assert_array_equal(pixels, full_decode(data)[top:bottom, left:right])
    else:
        keep = -(-bottom // job.scale)
        np.testing.assert_array_equal(pixels[:keep], full_decode(data, job.scale)[:keep])


def full_decode(data: bytes, scale: int = 1) -> np.ndarray:
    """Pillow's decode of the whole file at ``1 / scale`` (libjpeg-turbo, as every backend)."""
    with Image.open(io.BytesIO(data)) as image:
        if scale > 1:
            image.draft("RGB", (image.width // scale, image.height // scale))
        return np.asarray(image.convert("RGB"))


@pytest.mark.parametrize("edge", ["left", "top", "right", "bottom", "all"])
def test_crops_touching_each_edge(backend, edge):
    data = encoded(picture(517, 389, seed=12))
    params = {"left": crop(0, 0.2, 0.5, 0.5), "top": crop(0.2, 0, 0.5, 0.5),
              "right": crop(0.5, 0.2, 0.5, 0.5), "bottom": crop(0.2, 0.5, 0.5, 0.5),
              "all": crop(0, 0, 1, 1)}[edge]  # fmt: skip
    for size in (37, 120, 300):
        check(data, params, size, 33)


def test_a_truncated_jpeg_raises_as_the_reference_does(backend):
    data = encoded(picture(400, 300, seed=13))[:5000]
    with pytest.raises(OSError):
        decode_crop_reference(data, crop(0, 0, 0.2, 0.2), 32)
    with pytest.raises((ValueError, OSError)):
        decode_crop(data, crop(0, 0, 0.2, 0.2), 32)  # the crop lies in the bytes that are there


def test_the_same_inputs_give_the_same_bytes_in_another_process(backend):
    """The backend's choice is a pure function of the header, the parameters and the installed
    set: a fresh process with the same backends decodes every crop to the same bytes."""
    script = (
        "import sys\n"
        "import nnh_data.images.crop_decoder as m\n"
        "from tests.nnh_data.images.test_crop_decoder import crops_digest\n"
        "if sys.argv[1] != 'chosen':\n"
        "    only = tuple(b for b in m.installed_backends() if b.name == sys.argv[1])\n"
        "    m.installed_backends = lambda: only\n"
        "print(crops_digest())\n"
    )
    out = subprocess.run([sys.executable, "-c", script, backend], capture_output=True, text=True,
                         check=True, timeout=120, cwd=Path(__file__).parents[3])  # fmt: skip
    assert out.stdout.strip() == crops_digest()


def crops_digest() -> str:
    """The SHA-256 of the crops of three pictures (scaled, unscaled, progressive, 4:4:4)."""
    digest = hashlib.sha256()
    for i, (w, h, options) in enumerate([
        (1200, 900, {}), (640, 480, {"progressive": True}), (333, 251, {"subsampling": 0}),
    ]):  # fmt: skip
        data = encoded(picture(w, h, seed=i), **options)
        for k in range(6):
            params = gen_augmentation_params(k, get_preset("imagenet"))
            digest.update(decode_crop(data, params, 64 * (1 + k % 3)).tobytes())
    return digest.hexdigest()
