"""Hugging Face data sets as sources, on files ``datasets`` itself writes (``to_parquet`` shards
and a ``save_to_disk`` folder of Arrow files; an ``Image()``, a ``ClassLabel``, a nullable int,
a list and a string column): every sample once per epoch at 1-3 ranks with 0 and 2 workers, in
sample and batch mode; mid-epoch resume; decoders by field name, with crops; errors that name
the shard, the sample and the field."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from nnh_data import (
    SampleDecoder,
    ShardedStreamingDataset,
    ShardError,
    get_preset,
    streaming_loader,
)
from tests.nnh_data.hf_data import CLASSES, ROWS, hf_row, row_of_key, write_parquet, write_saved

pytest.importorskip("datasets", reason="the datasets package (the dev extra) writes these files")
pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]

SHARDS = {"parquet": 4, "saved": 3}  # neither divides 2 ranks or 3 ranks both


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("hf")
    return {"parquet": write_parquet(folder / "parquet", SHARDS["parquet"]),
            "saved": write_saved(folder / "saved", SHARDS["saved"])}  # fmt: skip


def rows_of(batch: dict, kind: str) -> list[int]:
    """The data set rows of a batch's real (not pad) samples."""
    keys = batch["__key__"].tolist() if hasattr(batch["__key__"], "tolist") else batch["__key__"]
    pads = batch["__pad__"].tolist()
    return [row_of_key(k, SHARDS[kind]) for k, pad in zip(keys, pads) if not pad]


def check_values(batch: dict, kind: str) -> None:
    """Each row's label, nullable score, tags and caption are the row's own."""
    for i, row in enumerate(rows_of_all(batch, kind)):
        want = hf_row(row)
        assert int(batch["label"][i]) == want["label"]
        assert batch["score"][i] == want["score"]  # None where null
        assert list(batch["tags"][i]) == want["tags"]
        assert batch["caption"][i] == want["caption"]


def rows_of_all(batch: dict, kind: str) -> list[int]:
    keys = batch["__key__"].tolist() if hasattr(batch["__key__"], "tolist") else batch["__key__"]
    return [row_of_key(k, SHARDS[kind]) for k in keys]


@pytest.mark.parametrize("kind", ["parquet", "saved"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("batch_size", [None, 4])
def test_every_sample_once_per_epoch(sources, kind, world, workers, batch_size):
    seen, lengths = Counter(), []
    for rank in range(world):
        ds = ShardedStreamingDataset(sources[kind], seed=3, shuffle_window=8, rank=rank,
                                     world_size=world, batch_size=batch_size)  # fmt: skip
        ds.set_epoch(1)
        batches = list(streaming_loader(ds, batch_size or 5, num_workers=workers))
        lengths.append(len(batches))
        for batch in batches:
            check_values(batch, kind)
            assert isinstance(batch["score"], list)  # a nullable column: Python values
            seen.update(rows_of(batch, kind))
    assert seen == Counter(range(ROWS)) and len(set(lengths)) == 1


def test_image_values_come_undecoded_without_a_decoder(sources):
    (batch,) = ShardedStreamingDataset(sources["saved"], shuffle=False, batch_size=ROWS)
    assert [image["bytes"] for image in batch["image"]] == [
        hf_row(i)["image"]["bytes"] for i in range(ROWS)
    ]  # fmt: skip


@pytest.mark.parametrize("kind", ["parquet", "saved"])
@pytest.mark.parametrize("batch_size", [None, 4])
def test_decoded_samples_and_batches_keep_nulls_as_none(sources, kind, batch_size):
    decode = {"image": "bytes", "label": "cls"}  # images of several sizes: no stacking
    ds = ShardedStreamingDataset(sources[kind], shuffle=False, decode=decode,
                                 batch_size=batch_size)  # fmt: skip
    loader = streaming_loader(ds, batch_size or 4, num_workers=2)
    scores = [s for batch in loader for s in batch["score"]]
    assert scores.count(None) == len([i for i in range(ROWS) if hf_row(i)["score"] is None])


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_gives_the_rest_once(sources, workers):
    def loader_of(rank):
        ds = ShardedStreamingDataset(sources["saved"], seed=9, rank=rank, world_size=2)
        return streaming_loader(ds, 3, num_workers=workers)

    handed, rest = [], []
    for rank in range(2):
        loader = loader_of(rank)
        it = iter(loader)
        for _ in range(2):
            handed += rows_of(next(it), "saved")
        state = loader.state_dict()
        del it
        resumed = loader_of(rank)
        resumed.load_state_dict(state)
        rest += [row for batch in resumed for row in rows_of(batch, "saved")]
    assert Counter(handed + rest) == Counter(range(ROWS))


@pytest.mark.parametrize("kind", ["parquet", "saved"])
def test_decoders_by_field_name_decode_and_crop_the_image_column(sources, kind):
    ds = ShardedStreamingDataset(sources[kind], shuffle=False,
                                 decode={"image": "rgb8", "label": "cls"})  # fmt: skip
    for sample in ds:
        number = row_of_key(sample["__key__"], SHARDS[kind])
        row = hf_row(number)
        assert sample["image"].shape == (20 + number % 5, 24 + number % 7, 3)
        assert sample["label"] == row["label"] and CLASSES[sample["label"]]
        assert sample["tags"] == row["tags"]  # fields not named: as they are
    crop = SampleDecoder({"image": "torchrgb8"}, crop_size=16)
    for batch_size in (None, 6):
        ds = ShardedStreamingDataset(sources[kind], seed=1, decode=crop, batch_size=batch_size,
                                     aug_config=get_preset("imagenet"))  # fmt: skip
        batch = next(iter(streaming_loader(ds, 6)))
        assert batch["image"].shape == (6, 3, 16, 16) and batch["image"].dtype == torch.uint8


def test_by_extension_decoders_decode_the_image_value(sources):
    ds = ShardedStreamingDataset(sources["parquet"], shuffle=False, decode="torchrgb8")
    sample = next(iter(ds))
    assert isinstance(sample["image"], torch.Tensor) and sample["image"].shape[0] == 3
    assert sample["label"] == 0 and isinstance(sample["label"], (int, np.integer))


@pytest.mark.parametrize("batch_size", [None, 4])
def test_a_field_its_decoder_cannot_decode_names_shard_key_and_field(sources, batch_size):
    ds = ShardedStreamingDataset(sources["saved"], shuffle=False, batch_size=batch_size,
                                 decode={"image": "rgb8", "caption": "rgb8"})  # fmt: skip
    with pytest.raises(ShardError) as caught:
        next(iter(ds))
    text = str(caught.value)
    assert "data-00000-of-00003.arrow" in text and "'data-00000-of-00003/0'" in text
    assert "field 'caption'" in text and "'rgb8' cannot decode" in text
    typo = ShardedStreamingDataset(sources["saved"], decode={"imgae": "rgb8"})
    with pytest.raises(ShardError, match="field 'imgae'.*no such field"):
        next(iter(typo))


def test_a_bad_decoder_name_fails_at_construction(sources):
    with pytest.raises(ValueError, match="decode=.*'image': 'jpeg'"):
        ShardedStreamingDataset(sources["saved"], decode={"image": "jpeg"})
