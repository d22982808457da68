"""Cumulative floats sent per worker (the paper's "Data Sent"), mean over seeds."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.ticker import FuncFormatter, NullFormatter

from .common import (
    LEGEND_FONTSIZE,
    LEGEND_OUTSIDE,
    add_decays,
    by_strategy,
    context,
    figure,
    integer_epochs,
    markers,
    mean_std,
    runs_of,
    save,
    stack,
)
from .style import strategy_style


def _float_unit(value: float) -> tuple[float, str]:
    """(scale, unit) that shows ``value`` as 1 to 999 units: (1e6, "M") for 2.4e6."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return scale, unit
    return 1.0, ""


def _floats_text(value: float) -> str:
    scale, unit = _float_unit(value)
    return f"{value / scale:.4g} {unit}".rstrip()


def _curves(groups: Mapping[str, Any]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(strategy, epochs, mean floats) of every strategy with a finite value."""
    curves = []
    for strategy, strategy_runs in groups.items():
        epochs, values = stack(strategy_runs, "floats")
        mean, _ = mean_std(values)
        if len(epochs) and np.isfinite(mean).any():
            curves.append((strategy, epochs, mean))
    return curves


def plot_data_sent(results: Mapping[str, Any], path: str | Path) -> Path:
    """Cumulative floats sent per worker (paper convention) vs epoch, mean over seeds.

    The y axis is logarithmic when the largest final total exceeds the smallest by more
    than 100x (then in k/M/B units of the smallest total), else linear (in units of the
    largest). Each legend entry gives the strategy's final total. Returns ``path``.
    """
    runs = runs_of(results)
    groups = by_strategy(runs)
    curves = _curves(groups)
    finals = [float(m[np.isfinite(m)][-1]) for _, _, m in curves]
    largest = max((f for f in finals if f > 0), default=1.0)
    smallest = min((f for f in finals if f > 0), default=1.0)
    log = largest / smallest > 100.0
    # a log axis in units of its smallest total, a linear one in units of its largest
    scale, unit = _float_unit(smallest if log else largest)
    fig = figure()
    ax = fig.add_subplot()
    x_min, x_max = math.inf, -math.inf
    for (strategy, epochs, mean), final in zip(curves, finals):
        label = f"{strategy}: {_floats_text(final)}"
        y = mean / scale
        if log:
            y = np.where(y > 0, y, np.nan)
        ax.plot(epochs, y, **strategy_style(strategy), **markers(len(epochs)), label=label)
        x_min, x_max = min(x_min, epochs[0]), max(x_max, epochs[-1])
    if not math.isfinite(x_min):
        x_min, x_max = 0, 1
    ax.set_xlim(x_min - 0.5, x_max + 0.5)
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    handles, _ = ax.get_legend_handles_labels()
    add_decays(ax, results, x_min, x_max, handles)
    integer_epochs(ax)
    ax.set_xlabel("epoch")
    unit_text = f"{unit} floats" if unit else "floats"
    scale_text = ", log scale" if log else ""
    ax.set_ylabel(f"cumulative floats sent per worker\n({unit_text}{scale_text})")
    ax.grid(alpha=0.3, which="major")
    several = any(len(rs) > 1 for rs in groups.values())
    summary = ", mean over seeds" if several else ""
    ax.set_title(f"Floats sent per worker (paper convention{summary})\n{context(results, runs)}")
    ax.legend(handles=handles, title="strategy: total floats", title_fontsize=LEGEND_FONTSIZE,
              fontsize=LEGEND_FONTSIZE, **LEGEND_OUTSIDE)  # fmt: skip
    return save(fig, path)
