"""Figure helpers: matplotlib's object API (no pyplot global state, no backend switching)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure


def new_figure(*, width: float = 7.0, height: float = 3.5, ncols: int = 1):
    """A figure and its axes (a list when `ncols` > 1)."""
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(1, ncols)
    return fig, axes


def save(fig: Figure, path: Path) -> str:
    """Save as PNG; return the file name (the report references plots by name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path.name
