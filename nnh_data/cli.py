"""The ``nnh-data`` command: index shards, convert files, Parquet or Arrow tables to tar shards.

nnh-data index "data/train-{000000..000063}.tar" --storage-options '{"anon": true}'
nnh-data convert images/ "shards/train-%06d.tar" --max-count 10000
nnh-data convert "table/*.parquet" "shards/train-%06d.tar" --max-bytes 1000000000
nnh-data convert hf_saved/train "shards/train-%06d.tar"   # a datasets save_to_disk folder
nnh-data cache warm "s3://bucket/train-*.tar" --cache-dir /local/cache --world-size 8 --ranks 0-3
nnh-data cache stats /local/cache --json

Errors are one line on stderr and exit status 2, whatever raised them (a storage endpoint that
cannot be reached too); an index that cannot be saved is an error (pass --index-path to write
it elsewhere).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence

from nnh_data.cache.policy import read_schedule
from nnh_data.cache.store import ShardCache
from nnh_data.command_line import OneLineParser, error_line
from nnh_data.order.epoch import UNEVEN
from nnh_data.order.ranges import DistributedRangeSplitter
from nnh_data.precompute.job_array import array_task_info
from nnh_data.shards.index import ShardIndex, ShardInfo
from nnh_data.shards.reading import build_shard_index
from nnh_data.shards.sources import FORMATS, expand_sources
from nnh_data.shards.writer import (
    count_directory_samples,
    count_table_samples,
    directory_samples,
    table_samples,
    write_shards,
)

__all__ = ["main"]

_TABLES = (".parquet", ".pq", ".arrow")  # convert reads these as tables


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``nnh-data``; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="could not save the shard index")
            warnings.filterwarnings("ignore", message="wrote the shard index")  # printed below
            result = args.run(args)
    except Exception as exc:  # noqa: BLE001 - every error is one line (command_line)
        parser.exit(2, error_line(parser.prog, exc))
    print(args.report(result, time.perf_counter() - started))
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
    common = OneLineParser(add_help=False)
    common.add_argument(
        "--storage-options", type=_storage_options, default=default, help="fsspec options (JSON)"
    )
    return common


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="nnh-data", description=__doc__.splitlines()[0].replace("``", ""),
        parents=[_common(None)],
    )  # fmt: skip
    parser.set_defaults(report=_summary)
    common = _common(argparse.SUPPRESS)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    index = commands.add_parser(
        "index", help="build (or refresh) the index of shards", parents=[common]
    )
    index.add_argument("sources", nargs="+", help="shard URLs, globs or brace patterns")
    index.add_argument("--format", choices=FORMATS, default=None)
    index.add_argument("--index-path", default=None, help="where to save the JSON index")
    index.add_argument("--rebuild", action="store_true", help="rescan every shard")
    index.set_defaults(run=_index)

    convert = commands.add_parser(
        "convert", help="write tar shards from files, Parquet or Arrow", parents=[common]
    )
    convert.add_argument(
        "source", help="a folder of key.field files, Parquet or Arrow file(s), or a folder of "
        "them (a Hugging Face save_to_disk folder included)",
    )  # fmt: skip
    convert.add_argument("pattern", help="output shard names, like shards/train-%%06d.tar")
    convert.add_argument("--max-count", type=int, default=100_000)
    convert.add_argument("--max-bytes", type=int, default=3_000_000_000)
    convert.add_argument("--task-index", type=int, default=None, help="this task (Slurm array)")
    convert.add_argument("--num-tasks", type=int, default=None, help="tasks splitting the work")
    convert.add_argument(
        "--follow-symlinks", action="store_true",
        help="read the files symbolic links in the folder point to (default: skip the links)",
    )  # fmt: skip
    convert.set_defaults(run=_convert)
    _cache_parser(commands, common)
    return parser


def _cache_parser(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    cache = commands.add_parser("cache", help="inspect, tidy or warm a node-local shard cache")
    actions = cache.add_subparsers(required=True, metavar="ACTION")
    stats = actions.add_parser("stats", help="files, bytes and counters of a cache folder")
    stats.add_argument("cache_dir")
    stats.add_argument("--json", action="store_true", help="one JSON object")
    stats.set_defaults(run=_cache_stats)
    verify = actions.add_parser("verify", help="check every shard; remove what is broken")
    verify.add_argument("cache_dir")
    verify.set_defaults(run=_cache_verify)
    clear = actions.add_parser("clear", help="remove every shard nobody reads")
    clear.add_argument("cache_dir")
    clear.set_defaults(run=_cache_clear)
    warm = actions.add_parser(
        "warm", help="download what given ranks read first, in need order", parents=[common]
    )
    warm.add_argument("sources", nargs="+", help="shard URLs, globs or brace patterns")
    warm.add_argument("--cache-dir", required=True)
    warm.add_argument("--limit", default=None, help="bytes, e.g. 50GB or 1.5GiB (default: disk)")
    warm.add_argument("--world-size", type=int, default=1)
    warm.add_argument("--ranks", default=None, help="e.g. 0,1 or 0-3 (default: all)")
    warm.add_argument("--num-workers", type=int, default=1, help="DataLoader workers per rank")
    warm.add_argument("--seed", type=int, default=0)
    warm.add_argument("--epoch", type=int, default=0)
    warm.add_argument("--shuffle-window", type=int, default=1024, help="0: no shuffle")
    warm.add_argument("--uneven", choices=UNEVEN, default="pad")
    warm.add_argument("--batch-size", type=int, default=1, help="loader batch (worker ranges)")
    warm.add_argument("--format", choices=FORMATS, default=None)
    warm.set_defaults(run=_cache_warm)
    for action in (stats, verify, clear, warm):
        action.set_defaults(report=lambda text, seconds: text)


def _index(args: argparse.Namespace) -> ShardIndex:
    return build_shard_index(
        args.sources,
        format=args.format,
        storage_options=args.storage_options,
        index_path=args.index_path,
        rebuild=args.rebuild,
    )


def _convert(args: argparse.Namespace) -> ShardIndex:
    if args.source.rstrip("/").endswith(_TABLES) or _table_folder(args):
        urls = [
            u for u in expand_sources(args.source, args.storage_options) if u.endswith(_TABLES)
        ]
        read = functools.partial(table_samples, urls, args.storage_options)
        count = functools.partial(count_table_samples, urls, args.storage_options)
    else:
        where = (args.source, args.storage_options, args.pattern)
        follow = {"follow_symlinks": args.follow_symlinks}
        read = functools.partial(directory_samples, *where, **follow)
        count = functools.partial(count_directory_samples, *where, **follow)
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


def _existing_cache(path: str) -> ShardCache:
    if not os.path.isdir(os.path.join(path, "shards")):
        raise ValueError(f"cache_dir must be a shard cache folder, got {path!r}")
    return ShardCache(path)


def _cache_stats(args: argparse.Namespace) -> str:
    stats = _existing_cache(args.cache_dir).stats()
    if args.json:
        return json.dumps(stats)
    return "\n".join(f"{name}: {value}" for name, value in stats.items())


def _cache_verify(args: argparse.Namespace) -> str:
    problems = _existing_cache(args.cache_dir).verify()
    return "\n".join([*problems, f"{len(problems)} problem(s) found and removed"])


def _cache_clear(args: argparse.Namespace) -> str:
    cache = _existing_cache(args.cache_dir)
    cache.clear()
    return f"cleared {cache.cache_dir}: {cache.stats()['files']} shards in use are left"


def _cache_warm(args: argparse.Namespace) -> str:
    cache = ShardCache(args.cache_dir, args.limit)
    ranks = _ranks(args.ranks, args.world_size)
    index = build_shard_index(
        args.sources, format=args.format, storage_options=args.storage_options
    )
    order = _need_order(index, ranks, args)
    cached = cache.warm(order, storage_options=args.storage_options)
    size = sum(info.size for info in order[:cached])
    return f"warmed {cached} of {len(order)} shards ({size} bytes) in {cache.cache_dir}"


def _need_order(index: ShardIndex, ranks: list[int], args: argparse.Namespace) -> list[ShardInfo]:
    """The shards the workers of ``ranks`` read, each once, in the order they are first
    needed: ranks advance in step and the workers of a rank take turns."""
    counts = [info.num_samples for info in index.shards]
    reads = []
    for rank in ranks:
        for worker in range(args.num_workers):
            schedule = read_schedule(
                counts, seed=args.seed, epoch=args.epoch, window=args.shuffle_window,
                world_size=args.world_size, rank=rank, num_workers=args.num_workers,
                worker=worker, uneven=args.uneven, unit=args.batch_size,
            )  # fmt: skip
            reads += [(t * args.num_workers + worker, rank, shard) for shard, t in schedule]
    order = dict.fromkeys(shard for _, _, shard in sorted(reads))
    return [index.shards[shard] for shard in order]


def _ranks(text: str | None, world_size: int) -> list[int]:
    """``"0,2"`` or ``"0-3"`` (or None: all) as rank numbers below ``world_size``."""
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    if text is None:
        return list(range(world_size))
    ranks = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        if not (first.strip().isdigit() and (not last or last.strip().isdigit())):
            raise ValueError(f"--ranks must be numbers or ranges like 0,2 or 0-3, got {text!r}")
        ranks += range(int(first), int(last or first) + 1)
    if not ranks or max(ranks) >= world_size:
        raise ValueError(f"--ranks must be in [0, {world_size - 1}], got {text!r}")
    return sorted(set(ranks))


def _in_array() -> bool:
    return array_task_info()[1] > 1


def _table_folder(args: argparse.Namespace) -> bool:
    """True when ``source`` is a folder that holds Parquet or Arrow files, a ``datasets``
    ``save_to_disk`` folder included (then only they are read: tar shards beside them, such as
    this command's earlier output, are not inputs)."""
    try:
        urls = expand_sources(args.source, args.storage_options)
    except FileNotFoundError:
        return False
    return urls != [args.source] and any(url.endswith(_TABLES) for url in urls)


def _summary(index: ShardIndex, seconds: float) -> str:
    counts = [info.num_samples for info in index.shards] or [0]
    return (
        f"{len(index.shards)} shards, {index.total_samples} samples "
        f"({min(counts)} to {max(counts)} per shard) in {seconds:.2f} s; index: {index.path}"
    )


if __name__ == "__main__":
    sys.exit(main())
