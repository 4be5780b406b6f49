"""The hand-off (nnh_data.workers.handoff): batches as tensors and packed fields, equal to what the
plain collation gives, and the same whether they cross a DataLoader worker queue or not."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, IterableDataset, default_collate

from nnh_data import PackedField, ShardedStreamingDataset, Source, streaming_loader
from nnh_data.shards.reading import build_shard_index
from nnh_data.workers.handoff import (
    BY_VALUE_BYTES,
    PACKED_LIST_BYTES,
    collate_decoded,
    collate_samples,
    handed_out,
    tensor_columns,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]


def plain(value):
    """A batch with packed fields as lists and tensors with their dtype, to compare."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, PackedField):
        return ("packed", value.kind, value.tolist())
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.tolist())
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def as_default(value):
    """``default_collate`` output with the lists collate_samples packs marked as packed."""
    if isinstance(value, dict):
        return {k: as_default(v) for k, v in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], (bytes, str)):
        return ("packed", "str" if isinstance(value[0], str) else "bytes", value)
    return plain(value)


field = st.sampled_from(["int", "float", "bool", "bytes", "str", "nested", "tensor"])
VALUES = {
    "int": st.integers(-(2**62), 2**62),
    "float": st.floats(allow_nan=False),
    "bool": st.booleans(),
    "bytes": st.binary(max_size=5),
    "str": st.text(max_size=4),
    "nested": st.fixed_dictionaries({"a": st.integers(0, 9), "b": st.floats(0, 1)}),
    "tensor": st.integers(0, 9).map(lambda i: torch.full((2,), i)),
}


@st.composite
def sample_lists(draw):
    kinds = draw(st.dictionaries(st.text("abc", min_size=1, max_size=2), field, max_size=4))
    n = draw(st.integers(1, 6))
    return [{name: draw(VALUES[kind]) for name, kind in kinds.items()} for _ in range(n)]


@settings(max_examples=60, deadline=None)
@given(sample_lists())
def test_collate_samples_is_default_collate_with_packed_fields(samples):
    assert plain(collate_samples(samples)) == as_default(default_collate(samples))


def test_collate_samples_details():
    batch = collate_samples([{"t": "a", "x": 1}, {"t": None, "x": 2, "y": b"z"}])
    assert batch["t"].tolist() == ["a", None] and batch["y"].tolist() == [None, b"z"]
    assert batch["x"].dtype == torch.int64
    mixed = collate_samples([{"v": 1}, {"v": 2.5}])  # what default_collate makes of it
    assert mixed["v"].dtype == default_collate([1, 2.5]).dtype
    # a nullable column (and a list column) stays Python values, as in batch mode
    assert collate_samples([{"v": 1}, {"v": None}])["v"] == [1, None]
    assert collate_samples([{"v": None}, {"v": 2.5}])["v"] == [None, 2.5]
    assert collate_samples([{"v": [1]}, {"v": [2, 3]}])["v"] == [[1], [2, 3]]
    assert collate_samples([{"d": {"a": 1}}, {"d": None}])["d"] == [{"a": 1}, None]
    assert collate_samples([(1, 2), (3, 4)])[0].tolist() == [1, 3]  # not dicts: default


def test_tensor_columns_outside_a_worker():
    import numpy as np

    out = tensor_columns({"i": np.arange(3), "b": [b"x", None, b"y"], "f": [1.0, None, 2.0],
                          "n": {"s": ["a", "b", "c"]}})  # fmt: skip
    assert out["i"].tolist() == [0, 1, 2] and isinstance(out["b"], PackedField)
    assert out["f"] == [1.0, None, 2.0] and out["n"]["s"] == ["a", "b", "c"]
    assert type(handed_out(out)) is dict


class Batches(IterableDataset):
    """Batches as a worker hands them out: small and large tensors and packed fields."""

    def __iter__(self):
        for i in range(3):
            yield handed_out(make_batch(i))


def make_batch(i: int) -> dict:
    big = BY_VALUE_BYTES // 8 + 1
    return {
        "small": torch.arange(4) + i,
        "big": torch.full((big,), i, dtype=torch.float64),
        "half": torch.ones(3, dtype=torch.bfloat16) * i,
        "text": PackedField.pack([f"t{i}", None]),
        "blob": PackedField.pack([bytes([i]) * (BY_VALUE_BYTES + 1)]),
        "nested": {"n": torch.tensor([i])},
        "other": [i, "x"],
        "blobs": [bytes([i, j]) * (PACKED_LIST_BYTES // 4) for j in range(3)],  # travel packed
        "few": [b"ab", b"c"],  # travel as they are
        "huge": [bytes([i, j]) * (BY_VALUE_BYTES // 2) for j in range(2)],  # in shared memory
    }


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_worker_batches_arrive_as_plain_dicts_of_the_same_values(context):
    loader = DataLoader(Batches(), batch_size=None, num_workers=1, multiprocessing_context=context)
    got = list(loader)
    assert [plain(b) for b in got] == [plain(make_batch(i)) for i in range(3)]
    assert all(type(b) is dict and type(b["nested"]) is dict for b in got)
    assert all(type(b[k]) is list and {type(v) for v in b[k]} == {bytes}
               for b in got for k in ("blobs", "few", "huge"))  # fmt: skip


def _check_rows_equal_samples(ds_args: dict, workers: int = 0, batch: int = 5):
    """streaming_loader's batches (rows collated from columns) equal collate_samples over the
    per-sample dicts of the same dataset; the dataset of the first."""
    dataset = ShardedStreamingDataset(**ds_args)
    fast = list(streaming_loader(dataset, batch, num_workers=workers))
    ds = ShardedStreamingDataset(**ds_args)
    ds.set_loader_batch_size(batch)
    slow = DataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=collate_samples)
    reference = [plain(b) for b in slow]
    assert [plain(b) for b in fast] == reference and reference
    assert [list(b) for b in fast] == [list(b) for b in reference]  # the fields' order too
    return dataset


@pytest.mark.parametrize("workers", [0, 2])
def test_rows_collated_from_columns_equal_the_samples_collated(tar_shards, workers):
    urls = tar_shards([7, 0, 5, 9])
    settings = {"seed": 4, "shuffle_window": 4, "rank": 1, "world_size": 2}
    _check_rows_equal_samples({"source": urls, **settings}, workers)


def test_rows_equal_samples_for_parquet_types(tmp_path):
    table = pa.table({"i32": pa.array(range(9), pa.int32()), "u8": pa.array(range(9), pa.uint8()),
                      "f32": pa.array([0.5] * 9, pa.float32()), "b": [True, False, True] * 3,
                      "s": list("abcdefghé"), "bin": [b"x"] * 9, "lst": [[1, 2]] * 9,
                      "ls": pa.array(["t"] * 9, pa.large_string()),
                      "ns": ["a", None, "c"] * 3})  # fmt: skip
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=4)
    _check_rows_equal_samples({"source": str(tmp_path / "t.parquet"), "seed": 1}, batch=4)


def test_rows_equal_samples_when_mixing_and_skipping(tar_shards, parquet_shards):
    urls = tar_shards([4, 4, 4], name="a")
    index = build_shard_index(urls)
    with open(urls[1], "r+b") as f:
        f.truncate(512 * 5)
    sources = [Source(index, repeat=1.5, name="a"), Source(tar_shards([6], name="b"), name="b")]
    with pytest.warns(UserWarning, match="a-000001"):
        ds = _check_rows_equal_samples({"source": sources, "seed": 2, "on_error": "skip"}, batch=4)
    assert ds.error_counts[urls[1]] >= 4


def test_parquet_batches_pack_text_and_decode_gets_lists(tmp_path):
    pq.write_table(pa.table({"s": ["a", "bé", None, "d"], "b": [b"x", b"", b"z", b"w"]}),
                   tmp_path / "t.parquet")  # fmt: skip
    (batch,) = ShardedStreamingDataset(str(tmp_path / "t.parquet"), shuffle=False, batch_size=4)
    assert batch["s"] == ["a", "bé", None, "d"] and batch["b"].tolist() == [b"x", b"", b"z", b"w"]
    decoded = ShardedStreamingDataset(str(tmp_path / "t.parquet"), shuffle=False, batch_size=4,
                                      decode=lambda b: (b["s"], b["b"]))  # fmt: skip
    assert list(decoded) == [(["a", "bé", None, "d"], [b"x", b"", b"z", b"w"])]


def test_loader_view_is_the_dataset(tar_shards):
    ds = ShardedStreamingDataset(tar_shards([5]), seed=0)
    loader = streaming_loader(ds, 2)
    loader.dataset.set_epoch(3)
    assert ds.epoch == 3 and loader.dataset.seed == 0 and len(loader.dataset) == len(ds)
    with pytest.raises(ValueError, match="per-sample datasets without decode"):
        ShardedStreamingDataset(tar_shards([5]), batch_size=2).loader_view()


def decoded_samples(i: int) -> list[dict]:
    """Decoded samples as a decode function returns them: tensors of several dtypes and
    layouts (a transposed view, bfloat16 which numpy lacks), a numpy array, a number."""
    g = torch.Generator().manual_seed(i)
    return [
        {"image": torch.randint(0, 256, (4, 5, 3), dtype=torch.uint8, generator=g),
         "t": torch.randn(3, 2, generator=g).T, "half": torch.ones(2, dtype=torch.bfloat16) * j,
         "array": torch.randn(2, generator=g).numpy(), "cls": j}
        for j in range(3)
    ]  # fmt: skip


class Decoded(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return decoded_samples(i)


@pytest.mark.parametrize("workers", [0, 1])
def test_collate_decoded_is_default_collate(workers):
    loader = DataLoader(Decoded(), batch_size=None, num_workers=workers,
                        collate_fn=collate_decoded)  # fmt: skip
    got = list(loader)
    assert [plain(b) for b in got] == [plain(default_collate(decoded_samples(i))) for i in range(2)]
    assert all(b["image"].dtype == torch.uint8 and b["t"].shape == (3, 2, 3) for b in got)
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        collate_decoded([{"x": torch.zeros(2)}, {"x": torch.zeros(3)}])


NUMBER = st.one_of(st.integers(-(2**64), 2**64), st.booleans(), st.floats(allow_nan=False),
                   st.integers(-9, 9).map(np.int32))  # fmt: skip
ARRAY = st.tuples(st.sampled_from(["<i4", ">i4", "u1", "f2", "f8", "?", "<U2", "i8"]),
                  st.integers(1, 2), st.integers(0, 3)).map(
    lambda d: np.full((d[1],), d[2]).astype(d[0]))  # fmt: skip
COLUMN = st.one_of(
    st.sampled_from([st.integers(-(2**63), 2**63 - 1), st.booleans(), st.floats(allow_nan=False)]),
    st.just(NUMBER),  # numbers of mixed kinds
    ARRAY.map(st.just),  # one array for every sample
    st.just(ARRAY),  # arrays of mixed dtypes and shapes
)


def outcome(collate_fn, samples):
    try:
        return plain(collate_fn(samples))
    except Exception as exc:
        return type(exc)


@settings(max_examples=150, deadline=None)
@given(st.lists(COLUMN, min_size=1, max_size=3), st.integers(1, 5), st.data())
def test_collate_decoded_of_numbers_and_arrays_is_default_collate(columns, n, data):
    """numpy makes the tensors of Python numbers and stacks numpy arrays where it gives
    torch's result: the same dtypes, values and errors as default_collate otherwise."""
    samples = [{f"c{i}": data.draw(c) for i, c in enumerate(columns)} for _ in range(n)]
    assert outcome(collate_decoded, samples) == outcome(default_collate, samples)
    values = [sample["c0"] for sample in samples]  # a list of values, not of dicts
    assert outcome(collate_decoded, values) == outcome(default_collate, values)
