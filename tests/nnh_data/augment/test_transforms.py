"""Applying augmentation parameters: known transforms, keyed noise, determinism, input forms."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from nnh_data.augment import transforms
from nnh_data.augment.params import gen_augmentation_params, gen_augmentation_params_batch
from nnh_data.augment.transforms import (
    AugmentModule,
    AugmentParams,
    apply_augmentation,
    key_noise,
    mix64_,
)
from nnh_data.seeding import mix64

G = 0x9E3779B97F4A7C15
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def params(n: int = 1, **values: float) -> dict[str, np.ndarray]:
    """Identity parameters for ``n`` samples (real seeds), with ``values`` for all of them."""
    cols = gen_augmentation_params_batch(np.arange(n), rank_aware=False)
    identity = {"rotation": 0.0, "scale": 1.0, "brightness": 1.0, "contrast": 1.0, "noise": 0.0}
    for name, value in {**identity, **values}.items():
        cols[name] = np.full(n, value)
    return cols


def square(size: int = 64, half: int = 10) -> torch.Tensor:
    img = torch.zeros(1, 1, size, size)
    c = size // 2
    img[..., c - half : c + half, c - half : c + half] = 1.0
    return img


def ref_noise(seed: int, count: int) -> np.ndarray:
    """Keyed noise exactly as the module docstring writes it, in numpy float64."""
    pairs = (count + 1) // 2
    draws = np.arange(5, 5 + pairs, dtype=np.uint64)
    u = mix64(np.uint64(seed) + (draws + np.uint64(1)) * np.uint64(G))
    u1 = ((u >> np.uint64(40)) + np.uint64(1)) * 2.0**-24
    u2 = (u & np.uint64(0xFFFFFF)) * 2.0**-24
    r, t = np.sqrt(-2 * np.log(u1)), 2 * np.pi * u2
    return np.concatenate([r * np.cos(t), r * np.sin(t)])[:count]


def test_mix64_matches_numpy_bit_for_bit():
    rng = np.random.default_rng(0)
    z = rng.integers(0, 2**64 - 1, 10_000, dtype=np.uint64, endpoint=True)
    z[:4] = [0, 1, 2**63, 2**64 - 1]
    bits = torch.from_numpy(z.view(np.int64).copy())
    mix64_(bits, torch.empty_like(bits))
    assert np.array_equal(bits.numpy().view(np.uint64), mix64(z.copy()))


def test_key_noise_is_the_documented_algorithm():
    seeds = gen_augmentation_params_batch(np.arange(3))["seed"]
    z = key_noise(torch.from_numpy(seeds.view(np.int64)), 101).double().numpy()
    for row, seed in zip(z, seeds.tolist()):
        np.testing.assert_allclose(row, ref_noise(seed, 101), atol=2e-5)


def test_key_noise_rows_depend_only_on_their_seed():
    seeds = torch.tensor([5, -3, 2**62, 5])
    z = key_noise(seeds, 64)
    assert torch.equal(z[0], z[3]) and torch.equal(z[1], key_noise(seeds[1:2], 64)[0])
    assert not torch.equal(z[0], z[1])


def test_key_noise_is_standard_normal():
    z = key_noise(torch.arange(4), 50_000).double()
    assert abs(z.mean().item()) < 0.02 and abs(z.std().item() - 1) < 0.02
    assert z.abs().max().item() <= math.sqrt(2 * 24 * math.log(2))


def test_identity_returns_input():
    u8 = torch.randint(0, 256, (3, 3, 9, 11), dtype=torch.uint8)
    assert torch.equal(apply_augmentation(u8, params(3)), u8)
    f = torch.rand(3, 3, 9, 11)
    assert (apply_augmentation(f, params(3)) - f).abs().max() <= 1e-6


def test_layouts_dtypes_and_empty_batches():
    x = torch.rand(4, 3, 16, 16)
    p = gen_augmentation_params_batch(np.arange(4))
    out = apply_augmentation(x, p)
    assert torch.equal(apply_augmentation(x.to(memory_format=torch.channels_last), p), out)
    for dtype in (torch.float16, torch.float64):
        other = apply_augmentation(x.to(dtype), p)
        assert other.dtype == dtype and (other.float() - out).abs().max() < 1e-3
    empty = gen_augmentation_params_batch(np.arange(0))
    assert apply_augmentation(torch.zeros(0, 3, 8, 8), empty).shape == (0, 3, 8, 8)


def test_identity_rows_stay_exact_in_a_moving_batch():
    f = torch.rand(3, 3, 9, 11)
    p = params(3)
    p["rotation"][1] = 30.0
    out = apply_augmentation(f, p)
    assert torch.equal(out[0], f[0]) and torch.equal(out[2], f[2]) and not torch.equal(out[1], f[1])


def test_rotated_square_corners():
    out = apply_augmentation(square(), params(rotation=45.0))[0, 0]
    c, half_diag = 32, 10 * math.sqrt(2)
    # the rotated square's corners lie on the axes at half the diagonal; old corners are cut off
    for dy, dx in ((0, 1), (0, -1), (1, 0), (-1, 0)):
        y, x = round(c - 0.5 + dy * (half_diag - 2)), round(c - 0.5 + dx * (half_diag - 2))
        assert out[y, x] > 0.9
    for dy, dx in ((1, 1), (1, -1), (-1, 1), (-1, -1)):
        assert out[c - 1 + dy * 9 + (dy < 0), c - 1 + dx * 9 + (dx < 0)] < 0.1
    assert abs(out.sum().item() - 400) < 8  # the area is kept


def test_rotation_is_counter_clockwise_and_keeps_non_square_pixels():
    img = torch.rand(2, 3, 16, 16)
    ccw = apply_augmentation(img, params(2, rotation=90.0))
    torch.testing.assert_close(ccw, torch.rot90(img, 1, (-2, -1)), atol=1e-5, rtol=0)
    wide = torch.rand(1, 2, 6, 10)
    flipped = apply_augmentation(wide, params(rotation=180.0))
    torch.testing.assert_close(flipped, wide.flip(-2, -1), atol=1e-5, rtol=0)


def test_scale_zooms_in():
    out = apply_augmentation(square(half=8), params(scale=2.0))[0, 0]
    assert abs(out.sum().item() - 4 * 256) < 1e-3
    assert out[18:46, 18:46].min() == 1 and out[:15].max() == 0 and out[:, :15].max() == 0


def test_brightness_of_a_constant_image_and_clamp():
    img = torch.full((1, 3, 5, 5), 0.4)
    torch.testing.assert_close(apply_augmentation(img, params(brightness=1.5)), img * 1.5)
    assert torch.equal(apply_augmentation(img, params(brightness=3.0)), torch.ones_like(img))
    u8 = torch.full((1, 3, 5, 5), 101, dtype=torch.uint8)
    # 151.5 rounds half to even
    assert apply_augmentation(u8, params(brightness=1.5)).unique().tolist() == [152]


def test_contrast_of_a_two_level_image():
    img = torch.full((1, 1, 4, 4), 0.2)
    img[..., 2:] = 0.6
    out = apply_augmentation(img, params(contrast=0.5))[0, 0]
    torch.testing.assert_close(out[:, :2], torch.full((4, 2), 0.3))
    torch.testing.assert_close(out[:, 2:], torch.full((4, 2), 0.5))


def test_noise_scale_is_a_fraction_of_the_value_range():
    f = apply_augmentation(torch.full((1, 3, 64, 64), 0.5), params(noise=0.05)) - 0.5
    assert abs(f.std().item() - 0.05) < 0.003
    u8 = apply_augmentation(torch.full((1, 3, 64, 64), 128, dtype=torch.uint8), params(noise=0.05))
    assert abs(u8.double().std().item() - 0.05 * 255) < 0.5
    wide = torch.zeros(1, 3, 64, 64)
    out = apply_augmentation(wide, params(noise=0.05), value_range=(-1.0, 1.0))
    assert abs(out.std().item() - 0.1) < 0.006 and out.min() < 0


def test_batch_order_and_per_sample_calls_agree():
    images = torch.randint(0, 256, (6, 3, 20, 24), dtype=torch.uint8)
    p = gen_augmentation_params_batch(np.arange(6), rank_aware=False)
    out = apply_augmentation(images, p)
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(1))
    permuted = apply_augmentation(images[perm], {k: v[perm.numpy()] for k, v in p.items()})
    assert torch.equal(permuted, out[perm])
    singles = [apply_augmentation(images[i], gen_augmentation_params(i)) for i in range(6)]
    assert torch.equal(torch.stack(singles), out)
    assert not torch.equal(out, images)


def test_cpu_groups_give_the_one_pass_result(monkeypatch):
    """On the CPU a large batch runs in cache-sized groups: the same pixels as one pass."""
    images = torch.randint(0, 256, (7, 3, 40, 40), dtype=torch.uint8)
    p = gen_augmentation_params_batch(np.arange(7), rank_aware=False)
    whole = apply_augmentation(images, p)
    drawn = apply_augmentation(images, p, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(transforms, "_CPU_CHUNK_BYTES", 3 * 40 * 40 * 4 * 2)  # 2-4 images
    assert len(transforms._chunks(images)) > 1
    assert torch.equal(apply_augmentation(images, p), whole)
    again = apply_augmentation(images, p, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again, drawn)  # generator noise does not depend on the groups either


def test_params_forms_agree():
    images = torch.rand(4, 3, 12, 12)
    cols = gen_augmentation_params_batch(np.arange(4), rank_aware=False)
    dicts = [gen_augmentation_params(i) for i in range(4)]
    collated = default_collate(dicts)  # tensors, and 'seed' as a list of hex strings
    as_tensors = {k: torch.from_numpy(v) for k, v in cols.items() if k != "seed"}
    as_tensors["seed"] = torch.from_numpy(cols["seed"].view(np.int64))
    expected = apply_augmentation(images, cols)
    for form in (dicts, collated, as_tensors):
        assert torch.equal(apply_augmentation(images, form), expected)


_CHILD = """
import hashlib, sys, numpy as np, torch
from nnh_data.augment.params import gen_augmentation_params_batch
from nnh_data.augment.transforms import apply_augmentation
ids = np.array([int(a) for a in sys.argv[1:]])
images = torch.arange(len(ids) * 3 * 16 * 16, dtype=torch.float32).reshape(-1, 3, 16, 16) % 251
images = images[torch.from_numpy(np.argsort(np.argsort(ids)))].to(torch.uint8)
out = apply_augmentation(images, gen_augmentation_params_batch(ids, rank_aware=False))
print(hashlib.sha256(out[torch.from_numpy(np.argsort(ids))].numpy().tobytes()).hexdigest())
"""


@pytest.mark.timeout(120)
def test_same_result_in_other_processes_and_orders():
    orders = [[0, 1, 2, 3, 4], [4, 2, 0, 3, 1]]
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    commands = [[sys.executable, "-c", _CHILD, *map(str, order)] for order in orders]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, env=env) for c in commands]
    digests = [p.communicate(timeout=100)[0].decode().strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    images = torch.arange(5 * 3 * 16 * 16, dtype=torch.float32).reshape(-1, 3, 16, 16) % 251
    images = images.to(torch.uint8)
    out = apply_augmentation(images, gen_augmentation_params_batch(np.arange(5), rank_aware=False))
    assert digests == [hashlib.sha256(out.numpy().tobytes()).hexdigest()] * 2


def test_generator_draws_the_noise():
    img = torch.full((2, 3, 8, 8), 0.5)
    p = params(2, noise=0.1)
    a = apply_augmentation(img, p, generator=torch.Generator().manual_seed(3))
    b = apply_augmentation(img, p, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and not torch.equal(a, apply_augmentation(img, p))


def test_transform_objects():
    image = torch.randint(0, 256, (3, 10, 10), dtype=torch.uint8)
    sample = {"image": image, "label": 7, "__aug__": gen_augmentation_params(42)}
    out = AugmentParams()(sample)
    assert out["label"] == 7 and out["image"].dtype == torch.uint8 and sample["image"] is image
    assert torch.equal(out["image"], apply_augmentation(image, sample["__aug__"]))
    module = AugmentModule(padding_mode="border")
    batch = default_collate([sample, sample])
    expected = apply_augmentation(batch["image"], batch["__aug__"], padding_mode="border")
    assert torch.equal(module(batch["image"], batch["__aug__"]), expected)
    assert "border" in repr(module)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: apply_augmentation(torch.zeros(2, 3, 4, 4), params(3)), "holds 3 values for 2"),
        (lambda: apply_augmentation(torch.zeros(4, 4), params()), "got \\(4, 4\\)"),
        (lambda: apply_augmentation(torch.zeros(1, 1, 4, 4, dtype=torch.int32), params()), "uint8"),
        (lambda: apply_augmentation(torch.zeros(1, 1, 4, 4), {"rotation": [0]}), "missing keys"),
        (lambda: apply_augmentation(torch.zeros(1, 1, 4, 4), "seed"), "mapping"),
        (lambda: apply_augmentation(torch.zeros(1, 1, 4, 4), params(), padding_mode="x"), "zeros"),
        (lambda: apply_augmentation(torch.zeros(1, 1, 2, 2), params(), value_range=(1, 1)), "<"),
        (lambda: AugmentParams(padding_mode="wrap"), "padding_mode"),
        (lambda: AugmentModule(value_range=(2, 1)), "value_range"),
    ],
)
def test_user_errors_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@CUDA
def test_cuda_matches_cpu():
    seeds = torch.tensor([0, -1, 2**62, 12345])
    bits = seeds.view(-1, 1) + torch.arange(1000)
    expected = mix64_(bits.clone(), torch.empty_like(bits))
    assert torch.equal(mix64_(bits.cuda(), torch.empty_like(bits.cuda())).cpu(), expected)
    p = gen_augmentation_params_batch(np.arange(8), rank_aware=False)
    images = torch.rand(8, 3, 32, 40)
    gpu = apply_augmentation(images.cuda(), p)
    assert gpu.is_cuda
    torch.testing.assert_close(gpu.cpu(), apply_augmentation(images, p), atol=1e-4, rtol=0)
    u8 = (images * 255).byte()
    diff = apply_augmentation(u8.cuda(), p).cpu().int() - apply_augmentation(u8, p).int()
    assert diff.abs().max() <= 1


def test_float_images_outside_the_value_range_warn():
    images = torch.randn(2, 3, 8, 8)  # normalised: negative values
    params = gen_augmentation_params_batch(range(2), rank_aware=False)
    with pytest.warns(UserWarning, match="outside value_range"):
        apply_augmentation(images, params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_augmentation(images, params, value_range=(-10.0, 10.0))
        apply_augmentation(images.clamp(0, 1), params)


# --- crop and flip (the imagenet preset's geometry) -------------------------------------------


def geometry(n: int, **values: float) -> dict[str, np.ndarray]:
    """Identity parameters with a crop and flip column for ``n`` samples."""
    cols = params(n)
    for name, value in {"crop_x": 0.0, "crop_y": 0.0, "crop_w": 1.0, "crop_h": 1.0,
                        "flip": 0, **values}.items():  # fmt: skip
        cols[name] = np.full(n, value)
    return cols


def test_a_crop_is_stretched_to_the_whole_image():
    from nnh_data.augment.params import crop_box, get_preset

    images = torch.rand(5, 3, 30, 44, dtype=torch.float64)
    cols = gen_augmentation_params_batch(range(5), config=get_preset("imagenet"), rank_aware=False)
    out = apply_augmentation(images, cols)
    for i in range(5):
        left, top, right, bottom = crop_box({k: cols[k][i] for k in cols}, 44, 30)
        want = torch.nn.functional.interpolate(
            images[i : i + 1, :, top:bottom, left:right], size=(30, 44), mode="bilinear"
        )[0]
        want = want.flip(-1) if cols["flip"][i] else want
        # grid_sample reads the image around the crop at its edges, interpolate clamps
        torch.testing.assert_close(out[i, :, 2:-2, 2:-2], want[:, 2:-2, 2:-2])


def test_a_flip_alone_is_an_exact_mirror_and_the_whole_image_is_untouched():
    images = torch.randint(0, 256, (3, 3, 9, 13), dtype=torch.uint8)
    cols = geometry(3)
    cols["flip"] = np.array([1, 0, 1])
    out = apply_augmentation(images, cols)
    assert torch.equal(out[0], images[0].flip(-1)) and torch.equal(out[1], images[1])
    assert torch.equal(out[2], images[2].flip(-1))


def test_crop_flip_and_rotation_compose_and_dicts_work_too():
    images = torch.rand(2, 1, 16, 16)
    cols = geometry(2, crop_x=0.25, crop_y=0.25, crop_w=0.5, crop_h=0.5, flip=1, rotation=90.0)
    out = apply_augmentation(images, cols)
    rows = [{k: (v[i].item() if k != "seed" else format(int(v[i]), "016x"))
             for k, v in cols.items()} for i in range(2)]  # fmt: skip
    torch.testing.assert_close(apply_augmentation(images, rows), out)
    no_rotation = apply_augmentation(images, {**cols, "rotation": np.zeros(2)})
    # a quarter turn of the flipped crop: the crop's centre pixels only move, never blend
    torch.testing.assert_close(out[:, :, 4:12, 4:12].sum(), no_rotation[:, :, 4:12, 4:12].sum())


def test_geometry_keys_must_be_complete():
    cols = geometry(1)
    del cols["flip"]
    with pytest.raises(ValueError, match="flip"):
        apply_augmentation(torch.zeros(1, 1, 4, 4), cols)


@CUDA
def test_cuda_crop_and_flip_match_cpu():
    from nnh_data.augment.params import get_preset

    cfg = get_preset("imagenet")
    p = gen_augmentation_params_batch(np.arange(8), config=cfg, rank_aware=False)
    images = torch.rand(8, 3, 32, 40)
    gpu = apply_augmentation(images.cuda(), p)
    torch.testing.assert_close(gpu.cpu(), apply_augmentation(images, p), atol=1e-4, rtol=0)
