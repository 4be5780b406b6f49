"""The ``nnh-data`` command: index shards, convert files or Parquet tables to tar shards.

nnh-data index "data/train-{000000..000063}.tar" --storage-options '{"anon": true}'
nnh-data convert images/ "shards/train-%06d.tar" --max-count 10000
nnh-data convert "table/*.parquet" "shards/train-%06d.tar" --max-bytes 1000000000

Errors are one line on stderr and exit status 2; an index that cannot be saved is an error
(pass --index-path to write it elsewhere).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import warnings
from collections.abc import Callable, Sequence

from nnh_data.job_array import array_task_info
from nnh_data.ranges import DistributedRangeSplitter
from nnh_data.shard_index import ShardIndex
from nnh_data.shards import ShardError, build_shard_index
from nnh_data.sources import expand_sources
from nnh_data.writer import (
    count_directory_samples,
    count_parquet_samples,
    directory_samples,
    parquet_samples,
    write_shards,
)

__all__ = ["main"]

_PARQUET = (".parquet", ".pq")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``nnh-data``; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="could not save the shard index")
            index = args.run(args)
    except (ValueError, OSError, ShardError, UserWarning) as exc:
        parser.exit(2, f"nnh-data: error: {exc}\n")
    print(_summary(index, time.perf_counter() - started))
    return 0


def _storage_options(text: str) -> dict:
    try:
        options = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return options


def _common(default: object) -> argparse.ArgumentParser:
    """The options every command takes, before or after the command name (after it, the
    default is suppressed so that a value given before it is kept)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--storage-options", type=_storage_options, default=default, help="fsspec options (JSON)"
    )
    return common


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nnh-data", description=__doc__.splitlines()[0].replace("``", ""),
        parents=[_common(None)],
    )  # fmt: skip
    common = _common(argparse.SUPPRESS)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    index = commands.add_parser(
        "index", help="build (or refresh) the index of shards", parents=[common]
    )
    index.add_argument("sources", nargs="+", help="shard URLs, globs or brace patterns")
    index.add_argument("--format", choices=("tar", "parquet"), default=None)
    index.add_argument("--index-path", default=None, help="where to save the JSON index")
    index.add_argument("--rebuild", action="store_true", help="rescan every shard")
    index.set_defaults(run=_index)

    convert = commands.add_parser(
        "convert", help="write tar shards from files or Parquet", parents=[common]
    )
    convert.add_argument("source", help="a folder of key.field files, or Parquet file(s)")
    convert.add_argument("pattern", help="output shard names, like shards/train-%%06d.tar")
    convert.add_argument("--max-count", type=int, default=100_000)
    convert.add_argument("--max-bytes", type=int, default=3_000_000_000)
    convert.add_argument("--task-index", type=int, default=None, help="this task (Slurm array)")
    convert.add_argument("--num-tasks", type=int, default=None, help="tasks splitting the work")
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
    if args.source.rstrip("/").endswith(_PARQUET) or _parquet_folder(args):
        urls = [
            u for u in expand_sources(args.source, args.storage_options) if u.endswith(_PARQUET)
        ]
        read = functools.partial(parquet_samples, urls, args.storage_options)
        count = functools.partial(count_parquet_samples, urls, args.storage_options)
    else:
        where = (args.source, args.storage_options, args.pattern)
        read = functools.partial(directory_samples, *where)
        count = functools.partial(count_directory_samples, *where)
    write = functools.partial(
        write_shards, pattern=args.pattern, max_count=args.max_count, max_bytes=args.max_bytes,
        storage_options=args.storage_options,
    )  # fmt: skip
    if args.task_index is None and args.num_tasks is None and not _in_array():
        return write(read())
    return _convert_task(args, read, count(), write)


def _convert_task(
    args: argparse.Namespace, read: Callable, total: int, write: Callable
) -> ShardIndex:
    """This task's shards: shard ``s`` holds input samples ``[s * max_count, (s + 1) *
    max_count)`` whatever the number of tasks, and each task writes a contiguous run of shard
    numbers, so the union over tasks is the one-task output; ``nnh-data index`` afterwards
    writes one index for all of them."""
    task, tasks = array_task_info(args.task_index, args.num_tasks)
    shards = -(-total // args.max_count)
    first, last = DistributedRangeSplitter(shards, tasks).get_rank_range(task)
    infos = []
    for shard in range(first, last):
        samples = read(shard * args.max_count, (shard + 1) * args.max_count)
        index = write(samples, start_shard=shard)
        if len(index.shards) > 1:
            raise ValueError(
                f"max_bytes={args.max_bytes} split shard {shard} in two; with tasks, shards are "
                "cut by --max-count only: raise --max-bytes or lower --max-count"
            )
        infos.extend(index.shards)
    return ShardIndex(tuple(infos), index.path if infos else None)


def _in_array() -> bool:
    return array_task_info()[1] > 1


def _parquet_folder(args: argparse.Namespace) -> bool:
    """True when ``source`` is a folder that holds Parquet files (then only they are read:
    tar shards beside them, such as this command's earlier output, are not inputs)."""
    try:
        urls = expand_sources(args.source, args.storage_options)
    except (ValueError, FileNotFoundError):
        return False
    return urls != [args.source] and any(url.endswith(_PARQUET) for url in urls)


def _summary(index: ShardIndex, seconds: float) -> str:
    counts = [info.num_samples for info in index.shards] or [0]
    return (
        f"{len(index.shards)} shards, {index.total_samples} samples "
        f"({min(counts)} to {max(counts)} per shard) in {seconds:.2f} s; index: {index.path}"
    )


if __name__ == "__main__":
    sys.exit(main())
