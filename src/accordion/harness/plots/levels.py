"""An Accordion run's compression level per layer and epoch, as a heatmap."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colors as mcolors
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.transforms import blended_transform_factory

from ...compress import Compressor, compressor_class
from .common import (
    LEGEND_FONTSIZE,
    LEGEND_OUTSIDE,
    MILD_COLOUR,
    context,
    decay_epochs,
    decay_handle,
    draw_decays,
    epoch_of,
    figure,
    integer_epochs,
    layer_order,
    parsed,
    save,
    seed_of,
    select_accordion,
    wrapped_strategy,
)

# heatmap colours: the mildest rung warm and dark, the most aggressive cool and light, the
# rungs between blends of the two; levels off the ladder get the others in turn
_AGGRESSIVE_COLOUR = "#9ecae1"
_OTHER_LEVEL_COLOURS = ("#f4a582", "#2166ac", "#fddbc7", "#5aae61", "#762a83")
_MISSING_COLOUR = "#f0f0f0"
# on the heatmap: black, thicker and above the white cell borders
_HEATMAP_DECAY_STYLE = {"color": "black", "linestyle": (0, (2, 1.5)), "linewidth": 2.2}

Category = tuple[str, str, Any]  # (legend label, colour, level)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _recorded(value: Any) -> Any:
    """A recorded level as a heatmap cell: ``None`` for missing, dense or non-finite."""
    if _is_number(value):
        return value if math.isfinite(value) else None
    return value if isinstance(value, str) else None


def _same(a: Any, b: Any) -> bool:
    """Whether two levels are one category: numbers within a relative 1e-9, else equal."""
    if _is_number(a) and _is_number(b):
        return math.isfinite(a) and math.isfinite(b) and math.isclose(a, b, rel_tol=1e-9)
    return a == b


def _matches(value: Any, level: Any) -> bool:
    """Whether a cell's value shows ``level`` (numbers as ``numpy.isclose(rtol=1e-9)``)."""
    if value is None:
        return False
    if _is_number(value) and _is_number(level):
        return abs(value - level) <= 1e-8 + 1e-9 * abs(level)
    return value == level


def _label(cls: type[Compressor], level: Any) -> str:
    try:
        return cls.label(level)
    except (TypeError, ValueError):
        return f"level {level}"


def _rung_colour(rung: int, rungs: int) -> str:
    """The mild colour for the first rung, the aggressive one for the last, blends between."""
    if rung == 0:
        return MILD_COLOUR
    if rung == rungs - 1:
        return _AGGRESSIVE_COLOUR
    mild, aggressive = np.array(mcolors.to_rgb(MILD_COLOUR)), mcolors.to_rgb(_AGGRESSIVE_COLOUR)
    return mcolors.to_hex(mild + (np.array(aggressive) - mild) * rung / (rungs - 1))


def _rung_label(cls: type[Compressor], level: Any, rung: int, rungs: int) -> str:
    if rung == 0:
        return f"mild ({_label(cls, level)}), critical"
    if rung == rungs - 1:
        return f"aggressive ({_label(cls, level)})"
    return f"intermediate ({_label(cls, level)})"


def _seen(grid: Sequence[Sequence[Any]]) -> list[Any]:
    """The distinct values in ``grid``: numbers ascending (one per float value), then text."""
    numbers_seen: dict[float, Any] = {}
    texts: set[str] = set()
    for value in (v for row in grid for v in row if v is not None):
        if _is_number(value):
            numbers_seen.setdefault(float(value), value)
        else:
            texts.add(value)
    return [numbers_seen[f] for f in sorted(numbers_seen)] + sorted(texts)


def _categories(cls: type[Compressor], ladder: Sequence[Any], grid) -> list[Category]:
    """The ladder's rungs, mildest first (a repeated level once), then any other level."""
    categories: list[Category] = []
    for rung, level in enumerate(ladder):
        if not any(_same(level, c[2]) for c in categories):
            label = _rung_label(cls, level, rung, len(ladder))
            categories.append((label, _rung_colour(rung, len(ladder)), level))
    others = [v for v in _seen(grid) if not any(_same(v, c[2]) for c in categories)]
    for k, value in enumerate(others):
        colour = _OTHER_LEVEL_COLOURS[k % len(_OTHER_LEVEL_COLOURS)]
        categories.append((_label(cls, value), colour, value))
    return categories


def _codes(grid: Sequence[Sequence[Any]], categories: Sequence[Category]) -> np.ndarray:
    """Each cell's category index (the last that matches), ``len(categories)`` if none."""
    codes = np.full((len(grid), len(grid[0]) if grid else 0), len(categories), dtype=float)
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            for k, (_, _, level) in enumerate(categories):
                if _matches(value, level):
                    codes[i, j] = k
    return codes


def _grid(run: Mapping[str, Any], strategy: str) -> tuple[list[str], int, int, list[list[Any]]]:
    """(layers, first epoch, last epoch, layers x epochs of recorded levels) of a run."""
    records = [r for r in run["epochs"] if isinstance(r, Mapping)]
    epoch_levels: dict[int, Mapping[str, Any]] = {}
    for i, r in enumerate(records):
        levels = r.get("levels")
        epoch_levels[epoch_of(r, i)] = levels if isinstance(levels, Mapping) else {}
    layers = layer_order(list(epoch_levels.values()))
    if not layers:
        raise ValueError(f"the {strategy} run (seed {seed_of(run)}) records no per-layer levels")
    first, last = min(epoch_levels), max(epoch_levels)
    grid = [
        [_recorded(epoch_levels.get(e, {}).get(layer)) for e in range(first, last + 1)]
        for layer in layers
    ]
    return layers, first, last, grid


def _draw_map(ax: Any, codes: np.ndarray, colours: list[str], first: int, last: int) -> None:
    """The heatmap of ``codes`` with white cell borders while the cells are big enough."""
    layers = codes.shape[0]
    cmap = mcolors.ListedColormap(colours)
    norm = mcolors.BoundaryNorm(np.arange(-0.5, len(colours) + 0.5), len(colours))
    ax.imshow(
        codes, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest",
        extent=(first - 0.5, last + 0.5, layers - 0.5, -0.5),
    )  # fmt: skip
    if last - first + 1 <= 30:
        ax.set_xticks(np.arange(first - 0.5, last + 1.0), minor=True)
        ax.grid(which="minor", axis="x", color="white", linewidth=0.8)
    if layers <= 60:
        ax.set_yticks(np.arange(-0.5, layers), minor=True)
        ax.grid(which="minor", axis="y", color="white", linewidth=0.8)
    ax.tick_params(which="minor", length=0)


def _category_handles(codes: np.ndarray, categories: Sequence[Category]) -> list[Any]:
    """Legend patches: each category with its share of layer-epochs, then the missing."""
    handles: list[Any] = []
    for k, (label, colour, _) in enumerate(categories):
        share = 100.0 * float((codes == k).sum()) / codes.size
        handles.append(Patch(facecolor=colour, label=f"{label}: {share:.0f}% of layer-epochs"))
    if bool((codes == len(categories)).any()):
        handles.append(
            Patch(facecolor=_MISSING_COLOUR, edgecolor="0.7", label="dense or not recorded")
        )
    return handles


def _mark_checks(ax: Any, run: Mapping[str, Any], first: int, last: int) -> Line2D | None:
    """Triangles above the map at the end of each checked epoch; their legend entry."""
    check_epochs = [
        epoch_of(c, i) for i, c in enumerate(run.get("checks") or []) if isinstance(c, Mapping)
    ]
    check_epochs = [e for e in check_epochs if first <= e <= last]
    if not check_epochs:
        return None
    # a check at the end of epoch e decides the epochs after it: mark the boundary
    transform = blended_transform_factory(ax.transData, ax.transAxes)
    ax.plot(
        [e + 0.5 for e in check_epochs], [1.0] * len(check_epochs), linestyle="none",
        marker="v", markersize=6, color="0.15", transform=transform, clip_on=False,
    )  # fmt: skip
    return Line2D(
        [], [], linestyle="none", marker="v", color="0.15", label="regime check (epoch end)"
    )


def _layer_ticks(ax: Any, layers: Sequence[str]) -> None:
    """One y tick per layer, thinned to about 30 labels, smaller fonts for many layers."""
    step = max(1, math.ceil(len(layers) / 30))
    rows = list(range(0, len(layers), step))
    ax.set_yticks(rows, [layers[i] for i in rows], fontsize=8 if len(layers) <= 12 else 6)


def plot_levels(results: Mapping[str, Any], path: str | Path, strategy: str | None = None) -> Path:
    """Heatmap of an Accordion run's compression level: layers (rows) x epochs (columns).

    ``strategy`` is an Accordion strategy string, or a family prefix such as
    ``"accordion:topk"``; by default the first ``accordion:*`` strategy. The run of its
    lowest seed is drawn. The mildest rung of the ladder (critical regimes) is dark red,
    the most aggressive light blue, the rungs between blends of the two; the legend names
    them ("mild (rank 4)", "intermediate (rank 2)", "aggressive (top-k 0.01)") with their
    share of layer-epochs. Decays are dashed black lines, regime checks triangles above.

    Raises:
        ValueError: no runs, no Accordion run (the message names the strategies present),
            or an Accordion run without per-layer levels.
    """
    strategy, run = select_accordion(results, strategy)
    ladder = parsed(strategy)
    assert ladder is not None  # select_accordion picks an Accordion strategy the harness knows
    cls = compressor_class(ladder.compressor)
    layers, first, last, grid = _grid(run, strategy)
    categories = _categories(cls, ladder.levels, grid)
    codes = _codes(grid, categories)
    fig = figure()
    ax = fig.add_subplot()
    _draw_map(ax, codes, [c[1] for c in categories] + [_MISSING_COLOUR], first, last)
    handles = _category_handles(codes, categories)
    drawn = draw_decays(ax, decay_epochs(results), (first - 0.5, last + 0.5),
                        _HEATMAP_DECAY_STYLE, 5)  # fmt: skip
    if drawn:
        handles.append(decay_handle(drawn, _HEATMAP_DECAY_STYLE))
    check = _mark_checks(ax, run, first, last)
    if check is not None:
        handles.append(check)
    ax.set_xlim(first - 0.5, last + 0.5)
    integer_epochs(ax)
    _layer_ticks(ax, layers)
    ax.set_xlabel("epoch")
    ax.set_ylabel("layer (compressed tensor)")
    ax.set_title(
        f"Compression level per layer and epoch:\n{wrapped_strategy(strategy)}\n"
        f"{context(results, [run])}",
        pad=10,
    )
    ax.legend(handles=handles, fontsize=LEGEND_FONTSIZE, **LEGEND_OUTSIDE)
    return save(fig, path)
