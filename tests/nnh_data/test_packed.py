"""PackedField (nnh_data.packed): a packed bytes or text field reads like the list it replaces."""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nnh_data import PackedField
from nnh_data.packed import as_views

binary = st.lists(st.one_of(st.none(), st.binary(max_size=9)), max_size=12)
text = st.lists(st.one_of(st.none(), st.text(max_size=6)), max_size=12)
ascii_text = st.lists(st.text(st.characters(max_codepoint=127), max_size=6), max_size=12)


def forms(values: list) -> list[PackedField]:
    """The field of ``values`` in each of its forms: kept values, packed tensors, and (for
    values without nulls) Arrow arrays kept and packed: chunked, views (as Parquet batches
    hold bytes and text), and dictionaries in one chunk and in two."""
    kept = PackedField.pack(values)
    packed = PackedField(kept.data, kept.offsets, kept.kind, kept.valid)
    out = [PackedField.pack(values), packed]
    if None not in values and values:
        kind = pa.string() if isinstance(values[0], str) else pa.binary()
        chunks = pa.chunked_array([pa.array(values[:2], kind), pa.array(values[2:], kind)])
        keys = np.arange(len(values))[::-1]
        shuffled = pa.DictionaryArray.from_arrays(keys, pa.array(values[::-1], kind))
        views = as_views(chunks)
        for array in (chunks, views, views.combine_chunks(), shuffled,
                      pa.chunked_array([shuffled[:1], shuffled[1:]])):  # fmt: skip
            arrow = PackedField.from_arrow(array)
            out += [PackedField.from_arrow(array), PackedField(arrow.data, arrow.offsets,
                                                               arrow.kind, arrow.valid)]
    return out


@given(st.one_of(binary, text, ascii_text), st.integers(-15, 15), st.integers(-15, 15))
def test_packed_values_read_like_the_list(values, start, stop):
    for packed in forms(values):
        assert len(packed) == len(values) and packed.tolist() == values and list(packed) == values
        assert [packed[i] for i in range(-len(values), len(values))] == values + values
        assert packed[start:stop].tolist() == values[start:stop] == packed[start:stop]
        assert pickle.loads(pickle.dumps(packed[start:stop])) == values[start:stop]
        lengths = [len(v.encode() if isinstance(v, str) else v or b"") for v in values]
        assert packed.lengths().tolist() == lengths
        assert packed.data.dtype == torch.uint8 and packed.offsets.dtype == torch.int64


surrogates = st.lists(st.one_of(st.none(), st.text(st.characters(categories=["Cs", "Ll", "Nd"]),
                                                   max_size=6)), max_size=12)  # fmt: skip


@given(surrogates)
def test_text_with_lone_surrogates_comes_back_as_it_went_in(values):
    """Keys of tar names that are not UTF-8 hold lone surrogates (as ``tarfile`` decodes them):
    packed, indexed, sliced and pickled, they are the same strings."""
    kept = PackedField.pack(values)
    packed = PackedField(kept.data, kept.offsets, kept.kind, kept.valid)
    for field in (kept, packed, pickle.loads(pickle.dumps(kept))):
        assert field.tolist() == values and [field[i] for i in range(len(values))] == values
        assert field[1:].tolist() == values[1:]


def test_kinds_values_and_errors():
    names = PackedField.pack(["cat", "é", None])
    assert names.kind == "str" and names[1] == "é" and names[2] is None
    assert names.valid.tolist() == [True, True, False]
    assert PackedField.pack([b"a", None]).kind == "bytes" and PackedField.pack([]).tolist() == []
    assert PackedField.pack([bytearray(b"x"), memoryview(b"yz")]).tolist() == [b"x", b"yz"]
    with pytest.raises(TypeError, match="all bytes or all str.*'b'"):
        PackedField.pack([b"a", "b"])
    with pytest.raises(TypeError, match="all bytes or all str.*1"):
        PackedField.pack(["a", 1])
    with pytest.raises(IndexError, match="index 3 out of range for 3 values"):
        names[3]
    with pytest.raises(ValueError, match="step 1"):
        names[::2]
    assert PackedField.pack(["a"]) != PackedField.pack([b"a"]) and "3 values" in repr(names)
    with pytest.raises(TypeError, match="a binary or string array, got dictionary<values=int64"):
        PackedField.from_arrow(pa.array([1, 2]).dictionary_encode())
    with_null = pa.DictionaryArray.from_arrays([1, 0, 1], pa.array([b"a", None]))
    assert PackedField.from_arrow(with_null).tolist() == [None, b"a", None]
    view_null = as_views(pa.array(["a", None, "long enough to be out of line"]))
    assert PackedField.from_arrow(view_null).tolist() == view_null.to_pylist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs an accelerator")
def test_pin_memory_keeps_the_values():
    packed = PackedField.pack([b"ab", None, b"c"]).pin_memory()
    assert packed.data.is_pinned() and packed.tolist() == [b"ab", None, b"c"]
