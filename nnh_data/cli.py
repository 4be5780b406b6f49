"""The ``nnh-data`` command: index shards, convert files or Parquet tables to tar shards.

nnh-data index "data/train-{000000..000063}.tar"
nnh-data convert images/ "shards/train-%06d.tar" --max-count 10000
nnh-data convert "table/*.parquet" "shards/train-%06d.tar" --max-bytes 1000000000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from nnh_data.shard_index import ShardIndex
from nnh_data.shards import build_shard_index
from nnh_data.sources import expand_sources
from nnh_data.writer import directory_samples, parquet_samples, write_shards


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``nnh-data``; returns the exit status."""
    args = _parser().parse_args(argv)
    started = time.perf_counter()
    index = args.run(args)
    print(_summary(index, time.perf_counter() - started))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nnh-data", description=__doc__.splitlines()[0].replace("``", "")
    )
    parser.add_argument(
        "--storage-options", type=json.loads, default=None, help="fsspec options, as JSON"
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    index = commands.add_parser("index", help="build (or refresh) the index of shards")
    index.add_argument("sources", nargs="+", help="shard URLs, globs or brace patterns")
    index.add_argument("--format", choices=("tar", "parquet"), default=None)
    index.add_argument("--index-path", default=None, help="where to save the JSON index")
    index.add_argument("--rebuild", action="store_true", help="rescan every shard")
    index.set_defaults(run=_index)

    convert = commands.add_parser("convert", help="write tar shards from files or Parquet")
    convert.add_argument("source", help="a folder of key.field files, or Parquet file(s)")
    convert.add_argument("pattern", help="output shard names, like shards/train-%%06d.tar")
    convert.add_argument("--max-count", type=int, default=100_000)
    convert.add_argument("--max-bytes", type=int, default=3_000_000_000)
    convert.set_defaults(run=_convert)
    return parser


def _index(args: argparse.Namespace) -> ShardIndex:
    return build_shard_index(
        args.sources,
        format=args.format,
        storage_options=args.storage_options,
        index_path=args.index_path,
        rebuild=args.rebuild,
    )


def _convert(args: argparse.Namespace) -> ShardIndex:
    if args.source.rstrip("/").endswith((".parquet", ".pq")):
        urls = expand_sources(args.source, args.storage_options)
        samples = parquet_samples(urls, args.storage_options)
    else:
        samples = directory_samples(args.source, args.storage_options)
    return write_shards(
        samples,
        args.pattern,
        max_count=args.max_count,
        max_bytes=args.max_bytes,
        storage_options=args.storage_options,
    )


def _summary(index: ShardIndex, seconds: float) -> str:
    counts = [info.num_samples for info in index.shards] or [0]
    return (
        f"{len(index.shards)} shards, {index.total_samples} samples "
        f"({min(counts)} to {max(counts)} per shard) in {seconds:.2f} s; index: {index.path}"
    )


if __name__ == "__main__":
    sys.exit(main())
