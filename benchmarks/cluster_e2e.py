"""End-to-end time to accuracy on an emulated cluster, at several link rates.

Builds ``--hosts`` emulated hosts (``accordion.harness.cluster``: network namespaces, a
bridge, every link limited by tc) and, for each link rate and each strategy, runs
``accordion train`` on the CPU-scale reproduction's task (MNIST-1D, its CNN, 60 epochs,
lr decays at 30 and 45) as one torchrun node per host. It reports per run:

* the time per epoch (training only: evaluation is not counted) and the time until the
  test accuracy first reaches ``--target``;
* the bytes each worker sent per step (ring collectives);
* a lower bound: the same strategy's time on the reference link (``--reference``, fast
  enough that sending costs almost nothing) plus the bytes it sent over the link rate.
  The reference run holds the computation (forward, backward, compression) and the
  per-message costs; the bound is what the run would take if the link added only its
  transfer time, with nothing lost to waiting.

Needs root and ``ip``/``tc`` (as ``accordion cluster``). Each run is seeded: runs of one
strategy send the same bytes and reach the same accuracy at every rate, except the
``:auto`` strategies, whose choice depends on the link they measure.

    sudo PYTHONPATH=src .venv/bin/python benchmarks/cluster_e2e.py --out runs/e2e
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from accordion.costmodel import parse_bandwidth
from accordion.harness.cluster import ClusterError, EmulatedCluster

STRATEGIES = (
    "dense",
    "torch-powersgd:4",
    "static:powersgd:4",
    "static:powersgd:1",
    "accordion:powersgd:4,1",
    "accordion:powersgd:4,1:auto",
)


def _safe(text: str) -> str:
    return text.replace(":", "_").replace(",", "-")


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise(records: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """Times (s), accuracy (%) and bytes of one run's per-epoch records."""
    times = [r["train_time_s"] for r in records]
    per_epoch = [b - a for a, b in zip([0.0, *times[:-1]], times)]
    reached = next((r["train_time_s"] for r in records if r["test_metric"] >= target), None)
    return {
        "epochs": len(records),
        "train_s": times[-1],
        "epoch_s_median": statistics.median(per_epoch),
        "epoch_s_min": min(per_epoch),
        "epoch_s_max": max(per_epoch),
        "final_accuracy": records[-1]["test_metric"],
        "best_accuracy": max(r["test_metric"] for r in records),
        "time_to_target_s": reached,
        "bytes_per_worker": records[-1]["bytes"],
    }


def run_one(cluster, strategy, rate, args, out: Path) -> dict[str, Any]:
    directory = out / _safe(rate) / _safe(strategy)
    command = [
        "train", "--task", "mnist1d", "--strategy", strategy, "--epochs", str(args.epochs),
        "--threads", "1", "--no-progress", "--seed", str(args.seed), "--out", str(directory),
    ]  # fmt: skip
    started = time.monotonic()
    cluster.run("accordion", command, timeout=args.timeout, log_dir=directory / "logs")
    summary = summarise(_records(directory / "metrics.jsonl"), args.target)
    summary["wall_s"] = time.monotonic() - started
    calibration = directory / "calibration.json"
    if calibration.exists():
        report = json.loads(calibration.read_text())
        summary["auto_dense"] = len(report["dense_keys"])
        summary["auto_tensors"] = len(report["tensors"])
        summary["auto_bandwidth"] = report["bandwidth"]
    return summary


def lower_bounds(results: dict[str, Any], reference: str) -> None:
    """Add ``bound_s`` and ``bound_ratio`` to every shaped run (see the module docstring)."""
    ref_runs = results["runs"][reference]
    for rate, runs in results["runs"].items():
        if rate == reference:
            continue
        rate_bytes = parse_bandwidth(rate)
        for strategy, run in runs.items():
            base = ref_runs.get(strategy)
            if strategy.endswith(":auto"):
                # its reference run chose for the reference link; take the run that made
                # the same choice at this rate, if any
                same = strategy[: -len(":auto")] if run.get("auto_dense") == 0 else None
                same = "dense" if run.get("auto_dense") == run.get("auto_tensors") else same
                base = ref_runs.get(same) if same else None
            if base is None:
                continue
            bound = base["train_s"] + run["bytes_per_worker"] / rate_bytes
            run["bound_s"] = bound
            run["bound_ratio"] = run["train_s"] / bound


def table(results: dict[str, Any], target: float) -> str:
    lines = [
        f"| link | strategy | s/epoch (min-max) | to {target:g}% (s) | final acc | "
        "KB/step/worker | vs dense | bound (s) | time / bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, runs in results["runs"].items():
        dense = runs.get("dense")
        for strategy, run in runs.items():
            steps = results["steps_per_epoch"] * run["epochs"]
            speedup = f"{dense['train_s'] / run['train_s']:.2f}x" if dense else "-"
            to_target = run["time_to_target_s"]
            lines.append(
                f"| {rate} | {strategy} | {run['epoch_s_median']:.2f} "
                f"({run['epoch_s_min']:.2f}-{run['epoch_s_max']:.2f}) | "
                f"{'not reached' if to_target is None else f'{to_target:.1f}'} | "
                f"{run['final_accuracy']:.2f} | {run['bytes_per_worker'] / steps / 1e3:.1f} | "
                f"{speedup} | {run.get('bound_s', float('nan')):.1f} | "
                f"{run.get('bound_ratio', float('nan')):.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"])
    parser.add_argument("--reference", default="10gbit", help="the near-free link of the bound")
    parser.add_argument("--delay", default="0", help="one-way delay between hosts, e.g. 1ms")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--target", type=float, default=90.0, help="test accuracy, percent")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    parser.add_argument("--out", default="runs/e2e")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = [args.reference, *[r for r in args.rates if r != args.reference]]
    for rate in rates:
        parse_bandwidth(rate)  # fail before building anything
    results: dict[str, Any] = {
        "hosts": args.hosts, "epochs": args.epochs, "target": args.target,
        "delay": args.delay, "reference": args.reference, "seed": args.seed,
        "steps_per_epoch": 4000 // 128, "probes": {}, "runs": {},
    }  # fmt: skip
    try:
        with EmulatedCluster(args.hosts, rates[0], args.delay) as cluster:
            for rate in rates:
                cluster.set_link(rate, args.delay)
                probe = cluster.measure_bandwidth(mbytes=2.0 if rate.endswith("mbit") else 8.0)
                results["probes"][rate] = probe
                print(
                    f"[{rate}] measured all-reduce bus bandwidth "
                    f"{probe['bus_bandwidth_bytes_per_s'] * 8 / 1e6:.1f} Mbit/s",
                    flush=True,
                )
                results["runs"][rate] = {}
                for strategy in args.strategies:
                    run = run_one(cluster, strategy, rate, args, out)
                    results["runs"][rate][strategy] = run
                    print(
                        f"[{rate}] {strategy}: {run['train_s']:.1f} s training, "
                        f"final {run['final_accuracy']:.2f}%, wall {run['wall_s']:.0f} s",
                        flush=True,
                    )
                    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    except ClusterError as exc:
        print(f"cluster_e2e: {exc}", file=sys.stderr)
        return 2
    lower_bounds(results, args.reference)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = table(results, args.target)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
