"""PNG plots of the ``results.json`` written by ``accordion compare``.

Every function takes the results structure (a dict loaded from JSON: ``{"config": {...},
"runs": [{"strategy", "seed", "epochs", "checks", "mild", "aggressive"}, ...]}``) and a
destination path, writes one PNG (150 dpi, 8 x 4.5 inches) and returns the path written:

* :func:`plot_accuracy` -- test metric per epoch, mean over seeds with a +/- 1 std band;
* :func:`plot_data_sent` -- cumulative floats sent per worker (the paper's "Data Sent");
* :func:`plot_levels` -- an Accordion run's compression level per layer and epoch;
* :func:`plot_norm_ratios` -- an Accordion run's gradient-norm change ratios at each check;
* :func:`plot_batch_size` -- the global batch per epoch of the batch-size strategies;
* :func:`plot_all` -- all of the above into one directory.

One module draws each figure; ``common`` holds what they share and ``style`` the line
style of each strategy (:func:`strategy_style`). Strategies are read with the harness's
own parser (:func:`accordion.harness.strategies.parse_strategy`) and levels are named by
their compressor (:meth:`accordion.compress.Compressor.label`), so any registered
compressor plots without changes here.

Epoch ``e`` of the x axes is the ``e``-th training epoch (0-based), with its metric measured
at its end. A learning-rate decay at epoch ``d`` (``config["decay_epochs"]``: the first
epoch that trains with the lower rate) is drawn as a dotted line at ``d - 0.5``, between
the last epoch before the decay and the first after it, on every plot.

Matplotlib is used through :class:`~matplotlib.figure.Figure` and the Agg canvas directly,
never through ``pyplot``: no GUI backend is needed and a backend the caller chose is left
alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .accuracy import plot_accuracy
from .batch_size import plot_batch_size
from .common import DPI, FIGSIZE, by_strategy, is_accordion, is_batch_strategy, parsed, runs_of
from .data_sent import plot_data_sent
from .levels import plot_levels
from .norm_ratios import plot_norm_ratios
from .style import strategy_style

__all__ = [
    "DPI",
    "FIGSIZE",
    "plot_accuracy",
    "plot_all",
    "plot_batch_size",
    "plot_data_sent",
    "plot_levels",
    "plot_norm_ratios",
    "strategy_style",
]


def _file_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "accordion"


def plot_all(results: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """Write every plot of ``results`` into ``out_dir`` (created if missing).

    Always ``accuracy.png`` and ``data_sent.png``; with batch-size strategies
    ``batch_size.png``; with Accordion runs, ``levels.png`` and
    ``norm_ratios.png`` for one Accordion strategy, or, when several Accordion families
    exist (``accordion:powersgd`` and ``accordion:topk``), ``levels-FAMILY.png`` and
    ``norm_ratios-FAMILY.png`` for one strategy of each: the first that runs the default
    (guarded) rule, else the first. Returns the paths written.
    """
    runs = runs_of(results)
    out = Path(out_dir)
    written = [
        plot_accuracy(results, out / "accuracy.png"),
        plot_data_sent(results, out / "data_sent.png"),
    ]
    families: dict[str, str] = {}
    for strategy in by_strategy(runs):
        ladder = parsed(strategy)
        if ladder is not None and is_accordion(strategy):
            families.setdefault(ladder.compressor, strategy)
    for strategy in reversed(list(by_strategy(runs))):
        # the default rule's run where there is one: the ladder a newcomer is told to use
        ladder = parsed(strategy)
        if ladder is not None and is_accordion(strategy) and ladder.rule in (None, "guarded"):
            families[ladder.compressor] = strategy
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
    if any(is_batch_strategy(r["strategy"]) for r in runs):
        written.append(plot_batch_size(results, out / "batch_size.png"))
    return written
