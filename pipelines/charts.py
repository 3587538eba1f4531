"""PNG charts for the reports (matplotlib, headless Agg backend)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["bar_chart", "line_chart"]

_COLORS = ("#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#b279a2")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_chart(path: Path, title: str, labels: Sequence[str],
              series: Mapping[str, Sequence[float]], *, ylabel: str = "",
              stacked: bool = True, horizontal: bool = False) -> Path:
    """A (stacked) bar chart of ``series`` over ``labels``, written to ``path``."""
    plt = _pyplot()
    n = max(len(labels), 1)
    size = (9, max(3.0, 0.35 * n + 1.5)) if horizontal else (max(6.0, 0.5 * n + 3), 4.5)
    fig, ax = plt.subplots(figsize=size)
    try:
        positions = list(range(len(labels)))
        base = [0.0] * len(labels)
        width = 0.8 if stacked else 0.8 / max(len(series), 1)
        for i, (name, values) in enumerate(series.items()):
            color = _COLORS[i % len(_COLORS)]
            vals = [float(v) for v in values]
            if stacked:
                if horizontal:
                    ax.barh(positions, vals, left=base, label=name, color=color)
                else:
                    ax.bar(positions, vals, bottom=base, label=name, color=color)
                base = [b + v for b, v in zip(base, vals, strict=True)]
            else:
                shifted = [p - 0.4 + width * (i + 0.5) for p in positions]
                if horizontal:
                    ax.barh(shifted, vals, height=width, label=name, color=color)
                else:
                    ax.bar(shifted, vals, width=width, label=name, color=color)
        if horizontal:
            ax.set_yticks(positions, labels)
            ax.invert_yaxis()
            ax.set_xlabel(ylabel)
        else:
            ax.set_xticks(positions, labels, rotation=30 if n > 4 else 0, ha="right"
                          if n > 4 else "center")
            ax.set_ylabel(ylabel)
        ax.set_title(title)
        if len(series) > 1:
            ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
        ax.grid(axis="x" if horizontal else "y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def line_chart(path: Path, title: str, labels: Sequence[str],
               series: Mapping[str, Sequence[float]], *, ylabel: str = "") -> Path:
    """One line per series over ``labels`` (e.g. hours), written to ``path``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * len(labels) + 4), 4.5))
    try:
        positions = list(range(len(labels)))
        for i, (name, values) in enumerate(series.items()):
            ax.plot(positions, [float(v) for v in values], marker="o", label=name,
                    color=_COLORS[i % len(_COLORS)])
        step = max(1, len(labels) // 12)
        ax.set_xticks(positions[::step], list(labels)[::step], rotation=30, ha="right")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if len(series) > 1:
            ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path
