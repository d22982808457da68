"""The small model's training loop on loopback: each strategy's time against dense DDP's.

Runs ``accordion train`` (MNIST-1D, its CNN, ``--workers`` local gloo processes on
loopback) for every strategy, ``--reps`` times in interleaved order, and reads each run's
training-loop time (``train_time_s`` of the last epoch: evaluation is not counted).
Prints, per strategy, the median time, its min-max over the repetitions, and the ratio
to dense, computed per repetition (the runs of one repetition are neighbours in time)
and given as median (min-max).

    PYTHONPATH=src .venv/bin/python benchmarks/loopback_loop.py --reps 3 --epochs 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

STRATEGIES = (
    "dense",
    "static:powersgd:4",
    "static:powersgd1:4",
    "accordion:powersgd:4,2,1",
    "accordion:powersgd1:4,2,1",
)


def loop_seconds(metrics: Path) -> float:
    """The training-loop seconds of a run: the last epoch record's ``train_time_s``."""
    lines = [line for line in metrics.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{metrics} holds no epoch record")
    return float(json.loads(lines[-1])["train_time_s"])


def run_one(strategy: str, args: argparse.Namespace, out: Path) -> float:
    """Train once with ``strategy``; return its training-loop seconds."""
    command = [
        args.accordion, "train", "--task", "mnist1d", "--workers", str(args.workers),
        "--epochs", str(args.epochs), "--seed", str(args.seed), "--no-progress",
        "--strategy", strategy, "--out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=args.timeout)
    return loop_seconds(out / "metrics.jsonl")


def summarise(times: dict[str, list[float]], baseline: str = "dense") -> list[dict]:
    """Per strategy: median and min-max seconds, and the per-repetition ratio to
    ``baseline`` as median, min and max (repetitions paired by index)."""
    rows = []
    for strategy, values in times.items():
        ratios = [v / b for v, b in zip(values, times.get(baseline, []))]
        rows.append({
            "strategy": strategy, "median_s": statistics.median(values),
            "min_s": min(values), "max_s": max(values),
            "ratio": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios) if ratios else None,
            "ratio_max": max(ratios) if ratios else None,
        })  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    lines = ["| strategy | training loop s | vs dense (per repetition) |", "|---|---|---|"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else (
            f"{r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})")  # fmt: skip
        lines.append(
            f"| {r['strategy']} | {r['median_s']:.2f} ({r['min_s']:.2f}-{r['max_s']:.2f}) "
            f"| {ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--accordion", default=str(Path(sys.executable).parent / "accordion"))
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.epochs < 1 or args.workers < 1:
        parser.error(f"--reps, --epochs and --workers must be >= 1, got {args.reps}, "
                     f"{args.epochs}, {args.workers}")  # fmt: skip
    times: dict[str, list[float]] = {s: [] for s in args.strategies}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for i, strategy in enumerate(args.strategies):
                seconds = run_one(strategy, args, Path(tmp) / f"r{rep}s{i}")
                times[strategy].append(seconds)
                print(f"rep {rep} {strategy}: {seconds:.2f} s", flush=True)
    rows = summarise(times)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
