"""Files written by Hugging Face ``datasets`` itself, for the tests of reading them: a small data
set with an ``Image()`` column, a ``ClassLabel``, a nullable int, a list and a string column,
as ``to_parquet`` shards and as a ``save_to_disk`` folder of several Arrow files. Built from
Python dicts, offline (nothing is downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support import encoded, picture

CLASSES = ["cat", "dog", "fox"]
ROWS = 37


def hf_row(i: int) -> dict:
    """Row ``i``: a JPEG of its own size, its label, a number null in every fifth row, a list of
    ``i % 4`` tags and a caption."""
    return {
        "image": {"bytes": encoded(picture(24 + i % 7, 20 + i % 5, seed=i)), "path": f"{i}.jpg"},
        "label": i % len(CLASSES),
        "score": None if i % 5 == 2 else i * 10,
        "tags": [f"t{j}" for j in range(i % 4)],
        "caption": f"picture {i}",
    }


def hf_dataset(rows: int = ROWS):
    """The data set as a ``datasets.Dataset`` (the caller has checked ``datasets`` imports)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    features = datasets.Features({
        "image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES),
        "score": datasets.Value("int64"), "tags": datasets.List(datasets.Value("string")),
        "caption": datasets.Value("string"),
    })  # fmt: skip
    columns = [hf_row(i) for i in range(rows)]
    data = {name: [row[name] for row in columns] for name in features}
    return datasets.Dataset.from_dict(data, features=features)


def write_parquet(folder: Path, shards: int = 4, rows: int = ROWS) -> str:
    """``shards`` Parquet files of row groups of 4 rows, written by ``to_parquet``; the folder."""
    dataset = hf_dataset(rows)
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(shards):
        part = dataset.shard(shards, k, contiguous=True)
        part.to_parquet(str(folder / f"train-{k:05d}-of-{shards:05d}.parquet"), batch_size=4)
    return str(folder)


def write_saved(folder: Path, shards: int = 3, rows: int = ROWS) -> str:
    """A ``save_to_disk`` folder of ``shards`` Arrow files; the folder."""
    hf_dataset(rows).save_to_disk(str(folder), num_shards=shards)
    return str(folder)


def row_of_key(key: str, shards: int, rows: int = ROWS) -> int:
    """The row number of a sample key (``<file stem>/<row in the file>``) of either layout."""
    stem, row = key.rsplit("/", 1)
    number = int(stem.split("-")[1])
    return sum(_shard_sizes(shards, rows)[:number]) + int(row)


def _shard_sizes(shards: int, rows: int) -> list[int]:
    """Rows per contiguous shard, as ``datasets`` cuts them (the first ``rows % shards`` get one
    more)."""
    return [rows // shards + (k < rows % shards) for k in range(shards)]
