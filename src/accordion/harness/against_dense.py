"""Every strategy against uncompressed training: the paper's own yardstick.

Accordion promises the accuracy of *uncompressed* training at a fraction of its traffic.
When a comparison ran ``dense``, :func:`against_dense` pairs every other strategy with it
by seed: the final test metric's difference (percentage points of accuracy, or
perplexity) with its Student-t interval, for language models the validation loss's
relative difference too, and the data ratio in wire bytes (so that half precision,
quantisation and low rank compare fairly). :func:`keeps_dense` applies the quality bar
(within 0.3 points of dense accuracy and, where there is a validation loss, within 0.5%
of it), and :func:`best_static` names the most compressed static level that keeps it.

No torch here, as in :mod:`accordion.harness.paired`.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from .paired import final_metric, paired_difference, runs_by_strategy

#: The strategy every other one is measured against.
DENSE = "dense"
#: Dense quality: the mean paired accuracy difference at least this (points).
ACCURACY_TOLERANCE_PP = 0.3
#: Dense quality: the mean paired relative validation-loss difference at most this (%).
LOSS_TOLERANCE_PERCENT = 0.5


def _final(run: Mapping[str, Any], key: str) -> Any:
    return run["epochs"][-1].get(key)


def _row(strategy: str, runs: Mapping[Any, Any], dense: Mapping[Any, Any], confidence: float):
    """The paired row of one strategy against dense (``None`` without a shared seed)."""
    seeds = [s for s in runs if s in dense]
    if not seeds:
        return None
    values = [final_metric(runs[s]) for s in seeds]
    dense_values = [final_metric(dense[s]) for s in seeds]
    row: dict[str, Any] = {"strategy": strategy, "seeds": seeds,
                           "dense_mean": statistics.fmean(dense_values),
                           **paired_difference(values, dense_values, confidence)}  # fmt: skip
    losses = [(_final(runs[s], "val_loss"), _final(dense[s], "val_loss")) for s in seeds]
    if all(ours is not None and theirs for ours, theirs in losses):
        relative = [100.0 * (ours - theirs) / theirs for ours, theirs in losses]
        stats = paired_difference(relative, [0.0] * len(relative), confidence)
        row["loss_percent"] = {k: stats[k] for k in ("mean", "low", "high")}
    ours = statistics.fmean(_final(runs[s], "bytes") for s in seeds)
    theirs = statistics.fmean(_final(dense[s], "bytes") for s in seeds)
    row["bytes_ratio"] = theirs / ours if ours else None
    return row


def against_dense(results: Mapping[str, Any], confidence: float = 0.95) -> dict[str, Any] | None:
    """Each strategy but dense, paired by seed with ``dense``; ``None`` when dense did not
    run. ``{"confidence", "metric", "rows", "best_static"}``; each row: ``strategy``,
    ``seeds``, ``dense_mean`` (dense's final metric on those seeds), ``n``, ``mean``,
    ``low``, ``high``, ``sd`` (of this - dense in final test metric), ``loss_percent``
    (``{"mean", "low", "high"}`` of the relative validation-loss difference, %, where the
    runs record ``val_loss``), ``bytes_ratio`` (dense's wire
    bytes / this: above 1 sends less) and ``keeps_dense`` (:func:`keeps_dense`)."""
    by_strategy = runs_by_strategy(results)
    if DENSE not in by_strategy:
        return None
    metric = results.get("config", {}).get("metric", "accuracy")
    rows = []
    for strategy, runs in by_strategy.items():
        row = None if strategy == DENSE else _row(strategy, runs, by_strategy[DENSE], confidence)
        if row is not None:
            row["keeps_dense"] = keeps_dense(row, metric)
            rows.append(row)
    return {"confidence": confidence, "metric": metric, "rows": rows,
            "best_static": best_static(rows)}  # fmt: skip


def keeps_dense(row: Mapping[str, Any], metric: str = "accuracy") -> bool:
    """Whether a row keeps dense quality: a mean paired accuracy difference of at least
    ``-ACCURACY_TOLERANCE_PP`` points (for perplexity, a mean rise of at most
    ``LOSS_TOLERANCE_PERCENT`` % of dense's) and, where runs record a validation loss, a
    mean relative loss difference of at most ``LOSS_TOLERANCE_PERCENT`` %."""
    if metric == "accuracy":
        quality = row["mean"] >= -ACCURACY_TOLERANCE_PP
    else:  # perplexity: lower is better
        quality = row["mean"] <= LOSS_TOLERANCE_PERCENT / 100 * row["dense_mean"]
    loss = row.get("loss_percent")
    return bool(quality and (loss is None or loss["mean"] <= LOSS_TOLERANCE_PERCENT))


def best_static(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """The static strategy that keeps dense quality with the most bytes saved, or ``None``.
    One with a ``momentum=`` suffix is no static level: its level changes at the freeze."""
    kept = [r for r in rows if r["strategy"].startswith("static:") and r["keeps_dense"]
            and ":momentum=" not in r["strategy"]]  # fmt: skip
    kept = [r for r in kept if r["bytes_ratio"] is not None]
    return max(kept, key=lambda r: r["bytes_ratio"])["strategy"] if kept else None


def _interval(stats: Mapping[str, Any], unit: str) -> str:
    if stats["low"] is None:
        return f"{stats['mean']:+.2f}{unit} [1 seed]"
    return f"{stats['mean']:+.2f}{unit} [{stats['low']:+.2f}, {stats['high']:+.2f}]"


def format_against_dense(summary: Mapping[str, Any], table: Any) -> str:
    """The rows of :func:`against_dense` as text, aligned by ``table`` (a function of a
    header and lines, as :func:`accordion.harness.compare._text_table`)."""
    metric, rows = summary["metric"], summary["rows"]
    unit = " pp" if metric == "accuracy" else ""
    losses = any("loss_percent" in r for r in rows)
    best = summary["best_static"]
    best_ratio = next((r["bytes_ratio"] for r in rows if r["strategy"] == best), None)
    header = ("strategy", f"test {metric} - dense [{summary['confidence']:.0%} CI]",
              *(("val loss vs dense",) if losses else ()), "bytes: dense / this",
              "keeps dense", "vs best static")  # fmt: skip
    lines = []
    for r in rows:
        ratio = r["bytes_ratio"]
        lines.append((
            r["strategy"], _interval(r, unit),
            *((_interval(r["loss_percent"], "%") if "loss_percent" in r else "-",) if losses
              else ()),
            "-" if ratio is None else f"{ratio:.2f}x",
            "yes" if r["keeps_dense"] else "no",
            "-" if not (best_ratio and ratio) else f"{ratio / best_ratio:.2f}x",
        ))  # fmt: skip
    out = table(header, lines)
    out.append(
        f"against uncompressed training (dense), paired by seed; keeps dense = mean within "
        f"{ACCURACY_TOLERANCE_PP} points"
        + (f" and validation loss within {LOSS_TOLERANCE_PERCENT}%" if losses else "")
        + f"; best static level that keeps dense: {best or 'none'}; 'vs best static' = "
        "this strategy's bytes saving over that level's (above 1: sends less)"
    )
    return "\n".join(out)


__all__ = [
    "ACCURACY_TOLERANCE_PP",
    "DENSE",
    "LOSS_TOLERANCE_PERCENT",
    "against_dense",
    "best_static",
    "format_against_dense",
    "keeps_dense",
]
