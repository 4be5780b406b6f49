"""The ``nnh-precompute`` command: write, finalize, verify and show precomputed parameter tables.

nnh-precompute --num-samples 1000000 --preset moderate --seed 0 --epochs 10 --out params/
sbatch --array=0-7 --wrap "nnh-precompute --num-samples 1000000000 --preset mild --seed 0 --epochs 3 --out params/"
nnh-precompute finalize params/
nnh-precompute verify params/ [--fraction 0.01]
nnh-precompute show params/ --sample-id 42 [--epoch 0] [--rank 0]

Errors are one line on stderr and exit status 2; ``verify`` exits with 1 when the table is
wrong (the first difference named) and 0 when it holds what it should.
"""  # noqa: E501 - the sbatch line reads best whole

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from nnh_data.augment.params import AugmentationConfig, get_preset, list_presets
from nnh_data.command_line import OneLineParser, error_line
from nnh_data.precompute.job_array import array_task_info
from nnh_data.precompute.read import load_precomputed_params
from nnh_data.precompute.spec import MANIFEST_NAME, PrecomputeSpec
from nnh_data.precompute.verify import verify_precomputed_params
from nnh_data.precompute.write import finalize_precomputed_params, write_precomputed_params
from nnh_data.seeding import seed_hex

__all__ = ["main"]

PROG = "nnh-precompute"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``nnh-precompute``; returns the exit status.

    Example:
        >>> import tempfile
        >>> out = tempfile.mkdtemp()
        >>> main(["--num-samples", "10", "--preset", "mild", "--seed", "0", "--epochs", "1",
        ...       "--out", out, "--no-progress"])  # doctest: +ELLIPSIS
        task 0/1: wrote 1 of 1 files; table complete: ...
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in _COMMANDS else "write"
    try:
        args = _parser(command).parse_args(argv[1:] if argv and argv[0] == command else argv)
    except SystemExit as done:  # --help, or a usage error already printed on one line
        return int(done.code or 0)
    try:
        return _COMMANDS[command][0](args)
    except Exception as err:  # noqa: BLE001 - every error is one line (command_line)
        sys.stderr.write(error_line(PROG, err))
        return 1 if command == "verify" and isinstance(err, (ValueError, OSError)) else 2


def _parser(command: str) -> argparse.ArgumentParser:
    help_text, add_arguments = _COMMANDS[command][1:]
    prog = PROG if command == "write" else f"{PROG} {command}"
    others = ", ".join(f"{PROG} {name} -h" for name in _COMMANDS if name != "write")
    parser = OneLineParser(prog=prog, description=help_text, epilog=f"other commands: {others}")
    add_arguments(parser)
    return parser


def _write_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-samples", type=int, required=True, help="sample ids 0 to N-1")
    parser.add_argument("--epochs", type=int, required=True, help="epochs 0 to E-1")
    parser.add_argument("--seed", type=int, required=True, help="the base seed")
    config = parser.add_mutually_exclusive_group(required=True)
    config.add_argument("--preset", choices=list_presets())
    config.add_argument("--config", type=Path, help="AugmentationConfig.to_dict() as JSON")
    parser.add_argument("--rank-aware", action="store_true", help="one row per rank too")
    parser.add_argument("--world-size", type=int, default=1, help="ranks (with --rank-aware)")
    parser.add_argument("--out", type=Path, required=True, help="the table's directory")
    parser.add_argument("--rows-per-file", type=int, default=1_000_000)
    parser.add_argument("--task-index", type=int, help="default: from SLURM_ARRAY_TASK_ID")
    parser.add_argument("--num-tasks", type=int, help="default: SLURM_ARRAY_TASK_COUNT, or 1")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _write(args: argparse.Namespace) -> int:
    config = get_preset(args.preset) if args.preset else _read_config(args.config)
    spec = PrecomputeSpec(args.num_samples, args.epochs, config, args.seed, args.rank_aware,
                          args.world_size, args.rows_per_file)  # fmt: skip
    task, tasks = array_task_info(args.task_index, args.num_tasks)
    written = write_precomputed_params(spec, args.out, task_index=task, num_tasks=tasks,
                                       progress=not args.no_progress)  # fmt: skip
    manifest = args.out / MANIFEST_NAME
    state = f"table complete: {manifest}" if manifest.exists() else (
        f"table not complete yet: the last task writes {MANIFEST_NAME} (or run "
        f"`{PROG} finalize {args.out}`)")  # fmt: skip
    print(f"task {task}/{tasks}: wrote {len(written)} of {spec.num_files} files; {state}")
    return 0


def _read_config(path: Path) -> AugmentationConfig:
    try:
        return AugmentationConfig.from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as err:
        raise ValueError(f"--config {path} is not valid JSON: {err}") from None


def _directory_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path, help="the table's directory")


def _finalize(args: argparse.Namespace) -> int:
    print(finalize_precomputed_params(args.directory))
    return 0


def _verify_arguments(parser: argparse.ArgumentParser) -> None:
    _directory_argument(parser)
    parser.add_argument(
        "--fraction", type=_fraction, default=1.0, help="share of the files recomputed (random)"
    )


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"--fraction must be in (0, 1], got {text}")
    return value


def _verify(args: argparse.Namespace) -> int:
    rows = verify_precomputed_params(args.directory, args.fraction)
    print(f"ok: {rows} rows of {args.directory} recomputed; keys, values and checksums match")
    return 0


def _show_arguments(parser: argparse.ArgumentParser) -> None:
    _directory_argument(parser)
    parser.add_argument("--sample-id", type=int, required=True)
    parser.add_argument("--epoch", type=int, default=0)
    parser.add_argument("--rank", type=int, default=None, help="required if rank-aware")


def _show(args: argparse.Namespace) -> int:
    """Print one sample's parameters as JSON, in the form of ``gen_augmentation_params``."""
    cols = load_precomputed_params(args.directory).batch([args.sample_id], args.epoch, args.rank)
    print(json.dumps({k: seed_hex(v[0]) if k == "seed" else v[0].item() for k, v in cols.items()}))
    return 0


_COMMANDS = {
    "write": (_write, "write this task's files of a parameter table", _write_arguments),
    "finalize": (_finalize, f"write {MANIFEST_NAME} of a complete table", _directory_argument),
    "verify": (_verify, "recompute a table and compare it bit for bit", _verify_arguments),
    "show": (_show, "print one sample's parameters as JSON", _show_arguments),
}


if __name__ == "__main__":
    sys.exit(main())
