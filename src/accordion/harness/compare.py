"""``accordion compare``: several strategies with the same seeds, the paper's table, plots."""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._validate import check_int
from ..compress import compressor_class
from .against_dense import against_dense, format_against_dense
from .launch import run_distributed
from .paired import check_baselines, data_sent, final_metric, merge_results, summarize_paired
from .strategies import parse_strategy
from .train import RunResult, TrainConfig, run_many


def slug(strategy: str) -> str:
    """A file-system-safe name for a strategy string."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", strategy).strip("-")


def _progress(config: TrainConfig, record: dict[str, Any]) -> None:
    if record["epoch"] == config.epochs - 1 or record["epoch"] % 10 == 0:
        print(
            f"  {config.strategy:<28} seed {config.seed}  epoch {record['epoch']:>3}  "
            f"loss {record['train_loss']:.4f}  test {record['test_metric']:.2f}  "
            f"floats {record['floats'] / 1e6:.2f} M",
            file=sys.stderr,
            flush=True,
        )


def _worker(rank: int, world: int, local_rank: int, configs: list[TrainConfig]) -> list[dict]:
    progress = _progress if rank == 0 else None
    return [r.as_dict() for r in run_many(configs, rank, world, local_rank, progress)]


def run_compare(
    base: TrainConfig,
    strategies: list[str],
    seeds: int,
    workers: int,
    out: str | Path,
    baseline: str | Sequence[str] | None = None,
) -> dict[str, Any]:
    """Run every strategy with seeds ``0 .. seeds-1`` and write ``out/results.json``.

    Each run logs under ``out/runs/<strategy>/seed<k>/``. Returns the results dict
    (``config``, ``runs``, ``table``; with ``baseline``, one of ``strategies`` or a
    sequence of distinct ones, also ``paired``: see :func:`add_paired`). Each run keeps
    its ``seed`` and per-epoch ``epochs`` records;
    :func:`~accordion.harness.paired.final_by_seed` reads back the final metric per
    strategy and seed.
    """
    for text in strategies:
        parse_strategy(text)  # fail before starting any process
    if baseline is not None:
        check_baselines(baseline, list(strategies))
    check_int("seeds", seeds, 1)
    out = Path(out)
    configs = [
        dataclasses.replace(
            base,
            strategy=text,
            seed=base.seed + k,
            progress=False,
            out=str(out / "runs" / slug(text) / f"seed{base.seed + k}"),
        )  # fmt: skip
        for text in strategies
        for k in range(seeds)
    ]
    for config in configs:
        config.validate()
    runs = run_distributed(_worker, workers, configs)
    metric = "perplexity" if base.task == "wikitext2" else "accuracy"
    results = {
        "config": {**base.to_dict(), "workers": workers, "seeds": seeds, "metric": metric,
                   "strategies": list(strategies)},
        "runs": runs,
    }  # fmt: skip
    results["table"] = summary_table(results)
    if baseline is not None:
        add_paired(results, baseline)
    add_against_dense(results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def _reference(strategy: str, rows: dict[str, dict[str, Any]]) -> str | None:
    """The mild static run a strategy is compared with (the mildest static level of its
    compressor; dense for dense)."""
    parsed = parse_strategy(strategy)
    if parsed.batch_mode is not None:
        # batch strategies compare with the small batch and the same communication
        comm = strategy.partition("+")[2]
        small = f"static-batch:{parsed.batch_small}" + (f"+{comm}" if comm else "")
        return small if small in rows else None
    if parsed.family == "dense":
        return strategy
    statics = [parse_strategy(s) for s in rows]
    candidates = [
        s for s in statics
        if s.family == "static" and s.batch_mode is None and s.compressor == parsed.compressor
    ]  # fmt: skip
    if parsed.family == "accordion":
        exact = [s.text for s in candidates if s.mild == parsed.mild]
        if exact:
            return exact[0]
    if not candidates:
        return None
    # the mildest compresses least; among equals the last text in sort order, as before
    aggressiveness = compressor_class(parsed.compressor).aggressiveness
    return max(candidates, key=lambda s: (-aggressiveness(s.mild), s.text)).text


def summary_table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per strategy: final metric mean/std over seeds, data and time with their
    ratios to the mild level (``mild / this``: above 1 means less data, faster)."""
    by_strategy: dict[str, list[dict[str, Any]]] = {}
    for run in results["runs"]:
        by_strategy.setdefault(run["strategy"], []).append(run)
    rows: dict[str, dict[str, Any]] = {}
    for strategy, runs in by_strategy.items():
        finals = [final_metric(r) for r in runs]
        rows[strategy] = {
            "strategy": strategy,
            "seeds": len(runs),
            "metric_mean": statistics.fmean(finals),
            "metric_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "floats": statistics.fmean(data_sent(r) for r in runs),
            "bytes": statistics.fmean(r["epochs"][-1]["bytes"] for r in runs),
            "time_s": statistics.fmean(r["epochs"][-1]["train_time_s"] for r in runs),
        }
    for strategy, row in rows.items():
        ref = _reference(strategy, rows)
        row["reference"] = ref
        if ref is None:
            row["data_vs_mild"] = row["time_vs_mild"] = None
        else:
            row["data_vs_mild"] = rows[ref]["floats"] / row["floats"] if row["floats"] else None
            row["time_vs_mild"] = rows[ref]["time_s"] / row["time_s"] if row["time_s"] else None
    return list(rows.values())


def _count(floats: float) -> str:
    return f"{floats / 1e6:,.2f} M" if floats < 1e10 else f"{floats / 1e9:,.2f} B"


def format_table(results: dict[str, Any]) -> str:
    """The paper's table as text."""
    metric = results["config"].get("metric", "accuracy")
    unit = "%" if metric == "accuracy" else ""
    header = ("strategy", f"test {metric}", "data sent", "less than mild", "time s", "vs mild")
    lines = []
    for row in results["table"]:
        ratio = row["data_vs_mild"]
        speed = row["time_vs_mild"]
        lines.append((
            row["strategy"],
            f"{row['metric_mean']:.2f}{unit} ± {row['metric_std']:.2f}",
            _count(row["floats"]),
            "-" if ratio is None else f"{ratio:.2f}x",
            f"{row['time_s']:.1f}",
            "-" if speed is None else f"{speed:.2f}x",
        ))  # fmt: skip
    out = _text_table(header, lines)
    config = results["config"]
    out.append(
        f"{config['task']}, {config['workers']} workers, {config['seeds']} seed(s), "
        f"{config['epochs']} epochs; data = floats sent per worker (paper convention); "
        "'less than mild' = mild level's data / this; time = training loop only"
    )
    return "\n".join(out)


def _text_table(header: Sequence[str], lines: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """Aligned rows: the first ``left`` columns (names) left-aligned, the figures
    right-aligned."""
    widths = [max(len(r[i]) for r in (header, *lines)) for i in range(len(header))]
    return ["  ".join(c.ljust(w) if i < left else c.rjust(w)
                      for i, (c, w) in enumerate(zip(cells, widths)))
            for cells in (header, *lines)]  # fmt: skip


def add_paired(
    results: dict[str, Any], baseline: str | Sequence[str], confidence: float = 0.95
) -> dict:
    """Store the paired comparison with ``baseline`` (a strategy, or a sequence of
    distinct ones) in ``results["paired"]`` and return it: ``{"baselines", "confidence",
    "metric", "rows"}``, the baselines as a list and the rows of
    :func:`~accordion.harness.paired.summarize_paired` (differences ``strategy -
    baseline`` in final test metric, paired by seed; each non-baseline strategy with the
    baseline of the same compressor, else the first, named in the row's ``baseline``)."""
    rows = summarize_paired(results, baseline, confidence)
    baselines = [baseline] if isinstance(baseline, str) else list(baseline)
    metric = results.get("config", {}).get("metric", "accuracy")
    results["paired"] = {"baselines": baselines, "confidence": confidence, "metric": metric,
                         "rows": rows}  # fmt: skip
    return results["paired"]


def _interval(row: dict[str, Any]) -> str:
    if row["mean"] is None:
        return "-"
    if row["low"] is None:
        return f"{row['mean']:+.2f} [no interval: 1 seed]"
    return f"{row['mean']:+.2f} [{row['low']:+.2f}, {row['high']:+.2f}]"


def format_paired(results: dict[str, Any]) -> str:
    """The paired table of ``results["paired"]`` (see :func:`add_paired`) as text: one
    row per non-baseline strategy, in strategy order; with several baselines a
    ``baseline`` column names each row's."""
    paired = results["paired"]
    metric = paired["metric"]
    baselines = paired.get("baselines") or [paired["baseline"]]  # older results.json
    several = len(baselines) > 1
    unit = " pp" if metric == "accuracy" else ""
    level = f"{paired['confidence']:.0%}"
    header = ("strategy", *(("baseline",) if several else ()),
              f"test {metric} - baseline{unit.replace(' pp', ' (pp)')} [{level} CI]",
              "paired seeds", "data ratio")  # fmt: skip
    lines = [(
        row["strategy"],
        *((row["baseline"],) if several else ()),
        _interval(row),
        str(row["n"]),
        "-" if row["data_ratio"] is None else f"{row['data_ratio']:.2f}x",
    ) for row in paired["rows"]]  # fmt: skip
    out = _text_table(header, lines, left=2 if several else 1)
    if several:
        paired_with = (
            "each strategy paired with its baseline (same compressor, else the first) by "
            f"seed (seeds both ran), baselines {', '.join(baselines)}"
        )
        its = "its "
    else:
        paired_with = f"paired with baseline {baselines[0]} by seed (seeds both ran)"
        its = ""
    out.append(
        f"{paired_with}; difference = this - {its}baseline in final test {metric}{unit}, "
        f"mean with a Student-t {level} interval; data ratio = {its}baseline's data sent "
        "/ this (above 1: this sends less)"
    )
    return "\n".join(out)


def load_results(
    paths: Sequence[str | Path], baseline: str | Sequence[str] | None = None
) -> dict[str, Any]:
    """Read and merge ``results.json`` files (:func:`~accordion.harness.paired.merge_results`)
    without training: the merged ``config`` and ``runs``, a fresh ``table``, and with
    ``baseline`` (one of their strategies, or a sequence of distinct ones) the ``paired``
    comparison."""
    loaded = []
    for path in paths:
        try:
            loaded.append(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not a results.json (not JSON: {exc})") from None
    results = merge_results(loaded)
    results["table"] = summary_table(results)
    if baseline is not None:
        add_paired(results, baseline)
    add_against_dense(results)
    return results


def add_against_dense(results: dict[str, Any]) -> dict[str, Any] | None:
    """Store every strategy's paired comparison with ``dense`` in
    ``results["against_dense"]`` when dense ran (see
    :func:`~accordion.harness.against_dense.against_dense`) and return it, else ``None``."""
    summary = against_dense(results)
    if summary is not None:
        results["against_dense"] = summary
    return summary


def format_dense_table(results: dict[str, Any]) -> str | None:
    """``results["against_dense"]`` as text, or ``None`` when dense did not run."""
    summary = results.get("against_dense")
    return None if summary is None else format_against_dense(summary, _text_table)


__all__ = [
    "RunResult",
    "add_against_dense",
    "add_paired",
    "format_dense_table",
    "format_paired",
    "format_table",
    "load_results",
    "run_compare",
    "slug",
    "summary_table",
]
