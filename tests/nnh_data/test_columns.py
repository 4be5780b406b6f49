"""Columns of samples (nnh_data.columns): the operations batch mode is built from."""

from __future__ import annotations

from itertools import repeat

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nnh_data.columns import columns_of, concat, cut, num_rows, rows_of, take

names = st.lists(st.text(min_size=1, max_size=5), min_size=0, max_size=12)


@given(names, st.integers(0, 6))
def test_rows_of_is_dict_zip_per_row(keys, rows):
    columns = [[(k, i) for i in range(rows)] for k in keys]
    expected = [dict(zip(keys, row)) for row in zip(*columns)]
    assert rows_of(keys, columns) == (expected if keys else [])


def test_rows_of_fills_constants_and_round_trips_columns_of():
    rows = rows_of(["a", "b", "c"], [[1, 2, 3], repeat("s"), np.arange(3).tolist()])
    assert rows == [{"a": i + 1, "b": "s", "c": i} for i in range(3)]
    assert columns_of(rows) == {"a": [1, 2, 3], "b": ["s"] * 3, "c": [0, 1, 2]}


@given(st.lists(st.integers(0, 9), min_size=1, max_size=20), st.data())
def test_take_cut_concat_keep_rows_together(values, data):
    cols = {"n": np.array(values), "s": [str(v) for v in values], "nested": {"x": np.array(values)}}
    order = np.array(data.draw(st.permutations(range(len(values)))), dtype=np.int64)
    taken = take(cols, order)
    assert (
        taken["s"]
        == [str(v) for v in taken["n"].tolist()]
        == [str(v) for v in taken["nested"]["x"]]
    )
    split = data.draw(st.integers(0, len(values)))
    joined = concat([cut(taken, 0, split), cut(taken, split, len(values))])
    assert num_rows(joined) == len(values) and joined["s"] == taken["s"]
    assert joined["n"].tolist() == taken["n"].tolist()


def test_concat_fills_missing_columns_and_mixes_numpy_with_lists():
    joined = concat([{"a": np.array([1, 2]), "b": [1, 2]}, {"a": [3], "c": ["z"]}])
    assert joined == {"a": [1, 2, 3], "b": [1, 2, None], "c": [None, None, "z"]}


@given(st.lists(st.dictionaries(st.sampled_from("abc"), st.integers(0, 9)), max_size=6))
def test_columns_of_is_the_plain_per_key_gather(samples):
    names = dict.fromkeys(key for sample in samples for key in sample)
    expected = {name: [sample.get(name) for sample in samples] for name in names}
    got = columns_of(samples)
    assert got == expected and list(got) == list(expected)


@given(st.lists(st.one_of(st.none(), st.text(max_size=3)), min_size=1, max_size=12), st.data())
def test_arrow_columns_give_the_values_of_lists(values, data):
    import pyarrow as pa

    from nnh_data.columns import as_list, without_arrow

    arrow, plain = {"s": pa.array(values, pa.string())}, {"s": list(values)}
    n = len(values)
    idx = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=2 * n)), dtype=np.int64)
    a, b = data.draw(st.integers(0, n)), data.draw(st.integers(0, n))
    assert as_list(take(arrow, idx)["s"]) == take(plain, idx)["s"]
    assert as_list(cut(arrow, a, b)["s"]) == cut(plain, a, b)["s"]
    assert as_list(concat([arrow, cut(arrow, a, b)])["s"]) == values + values[a:b]
    assert concat([arrow, plain])["s"] == values + values  # mixed: Python values
    assert without_arrow({"n": arrow})["n"]["s"] == values


@given(st.lists(st.binary(max_size=4), min_size=1, max_size=12), st.data())
def test_arrow_bytes_taken_again_joined_and_packed_give_the_values_of_lists(values, data):
    import pyarrow as pa

    from nnh_data.columns import as_list
    from nnh_data.packed import PackedField

    n = len(values)
    split = data.draw(st.integers(0, n))
    read = pa.chunked_array([pa.array(values[:split], pa.binary()),
                             pa.array(values[split:], pa.binary())])  # a window of two blocks
    arrow, plain = {"b": read}, {"b": list(values)}
    orders = [np.array(data.draw(st.permutations(range(n))), dtype=np.int64) for _ in range(2)]
    taken, expected = take(arrow, orders[0]), take(plain, orders[0])
    twice = take(concat([cut(taken, 0, split), cut(taken, split, n)]), orders[1])
    assert as_list(taken["b"]) == expected["b"]
    assert as_list(twice["b"]) == take(expected, orders[1])["b"]
    with_read = concat([twice, arrow])["b"]  # rows taken beside rows as read: still Arrow
    assert isinstance(with_read, pa.ChunkedArray)
    assert as_list(with_read) == as_list(twice["b"]) + values
    for column in (taken["b"], twice["b"], with_read):
        packed = PackedField.from_arrow(column)
        assert PackedField(packed.data, packed.offsets, packed.kind, None) == as_list(column)


@given(st.lists(st.one_of(st.none(), st.binary(max_size=20)), min_size=1, max_size=12), st.data())
def test_views_taken_give_the_values_of_lists(values, data):
    """Bytes read from Parquet are views: taking rows gathers the views (nulls too), in a slice
    of a joined array as well, and packing gives the values."""
    import pyarrow as pa

    from nnh_data.columns import as_list
    from nnh_data.packed import PackedField, as_views

    n = len(values)
    split = data.draw(st.integers(0, n))
    views = as_views(pa.chunked_array([pa.array(values[:split], pa.binary()),
                                       pa.array(values[split:], pa.binary())]))  # fmt: skip
    a = data.draw(st.integers(0, n - 1))
    arrow, plain = cut({"b": views}, a, n), {"b": values[a:]}
    idx = np.array(data.draw(st.lists(st.integers(0, n - a - 1), max_size=2 * n)), dtype=np.int64)
    taken = take(arrow, idx)["b"]
    assert taken.type == pa.binary_view() and as_list(taken) == take(plain, idx)["b"]
    assert taken.null_count == sum(v is None for v in take(plain, idx)["b"])
    packed = PackedField.from_arrow(taken)
    assert PackedField(packed.data, packed.offsets, packed.kind, packed.valid) == as_list(taken)


@given(st.lists(st.one_of(st.none(), st.integers(0, 9)), min_size=1, max_size=12), st.data())
def test_every_kind_of_arrow_column_taken_together_gives_the_values_of_lists(values, data):
    """One take of columns of every Arrow kind (short text, nullable numbers, views, a
    dictionary, beside numpy and nested columns) gives each column's values at the indices."""
    import pyarrow as pa

    from nnh_data.columns import as_list, constant
    from nnh_data.packed import as_views

    n = len(values)
    text = [None if v is None else f"t{v}" for v in values]
    columns = {"t": pa.array(text), "i": pa.array(values, pa.int64()),
               "v": as_views(pa.array([None if v is None else bytes(v) * 20 for v in values])),
               "d": constant("a.parquet", n), "n": np.arange(n), "aug": {"x": np.arange(n) * 2}}
    idx = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=2 * n)), dtype=np.int64)
    taken = take(columns, idx)
    for name in ("t", "i", "v", "d"):
        assert as_list(taken[name]) == [as_list(columns[name])[i] for i in idx]
    assert taken["n"].tolist() == idx.tolist() and taken["aug"]["x"].tolist() == (idx * 2).tolist()
    with pytest.raises(IndexError):
        take({"t": pa.array(text)}, np.array([n]))


def test_a_constant_text_column_is_arrow_and_reads_like_its_list():
    """A shard's URL labels every row of a batch as a one-value Arrow dictionary: taken, cut,
    joined and packed, it gives the values of the list it replaces; other values are lists."""
    from nnh_data.columns import as_list, constant
    from nnh_data.packed import PackedField

    url, other = {"u": constant("a/s.tar", 4)}, {"u": constant("b/t.tar", 2)}
    assert as_list(url["u"]) == ["a/s.tar"] * 4 and constant(3, 2) == [3, 3]
    taken = take(concat([url, other]), np.array([5, 0, 4, 1], dtype=np.int64))
    assert as_list(taken["u"]) == ["b/t.tar", "a/s.tar", "b/t.tar", "a/s.tar"]
    blocks = concat([{"u": constant("a/s.tar", 50)}, {"u": constant("b/t.tar", 30)}])
    backwards = take(blocks, np.arange(79, -1, -1))["u"]  # joined as keys: small dictionaries
    assert backwards.type == url["u"].type and as_list(backwards) == as_list(blocks["u"])[::-1]
    for column in (cut(url, 1, 3)["u"], taken["u"], concat([taken, url])["u"], constant("x", 0),
                   backwards):  # fmt: skip
        packed = PackedField.from_arrow(column)
        assert packed.kind == "str" and packed == as_list(column)
        assert PackedField(packed.data, packed.offsets, "str", None) == as_list(column)


def test_dictionary_columns_are_taken_by_their_keys_null_keys_too():
    import pyarrow as pa

    from nnh_data.columns import as_list

    words = pa.array(["a", "b"])
    with_null = pa.DictionaryArray.from_arrays(pa.array([1, None, 0, 1], pa.int32()), words)
    assert as_list(take({"d": with_null}, np.array([3, 1, 0, 2]))["d"]) == ["b", None, "b", "a"]
    plain = pa.DictionaryArray.from_arrays(pa.array([1, 0], pa.int32()), words)
    assert as_list(take({"d": plain}, np.array([1, 1, 0]))["d"]) == ["a", "a", "b"]


@given(st.sampled_from(["int8", "int32", "int64", "uint16", "float32", "float64"]),
       st.lists(st.integers(0, 100), max_size=12), st.integers(0, 3))  # fmt: skip
def test_arrow_of_is_pa_array_of_the_values(dtype, values, offset):
    import pyarrow as pa

    from nnh_data.columns import arrow_of

    array = np.array(values, dtype)[offset:]  # a view that does not start its buffer too
    assert arrow_of(array).equals(pa.array(array))
