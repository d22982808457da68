"""The global batch size per epoch of the batch-size strategies."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.ticker import FuncFormatter

from .common import (
    LEGEND_FONTSIZE,
    LEGEND_OUTSIDE,
    add_decays,
    by_strategy,
    context,
    figure,
    integer_epochs,
    is_batch_strategy,
    runs_of,
    save,
    seed_key,
    series,
)
from .style import strategy_style


def plot_batch_size(results: Mapping[str, Any], path: str | Path) -> Path:
    """Global batch size (samples per optimizer step) vs epoch for the batch-size
    strategies, first seed of each, with the decays marked. Returns ``path``."""
    runs = [r for r in runs_of(results) if is_batch_strategy(r["strategy"])]
    if not runs:
        strategies = sorted({r["strategy"] for r in runs_of(results)})
        raise ValueError(f"no batch-size strategy among {strategies}")
    fig = figure()
    ax = fig.add_subplot()
    x_min, x_max = math.inf, -math.inf
    for strategy, strategy_runs in by_strategy(runs).items():
        run = sorted(strategy_runs, key=seed_key)[0]
        batches = series(run, "batch_size")
        if not batches:
            continue
        epochs = np.array(sorted(batches))
        ax.step(epochs, [batches[e] for e in epochs], where="mid", label=strategy,
                **strategy_style(strategy))  # fmt: skip
        x_min, x_max = min(x_min, epochs[0]), max(x_max, epochs[-1])
    if not math.isfinite(x_min):
        x_min, x_max = 0, 1
    ax.set_xlim(x_min - 0.5, x_max + 0.5)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    handles, _ = ax.get_legend_handles_labels()
    add_decays(ax, results, x_min, x_max, handles)
    integer_epochs(ax)
    ax.set_xlabel("epoch")
    ax.set_ylabel("global batch (samples per step)")
    ax.grid(alpha=0.3)
    ax.set_title(f"Batch size per epoch (first seed)\n{context(results, runs)}")
    ax.legend(handles=handles, fontsize=LEGEND_FONTSIZE, **LEGEND_OUTSIDE)
    return save(fig, path)
