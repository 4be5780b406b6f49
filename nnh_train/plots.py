"""Training curves per epoch: saved as a PNG, or shown.

Design. matplotlib is imported when a plot is made, not with ``nnh_train``: it takes a quarter
of a second, on every rank. A saved plot is drawn on a ``Figure`` of its own (no pyplot state,
no display needed, any thread) into a folder created when missing, so a run stopped before its
first checkpoint still gets its plots. A shown plot goes through pyplot; when pyplot's backend
has no display (a batch job, a terminal without X), a warning says so and nothing is raised.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["NON_INTERACTIVE_BACKENDS", "plot_history"]

NON_INTERACTIVE_BACKENDS = ("agg", "cairo", "pdf", "pgf", "ps", "svg", "template")
"""matplotlib's backends that cannot show a window."""

Panel = tuple[str, Sequence[float], Sequence[float]]  # (name, train values, val values)


def plot_history(
    panels: list[Panel], val_epochs: Sequence[int], path: str | os.PathLike | None = None,
    log_y: bool = False,
) -> None:  # fmt: skip
    """One panel per ``(name, train values, val values)``, by epoch, saved as a PNG at ``path``
    or, without ``path``, shown (with a warning instead when there is no display).

    Example:
        >>> plot_history([("loss", [0.9, 0.5], [0.8])], val_epochs=[2], path="runs/loss.png")
    """
    if path is not None:
        from matplotlib.figure import Figure

        figure = Figure(figsize=(6, 3 * len(panels)))
        _draw(figure, panels, val_epochs, log_y)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        figure.savefig(path)
        return
    import matplotlib.pyplot as plt

    backend = plt.get_backend()
    if backend.lower() in NON_INTERACTIVE_BACKENDS:
        warnings.warn(f"plot not shown: matplotlib's backend {backend!r} has no display; pass a "
                      "path to save it as a PNG", RuntimeWarning, stacklevel=3)  # fmt: skip
        return
    figure = plt.figure(figsize=(6, 3 * len(panels)))
    _draw(figure, panels, val_epochs, log_y)
    plt.show()


def _draw(figure: Any, panels: list[Panel], val_epochs: Sequence[int], log_y: bool) -> None:
    for axes, (name, train, val) in zip(np.atleast_1d(figure.subplots(len(panels), 1)), panels):
        axes.plot(range(1, len(train) + 1), train, marker="o", label=f"train {name}")
        if val:
            axes.plot(val_epochs, val, marker="o", label=f"val {name}")
        if log_y:
            axes.set_yscale("log")
        axes.set_xlabel("epoch")
        axes.set_ylabel(name)
        axes.legend()
