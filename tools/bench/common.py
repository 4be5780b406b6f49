"""Helpers shared by the benchmark scripts beside this file: best-of timings, and figures taken in
a fresh interpreter.

A rate is the best of several runs, since on a shared machine the least disturbed run is the
closest to the code's own speed. Where a figure has baselines, they take turns within each round
(``best_rates``), so that a change in machine load between rounds affects a figure and its
baseline alike. The scripts import this module by name (``from common import best_rates``): the
folder of the script that runs is the first entry of ``sys.path``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

_PRINT_PEAK_RSS_MIB = (
    "print(next(int(line.split()[1]) for line in open('/proc/self/status')"
    " if line.startswith('VmHWM')) / 1024)"
)


def best_rate(fn: Callable[[], object], count: int, repeats: int) -> float:
    """Best items/s of ``fn()``, which handles ``count`` items, over ``repeats`` runs."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return count / best


def best_rates(fns: dict[str, Callable[[], int]], repeats: int) -> dict[str, float]:
    """Best items/s of each ``fn()`` (which returns the item count) over ``repeats`` rounds in
    which the functions take turns."""
    best = dict.fromkeys(fns, 0.0)
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            count = fn()
            best[name] = max(best[name], count / (time.perf_counter() - start))
    return best


def in_fresh_process(code: str) -> float:
    """Run ``code`` (which prints one number) in a new interpreter; the number."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout)


def peak_rss_mib(code: str) -> float:
    """Peak RSS (MiB) of a new interpreter that runs ``code``: its VmHWM (not ``ru_maxrss``,
    which Linux carries over from the forking parent)."""
    return in_fresh_process(f"{code}\n{_PRINT_PEAK_RSS_MIB}")


def rss_growth(code_1x: str, code_10x: str) -> dict[str, float]:
    """``peak_rss_mib_1x``, ``peak_rss_mib_10x`` and ``rss_growth`` (10x / 1x - 1): the peak RSS
    of new interpreters running ``code_1x`` and ``code_10x``, the same work on 10x the data."""
    one, ten = peak_rss_mib(code_1x), peak_rss_mib(code_10x)
    return {
        "peak_rss_mib_1x": round(one, 1),
        "peak_rss_mib_10x": round(ten, 1),
        "rss_growth": round(ten / one - 1, 3),
    }
