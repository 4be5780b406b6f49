"""Built-in decoders: every name on real shards written by webdataset's ShardWriter gives what
webdataset's own ``.decode(name)`` gives; batches, crop mode and the argument checks."""

from __future__ import annotations

import gzip
import io
import json
import pickle

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from nnh_data import (
    SampleDecoder,
    ShardedStreamingDataset,
    ShardError,
    decode_crop,
    get_preset,
    streaming_loader,
)
from nnh_data.images.decoders import DECODER_NAMES
from tests.support import encoded, picture

N = 6


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def _sample(i: int) -> dict:
    pixels = picture(40 + i, 30 + 2 * i, seed=i)
    return {
        "__key__": f"s{i:03d}",
        "jpg": encoded(pixels),
        "seg.png": encoded(pixels, "PNG", mode="RGBA" if i % 2 else "L"),
        "ppm": encoded(pixels, "PPM"),
        "webp": encoded(pixels, "WEBP", lossless=True),
        "cls": str(i).encode(),
        "txt": f"caption {i} é".encode(),
        "json": json.dumps({"i": i, "tags": ["a", "b"]}).encode(),
        "npy": _npy(np.arange(i + 3, dtype=np.float32).reshape(-1, 1)),
    }


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("decoders")
    with wds.ShardWriter(str(folder / "d-%04d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(N):
            sink.write(_sample(i))
    return str(folder / "d-{0000..0001}.tar")


def _fields(sample: dict) -> dict:
    return {k: v for k, v in sample.items() if not k.startswith("__")}


def _assert_same(ours, theirs, where: str) -> None:
    assert type(ours) is type(theirs), where
    if isinstance(ours, Image.Image):
        assert ours.mode == theirs.mode and ours.size == theirs.size, where
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs), err_msg=where)
    elif isinstance(ours, torch.Tensor):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), where
    elif isinstance(ours, np.ndarray):
        assert ours.dtype == theirs.dtype, where
        np.testing.assert_array_equal(ours, theirs, err_msg=where)
    else:
        assert ours == theirs, where


@pytest.mark.parametrize("name", DECODER_NAMES)
def test_every_name_decodes_as_webdataset_does(shards, name):
    ours = list(ShardedStreamingDataset(shards, shuffle=False, decode=name))
    handlers = [] if name == "bytes" else [name]
    theirs = list(wds.WebDataset(shards, shardshuffle=False).decode(*handlers))
    assert [s["__key__"] for s in ours] == [s["__key__"] for s in theirs]
    for mine, reference in zip(ours, theirs):
        assert _fields(mine).keys() == _fields(reference).keys()
        for field, value in _fields(mine).items():
            _assert_same(value, reference[field], f"{mine['__key__']}.{field} ({name})")
    first = ours[1]
    assert isinstance(first["cls"], int) and first["txt"] == "caption 1 é"
    if name == "rgb8":
        assert first["seg.png"].shape == (32, 41, 3)  # RGBA and L to RGB, as webdataset
    if name == "torchrgb":
        assert first["jpg"].dtype == torch.float32 and float(first["jpg"].max()) <= 1


def test_gz_fields_are_unzipped_and_pickles_stay_bytes():
    blob = pickle.dumps({"x": 1})
    sample = {"__key__": "a", "json.gz": gzip.compress(b'{"a": 1}'), "pkl": blob, "bin": b"\x00"}
    assert SampleDecoder("bytes")(sample) == {"__key__": "a", "json.gz": {"a": 1}, "pkl": blob,
                                              "bin": b"\x00"}  # fmt: skip


def test_values_that_are_not_bytes_are_left_alone():
    sample = {"__key__": "a", "jpg": None, "cls": 3, "txt": "done", "__aug__": {"flip": 1}}
    assert SampleDecoder("rgb8")(sample) == sample


def test_batches_are_decoded_column_by_column(shards):
    per_sample = list(ShardedStreamingDataset(shards, shuffle=False, decode="torchrgb8"))
    batches = list(ShardedStreamingDataset(shards, shuffle=False, batch_size=4, decode="torchrgb8"))
    assert [len(b["jpg"]) for b in batches] == [4, 2]
    flat = [(b["cls"][i], b["jpg"][i]) for b in batches for i in range(len(b["cls"]))]
    assert [c for c, _ in flat] == [s["cls"] for s in per_sample]
    assert all(torch.equal(img, s["jpg"]) for (_, img), s in zip(flat, per_sample))


def test_crop_mode_uses_each_samples_parameters(shards):
    cfg = get_preset("imagenet")
    ds = ShardedStreamingDataset(shards, shuffle=False, aug_config=cfg,
                                 decode=SampleDecoder("torchrgb8", crop_size=24))  # fmt: skip
    raw = {s["__key__"]: s for s in ShardedStreamingDataset(shards, shuffle=False, aug_config=cfg)}
    samples = list(ds)
    assert len(samples) == N and len({s["__aug__"]["crop_x"] for s in samples}) == N
    for s in samples:
        want = decode_crop(raw[s["__key__"]]["webp"], s["__aug__"], 24)
        assert s["webp"].shape == (3, 24, 24)
        assert torch.equal(s["webp"], torch.from_numpy(want).permute(2, 0, 1))
    batches = list(ShardedStreamingDataset(shards, shuffle=False, aug_config=cfg, batch_size=4,
                                           decode=SampleDecoder("rgb8", crop_size=24)))  # fmt: skip
    assert batches[0]["jpg"].shape == (4, 24, 24, 3) and batches[0]["jpg"].dtype == np.uint8
    for i in range(4):
        want = decode_crop(raw[batches[0]["__key__"][i]]["jpg"], samples[i]["__aug__"], 24)
        np.testing.assert_array_equal(batches[0]["jpg"][i], want)


def test_crop_mode_through_loader_workers(shards):
    ds = ShardedStreamingDataset(shards, aug_config=get_preset("imagenet"), batch_size=3,
                                 decode=SampleDecoder("torchrgb8", crop_size=16))  # fmt: skip
    batches = list(streaming_loader(ds, batch_size=3, num_workers=2, timeout=60))
    assert sorted(c for b in batches for c in b["cls"]) == list(range(N))
    assert all(b["jpg"].shape == (3, 3, 16, 16) and b["jpg"].dtype == torch.uint8 for b in batches)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"decode": "rgb"}, ["decode", "'rgb8'", "'rgb'"]),
        ({"decode": 3}, ["decode", "3"]),
        ({"decode": SampleDecoder("rgb8", crop_size=8)}, ["crop", "imagenet"]),
    ],
)
def test_bad_decode_arguments_fail_at_construction(shards, kwargs, words):
    with pytest.raises(ValueError) as err:
        ShardedStreamingDataset(shards, **kwargs)
    assert all(w in str(err.value) for w in words)


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [({"images": "png"}, "images"), ({"crop_size": 0}, "crop_size"),
     ({"images": "bytes", "crop_size": 8}, "bytes")],
)  # fmt: skip
def test_sample_decoder_checks_its_arguments(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SampleDecoder(**kwargs)


def _hf_sample(**fields) -> dict:
    return {"__key__": "k7", "__shard__": "/data/hf/train-0.parquet", **fields}


def test_a_mapping_decodes_the_fields_it_names_and_leaves_the_others():
    jpeg = encoded(picture(20, 12))
    sample = _hf_sample(image=jpeg, label=2, caption=b"raw", n=None)
    out = SampleDecoder({"image": "torchrgb8", "label": "cls", "n": "cls"})(sample)
    assert out["image"].shape == (3, 12, 20) and out["label"] == 2
    assert out["caption"] == b"raw" and out["n"] is None  # not named; a null stays None
    assert SampleDecoder({"label": "cls", "t": "txt", "j": "json"})(
        _hf_sample(label="3", t="text", j='{"a": 1}')
    ) == _hf_sample(label=3, t="text", j={"a": 1})  # fmt: skip


def test_image_values_decode_from_bytes_or_from_their_path(tmp_path):
    pixels = picture(16, 10)
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(encoded(pixels, "PNG"))
    shard = str(tmp_path / "part-0.parquet")
    by_path = {"__key__": "a", "__shard__": shard, "image": {"bytes": None, "path": "images/a.png"}}
    np.testing.assert_array_equal(SampleDecoder("rgb8")(by_path)["image"], pixels)
    np.testing.assert_array_equal(SampleDecoder({"image": "rgb8"})(by_path)["image"], pixels)
    assert SampleDecoder({"image": "bytes"})(by_path)["image"] == encoded(pixels, "PNG")
    audio = {"__key__": "a", "audio": {"bytes": b"RIFF....WAVE", "path": "a.wav"}}
    assert SampleDecoder("rgb8")(audio) == audio  # the same fields, another format: left alone


def test_image_values_are_cropped_and_stacked_in_batches():
    jpegs = [encoded(picture(30 + i, 20, seed=i)) for i in range(3)]
    params = {"crop_x": [0, 1, 2], "crop_y": [0, 0, 1], "crop_w": [10, 12, 14],
              "crop_h": [9, 8, 7], "flip": [0, 1, 0], "sample_id": [0, 1, 2]}  # fmt: skip
    batch = {"__key__": ["a", "b", "c"], "__shard__": ["s"] * 3, "__index__": np.arange(3),
             "__aug__": params, "image": [{"bytes": j, "path": None} for j in jpegs]}  # fmt: skip
    for decoder in (SampleDecoder("torchrgb8", crop_size=8),
                    SampleDecoder({"image": "torchrgb8"}, crop_size=8)):  # fmt: skip
        images = decoder(batch)["image"]
        assert images.shape == (3, 3, 8, 8)
        row = {name: values[1] for name, values in params.items()}
        want = torch.from_numpy(decode_crop(jpegs[1], row, 8)).permute(2, 0, 1)
        assert torch.equal(images[1], want)


def test_a_named_field_that_cannot_be_decoded_names_shard_key_and_field():
    with pytest.raises(ShardError) as caught:
        SampleDecoder({"label": "rgb8"})(_hf_sample(label=3))
    assert caught.value.url == "/data/hf/train-0.parquet"
    assert caught.value.position == "sample 'k7', field 'label'"
    batch = {"__key__": ["a", "b"], "__shard__": ["s0", "s1"], "__index__": np.arange(2),
             "image": [encoded(picture(8, 8)), b"not an image"]}  # fmt: skip
    with pytest.raises(ShardError, match=r"s1: 'rgb8' cannot decode.*sample 'b', field 'image'"):
        SampleDecoder({"image": "rgb8"})(batch)
    with pytest.raises(ShardError, match=r"no such field \(the fields: \['image'\]\).*'label'"):
        SampleDecoder({"label": "cls"})(_hf_sample(image=b""))
    with pytest.raises(ShardError, match=r"^s0: no such field.*sample 'a', field 'label'"):
        SampleDecoder({"label": "cls"})(batch)
    assert SampleDecoder({"n": "cls"})({**batch, "n": np.arange(2)})["n"].tolist() == [0, 1]


def test_image_bytes_in_a_field_without_an_image_extension_warn():
    sample = _hf_sample(image=encoded(picture(8, 8)))
    with pytest.warns(UserWarning, match=r"decode=\{'image': 'rgb8'\}"):
        assert SampleDecoder("rgb8")(sample)["image"] == sample["image"]


@pytest.mark.parametrize(
    ("images", "word"),
    [({}, "at least one"), ({"image": "png"}, "'image': 'png'"), ({3: "rgb8"}, "3: 'rgb8'")],
)
def test_a_mapping_is_checked(images, word):
    with pytest.raises(ValueError, match=word):
        SampleDecoder(images)
    with pytest.raises(ValueError, match="crop_size decodes images"):
        SampleDecoder({"label": "cls"}, crop_size=8)
