"""The test metric per epoch, mean over seeds with a +/- 1 std band."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from matplotlib.patches import Patch

from .common import (
    LEGEND_FONTSIZE,
    LEGEND_OUTSIDE,
    add_decays,
    by_strategy,
    config_of,
    context,
    figure,
    integer_epochs,
    markers,
    mean_std,
    runs_of,
    save,
    seeds_text,
    stack,
)
from .style import strategy_style


def _metric_label(results: Mapping[str, Any]) -> tuple[str, str]:
    """(axis label, title noun) for ``config["metric"]``."""
    metric = str(config_of(results).get("metric", "accuracy"))
    if metric == "accuracy":
        return "test accuracy (%)", "test accuracy"
    if metric == "perplexity":
        return "test perplexity", "test perplexity"
    return f"test {metric}", f"test {metric}"


def plot_accuracy(results: Mapping[str, Any], path: str | Path) -> Path:
    """Test metric vs epoch: per strategy the mean over seeds, shaded +/- 1 sample std.

    The y label is "test accuracy (%)" or "test perplexity" per ``config["metric"]``;
    learning-rate decays are dotted vertical lines. Returns ``path``.
    """
    runs = runs_of(results)
    groups = by_strategy(runs)
    ylabel, noun = _metric_label(results)
    fig = figure()
    ax = fig.add_subplot()
    x_min, x_max = math.inf, -math.inf
    several = any(len(rs) > 1 for rs in groups.values())
    most_seeds = max(len(rs) for rs in groups.values())
    for strategy, strategy_runs in groups.items():
        epochs, values = stack(strategy_runs, "test_metric")
        if not len(epochs):
            continue
        mean, std = mean_std(values)
        style = strategy_style(strategy)
        label = strategy
        if len(strategy_runs) < most_seeds:  # say so when a strategy has fewer seeds
            label += f" ({seeds_text(strategy_runs)} only)"
        ax.plot(epochs, mean, **style, **markers(len(epochs)), label=label, zorder=3)
        if len(strategy_runs) > 1:
            ax.fill_between(
                epochs, mean - std, mean + std, color=style["color"], alpha=0.18, lw=0, zorder=2
            )
        x_min, x_max = min(x_min, epochs[0]), max(x_max, epochs[-1])
    if not math.isfinite(x_min):
        x_min, x_max = 0, 1
    ax.set_xlim(x_min - 0.5, x_max + 0.5)
    handles, _ = ax.get_legend_handles_labels()
    add_decays(ax, results, x_min, x_max, handles)
    if several:
        handles.append(Patch(color="0.6", alpha=0.35, label="± 1 std over seeds"))
    integer_epochs(ax)
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    summary = "mean over seeds ± 1 std" if several else "one seed per strategy"
    ax.set_title(f"{noun.capitalize()} per epoch ({summary})\n{context(results, runs)}")
    ax.legend(handles=handles, fontsize=LEGEND_FONTSIZE, **LEGEND_OUTSIDE)
    return save(fig, path)
