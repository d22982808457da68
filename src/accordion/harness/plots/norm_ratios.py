"""An Accordion run's gradient-norm change ratio per layer at each regime check."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, NullFormatter
from matplotlib.transforms import blended_transform_factory

from .common import (
    LEGEND_FONTSIZE,
    LEGEND_OUTSIDE,
    MILD_COLOUR,
    config_of,
    context,
    decay_epochs,
    decay_handle,
    draw_decays,
    epoch_of,
    figure,
    integer_epochs,
    layer_order,
    number,
    save,
    seed_of,
    select_accordion,
    series,
    wrapped_strategy,
)

_GREY = "0.35"  # the legend's markers that stand for every layer


@dataclass
class _Ratios:
    """Layers x checks: the finite ratios (NaN elsewhere) and where each is infinite,
    decided critical, or recorded at all."""

    layers: list[str]
    check_x: list[int]
    ratio: np.ndarray
    infinite: np.ndarray
    critical: np.ndarray
    present: np.ndarray


def _ratios(checks: Sequence[Mapping[str, Any]]) -> _Ratios:
    """The ratio table of a run's checks (a ``None`` or infinite ratio is infinite)."""
    layer_dicts = [c.get("layers") for c in checks]
    layers = layer_order(layer_dicts)
    check_x = [epoch_of(c, i) for i, c in enumerate(checks)]
    shape = (len(layers), len(checks))
    table = _Ratios(layers, check_x, np.full(shape, np.nan), np.zeros(shape, dtype=bool),
                    np.zeros(shape, dtype=bool), np.zeros(shape, dtype=bool))  # fmt: skip
    for j, layer_dict in enumerate(layer_dicts):
        if not isinstance(layer_dict, Mapping):
            continue
        for i, layer in enumerate(layers):
            entry = layer_dict.get(layer)
            if not isinstance(entry, Mapping):
                continue
            table.present[i, j] = True
            value = entry.get("ratio")
            r = number(value)
            if value is None or r == math.inf:
                table.infinite[i, j] = True
            elif math.isfinite(r):
                table.ratio[i, j] = r
            table.critical[i, j] = bool(entry.get("critical", False))
    return table


def _y_range(ratio: np.ndarray, eta: float) -> tuple[bool, float, float]:
    """(log scale?, bottom, top): log when the positive values span more than 20x."""
    finite = ratio[np.isfinite(ratio)]
    reference = [float(v) for v in finite] + ([eta] if math.isfinite(eta) else [])
    positive = [v for v in reference if v > 0]
    log = (
        bool(positive) and len(positive) == len(reference) and max(positive) / min(positive) > 20.0
    )
    if log:
        return log, min(positive) / 2.0, max(positive) * 3.0
    return log, 0.0, max(reference, default=1.0) * 1.2 or 1.0


def _layer_colours(n: int) -> list[Any]:
    """Layer colours: the default cycle for up to 10 layers, else viridis by depth."""
    if n <= 10:
        return [f"C{i}" for i in range(n)]
    return [colormaps["viridis"](x) for x in np.linspace(0.0, 0.9, n)]


def _draw_layers(ax: Any, table: _Ratios, colours: Sequence[Any]) -> float:
    """Each layer's line and markers (filled: decided critical); infinite ratios are
    triangles at the top edge, spread sideways. Returns the spread, in epochs."""
    transform = blended_transform_factory(ax.transData, ax.transAxes)
    n = len(table.layers)
    gaps = np.diff(sorted(set(table.check_x)))
    gap = float(gaps.min()) if len(gaps) else 1.0
    spread = gap * min(0.3, 0.08 * (n - 1))
    offsets = np.linspace(-spread, spread, n) if n > 1 else [0.0]
    for i in range(n):
        colour = colours[i]
        ax.plot(table.check_x, table.ratio[i], color=colour, linewidth=1.2, alpha=0.8, zorder=3)
        for j, x in enumerate(table.check_x):
            if not table.present[i, j]:
                continue
            face = colour if table.critical[i, j] else "white"
            if table.infinite[i, j]:
                ax.plot(
                    [x + offsets[i]], [1.0], transform=transform, marker="^", markersize=8,
                    color=colour, markerfacecolor=face, clip_on=False, zorder=4,
                )  # fmt: skip
            elif math.isfinite(table.ratio[i, j]):
                ax.plot(
                    [x], [table.ratio[i, j]], marker="o", markersize=5, color=colour,
                    markerfacecolor=face, zorder=4,
                )  # fmt: skip
    return spread


def _layer_handles(layers: Sequence[str], colours: Sequence[Any]) -> list[Any]:
    """One legend entry per layer, or first and last for more than 12."""
    if len(layers) <= 12:
        return [
            Line2D([], [], color=colours[i], marker="o", label=layer)
            for i, layer in enumerate(layers)
        ]
    return [
        Line2D([], [], color=colours[0], label=f"{len(layers)} layers: first"),
        Line2D([], [], color=colours[-1], label="... last (colour = depth)"),
    ]


def _draw_eta(ax: Any, eta: float, top: float) -> list[Any]:
    """The threshold line and the critical band above it (nothing for a non-finite eta)."""
    if not math.isfinite(eta):
        return []
    ax.axhspan(eta, top, color=MILD_COLOUR, alpha=0.06, lw=0, zorder=0)
    ax.axhline(eta, color=MILD_COLOUR, linestyle="--", linewidth=1.2, zorder=2)
    return [
        Line2D([], [], color=MILD_COLOUR, linestyle="--", label=f"eta = {eta:g} (critical above)")
    ]


def _marker_handles(infinite: bool) -> list[Any]:
    """Legend entries of the markers' meaning: filled, open, and the infinite triangles."""
    handles: list[Any] = [
        Line2D([], [], linestyle="none", marker="o", color=_GREY, label="decided critical (mild)"),
        Line2D(
            [], [], linestyle="none", marker="o", color=_GREY, markerfacecolor="white",
            label="decided aggressive",
        ),
    ]  # fmt: skip
    if infinite:
        handles.append(
            Line2D(
                [], [], linestyle="none", marker="^", markersize=8, color=_GREY,
                label="ratio = ∞ (no old norm,\nor old norm 0): top edge",
            )
        )  # fmt: skip
    return handles


def _set_x_range(ax: Any, run: Mapping[str, Any], table: _Ratios, spread: float) -> tuple[int, int]:
    """The x limits around the epochs and checks; returns the epoch range (first, last)."""
    check_x = table.check_x
    epochs = sorted(series(run, "lr")) or check_x
    x_min, x_max = min(min(epochs), min(check_x)), max(max(epochs), max(check_x))
    # room for the spread triangles of infinite ratios at the first and last checks
    margin = max(0.5, spread + 0.4) if table.infinite.any() else 0.5
    ax.set_xlim(
        x_min - max(0.5, margin - (min(check_x) - x_min)),
        x_max + max(0.5, margin - (x_max - max(check_x))),
    )
    return x_min, x_max


def _decay_handles(ax: Any, results, checks, table: _Ratios, x_range) -> list[Any]:
    """Draw the decays; legend entries for them and for checks that forced all critical."""
    handles: list[Any] = []
    drawn = draw_decays(ax, decay_epochs(results), (x_range[0] - 0.5, x_range[1] + 0.5))
    if drawn:
        handles.append(decay_handle(drawn))
    if any(bool(c.get("lr_will_decay")) for c in checks):
        decay_checks = [x for x, c in zip(table.check_x, checks) if c.get("lr_will_decay")]
        handles.append(
            Patch(
                facecolor="none", edgecolor="none",
                label="lr decays after check " + ", ".join(map(str, decay_checks))
                + ":\nall layers critical",
            )
        )  # fmt: skip
    return handles


def plot_norm_ratios(
    results: Mapping[str, Any], path: str | Path, strategy: str | None = None
) -> Path:
    """An Accordion run's gradient-norm change ratio per layer at each regime check.

    ``strategy`` is chosen as in :func:`~accordion.harness.plots.plot_levels`. x: the
    check epochs; y: each layer's ``|D_old - D_new| / D_old`` (log scale when the values
    span more than 20x); a horizontal line at ``config["eta"]`` (critical above). Infinite
    ratios (``None``: no old norm, or an old norm of 0) are triangles at the top edge.
    Filled markers are checks that decided "critical" (after the learning-rate decay
    override), open ones "aggressive".

    Raises:
        ValueError: no runs, no Accordion run, or a run without regime checks.
    """
    strategy, run = select_accordion(results, strategy)
    checks = [c for c in (run.get("checks") or []) if isinstance(c, Mapping)]
    if not checks:
        raise ValueError(f"the {strategy} run (seed {seed_of(run)}) records no regime checks")
    eta = number(config_of(results).get("eta", 0.5))
    table = _ratios(checks)
    log, bottom, top = _y_range(table.ratio, eta)
    fig = figure()
    ax = fig.add_subplot()
    colours = _layer_colours(len(table.layers))
    spread = _draw_layers(ax, table, colours)
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(bottom, top)
    handles = _layer_handles(table.layers, colours) + _draw_eta(ax, eta, top)
    handles += _marker_handles(bool(table.infinite.any()))
    x_range = _set_x_range(ax, run, table, spread)
    handles += _decay_handles(ax, results, checks, table, x_range)
    integer_epochs(ax)
    ax.set_xlabel("epoch (check at its end)")
    ax.set_ylabel("gradient-norm change ratio\n|D_old − D_new| / D_old" + (" (log)" if log else ""))
    ax.grid(alpha=0.3)
    ax.set_title(
        f"Regime checks, norm change per layer:\n{wrapped_strategy(strategy)}\n"
        f"{context(results, [run])}",
        pad=10,
    )
    ax.legend(handles=handles, fontsize=LEGEND_FONTSIZE, **LEGEND_OUTSIDE)
    return save(fig, path)
