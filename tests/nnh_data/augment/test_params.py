"""Augmentation parameters: config validation, presets, golden vectors, quality, streaming, and
the crop and flip geometry (a property test; the same crops for any world size or workers)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from torch.utils.data import DataLoader

from nnh_data import (
    GEOMETRY_NAMES,
    PARAM_NAMES,
    AugmentationConfig,
    ShardedStreamingDataset,
    build_shard_index,
    crop_box,
    gen_augmentation_params,
    gen_augmentation_params_batch,
    gen_distributed_augmentation_params,
    get_preset,
    list_presets,
    stream_distributed_augmentation_chain,
)
from nnh_data.augment.params import param_names
from nnh_data.seeding import GOLDEN as G
from nnh_data.seeding import uniform_draws
from tests.support import DATA, simulated

GOLDEN = DATA / "golden_params.json"


# --- configuration and presets -------------------------------------------------------------


def test_defaults_are_moderate_and_round_trip_through_json():
    cfg = AugmentationConfig()
    assert cfg == get_preset("moderate")
    again = AugmentationConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and isinstance(again.rotation_range, tuple)


@pytest.mark.parametrize(
    ("name", "rotation", "noise", "contrast"),
    [
        ("mild", (-15, 15), (0, 0.05), (0.85, 1.15)),
        ("moderate", (-30, 30), (0, 0.1), (0.7, 1.3)),
        ("aggressive", (-45, 45), (0, 0.15), (0.6, 1.4)),
    ],
)
def test_presets(name, rotation, noise, contrast):
    cfg = get_preset(name)
    assert (cfg.rotation_range, cfg.noise_range, cfg.contrast_range) == (rotation, noise, contrast)


def test_presets_are_listed_and_immutable():
    assert list_presets() == ["mild", "moderate", "aggressive", "imagenet"]
    with pytest.raises(AttributeError):
        get_preset("mild").rotation_range = (0, 0)
    with pytest.raises(ValueError, match="mild"):
        get_preset("extreme")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"rotation_range": (10, -10)}, ["rotation_range", "low <= high"]),
        ({"scale_range": (0, 1)}, ["scale_range", "> 0"]),
        ({"noise_range": (-0.1, 0.1)}, ["noise_range", ">= 0"]),
        ({"brightness_range": (-1, 1)}, ["brightness_range"]),
        ({"contrast_range": (-1, 1)}, ["contrast_range"]),
        ({"rotation_range": (0, float("inf"))}, ["rotation_range", "finite"]),
        ({"rotation_range": (0, float("nan"))}, ["rotation_range", "finite"]),
        ({"rotation_range": (1, 2, 3)}, ["rotation_range", "pair"]),
        ({"rotation_range": "ab"}, ["rotation_range"]),
        ({"augmentation_depth": 0}, ["augmentation_depth", "0"]),
        ({"augmentation_depth": 1.5}, ["augmentation_depth"]),
    ],
)
def test_config_validation(kwargs, words):
    with pytest.raises(ValueError) as err:
        AugmentationConfig(**kwargs)
    assert all(w in str(err.value) for w in words)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="rotation"):
        AugmentationConfig.from_dict({"rotation": (0, 1)})


# --- exact numbers ------------------------------------------------------------------------


def _run_case(case):
    args = case["args"]
    if case["fn"] == "plain":
        cfg = get_preset(args["preset"])
        return gen_augmentation_params(args["sample_id"], cfg, args["base_seed"], args["epoch"])
    cfg = AugmentationConfig(augmentation_depth=args["depth"])
    return gen_distributed_augmentation_params(
        args["sample_id"], args["rank"], cfg, args["base_seed"], args["world_size"], args["epoch"]
    )


def test_golden_vectors():
    cases = json.loads(GOLDEN.read_text())["cases"]
    assert len(cases) > 100
    for case in cases:
        assert _run_case(case) == case["expected"], case["args"]


def test_values_inside_ranges_and_types():
    cfg = get_preset("aggressive")
    p = gen_augmentation_params(3, cfg)
    for name, (low, high) in zip(PARAM_NAMES, cfg.ranges()):
        assert isinstance(p[name], float) and low <= p[name] <= high
    assert (p["sample_id"], p["rank"], p["epoch"]) == (3, 0, 0)
    assert isinstance(p["seed"], str)


def test_degenerate_range_gives_its_value():
    cfg = AugmentationConfig(rotation_range=(5, 5), noise_range=(0, 0))
    p = gen_augmentation_params(11, cfg)
    assert p["rotation"] == 5.0 and p["noise"] == 0.0


def _numbers(p):
    return [p[n] for n in PARAM_NAMES]


def test_plain_depends_only_on_seed_id_epoch():
    a = gen_augmentation_params(17, base_seed=3, epoch=2)
    assert a == gen_augmentation_params(17, base_seed=3, epoch=2)
    assert _numbers(a) != _numbers(gen_augmentation_params(17, base_seed=3, epoch=3))
    assert _numbers(a) != _numbers(gen_augmentation_params(17, base_seed=4, epoch=2))
    assert _numbers(a) != _numbers(gen_augmentation_params(18, base_seed=3, epoch=2))


def test_distributed_differs_across_ranks_and_world_sizes():
    ranks = [_numbers(gen_distributed_augmentation_params(5, r, world_size=4)) for r in range(4)]
    assert len({tuple(r) for r in ranks}) == 4
    other_world = _numbers(gen_distributed_augmentation_params(5, 0, world_size=2))
    assert other_world != ranks[0]


def test_depth_is_part_of_the_key():
    one = gen_augmentation_params(5, AugmentationConfig(augmentation_depth=1))
    two = gen_augmentation_params(5, AugmentationConfig(augmentation_depth=2))
    assert _numbers(one) != _numbers(two)


@pytest.mark.parametrize("rank_aware", [True, False])
def test_batch_equals_scalar(rank_aware):
    ids = np.array([0, 9, 3, 123456789, 9])
    cfg = get_preset("mild")
    cols = gen_augmentation_params_batch(
        ids, 2, 3, cfg, base_seed=8, epoch=4, rank_aware=rank_aware
    )
    for i, sid in enumerate(ids.tolist()):
        if rank_aware:
            p = gen_distributed_augmentation_params(sid, 2, cfg, 8, 3, 4)
        else:
            p = gen_augmentation_params(sid, cfg, 8, 4)
        row = {k: cols[k][i].item() for k in (*PARAM_NAMES, "sample_id", "epoch")}
        assert row == {k: p[k] for k in row}
        assert format(int(cols["seed"][i]), "016x") == p["seed"]
        assert cols["rank"][i] == 2


def test_batch_accepts_empty_and_rejects_bad_ids():
    assert gen_augmentation_params_batch([])["rotation"].shape == (0,)
    with pytest.raises(ValueError, match="sample_ids"):
        gen_augmentation_params_batch([1, -2])
    with pytest.raises(ValueError, match="sample_ids"):
        gen_augmentation_params_batch([1.5])
    with pytest.raises(ValueError, match="rank"):
        gen_augmentation_params_batch([1], rank=3, world_size=2)
    with pytest.raises(ValueError, match="config"):
        gen_augmentation_params_batch([1], config={"rotation_range": (0, 1)})


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: gen_augmentation_params(-1), "sample_id"),
        (lambda: gen_augmentation_params(1, base_seed=-1), "base_seed"),
        (lambda: gen_augmentation_params(1, epoch=-1), "epoch"),
        (lambda: gen_distributed_augmentation_params(1, rank=2, world_size=2), "rank"),
        (lambda: gen_distributed_augmentation_params(1, rank=0, world_size=0), "world_size"),
    ],
)
def test_scalar_validation(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# --- statistical quality ------------------------------------------------------------------


@pytest.fixture(scope="module")
def many():
    return gen_augmentation_params_batch(np.arange(100_000), base_seed=1, rank_aware=False)


@pytest.mark.parametrize("index", range(len(PARAM_NAMES)))
def test_uniform_coverage_ks(many, index):
    name, (low, high) = PARAM_NAMES[index], get_preset("moderate").ranges()[index]
    result = stats.kstest(many[name], stats.uniform(loc=low, scale=high - low).cdf)
    assert result.pvalue > 1e-3, (name, result)


def test_low_correlation_between_parameters_and_neighbours(many):
    matrix = np.vstack([many[n] for n in PARAM_NAMES])
    corr = np.corrcoef(matrix)
    assert np.abs(corr - np.eye(len(PARAM_NAMES))).max() < 0.02
    for name in PARAM_NAMES:
        assert abs(np.corrcoef(many[name][:-1], many[name][1:])[0, 1]) < 0.02


def test_identical_in_a_separate_process():
    code = (
        "import json; from nnh_data import gen_augmentation_params as g, "
        "gen_distributed_augmentation_params as d; "
        "print(json.dumps([g(i, base_seed=5, epoch=1) for i in range(20)]"
        " + [d(i, 1, base_seed=5, world_size=3) for i in range(20)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    here = [gen_augmentation_params(i, base_seed=5, epoch=1) for i in range(20)]
    here += [
        gen_distributed_augmentation_params(i, 1, base_seed=5, world_size=3) for i in range(20)
    ]
    assert json.loads(out.stdout) == here


# --- streaming chain ----------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
def test_chain_yields_rank_range_equal_to_scalar(chunk_size):
    chain = list(
        stream_distributed_augmentation_chain(23, 3, 4, chunk_size=chunk_size, base_seed=2)
    )
    assert [p["sample_id"] for p in chain] == list(range(18, 23))
    assert chain == [
        gen_distributed_augmentation_params(i, 3, base_seed=2, world_size=4) for i in range(18, 23)
    ]


def test_chain_covers_all_samples_once_over_ranks():
    ids = [
        p["sample_id"] for r in range(5) for p in stream_distributed_augmentation_chain(37, r, 5)
    ]
    assert ids == list(range(37))


def test_chain_is_lazy_for_huge_counts():
    chain = stream_distributed_augmentation_chain(10**15, 1, 2, chunk_size=4)
    first = [next(chain) for _ in range(3)]
    assert [p["sample_id"] for p in first] == [5 * 10**14 + i for i in range(3)]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_samples": -1}, "num_samples"),
        ({"rank": 4}, "rank"),
        ({"world_size": 0}, "world_size"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"base_seed": -5}, "base_seed"),
        ({"epoch": 1.5}, "epoch"),
    ],
)
def test_chain_validates_at_call(kwargs, name):
    args = {"num_samples": 10, "rank": 0, "world_size": 4, **kwargs}
    with pytest.raises(ValueError, match=name):
        stream_distributed_augmentation_chain(**args)


def test_cached_keys_still_reject_bools():
    gen_augmentation_params(1, base_seed=1, epoch=1)
    with pytest.raises(ValueError, match="base_seed"):
        gen_augmentation_params(1, base_seed=True, epoch=1)
    with pytest.raises(ValueError, match="epoch"):
        gen_augmentation_params(1, base_seed=1, epoch=True)


# --- image geometry: crop and flip ----------------------------------------------------------

IMAGENET = get_preset("imagenet")
OLD_KEYS = [*PARAM_NAMES, "sample_id", "rank", "epoch", "seed"]


def test_presets_without_geometry_keep_their_columns_and_description():
    for name in ("mild", "moderate", "aggressive"):
        cfg = get_preset(name)
        assert param_names(cfg) == PARAM_NAMES and not cfg.geometry
        assert list(gen_augmentation_params(1, cfg)) == OLD_KEYS
        assert list(gen_augmentation_params_batch([1], config=cfg)) == OLD_KEYS
        assert "crop" not in cfg.to_dict()
    assert param_names(IMAGENET) == (*PARAM_NAMES, *GEOMETRY_NAMES)
    p = gen_augmentation_params(1, IMAGENET)
    assert list(p) == [*PARAM_NAMES, *GEOMETRY_NAMES, "sample_id", "rank", "epoch", "seed"]
    assert isinstance(p["flip"], int) and isinstance(p["crop_w"], float)
    assert AugmentationConfig.from_dict(json.loads(json.dumps(IMAGENET.to_dict()))) == IMAGENET


def test_imagenet_geometry_golden_values():
    """Pinned numbers: a change of the crop algorithm must be deliberate."""
    p = gen_augmentation_params(3, IMAGENET)
    assert p["seed"] == "36568e207cac1c5a"
    assert (p["crop_x"], p["crop_y"], p["crop_w"], p["crop_h"], p["flip"]) == (
        0.34058894754676294, 0.45187628458843493, 0.5290281417201688, 0.4945805610189475, 1,
    )  # fmt: skip
    assert crop_box(p, 500, 375) == (170, 169, 435, 355)


def test_geometry_leaves_the_five_parameters_unchanged():
    cfg = AugmentationConfig(crop=True, flip_prob=0.3)
    for i in range(20):
        with_geometry, plain = gen_augmentation_params(i, cfg), gen_augmentation_params(i)
        assert {k: with_geometry[k] for k in plain} == plain


def test_exp_is_exact_to_an_ulp_and_the_same_for_scalars_and_arrays():
    from nnh_data.augment.params import _exp

    x = np.linspace(-8, 8, 20001)
    got = _exp(x)
    want = np.array([math.exp(v) for v in x])
    assert np.all(np.abs(got - want) <= np.spacing(want))
    assert all(_exp(np.array([v]))[0] == g for v, g in zip(x[::997], got[::997]))


def _check_crop(cols, i, cfg):
    x, y, w, h = (float(cols[k][i]) for k in GEOMETRY_NAMES[:4])
    assert 0 <= x and 0 <= y and x + w <= 1 + 1e-12 and y + h <= 1 + 1e-12
    (a_low, a_high), (r_low, r_high) = cfg.crop_scale_range, cfg.crop_ratio_range
    fallback = (w, h) in ((1.0, 1.0), (1.0, 1 / r_low), (r_high, 1.0))
    tolerance = 1e-9
    in_range = a_low - tolerance <= w * h <= a_high + tolerance and (
        r_low * (1 - tolerance) <= w / h <= r_high * (1 + tolerance)
    )
    assert in_range or fallback, (x, y, w, h)
    assert int(cols["flip"][i]) in (0, 1)


@settings(max_examples=60, deadline=None)
@given(
    area=st.tuples(st.floats(0.01, 1), st.floats(0.01, 1)).map(sorted),
    ratio=st.tuples(st.floats(0.1, 10), st.floats(0.1, 10)).map(sorted),
    flip=st.floats(0, 1),
    seed=st.integers(0, 2**64 - 1),
    epoch=st.integers(0, 1000),
    ids=st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=20),
    size=st.tuples(st.integers(1, 5000), st.integers(1, 5000)),
)
def test_crops_lie_inside_with_area_and_ratio_in_range(area, ratio, flip, seed, epoch, ids, size):
    cfg = AugmentationConfig(crop=True, crop_scale_range=area, crop_ratio_range=ratio,
                             flip_prob=flip)  # fmt: skip
    cols = gen_augmentation_params_batch(ids, config=cfg, base_seed=seed, epoch=epoch,
                                         rank_aware=False)  # fmt: skip
    width, height = size
    for i, sample_id in enumerate(ids):
        _check_crop(cols, i, cfg)
        scalar = gen_augmentation_params(sample_id, cfg, seed, epoch)
        assert all(scalar[k] == cols[k][i] for k in GEOMETRY_NAMES)  # scalar == batch
        left, top, right, bottom = crop_box(scalar, width, height)
        assert 0 <= left < right <= width and 0 <= top < bottom <= height


def _torchvision_crop(u, cfg):
    """torchvision's RandomResizedCrop.get_params on a 1 x 1 image, written as it is there
    (a loop of attempts), from the sample's uniform draws ``u`` (areas, ratios, x, y)."""
    (a_low, a_high), (r_low, r_high) = cfg.crop_scale_range, cfg.crop_ratio_range
    for attempt in range(10):
        area = a_low + (a_high - a_low) * u[attempt]
        log_ratio = math.log(r_low) + (math.log(r_high) - math.log(r_low)) * u[10 + attempt]
        w, h = math.sqrt(area * math.exp(log_ratio)), math.sqrt(area / math.exp(log_ratio))
        if 0 < w <= 1 and 0 < h <= 1:
            break
    else:
        w, h = (1.0, 1 / r_low) if r_low > 1 else (r_high, 1.0) if r_high < 1 else (1.0, 1.0)
    return u[20] * (1 - w), u[21] * (1 - h), w, h


@pytest.mark.parametrize("ratio", [(3 / 4, 4 / 3), (1.5, 3.0), (0.2, 0.5)])
def test_crops_follow_torchvisions_algorithm(ratio):
    cfg = AugmentationConfig(crop=True, crop_ratio_range=ratio, flip_prob=0.5)
    ids = np.arange(3000)
    cols = gen_augmentation_params_batch(ids, config=cfg, rank_aware=False)
    first = cols["seed"] + np.uint64((2**32 * G) % 2**64)  # draws 2**32 on
    draws = uniform_draws(first, 23)
    for i in ids:
        want = _torchvision_crop(draws[:, i], cfg)
        got = [cols[k][i] for k in GEOMETRY_NAMES[:4]]
        assert np.allclose(got, want, rtol=1e-14, atol=1e-15), (i, got, want)
        assert cols["flip"][i] == (draws[22, i] < 0.5)
    assert abs(cols["flip"].mean() - 0.5) < 0.03


@pytest.mark.parametrize(("kwargs", "word"), [
    ({"crop": 1}, "crop"), ({"crop_scale_range": (0, 0.5)}, "crop_scale_range"),
    ({"crop_scale_range": (0.5, 1.5)}, "crop_scale_range"),
    ({"crop_ratio_range": (0, 2)}, "crop_ratio_range"), ({"flip_prob": 1.5}, "flip_prob"),
    ({"flip_prob": "half"}, "flip_prob"), ({"flip_prob": True}, "flip_prob"),
])  # fmt: skip
def test_geometry_validation(kwargs, word):
    with pytest.raises(ValueError, match=word):
        AugmentationConfig(**kwargs)


@pytest.mark.timeout(120)
def test_crops_are_the_same_for_any_world_size_and_worker_count(tar_shards, monkeypatch):
    index = build_shard_index(tar_shards([7, 5, 9]))
    want = {g: gen_augmentation_params(g, IMAGENET, base_seed=4, epoch=1) for g in range(21)}

    def crops(samples):
        return {s["__index__"]: tuple(s["__aug__"][k] for k in GEOMETRY_NAMES) for s in samples}

    expected = crops({"__index__": g, "__aug__": p} for g, p in want.items())
    for world, workers in [(1, 0), (2, 3), (3, 2)]:
        seen = {}
        for rank in range(world):
            ds = ShardedStreamingDataset(index, rank=rank, world_size=world, seed=4, epoch=1,
                                         aug_config=IMAGENET)  # fmt: skip
            seen.update(crops(simulated(ds, workers, monkeypatch)))
        assert seen == expected, (world, workers)
    ds = ShardedStreamingDataset(index, rank=1, world_size=2, seed=4, epoch=1, aug_config=IMAGENET)
    real = list(DataLoader(ds, batch_size=None, num_workers=2, timeout=60))
    assert crops(real) == {g: expected[g] for g in crops(real)}
