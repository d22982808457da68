"""What every plot shares: the results' validation and series, strategies, and drawing.

Matplotlib is used through :class:`~matplotlib.figure.Figure` and the Agg canvas directly,
never through ``pyplot``: no GUI backend is needed and a backend the caller chose is left
alone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from ..strategies import Strategy, parse_strategy

FIGSIZE = (8.0, 4.5)
"""Figure size of every plot, in inches (width, height)."""
DPI = 150
"""Resolution of every PNG, in dots per inch: 1200 x 675 pixels."""

#: The mild level (critical regime) on the heatmap and the threshold line: warm and dark.
MILD_COLOUR = "#b2182b"
DECAY_STYLE = {"color": "0.25", "linestyle": ":", "linewidth": 1.3}
LEGEND_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0}
LEGEND_FONTSIZE = 8

# ---------------------------------------------------------------------------- validation


def runs_of(results: Any) -> list[Mapping[str, Any]]:
    """The runs of ``results``, validated: ValueError without a non-empty list of runs."""
    if not isinstance(results, Mapping):
        raise TypeError(f"results must be a dict (results.json loaded), got {type(results)}")
    runs = results.get("runs")
    if not isinstance(runs, Sequence) or isinstance(runs, str) or not runs:
        raise ValueError(
            "results has no runs: expected results['runs'] to be a non-empty list of "
            f"{{'strategy', 'seed', 'epochs', ...}} records, got {runs!r:.80}"
        )
    for i, run in enumerate(runs):
        if not isinstance(run, Mapping):
            raise ValueError(f"results['runs'][{i}] must be a dict, got {type(run).__name__}")
        if not isinstance(run.get("strategy"), str):
            raise ValueError(f"results['runs'][{i}] has no 'strategy' string")
        epochs = run.get("epochs")
        if not isinstance(epochs, Sequence) or isinstance(epochs, str):
            raise ValueError(f"results['runs'][{i}] ({run['strategy']}) has no 'epochs' list")
    return list(runs)


def config_of(results: Mapping[str, Any]) -> Mapping[str, Any]:
    """``results["config"]``, or an empty dict when it has none."""
    config = results.get("config")
    return config if isinstance(config, Mapping) else {}


def seed_of(run: Mapping[str, Any]) -> Any:
    """A run's seed (0 when it records none)."""
    return run.get("seed", 0)


def seed_key(run: Mapping[str, Any]) -> tuple[int, Any]:
    """Sort key of a run by seed: numbers first, in order, then other seeds as text."""
    seed = seed_of(run)
    return (0, seed) if isinstance(seed, int | float) else (1, str(seed))


def by_strategy(runs: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Strategy -> its runs sorted by seed; strategies in order of first appearance."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for run in runs:
        groups.setdefault(run["strategy"], []).append(run)
    return {s: sorted(rs, key=seed_key) for s, rs in groups.items()}


def number(value: Any) -> float:
    """A JSON number as a float; None, booleans and anything else as NaN."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return float(value)


def epoch_of(record: Mapping[str, Any], index: int) -> int:
    """The ``epoch`` of a per-epoch record or check, else its position ``index``."""
    epoch = record.get("epoch", index) if isinstance(record, Mapping) else index
    return int(epoch) if isinstance(epoch, int | float) and not isinstance(epoch, bool) else index


def series(run: Mapping[str, Any], key: str) -> dict[int, float]:
    """Epoch -> the run's value of ``key`` in that epoch's record (NaN when missing)."""
    out: dict[int, float] = {}
    for i, record in enumerate(run["epochs"]):
        value = record.get(key) if isinstance(record, Mapping) else None
        out[epoch_of(record, i)] = number(value)
    return out


def stack(runs: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Epochs (sorted) and a seeds x epochs array of ``key`` (NaN where a run lacks it)."""
    all_series = [series(run, key) for run in runs]
    epochs = np.array(sorted({e for s in all_series for e in s}), dtype=int)
    values = np.full((len(all_series), len(epochs)), np.nan)
    for i, s in enumerate(all_series):
        for j, e in enumerate(epochs):
            values[i, j] = s.get(int(e), math.nan)
    return epochs, values


def mean_std(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column: mean over the finite values, and their sample std (0 with one value)."""
    finite = np.isfinite(values)
    count = finite.sum(axis=0)
    filled = np.where(finite, values, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(count > 0, filled.sum(axis=0) / np.maximum(count, 1), np.nan)
        sq = np.where(finite, (values - mean) ** 2, 0.0).sum(axis=0)
        std = np.where(count > 1, np.sqrt(sq / np.maximum(count - 1, 1)), 0.0)
    return mean, std


def decay_epochs(results: Mapping[str, Any]) -> list[int]:
    """``config["decay_epochs"]``, or else the epochs where the first run's lr drops."""
    decays = config_of(results).get("decay_epochs")
    if isinstance(decays, Sequence) and not isinstance(decays, str):
        return sorted(int(d) for d in decays if isinstance(d, int | float))
    runs = runs_of(results)
    lr = series(runs[0], "lr")
    epochs = sorted(lr)
    return [b for a, b in zip(epochs, epochs[1:]) if lr[b] < lr[a]]


def seeds_text(runs: Sequence[Mapping[str, Any]]) -> str:
    """'seed 0', 'seeds 0, 1' or 'N seeds' for titles and legends."""
    seeds = sorted({seed_of(r) for r in runs}, key=lambda s: seed_key({"seed": s}))
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    if len(seeds) <= 4:
        return "seeds " + ", ".join(str(s) for s in seeds)
    return f"{len(seeds)} seeds"


def context(results: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> str:
    """'task, N workers, seeds ...' for titles."""
    config = config_of(results)
    parts = [str(config.get("task", "unknown task"))]
    if config.get("workers") is not None:
        parts.append(f"{config['workers']} workers")
    parts.append(seeds_text(runs))
    return ", ".join(parts)


#: The widest title line, in characters, that a figure shows whole.
TITLE_WIDTH = 60


def wrapped_strategy(strategy: str, width: int = TITLE_WIDTH) -> str:
    """``strategy`` on lines of at most ``width`` characters for a title, broken after its
    commas and colons (a long ladder would otherwise run off the figure)."""
    lines, line = [], ""
    for piece in re.findall(r"[^,:]*[,:]|[^,:]+", strategy):  # every character kept
        if line and len(line) + len(piece) > width:
            lines.append(line)
            line = ""
        line += piece
    return "\n".join([*lines, line])


def layer_order(dicts: Sequence[Any]) -> list[str]:
    """Keys of a sequence of dicts, in order of first appearance."""
    order: dict[str, None] = {}
    for d in dicts:
        if isinstance(d, Mapping):
            order.update(dict.fromkeys(d))
    return list(order)


# ---------------------------------------------------------------------------- strategies


def parsed(strategy: str) -> Strategy | None:
    """The parsed strategy string, or ``None`` when it is not one the harness knows."""
    try:
        return parse_strategy(strategy)
    except (TypeError, ValueError):
        return None


def is_accordion(strategy: str) -> bool:
    """Whether ``strategy`` is an Accordion compression strategy (not combined with a
    batch strategy): the strategies with per-layer levels and regime checks."""
    strat = parsed(strategy)
    return strat is not None and strat.family == "accordion" and strat.batch_mode is None


def is_batch_strategy(strategy: str) -> bool:
    """Whether ``strategy`` is a batch-size strategy (alone or combined with compression)."""
    return strategy.split(":", 1)[0] in ("batch", "batch-fixed", "static-batch")


def select_accordion(
    results: Mapping[str, Any], strategy: str | None
) -> tuple[str, Mapping[str, Any]]:
    """The chosen Accordion strategy and its run of lowest seed."""
    groups = by_strategy(runs_of(results))
    accordion = [s for s in groups if is_accordion(s)]
    present = ", ".join(groups)
    if strategy is None:
        if not accordion:
            raise ValueError(
                "no Accordion run in results (a strategy "
                f"'accordion:COMPRESSOR:MILD,...,AGGRESSIVE'); strategies present: {present}"
            )
        strategy = accordion[0]
    elif strategy not in groups:
        # a family prefix such as "accordion:topk" picks that family's first strategy
        matches = [s for s in accordion if s.startswith(strategy.rstrip(":") + ":")]
        if not matches:
            raise ValueError(f"no run of strategy {strategy!r}; strategies present: {present}")
        strategy = matches[0]
    if not is_accordion(strategy):
        raise ValueError(
            f"strategy {strategy!r} is not an Accordion strategy: it has no per-layer levels "
            f"or regime checks; Accordion strategies present: {', '.join(accordion) or 'none'}"
        )
    return strategy, groups[strategy][0]


# ---------------------------------------------------------------------------- drawing


def figure() -> Figure:
    """A new figure of :data:`FIGSIZE` on an Agg canvas (no pyplot)."""
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (parents created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return path


def draw_decays(
    ax: Any,
    decays: Sequence[int],
    x_range: tuple[float, float],
    style: Mapping[str, Any] = DECAY_STYLE,
    zorder: float = 1,
) -> list[int]:
    """Dotted lines at ``d - 0.5`` for the decays inside ``x_range``; returns those decays."""
    drawn = [d for d in decays if x_range[0] <= d - 0.5 <= x_range[1]]
    for d in drawn:
        ax.axvline(d - 0.5, **style, zorder=zorder)
    return drawn


def decay_handle(decays: Sequence[int], style: Mapping[str, Any] = DECAY_STYLE) -> Line2D:
    """The legend entry of the decay lines."""
    label = "lr decay before epoch " + ", ".join(str(d) for d in decays)
    return Line2D([], [], **style, label=label)


def add_decays(ax: Any, results: Mapping[str, Any], x_min: float, x_max: float,
               handles: list[Any]) -> None:  # fmt: skip
    """Draw the decays within ``[x_min - 0.5, x_max + 0.5]`` and add their legend entry."""
    drawn = draw_decays(ax, decay_epochs(results), (x_min - 0.5, x_max + 0.5))
    if drawn:
        handles.append(decay_handle(drawn))


def markers(points: int) -> dict[str, Any]:
    """Small dots on the points of short curves; none on long ones, where they would blur."""
    return {"marker": "o", "markersize": 3} if points <= 30 else {"marker": None}


def integer_epochs(ax: Any) -> None:
    """Integer epoch ticks on the x axis."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
