"""What a new user's real files and mistakes do: never a silent wrong result (issue 9)."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from nnh_data import ShardedStreamingDataset, ShardError, StaleIndexError, build_shard_index
from tests.support import numbered_samples, write_tar

pytestmark = pytest.mark.timeout(120)


def _rewrite_same_size(path: str, count: int) -> None:
    before = os.path.getsize(path)
    write_tar(path, numbered_samples(0, count, 16), pax=False)
    assert os.path.getsize(path) == before  # tar pads to 10 KiB records
    os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 1))


def test_rewritten_shard_of_the_same_size_is_reindexed(tmp_path):
    path = tmp_path / "s-000000.tar"
    write_tar(path, numbered_samples(0, 7, 16), pax=False)
    assert build_shard_index(str(path)).total_samples == 7
    _rewrite_same_size(path, 8)
    ds = ShardedStreamingDataset(str(path))
    assert len(list(ds)) == 8


@pytest.mark.parametrize(("before", "after"), [(7, 8), (8, 7)])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_stale_index_in_hand_raises_with_the_fix(tmp_path, before, after, on_error):
    path = tmp_path / "s-000000.tar"
    write_tar(path, numbered_samples(0, before, 16), pax=False)
    index = build_shard_index(str(path))
    _rewrite_same_size(path, after)
    ds = ShardedStreamingDataset(index, on_error=on_error, shuffle=False)
    with pytest.raises(StaleIndexError, match="rebuild") as info:
        list(ds)
    assert str(path) in str(info.value)


def test_stale_parquet_index_raises(tmp_path):
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"x": list(range(6))}), path, row_group_size=3)
    index = build_shard_index(path)
    pq.write_table(pa.table({"x": list(range(7))}), path, row_group_size=3)
    with pytest.raises(StaleIndexError, match="rebuild"):
        list(ShardedStreamingDataset(index, on_error="skip"))


def test_state_from_another_shard_list_is_refused(tar_shards, tmp_path):
    urls = tar_shards([12, 12, 12, 12])
    ds = ShardedStreamingDataset(urls, seed=0)
    it = iter(ds)
    [next(it) for _ in range(5)]
    state = ds.state_dict()
    other = ShardedStreamingDataset(list(reversed(urls)), seed=0)  # same total, other order
    with pytest.raises(ValueError, match=r"state\['shards'\].*same shards"):
        other.load_state_dict(state)
    ShardedStreamingDataset(urls, seed=0).load_state_dict(state)  # the same list loads


def test_parquet_column_types_follow_the_dataset(tmp_path):
    pq.write_table(pa.table({"v": [1, 2, 3]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"v": [4, None, 6]}), tmp_path / "b.parquet")
    pq.write_table(pa.table({"w": [1.5, 2.5, 3.5], "v": [7, 8, 9]}).select(["v"]),
                   tmp_path / "c.parquet")  # fmt: skip
    for seed in range(4):
        ds = ShardedStreamingDataset(str(tmp_path), batch_size=2, seed=seed)
        for batch in ds:
            assert isinstance(batch["v"], list)  # nullable somewhere: lists, None for nulls
        values = sorted((s["v"] is None, s["v"] or 0) for s in ShardedStreamingDataset(
            str(tmp_path), seed=seed))  # fmt: skip
        assert values[-1] == (True, 0)
    keys = [s["__key__"] for s in ShardedStreamingDataset(str(tmp_path))]
    assert len(set(keys)) == 9 and "b/1" in keys


def test_decode_errors_name_shard_and_key_and_skip_counts(tar_shards):
    urls = tar_shards([4, 4])

    def decode(sample):
        if sample["__key__"] == "00000005":
            raise OSError("truncated JPEG")
        return sample

    with pytest.raises(ShardError, match=r"shard-000001\.tar.*truncated JPEG.*'00000005'"):
        list(ShardedStreamingDataset(urls, decode=decode))
    ds = ShardedStreamingDataset(urls, decode=decode, on_error="skip")
    with pytest.warns(UserWarning, match="truncated JPEG"):
        assert len(list(ds)) == 7
    assert ds.error_counts == {urls[1]: 1}


def _corrupt_header(path: str, sample: int) -> None:
    """Break the checksum of the first header of sample ``sample`` (2 members per sample)."""
    with tarfile.open(path) as tar:
        offset = tar.getmembers()[2 * sample].offset
    with open(path, "r+b") as f:
        f.seek(offset + 148)
        f.write(b"7777777\0")


def test_skip_drops_only_the_bad_sample_and_counts_in_workers(tar_shards):
    urls = tar_shards([10, 10], pax=False)
    index = build_shard_index(urls)
    _corrupt_header(urls[0], 3)
    ds = ShardedStreamingDataset(index, on_error="skip", seed=0)
    got = [int(i) for b in DataLoader(ds, batch_size=4, num_workers=2) for i in b["__index__"]]
    assert sorted(got) == [i for i in range(20) if i != 3]
    assert ds.error_counts == {urls[0]: 1}  # seen in the training process


def test_split_samples_warn(tmp_path):
    path = tmp_path / "gnu.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name in ["a.jpg", "b.jpg", "a.cls", "b.cls"]:  # as `tar -C dir .` may store them
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    with pytest.warns(UserWarning, match="not contiguous"):
        list(ShardedStreamingDataset(str(path)))


def test_folder_and_missing_shard(tar_shards, tmp_path):
    urls = tar_shards([3, 2])
    assert len(list(ShardedStreamingDataset(str(tmp_path)))) == 5
    with pytest.raises(FileNotFoundError, match="gone.tar"):
        ShardedStreamingDataset([*urls, str(tmp_path / "sub" / "gone.tar")])
    (tmp_path / "x.tar.gz").write_bytes(b"")
    with pytest.raises(ValueError, match="compressed tar is not supported"):
        ShardedStreamingDataset(str(tmp_path / "x.tar.gz"))


def test_a_path_that_does_not_exist_says_so(tar_shards, tmp_path):
    tar_shards([2])
    for name in ("trian", "trian.tar"):
        with pytest.raises(FileNotFoundError) as caught:
            ShardedStreamingDataset(str(tmp_path / name))
        assert str(caught.value) == (
            f"no such file or folder: {str(tmp_path / name)!r} (1 of 1 shards missing)"
        )
    (tmp_path / "train").mkdir()
    with pytest.raises(FileNotFoundError, match="no shards .* in folder"):
        ShardedStreamingDataset(str(tmp_path / "train"))


def test_seed_has_one_form_in_both_modes(tar_shards):
    urls = tar_shards([6])
    per_sample = {s["__index__"]: s["__aug__"]["seed"] for s in ShardedStreamingDataset(urls)}
    for batch in ShardedStreamingDataset(urls, batch_size=4):
        seeds = batch["__aug__"]["seed"]
        assert seeds.dtype == torch.int64
        assert [per_sample[i] for i in batch["__index__"].tolist()] == seeds.tolist()


@pytest.mark.parametrize("batch_size", [None, 4])
@pytest.mark.parametrize("rank_aware", [False, True])
def test_precomputed_parameters_equal_generated_ones(tar_shards, tmp_path, batch_size, rank_aware):
    from nnh_data import PrecomputeSpec, get_preset, write_precomputed_params

    urls = tar_shards([5, 6])
    config = get_preset("mild")
    spec = PrecomputeSpec(11, epochs=2, config=config, seed=3, rank_aware=rank_aware,
                          world_size=2 if rank_aware else 1, rows_per_file=7)  # fmt: skip
    write_precomputed_params(spec, tmp_path / "table", progress=False)
    kwargs = dict(seed=3, aug_config=config, batch_size=batch_size, epoch=1, rank=1,
                  world_size=2, rank_aware_params=rank_aware)  # fmt: skip
    generated = list(ShardedStreamingDataset(urls, **kwargs))
    replayed = list(ShardedStreamingDataset(urls, precomputed=str(tmp_path / "table"), **kwargs))
    for a, b in zip(generated, replayed, strict=True):
        for name, value in a["__aug__"].items():
            assert np.array_equal(np.asarray(value), np.asarray(b["__aug__"][name])), name
    with pytest.raises(ValueError, match="seed"):
        ShardedStreamingDataset(urls, precomputed=str(tmp_path / "table"), **{**kwargs, "seed": 4})
    late = ShardedStreamingDataset(urls, precomputed=str(tmp_path / "table"), **kwargs)
    with pytest.raises(ValueError, match="epochs"):
        late.set_epoch(2)


# ---------------------------------------------------------------- damaged shards (issue 21)


def _keys(ds, batch_size: int | None = 4) -> Counter:
    """Every key the dataset hands out through a DataLoader with two workers."""
    loader = DataLoader(ds, batch_size=batch_size, num_workers=2)
    return Counter(key for batch in loader for key in batch["__key__"])


def _damage_header(path: str, sample: int, how: str) -> int:
    """Damage the first header of sample ``sample`` (2 members per sample): a wrong checksum,
    or a size of 10 GiB; returns its offset."""
    with tarfile.open(path) as tar:
        member = tar.getmembers()[2 * sample]
    with open(path, "r+b") as f:
        f.seek(member.offset + (148 if how == "checksum" else 0))
        if how == "checksum":
            f.write(b"7777777\0")
        else:
            info = tarfile.TarInfo(member.name)
            info.size = 10 << 30
            f.write(info.tobuf(tarfile.GNU_FORMAT))
    return member.offset


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("checksum", "bad tar header checksum at byte {at}"),
        ("huge", "the member at byte {at} '00000004.bin' declares 10737418240 bytes, past the "
                 "end of the file ({size} bytes)"),  # fmt: skip
    ],
)
def test_skip_indexes_the_samples_before_and_after_a_damaged_header(tar_shards, how, reason):
    urls = tar_shards([10, 10], pax=False)
    at = _damage_header(urls[0], 4, how)
    reason = reason.format(at=at, size=os.path.getsize(urls[0]))
    expected = Counter(f"{g:08d}" for g in range(20) if g != 4)
    for opened in ("scanned", "from the sidecar"):
        with pytest.warns(UserWarning, match="lost") as caught:
            ds = ShardedStreamingDataset(urls, on_error="skip", seed=1)
        lost = [str(w.message) for w in caught if "lost" in str(w.message)]
        assert lost == [f"{urls[0]}: 1 sample lost, 9 indexed ({reason})"], opened
        assert len(ds) == 19 and _keys(ds) == expected
        assert ds.error_counts == {urls[0]: 1}
    with pytest.raises(ShardError) as caught:
        ShardedStreamingDataset(urls)  # "raise" scans the damaged shard again and raises
    assert caught.value.url == urls[0]


def test_skip_leaves_out_files_that_are_no_tar_and_says_what_they_are(tar_shards, tmp_path):
    urls = tar_shards([10, 10])
    gz = tmp_path / "shard-000002.tar"
    gz.write_bytes(gzip.compress(open(urls[0], "rb").read()))
    junk = tmp_path / "shard-000003.tar"
    junk.write_bytes(b"no tar archive here\n" * 50)
    with pytest.raises(ShardError) as caught:
        ShardedStreamingDataset([str(gz)], format="tar")
    assert str(caught.value) == (
        f"{gz}: gzip-compressed, not supported (nnh seeks to samples by byte offset, which a "
        "compressed stream cannot do): decompress it with gunzip (at byte 0)"
    )
    with pytest.raises(ShardError, match="not a tar file: its first block is no tar header"):
        ShardedStreamingDataset([str(junk)])
    with pytest.warns(UserWarning) as warned:
        ds = ShardedStreamingDataset([*urls, str(gz), str(junk)], on_error="skip")
    lost = sorted(str(w.message) for w in warned if "lost" in str(w.message))
    assert lost == [
        f"{gz}: an unknown number of samples lost, 0 indexed (gzip-compressed, not supported "
        "(nnh seeks to samples by byte offset, which a compressed stream cannot do): "
        "decompress it with gunzip (at byte 0))",
        f"{junk}: an unknown number of samples lost, 0 indexed (not a tar file: no readable tar "
        "header in its 1000 bytes)",
    ]
    assert _keys(ds) == Counter(f"{g:08d}" for g in range(20))
    assert ds.error_counts == {str(gz): 0, str(junk): 0}  # listed: their loss is unknown


def _parquet_set(tmp_path) -> list[str]:
    """a.parquet: ids 0-29 in row groups of 10; b.parquet: ids 30-39."""
    paths = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    pq.write_table(pa.table({"id": list(range(30)), "t": ["x"] * 30}), paths[0],
                   row_group_size=10)  # fmt: skip
    pq.write_table(pa.table({"id": list(range(30, 40)), "t": ["y"] * 10}), paths[1])
    return paths


@pytest.mark.parametrize("batch_size", [None, 4])
def test_skip_keeps_the_readable_row_groups_of_a_damaged_parquet_file(tmp_path, batch_size):
    paths = _parquet_set(tmp_path)
    build_shard_index(paths)  # the footer is whole: the damage shows when the rows are read
    page = pq.read_metadata(paths[0]).row_group(1).column(0).data_page_offset
    with open(paths[0], "r+b") as f:
        f.seek(page)
        f.write(b"\xff" * 16)  # row group 1's first page header
    ds = ShardedStreamingDataset(paths, on_error="skip", batch_size=batch_size, seed=2)
    batches = list(DataLoader(ds, batch_size=None if batch_size else 4, num_workers=2))
    ids = Counter(int(i) for batch in batches for i in batch["id"])
    assert ids == Counter([*range(10), *range(20, 40)])
    assert ds.error_counts == {paths[0]: 10}
    if batch_size:  # the column keeps its type in every batch (numpy, made a tensor)
        assert {type(batch["id"]) for batch in batches} == {torch.Tensor}


def test_a_destroyed_parquet_footer_leaves_the_file_empty_and_its_count_unknown(tmp_path):
    paths = _parquet_set(tmp_path)
    with open(paths[0], "r+b") as f:
        f.seek(-12, os.SEEK_END)
        f.write(b"\xff\xff\xff\x7f")  # the footer's length
    with pytest.warns(UserWarning) as warned:
        ds = ShardedStreamingDataset(paths, on_error="skip")
    (lost,) = [str(w.message) for w in warned if "lost" in str(w.message)]
    assert lost.startswith(f"{paths[0]}: an unknown number of samples lost, 0 indexed "
                           "(unreadable Parquet file (")  # fmt: skip
    assert Counter(int(s["id"]) for s in ds) == Counter(range(30, 40))
    assert ds.error_counts == {paths[0]: 0}
