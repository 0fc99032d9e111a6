"""Matplotlib plumbing shared by the report builders: Agg backend, panel grids, save and close."""

from __future__ import annotations

import math


def pyplot():
    """matplotlib.pyplot on the Agg backend (reports are built headless, on clusters too)."""
    # late: pyplot (0.8 s) loads after the Agg backend is chosen, and only when a figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    # late: pyplot (0.8 s) loads after the Agg backend is chosen, and only when a figure is drawn
    import matplotlib.pyplot as plt

    return plt


def panels(n: int, width: float, height: float, cols: int = 3):
    """A figure with `n` panels, at most `cols` per row, each `width` x `height` inches; unused ones hidden."""
    cols = max(1, min(cols, n))
    rows = math.ceil(n / cols)
    fig, axes = pyplot().subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    return fig, list(axes.flat)[:n]


def save(fig, path: str, dpi: int = 110) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
