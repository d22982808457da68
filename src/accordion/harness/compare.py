"""``accordion compare``: several strategies with the same seeds, the paper's table, plots."""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from ..compress import compressor_class
from .launch import run_distributed
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
    base: TrainConfig, strategies: list[str], seeds: int, workers: int, out: str | Path
) -> dict[str, Any]:
    """Run every strategy with seeds ``0 .. seeds-1`` and write ``out/results.json``.

    Each run logs under ``out/runs/<strategy>/seed<k>/``. Returns the results dict
    (``config``, ``runs``, ``table``).
    """
    for text in strategies:
        parse_strategy(text)  # fail before starting any process
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds must be an int >= 1, got {seeds!r}")
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
        finals = [r["epochs"][-1]["test_metric"] for r in runs]
        rows[strategy] = {
            "strategy": strategy,
            "seeds": len(runs),
            "metric_mean": statistics.fmean(finals),
            "metric_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "floats": statistics.fmean(r["epochs"][-1]["floats"] for r in runs),
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
    widths = [max(len(r[i]) for r in (header, *lines)) for i in range(len(header))]
    out = []
    for cells in (header, *lines):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths))))  # fmt: skip
    config = results["config"]
    out.append(
        f"{config['task']}, {config['workers']} workers, {config['seeds']} seed(s), "
        f"{config['epochs']} epochs; data = floats sent per worker (paper convention); "
        "'less than mild' = mild level's data / this; time = training loop only"
    )
    return "\n".join(out)


__all__ = ["RunResult", "format_table", "run_compare", "slug", "summary_table"]
