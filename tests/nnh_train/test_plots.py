"""plot_history: a PNG with one panel per figure (its folder created), or shown through pyplot,
with a warning instead where pyplot has no display; matplotlib is not imported with nnh_train."""

from __future__ import annotations

import subprocess
import sys

import matplotlib.pyplot as plt
import pytest
from PIL import Image

from nnh_train.plots import NON_INTERACTIVE_BACKENDS, plot_history
from tests.support import ROOT

PANELS = [("loss", [0.9, 0.5, 0.4], [0.8, 0.45]), ("acc", [0.5, 0.7, 0.8], [])]


@pytest.mark.parametrize("log_y", [False, True])
def test_saved_as_a_png_one_panel_per_figure(tmp_path, log_y):
    path = tmp_path / "not" / "yet" / "history.png"
    plot_history(PANELS, [2, 3], path, log_y=log_y)
    one = tmp_path / "one.png"
    plot_history(PANELS[:1], [2, 3], one, log_y=log_y)
    with Image.open(path) as two_panels, Image.open(one) as one_panel:
        assert two_panels.format == "PNG" and one_panel.format == "PNG"
        assert two_panels.height == 2 * one_panel.height  # 3 inches a panel
        assert two_panels.width == one_panel.width


def test_shown_through_pyplot_or_a_warning_without_a_display(monkeypatch):
    shown = []
    monkeypatch.setattr(plt, "show", lambda: shown.append(plt.gcf()))
    monkeypatch.setattr(plt, "get_backend", lambda: "TkAgg")
    plot_history(PANELS, [2, 3])
    assert len(shown) == 1 and len(shown[0].axes) == 2
    plt.close("all")
    for backend in ("agg", "Agg", "pdf"):
        monkeypatch.setattr(plt, "get_backend", lambda backend=backend: backend)
        with pytest.warns(RuntimeWarning, match=f"plot not shown: .*'{backend}' has no display"):
            plot_history(PANELS, [2, 3])
    assert len(shown) == 1 and "agg" in NON_INTERACTIVE_BACKENDS


@pytest.mark.timeout(60)
def test_matplotlib_is_imported_only_when_a_plot_is_made():
    check = "import sys, nnh_train; print('matplotlib' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True,
                          text=True, timeout=50)  # fmt: skip
    assert done.stdout.strip() == "False", done.stderr
