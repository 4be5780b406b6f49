"""Benchmark: writing a precomputed parameter table against generating its rows, one process.

Prints one JSON object. ``write_vs_generate``: rows/s of ``write_precomputed_params`` (one
task, files of 1M rows: generate, encode, hash, store) over rows/s of generating the same rows
with ``gen_augmentation_params_batch`` alone, 1M at a time (target >= 0.5: writing must not
dominate). ``lookup_vs_generate``: rows/s of ``PrecomputedParams.batch`` on shuffled windows of
4096 ids over generating those windows; ``first_lookup_vs_generate`` the same for a table just
opened (each row group's page checksums checked at its first lookup: the cost of a changed file
being an error), and ``open_ms`` the time ``load_precomputed_params`` takes. Peak RSS (VmHWM)
of a fresh process writing the table of 1x and 10x the samples (``rss_growth`` = 10x / 1x - 1,
target < 0.1). Rates are the best of a few rounds in which a figure and its baseline take turns
(``best_rates`` of common.py).

    .venv/bin/python tools/bench/precompute.py [--samples 10000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
from common import best_rates, rss_growth  # tools/bench/common.py, beside this file

from nnh_data.augment.params import gen_augmentation_params_batch
from nnh_data.precompute.read import PrecomputedParams, load_precomputed_params
from nnh_data.precompute.spec import PrecomputeSpec
from nnh_data.precompute.write import write_precomputed_params

WINDOW = 4096


def generate_all(spec: PrecomputeSpec) -> int:
    """Generate every row of ``spec``, a file's rows at a time; the row count."""
    for index in range(spec.num_files):
        ids = np.arange(spec.file_rows(index).start, spec.file_rows(index).stop)
        gen_augmentation_params_batch(ids, rank_aware=False)
    return spec.num_rows


def write_fresh(spec: PrecomputeSpec, root: str) -> int:
    """Write the whole table into a new folder under ``root`` (removed after); the row count."""
    out = tempfile.mkdtemp(dir=root)
    write_precomputed_params(spec, out, progress=False)
    shutil.rmtree(out)
    return spec.num_rows


def windows(num_samples: int, count: int) -> list[np.ndarray]:
    """``count`` windows of ``WINDOW`` consecutive ids, shuffled, at random places."""
    rng = np.random.default_rng(0)
    starts = rng.integers(0, num_samples - WINDOW, count)
    return [rng.permutation(np.arange(s, s + WINDOW)) for s in np.sort(starts)]


def lookups(params: PrecomputedParams, some: list[np.ndarray]) -> int:
    return sum(len(params.batch(w, epoch=0)["seed"]) for w in some)


def write_table(samples: int, root: str) -> str:
    """Code that writes the table of ``samples`` samples under ``root`` (for a fresh process)."""
    return (
        "import tempfile\n"
        "from nnh_data.precompute import PrecomputeSpec, write_precomputed_params\n"
        f"write_precomputed_params(PrecomputeSpec({samples}, 1), tempfile.mkdtemp(dir={root!r}),"
        " progress=False)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    spec = PrecomputeSpec(args.samples, epochs=1)
    with tempfile.TemporaryDirectory() as root:
        write = best_rates(
            {"generate": lambda: generate_all(spec), "write": lambda: write_fresh(spec, root)},
            args.repeats,
        )
        table = f"{root}/table"
        write_precomputed_params(spec, table, progress=False)
        params, some = load_precomputed_params(table), windows(args.samples, 200)
        lookup = best_rates(
            {
                "generate": lambda: sum(
                    len(gen_augmentation_params_batch(w, rank_aware=False)["seed"]) for w in some
                ),
                "lookup": lambda: lookups(params, some),
                "first_lookup": lambda: lookups(load_precomputed_params(table), some),
            },
            args.repeats,
        )
        opened = best_rates({"open": lambda: load_precomputed_params(table) and 1}, 5)
        file_bytes = sum(path.stat().st_size for path in Path(table).glob("*.parquet"))
        rss = rss_growth(write_table(args.samples // 10, root), write_table(args.samples, root))
    result = {
        "samples": args.samples,
        "rows_per_file": spec.rows_per_file,
        "generate_rows_per_s": round(write["generate"]),
        "write_rows_per_s": round(write["write"]),
        "write_vs_generate": round(write["write"] / write["generate"], 2),
        "bytes_per_row": round(file_bytes / spec.num_rows, 1),
        "window_generate_rows_per_s": round(lookup["generate"]),
        "lookup_rows_per_s": round(lookup["lookup"]),
        "lookup_vs_generate": round(lookup["lookup"] / lookup["generate"], 2),
        "first_lookup_rows_per_s": round(lookup["first_lookup"]),
        "first_lookup_vs_generate": round(lookup["first_lookup"] / lookup["generate"], 2),
        "open_ms": round(1e3 / opened["open"], 2),
        **rss,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
