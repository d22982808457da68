"""PNG plots of the ``results.json`` written by ``accordion compare``.

Every function takes the results structure (a dict loaded from JSON: ``{"config": {...},
"runs": [{"strategy", "seed", "epochs", "checks", "mild", "aggressive"}, ...]}``) and a
destination path, writes one PNG (150 dpi, 8 x 4.5 inches) and returns the path written:

* :func:`plot_accuracy` -- test metric per epoch, mean over seeds with a +/- 1 std band;
* :func:`plot_data_sent` -- cumulative floats sent per worker (the paper's "Data Sent");
* :func:`plot_levels` -- an Accordion run's compression level per layer and epoch;
* :func:`plot_norm_ratios` -- an Accordion run's gradient-norm change ratios at each check;
* :func:`plot_all` -- all of the above into one directory.

Epoch ``e`` of the x axes is the ``e``-th training epoch (0-based), with its metric measured
at its end. A learning-rate decay at epoch ``d`` (``config["decay_epochs"]``: the first
epoch that trains with the lower rate) is drawn as a dotted line at ``d - 0.5``, between
the last epoch before the decay and the first after it, on every plot.

Matplotlib is used through :class:`~matplotlib.figure.Figure` and the Agg canvas directly,
never through ``pyplot``: no GUI backend is needed and a backend the caller chose is left
alone.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib import colors as mcolors
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter
from matplotlib.transforms import blended_transform_factory

__all__ = [
    "DPI",
    "FIGSIZE",
    "plot_accuracy",
    "plot_all",
    "plot_data_sent",
    "plot_levels",
    "plot_norm_ratios",
    "strategy_style",
]

FIGSIZE = (8.0, 4.5)
"""Figure size of every plot, in inches (width, height)."""
DPI = 150
"""Resolution of every PNG, in dots per inch: 1200 x 675 pixels."""

# Base colour of each strategy family; the level then lightens it (milder = darker), so
# that a family reads as one hue and the static mild/aggressive pair as two shades of it.
_FAMILY_COLOURS = {
    "dense": "#000000",
    "static:powersgd": "#1f77b4",
    "accordion:powersgd": "#d62728",
    "torch-powersgd": "#9467bd",
    "static:topk": "#2ca02c",
    "accordion:topk": "#ff7f0e",
}
# families we do not know get one of these, chosen by a stable hash of the family name
_FALLBACK_COLOURS = ("#8c564b", "#e377c2", "#bcbd22", "#17becf", "#7f7f7f")
_FAMILY_LINESTYLES = {"static": "--", "torch-powersgd": "-."}
# batch-size strategies: (colour, line style) per kind
_BATCH_STYLES = {
    "static-batch": ("#7f7f7f", "--"),
    "batch": ("#17becf", "-"),
    "batch-fixed": ("#8c564b", "-."),
}

# heatmap colours: mild (critical regime) warm and dark, aggressive cool and light
_MILD_COLOUR = "#b2182b"
_AGGRESSIVE_COLOUR = "#9ecae1"
_OTHER_LEVEL_COLOURS = ("#f4a582", "#2166ac", "#fddbc7", "#5aae61", "#762a83")
_MISSING_COLOUR = "#f0f0f0"
_DECAY_STYLE = {"color": "0.25", "linestyle": ":", "linewidth": 1.3}
# on the heatmap: black, thicker and above the white cell borders
_HEATMAP_DECAY_STYLE = {"color": "black", "linestyle": (0, (2, 1.5)), "linewidth": 2.2}
_LEGEND_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0}
_LEGEND_FONTSIZE = 8


# ---------------------------------------------------------------------------- validation


def _runs(results: Any) -> list[Mapping[str, Any]]:
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


def _config(results: Mapping[str, Any]) -> Mapping[str, Any]:
    config = results.get("config")
    return config if isinstance(config, Mapping) else {}


def _seed(run: Mapping[str, Any]) -> Any:
    return run.get("seed", 0)


def _seed_key(run: Mapping[str, Any]) -> tuple[int, Any]:
    seed = _seed(run)
    return (0, seed) if isinstance(seed, int | float) else (1, str(seed))


def _by_strategy(runs: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Strategy -> its runs sorted by seed; strategies in order of first appearance."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for run in runs:
        groups.setdefault(run["strategy"], []).append(run)
    return {s: sorted(rs, key=_seed_key) for s, rs in groups.items()}


def _number(value: Any) -> float:
    """A JSON number as a float; None, booleans and anything else as NaN."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return float(value)


def _epoch_of(record: Mapping[str, Any], index: int) -> int:
    epoch = record.get("epoch", index) if isinstance(record, Mapping) else index
    return int(epoch) if isinstance(epoch, int | float) and not isinstance(epoch, bool) else index


def _series(run: Mapping[str, Any], key: str) -> dict[int, float]:
    """Epoch -> the run's value of ``key`` in that epoch's record (NaN when missing)."""
    out: dict[int, float] = {}
    for i, record in enumerate(run["epochs"]):
        value = record.get(key) if isinstance(record, Mapping) else None
        out[_epoch_of(record, i)] = _number(value)
    return out


def _stack(runs: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Epochs (sorted) and a seeds x epochs array of ``key`` (NaN where a run lacks it)."""
    series = [_series(run, key) for run in runs]
    epochs = np.array(sorted({e for s in series for e in s}), dtype=int)
    values = np.full((len(series), len(epochs)), np.nan)
    for i, s in enumerate(series):
        for j, e in enumerate(epochs):
            values[i, j] = s.get(int(e), math.nan)
    return epochs, values


def _mean_std(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column: mean over the finite values, and their sample std (0 with one value)."""
    finite = np.isfinite(values)
    count = finite.sum(axis=0)
    filled = np.where(finite, values, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(count > 0, filled.sum(axis=0) / np.maximum(count, 1), np.nan)
        sq = np.where(finite, (values - mean) ** 2, 0.0).sum(axis=0)
        std = np.where(count > 1, np.sqrt(sq / np.maximum(count - 1, 1)), 0.0)
    return mean, std


def _decay_epochs(results: Mapping[str, Any]) -> list[int]:
    """``config["decay_epochs"]``, or else the epochs where the first run's lr drops."""
    decays = _config(results).get("decay_epochs")
    if isinstance(decays, Sequence) and not isinstance(decays, str):
        return sorted(int(d) for d in decays if isinstance(d, int | float))
    runs = _runs(results)
    lr = _series(runs[0], "lr")
    epochs = sorted(lr)
    return [b for a, b in zip(epochs, epochs[1:]) if lr[b] < lr[a]]


def _seeds_text(runs: Sequence[Mapping[str, Any]]) -> str:
    seeds = sorted({_seed(r) for r in runs}, key=lambda s: _seed_key({"seed": s}))
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    if len(seeds) <= 4:
        return "seeds " + ", ".join(str(s) for s in seeds)
    return f"{len(seeds)} seeds"


def _context(results: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> str:
    """'task, N workers, seeds ...' for titles."""
    config = _config(results)
    parts = [str(config.get("task", "unknown task"))]
    if config.get("workers") is not None:
        parts.append(f"{config['workers']} workers")
    parts.append(_seeds_text(runs))
    return ", ".join(parts)


# ---------------------------------------------------------------------------- strategies


def _family(strategy: str) -> tuple[str, str, str]:
    """(kind, compressor, levels text): ('accordion', 'powersgd', '4,1'), ('dense', '', '')."""
    parts = strategy.split(":")
    if len(parts) == 4 and parts[3] == "auto":  # the cost model's flag, not a level
        parts = parts[:3]
    if len(parts) >= 3:
        return parts[0], parts[1], ":".join(parts[2:])
    if len(parts) == 2:
        return parts[0], parts[0].split("-")[-1], parts[1]
    return parts[0], "", ""


def _is_accordion(strategy: str) -> bool:
    return strategy.startswith("accordion:")


def _first_level(text: str) -> float | None:
    match = re.match(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)", text)
    return float(match.group(1)) if match else None


def _lightening(compressor: str, level: float | None) -> float:
    """How much of white to mix into a family colour: 0 for the mildest levels."""
    if level is None or not level > 0:
        return 0.0
    if compressor == "powersgd":  # rank 8+ darkest, rank 1 lightest
        mix = 0.45 - 0.15 * math.log2(level)
    elif compressor == "topk":  # keep 99% darkest, 1% lightest
        mix = 0.2 * -math.log10(min(level, 1.0))
    elif compressor == "batch":  # larger batches are more aggressive
        mix = 0.15 * math.log2(level / 256.0)
    else:
        mix = 0.0
    return min(max(mix, 0.0), 0.5)


def strategy_style(strategy: str) -> dict[str, Any]:
    """Line style of a strategy, a fixed function of its string: same in every plot.

    Each family has one hue (dense black, static PowerSGD blue, Accordion PowerSGD red,
    PyTorch's PowerSGD purple, static top-k green, Accordion top-k orange); more aggressive
    levels are lighter shades of it. Static strategies are dashed, PyTorch's dash-dotted,
    Accordion and dense solid. Returns ``{"color", "linestyle", "linewidth"}``.
    """
    batch_kind, comm = strategy.partition(":")[0], strategy.partition("+")[2]
    if batch_kind in _BATCH_STYLES:
        colour, linestyle = _BATCH_STYLES[batch_kind]
        # a batch strategy combined with compression: the same hue, dotted
        return {"color": colour, "linestyle": ":" if comm else linestyle, "linewidth": 2.0}
    kind, compressor, levels = _family(strategy)
    key = kind if kind in ("dense", "torch-powersgd") else f"{kind}:{compressor}"
    base = _FAMILY_COLOURS.get(key)
    if base is None:
        base = _FALLBACK_COLOURS[zlib.crc32(key.encode()) % len(_FALLBACK_COLOURS)]
    mix = _lightening(compressor, _first_level(levels))
    if kind == "accordion":  # the strategy under study: keep it close to full colour
        mix /= 2.0
    rgb = np.array(mcolors.to_rgb(base))
    colour = mcolors.to_hex(rgb + (1.0 - rgb) * mix)
    return {
        "color": colour,
        "linestyle": _FAMILY_LINESTYLES.get(kind, "-"),
        "linewidth": 2.0 if kind == "accordion" else 1.5,
    }


def _level_text(compressor: str, level: Any) -> str:
    value = _number(level)
    shown = f"{value:g}" if math.isfinite(value) else str(level)
    if compressor == "powersgd":
        return f"rank {shown}"
    if compressor == "topk":
        return f"top-k {shown}"
    if compressor == "batch":
        return f"batch {shown}"
    return f"level {shown}"


def _strategy_levels(run: Mapping[str, Any]) -> tuple[Any, Any]:
    """(mild, aggressive) of a run: its 'mild'/'aggressive' keys, else parsed from the name."""
    mild, aggressive = run.get("mild"), run.get("aggressive")
    if mild is None or aggressive is None:
        _, _, levels = _family(run["strategy"])
        parts = levels.split(",")
        if len(parts) == 2:
            mild = _first_level(parts[0]) if mild is None else mild
            aggressive = _first_level(parts[1]) if aggressive is None else aggressive
    return mild, aggressive


def _select_accordion(
    results: Mapping[str, Any], strategy: str | None
) -> tuple[str, Mapping[str, Any]]:
    """The chosen Accordion strategy and its run of lowest seed."""
    groups = _by_strategy(_runs(results))
    accordion = [s for s in groups if _is_accordion(s)]
    present = ", ".join(groups)
    if strategy is None:
        if not accordion:
            raise ValueError(
                "no Accordion run in results (a strategy 'accordion:COMPRESSOR:MILD,AGG'); "
                f"strategies present: {present}"
            )
        strategy = accordion[0]
    elif strategy not in groups:
        # a family prefix such as "accordion:topk" picks that family's first strategy
        matches = [s for s in accordion if s.startswith(strategy.rstrip(":") + ":")]
        if not matches:
            raise ValueError(f"no run of strategy {strategy!r}; strategies present: {present}")
        strategy = matches[0]
    if not _is_accordion(strategy):
        raise ValueError(
            f"strategy {strategy!r} is not an Accordion strategy: it has no per-layer levels "
            f"or regime checks; Accordion strategies present: {', '.join(accordion) or 'none'}"
        )
    return strategy, groups[strategy][0]


# ---------------------------------------------------------------------------- drawing


def _figure() -> Figure:
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return path


def _draw_decays(
    ax: Any,
    decays: Sequence[int],
    x_range: tuple[float, float],
    style: Mapping[str, Any] = _DECAY_STYLE,
    zorder: float = 1,
) -> list[int]:
    """Dotted lines at ``d - 0.5`` for the decays inside ``x_range``; returns those decays."""
    drawn = [d for d in decays if x_range[0] <= d - 0.5 <= x_range[1]]
    for d in drawn:
        ax.axvline(d - 0.5, **style, zorder=zorder)
    return drawn


def _decay_handle(decays: Sequence[int], style: Mapping[str, Any] = _DECAY_STYLE) -> Line2D:
    label = "lr decay before epoch " + ", ".join(str(d) for d in decays)
    return Line2D([], [], **style, label=label)


def _markers(points: int) -> dict[str, Any]:
    """Small dots on the points of short curves; none on long ones, where they would blur."""
    return {"marker": "o", "markersize": 3} if points <= 30 else {"marker": None}


def _integer_epochs(ax: Any) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))


def _metric_label(results: Mapping[str, Any]) -> tuple[str, str]:
    """(axis label, title noun) for ``config["metric"]``."""
    metric = str(_config(results).get("metric", "accuracy"))
    if metric == "accuracy":
        return "test accuracy (%)", "test accuracy"
    if metric == "perplexity":
        return "test perplexity", "test perplexity"
    return f"test {metric}", f"test {metric}"


# ---------------------------------------------------------------------------- plots


def plot_accuracy(results: Mapping[str, Any], path: str | Path) -> Path:
    """Test metric vs epoch: per strategy the mean over seeds, shaded +/- 1 sample std.

    The y label is "test accuracy (%)" or "test perplexity" per ``config["metric"]``;
    learning-rate decays are dotted vertical lines. Returns ``path``.
    """
    runs = _runs(results)
    groups = _by_strategy(runs)
    ylabel, noun = _metric_label(results)
    fig = _figure()
    ax = fig.add_subplot()
    x_min, x_max = math.inf, -math.inf
    several = any(len(rs) > 1 for rs in groups.values())
    most_seeds = max(len(rs) for rs in groups.values())
    for strategy, strategy_runs in groups.items():
        epochs, values = _stack(strategy_runs, "test_metric")
        if not len(epochs):
            continue
        mean, std = _mean_std(values)
        style = strategy_style(strategy)
        label = strategy
        if len(strategy_runs) < most_seeds:  # say so when a strategy has fewer seeds
            label += f" ({_seeds_text(strategy_runs)} only)"
        ax.plot(epochs, mean, **style, **_markers(len(epochs)), label=label, zorder=3)
        if len(strategy_runs) > 1:
            ax.fill_between(
                epochs, mean - std, mean + std, color=style["color"], alpha=0.18, lw=0, zorder=2
            )
        x_min, x_max = min(x_min, epochs[0]), max(x_max, epochs[-1])
    if not math.isfinite(x_min):
        x_min, x_max = 0, 1
    ax.set_xlim(x_min - 0.5, x_max + 0.5)
    decays = _decay_epochs(results)
    handles, _ = ax.get_legend_handles_labels()
    drawn = _draw_decays(ax, decays, (x_min - 0.5, x_max + 0.5))
    if drawn:
        handles.append(_decay_handle(drawn))
    if several:
        handles.append(Patch(color="0.6", alpha=0.35, label="± 1 std over seeds"))
    _integer_epochs(ax)
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    summary = "mean over seeds ± 1 std" if several else "one seed per strategy"
    ax.set_title(f"{noun.capitalize()} per epoch ({summary})\n{_context(results, runs)}")
    ax.legend(handles=handles, fontsize=_LEGEND_FONTSIZE, **_LEGEND_OUTSIDE)
    return _save(fig, path)


def _float_unit(value: float) -> tuple[float, str]:
    """(scale, unit) that shows ``value`` as 1 to 999 units: (1e6, "M") for 2.4e6."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return scale, unit
    return 1.0, ""


def _floats_text(value: float) -> str:
    scale, unit = _float_unit(value)
    return f"{value / scale:.4g} {unit}".rstrip()


def plot_data_sent(results: Mapping[str, Any], path: str | Path) -> Path:
    """Cumulative floats sent per worker (paper convention) vs epoch, mean over seeds.

    The y axis is logarithmic when the largest final total exceeds the smallest by more
    than 100x (then in k/M/B units of the smallest total), else linear (in units of the
    largest). Each legend entry gives the strategy's final total. Returns ``path``.
    """
    runs = _runs(results)
    groups = _by_strategy(runs)
    curves: list[tuple[str, np.ndarray, np.ndarray]] = []
    for strategy, strategy_runs in groups.items():
        epochs, values = _stack(strategy_runs, "floats")
        mean, _ = _mean_std(values)
        if len(epochs) and np.isfinite(mean).any():
            curves.append((strategy, epochs, mean))
    finals = [float(m[np.isfinite(m)][-1]) for _, _, m in curves]
    largest = max((f for f in finals if f > 0), default=1.0)
    smallest = min((f for f in finals if f > 0), default=1.0)
    log = largest / smallest > 100.0
    # a log axis in units of its smallest total, a linear one in units of its largest
    scale, unit = _float_unit(smallest if log else largest)
    fig = _figure()
    ax = fig.add_subplot()
    x_min, x_max = math.inf, -math.inf
    for (strategy, epochs, mean), final in zip(curves, finals):
        label = f"{strategy}: {_floats_text(final)}"
        y = mean / scale
        if log:
            y = np.where(y > 0, y, np.nan)
        ax.plot(epochs, y, **strategy_style(strategy), **_markers(len(epochs)), label=label)
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
    decays = _decay_epochs(results)
    handles, _ = ax.get_legend_handles_labels()
    drawn = _draw_decays(ax, decays, (x_min - 0.5, x_max + 0.5))
    if drawn:
        handles.append(_decay_handle(drawn))
    _integer_epochs(ax)
    ax.set_xlabel("epoch")
    unit_text = f"{unit} floats" if unit else "floats"
    scale_text = ", log scale" if log else ""
    ax.set_ylabel(f"cumulative floats sent per worker\n({unit_text}{scale_text})")
    ax.grid(alpha=0.3, which="major")
    several = any(len(rs) > 1 for rs in groups.values())
    summary = ", mean over seeds" if several else ""
    ax.set_title(f"Floats sent per worker (paper convention{summary})\n{_context(results, runs)}")
    ax.legend(
        handles=handles,
        title="strategy: total floats",
        title_fontsize=_LEGEND_FONTSIZE,
        fontsize=_LEGEND_FONTSIZE,
        **_LEGEND_OUTSIDE,
    )
    return _save(fig, path)


def _layer_order(dicts: Sequence[Any]) -> list[str]:
    """Keys of a sequence of dicts, in order of first appearance."""
    order: dict[str, None] = {}
    for d in dicts:
        if isinstance(d, Mapping):
            order.update(dict.fromkeys(d))
    return list(order)


def _same(a: float, b: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and math.isclose(a, b, rel_tol=1e-9)


def _layer_ticks(ax: Any, layers: Sequence[str]) -> None:
    """One y tick per layer, thinned to about 30 labels, smaller fonts for many layers."""
    step = max(1, math.ceil(len(layers) / 30))
    rows = list(range(0, len(layers), step))
    ax.set_yticks(rows, [layers[i] for i in rows], fontsize=8 if len(layers) <= 12 else 6)


def plot_levels(results: Mapping[str, Any], path: str | Path, strategy: str | None = None) -> Path:
    """Heatmap of an Accordion run's compression level: layers (rows) x epochs (columns).

    ``strategy`` is an Accordion strategy string, or a family prefix such as
    ``"accordion:topk"``; by default the first ``accordion:*`` strategy. The run of its
    lowest seed is drawn. Mild levels (critical regimes) are dark red, aggressive ones light
    blue; the legend names them ("mild (rank 4)", "aggressive (top-k 0.01)") with their share
    of layer-epochs. Decays are dashed black lines, regime checks triangles above the map.

    Raises:
        ValueError: no runs, no Accordion run (the message names the strategies present),
            or an Accordion run without per-layer levels.
    """
    strategy, run = _select_accordion(results, strategy)
    _, compressor, _ = _family(strategy)
    records = [r for r in run["epochs"] if isinstance(r, Mapping)]
    epoch_levels = {
        _epoch_of(r, i): (r.get("levels") if isinstance(r.get("levels"), Mapping) else {})
        for i, r in enumerate(records)
    }
    layers = _layer_order(list(epoch_levels.values()))
    if not layers:
        raise ValueError(f"the {strategy} run (seed {_seed(run)}) records no per-layer levels")
    first, last = min(epoch_levels), max(epoch_levels)
    epochs = list(range(first, last + 1))
    mild, aggressive = (_number(v) for v in _strategy_levels(run))
    values = np.full((len(layers), len(epochs)), np.nan)
    for j, e in enumerate(epochs):
        for i, layer in enumerate(layers):
            values[i, j] = _number(epoch_levels.get(e, {}).get(layer))
    # categories: mild, aggressive, then any other level seen (sorted), then missing
    categories: list[tuple[str, str, float]] = []
    if math.isfinite(mild):
        label = f"mild ({_level_text(compressor, mild)}), critical"
        categories.append((label, _MILD_COLOUR, mild))
    if math.isfinite(aggressive) and not _same(aggressive, mild):
        label = f"aggressive ({_level_text(compressor, aggressive)})"
        categories.append((label, _AGGRESSIVE_COLOUR, aggressive))
    seen = sorted({float(v) for v in values[np.isfinite(values)]})
    others = [v for v in seen if not any(_same(v, c[2]) for c in categories)]
    for k, v in enumerate(others):
        colour = _OTHER_LEVEL_COLOURS[k % len(_OTHER_LEVEL_COLOURS)]
        categories.append((_level_text(compressor, v), colour, v))
    codes = np.full(values.shape, len(categories), dtype=float)
    for k, (_, _, level) in enumerate(categories):
        codes[np.isclose(values, level, rtol=1e-9) & np.isfinite(values)] = k
    has_missing = bool((codes == len(categories)).any())
    colours = [c[1] for c in categories] + [_MISSING_COLOUR]
    cmap = mcolors.ListedColormap(colours)
    norm = mcolors.BoundaryNorm(np.arange(-0.5, len(colours) + 0.5), len(colours))

    fig = _figure()
    ax = fig.add_subplot()
    ax.imshow(
        codes,
        cmap=cmap,
        norm=norm,
        aspect="auto",
        interpolation="nearest",
        extent=(first - 0.5, last + 0.5, len(layers) - 0.5, -0.5),
    )
    # white cell borders, in each direction while the cells are big enough for them
    if len(epochs) <= 30:
        ax.set_xticks(np.arange(first - 0.5, last + 1.0), minor=True)
        ax.grid(which="minor", axis="x", color="white", linewidth=0.8)
    if len(layers) <= 60:
        ax.set_yticks(np.arange(-0.5, len(layers)), minor=True)
        ax.grid(which="minor", axis="y", color="white", linewidth=0.8)
    ax.tick_params(which="minor", length=0)
    total = codes.size
    handles: list[Any] = []
    for k, (label, colour, _) in enumerate(categories):
        share = 100.0 * float((codes == k).sum()) / total
        handles.append(Patch(facecolor=colour, label=f"{label}: {share:.0f}% of layer-epochs"))
    if has_missing:
        handles.append(
            Patch(facecolor=_MISSING_COLOUR, edgecolor="0.7", label="dense or not recorded")
        )
    decays = _decay_epochs(results)
    drawn = _draw_decays(ax, decays, (first - 0.5, last + 0.5), _HEATMAP_DECAY_STYLE, 5)
    if drawn:
        handles.append(_decay_handle(drawn, _HEATMAP_DECAY_STYLE))
    check_epochs = [
        _epoch_of(c, i) for i, c in enumerate(run.get("checks") or []) if isinstance(c, Mapping)
    ]
    check_epochs = [e for e in check_epochs if first <= e <= last]
    if check_epochs:
        # a check at the end of epoch e decides the epochs after it: mark the boundary
        transform = blended_transform_factory(ax.transData, ax.transAxes)
        ax.plot(
            [e + 0.5 for e in check_epochs],
            [1.0] * len(check_epochs),
            linestyle="none",
            marker="v",
            markersize=6,
            color="0.15",
            transform=transform,
            clip_on=False,
        )
        handles.append(
            Line2D(
                [], [], linestyle="none", marker="v", color="0.15", label="regime check (epoch end)"
            )
        )
    ax.set_xlim(first - 0.5, last + 0.5)
    _integer_epochs(ax)
    _layer_ticks(ax, layers)
    ax.set_xlabel("epoch")
    ax.set_ylabel("layer (compressed tensor)")
    ax.set_title(
        f"Compression level per layer and epoch: {strategy}\n{_context(results, [run])}",
        pad=10,
    )
    ax.legend(handles=handles, fontsize=_LEGEND_FONTSIZE, **_LEGEND_OUTSIDE)
    return _save(fig, path)


def _layer_colours(n: int) -> list[Any]:
    """Layer colours: the default cycle for up to 10 layers, else viridis by depth."""
    if n <= 10:
        return [f"C{i}" for i in range(n)]
    return [colormaps["viridis"](x) for x in np.linspace(0.0, 0.9, n)]


def plot_norm_ratios(
    results: Mapping[str, Any], path: str | Path, strategy: str | None = None
) -> Path:
    """An Accordion run's gradient-norm change ratio per layer at each regime check.

    ``strategy`` is chosen as in :func:`plot_levels`. x: the check epochs; y: each layer's
    ``|D_old - D_new| / D_old`` (log scale when the values span more than 20x); a horizontal
    line at ``config["eta"]`` (critical above). Infinite ratios (``None``: no old norm, or
    an old norm of 0) are triangles at the top edge. Filled markers are checks that decided
    "critical" (after the learning-rate decay override), open ones "aggressive".

    Raises:
        ValueError: no runs, no Accordion run, or a run without regime checks.
    """
    strategy, run = _select_accordion(results, strategy)
    checks = [c for c in (run.get("checks") or []) if isinstance(c, Mapping)]
    if not checks:
        raise ValueError(f"the {strategy} run (seed {_seed(run)}) records no regime checks")
    eta = _number(_config(results).get("eta", 0.5))
    layer_dicts = [c.get("layers") for c in checks]
    layers = _layer_order(layer_dicts)
    check_x = [_epoch_of(c, i) for i, c in enumerate(checks)]
    ratio = np.full((len(layers), len(checks)), np.nan)
    infinite = np.zeros(ratio.shape, dtype=bool)
    critical = np.zeros(ratio.shape, dtype=bool)
    present = np.zeros(ratio.shape, dtype=bool)
    for j, layer_dict in enumerate(layer_dicts):
        if not isinstance(layer_dict, Mapping):
            continue
        for i, layer in enumerate(layers):
            entry = layer_dict.get(layer)
            if not isinstance(entry, Mapping):
                continue
            present[i, j] = True
            value = entry.get("ratio")
            r = _number(value)
            if value is None or r == math.inf:
                infinite[i, j] = True
            elif math.isfinite(r):
                ratio[i, j] = r
            critical[i, j] = bool(entry.get("critical", False))
    finite = ratio[np.isfinite(ratio)]
    reference = [float(v) for v in finite] + ([eta] if math.isfinite(eta) else [])
    positive = [v for v in reference if v > 0]
    log = (
        bool(positive) and len(positive) == len(reference) and max(positive) / min(positive) > 20.0
    )
    if log:
        bottom, top = min(positive) / 2.0, max(positive) * 3.0
    else:
        bottom, top = 0.0, max(reference, default=1.0) * 1.2 or 1.0

    fig = _figure()
    ax = fig.add_subplot()
    colours = _layer_colours(len(layers))
    transform = blended_transform_factory(ax.transData, ax.transAxes)
    # infinite ratios share the top edge: spread the layers' triangles a little sideways
    gaps = np.diff(sorted(set(check_x)))
    gap = float(gaps.min()) if len(gaps) else 1.0
    spread = gap * min(0.3, 0.08 * (len(layers) - 1))
    offsets = np.linspace(-spread, spread, len(layers)) if len(layers) > 1 else [0.0]
    for i in range(len(layers)):
        colour = colours[i]
        ax.plot(check_x, ratio[i], color=colour, linewidth=1.2, alpha=0.8, zorder=3)
        for j, x in enumerate(check_x):
            if not present[i, j]:
                continue
            face = colour if critical[i, j] else "white"
            if infinite[i, j]:
                ax.plot(
                    [x + offsets[i]],
                    [1.0],
                    transform=transform,
                    marker="^",
                    markersize=8,
                    color=colour,
                    markerfacecolor=face,
                    clip_on=False,
                    zorder=4,
                )
            elif math.isfinite(ratio[i, j]):
                ax.plot(
                    [x], [ratio[i, j]], marker="o", markersize=5, color=colour,
                    markerfacecolor=face, zorder=4,
                )  # fmt: skip
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(bottom, top)
    handles: list[Any] = []
    if len(layers) <= 12:
        handles += [
            Line2D([], [], color=colours[i], marker="o", label=layer)
            for i, layer in enumerate(layers)
        ]
    else:
        handles.append(Line2D([], [], color=colours[0], label=f"{len(layers)} layers: first"))
        handles.append(Line2D([], [], color=colours[-1], label="... last (colour = depth)"))
    if math.isfinite(eta):
        ax.axhspan(eta, top, color=_MILD_COLOUR, alpha=0.06, lw=0, zorder=0)
        ax.axhline(eta, color=_MILD_COLOUR, linestyle="--", linewidth=1.2, zorder=2)
        handles.append(
            Line2D(
                [], [], color=_MILD_COLOUR, linestyle="--", label=f"eta = {eta:g} (critical above)"
            )
        )
    grey = "0.35"
    handles += [
        Line2D([], [], linestyle="none", marker="o", color=grey, label="decided critical (mild)"),
        Line2D(
            [], [], linestyle="none", marker="o", color=grey, markerfacecolor="white",
            label="decided aggressive",
        ),
    ]  # fmt: skip
    if infinite.any():
        handles.append(
            Line2D(
                [], [], linestyle="none", marker="^", markersize=8, color=grey,
                label="ratio = ∞ (no old norm,\nor old norm 0): top edge",
            )
        )  # fmt: skip
    epochs = sorted(_series(run, "lr")) or check_x
    x_min, x_max = min(min(epochs), min(check_x)), max(max(epochs), max(check_x))
    # room for the spread triangles of infinite ratios at the first and last checks
    margin = max(0.5, spread + 0.4) if infinite.any() else 0.5
    ax.set_xlim(
        x_min - max(0.5, margin - (min(check_x) - x_min)),
        x_max + max(0.5, margin - (x_max - max(check_x))),
    )
    decays = _decay_epochs(results)
    drawn = _draw_decays(ax, decays, (x_min - 0.5, x_max + 0.5))
    if drawn:
        handles.append(_decay_handle(drawn))
    if any(bool(c.get("lr_will_decay")) for c in checks):
        decay_checks = [x for x, c in zip(check_x, checks) if c.get("lr_will_decay")]
        handles.append(
            Patch(
                facecolor="none", edgecolor="none",
                label="lr decays after check " + ", ".join(map(str, decay_checks))
                + ":\nall layers critical",
            )
        )  # fmt: skip
    _integer_epochs(ax)
    ax.set_xlabel("epoch (check at its end)")
    ax.set_ylabel("gradient-norm change ratio\n|D_old − D_new| / D_old" + (" (log)" if log else ""))
    ax.grid(alpha=0.3)
    ax.set_title(
        f"Regime checks of {strategy}: norm change per layer\n{_context(results, [run])}",
        pad=10,
    )
    ax.legend(handles=handles, fontsize=_LEGEND_FONTSIZE, **_LEGEND_OUTSIDE)
    return _save(fig, path)


def _file_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "accordion"


def _is_batch_strategy(strategy: str) -> bool:
    return strategy.split(":", 1)[0] in ("batch", "batch-fixed", "static-batch")


def plot_batch_size(results: Mapping[str, Any], path: str | Path) -> Path:
    """Global batch size (samples per optimizer step) vs epoch for the batch-size
    strategies, first seed of each, with the decays marked. Returns ``path``."""
    runs = [r for r in _runs(results) if _is_batch_strategy(r["strategy"])]
    if not runs:
        strategies = sorted({r["strategy"] for r in _runs(results)})
        raise ValueError(f"no batch-size strategy among {strategies}")
    fig = _figure()
    ax = fig.add_subplot()
    x_min, x_max = math.inf, -math.inf
    for strategy, strategy_runs in _by_strategy(runs).items():
        run = sorted(strategy_runs, key=_seed_key)[0]
        series = _series(run, "batch_size")
        if not series:
            continue
        epochs = np.array(sorted(series))
        ax.step(epochs, [series[e] for e in epochs], where="mid", label=strategy,
                **strategy_style(strategy))  # fmt: skip
        x_min, x_max = min(x_min, epochs[0]), max(x_max, epochs[-1])
    if not math.isfinite(x_min):
        x_min, x_max = 0, 1
    ax.set_xlim(x_min - 0.5, x_max + 0.5)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    handles, _ = ax.get_legend_handles_labels()
    drawn = _draw_decays(ax, _decay_epochs(results), (x_min - 0.5, x_max + 0.5))
    if drawn:
        handles.append(_decay_handle(drawn))
    _integer_epochs(ax)
    ax.set_xlabel("epoch")
    ax.set_ylabel("global batch (samples per step)")
    ax.grid(alpha=0.3)
    ax.set_title(f"Batch size per epoch (first seed)\n{_context(results, runs)}")
    ax.legend(handles=handles, fontsize=_LEGEND_FONTSIZE, **_LEGEND_OUTSIDE)
    return _save(fig, path)


def plot_all(results: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """Write every plot of ``results`` into ``out_dir`` (created if missing).

    Always ``accuracy.png`` and ``data_sent.png``; with batch-size strategies
    ``batch_size.png``; with Accordion runs, ``levels.png`` and
    ``norm_ratios.png`` for the first Accordion strategy, or, when several Accordion
    families exist (``accordion:powersgd`` and ``accordion:topk``), ``levels-FAMILY.png``
    and ``norm_ratios-FAMILY.png`` for the first strategy of each. Returns the paths written.
    """
    runs = _runs(results)
    out = Path(out_dir)
    written = [
        plot_accuracy(results, out / "accuracy.png"),
        plot_data_sent(results, out / "data_sent.png"),
    ]
    families: dict[str, str] = {}
    for strategy in _by_strategy(runs):
        if _is_accordion(strategy):
            families.setdefault(_family(strategy)[1], strategy)
    if len(families) == 1:
        (strategy,) = families.values()
        written.append(plot_levels(results, out / "levels.png", strategy))
        written.append(plot_norm_ratios(results, out / "norm_ratios.png", strategy))
    elif families:
        for family, strategy in families.items():
            written.append(plot_levels(results, out / f"levels-{_file_part(family)}.png", strategy))
        for family, strategy in families.items():
            name = f"norm_ratios-{_file_part(family)}.png"
            written.append(plot_norm_ratios(results, out / name, strategy))
    if any(_is_batch_strategy(r["strategy"]) for r in runs):
        written.append(plot_batch_size(results, out / "batch_size.png"))
    return written
