"""End-to-end time to accuracy on an emulated cluster, at several link rates.

Builds ``--hosts`` emulated hosts (``accordion.cluster``: network namespaces, a
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
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from accordion.cluster import ClusterError, EmulatedCluster
from accordion.costmodel import parse_bandwidth

STRATEGIES = (
    "dense",
    "torch-powersgd:4",
    "static:powersgd:4",
    "static:powersgd:1",
    "accordion:powersgd:4,1:paper",  # the paper's rule, as when docs/performance.md was measured
    "accordion:powersgd:4,1:paper:auto",
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
    summary.update(calibration_summary(directory))
    return summary


def calibration_summary(directory: Path) -> dict[str, Any]:
    """What an ``:auto`` run's ``calibration.json`` chose: how many tensors it sent dense
    of how many, and the link rate it measured (bytes/s); empty without that file."""
    calibration = directory / "calibration.json"
    if not calibration.exists():
        return {}
    report = json.loads(calibration.read_text())
    return {"auto_dense": len(report["dense_keys"]), "auto_tensors": len(report["tensors"]),
            "auto_bandwidth": report["bandwidth"]}  # fmt: skip


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def lower_bounds(results: dict[str, Any], reference: str) -> None:
    """Add ``bound_s`` (reference time + transfer time) and ``overlap_bound_s`` (the larger
    of the two) to every shaped run; the reference time is the median over its runs."""
    ref_runs = results["runs"][reference]
    for rate, per_strategy in results["runs"].items():
        if rate == reference:
            continue
        rate_bytes = parse_bandwidth(rate)
        for strategy, runs in per_strategy.items():
            for run in runs:
                base = strategy
                if strategy.endswith(":auto"):
                    # its reference run chose for the reference link: take the strategy
                    # that makes the same choice as it did at this rate, if there is one
                    base = None
                    if run.get("auto_dense") == 0:
                        base = strategy[: -len(":auto")]
                    elif run.get("auto_dense") == run.get("auto_tensors"):
                        base = "dense"
                reference_s = _median(ref_runs.get(base, []), "train_s") if base else None
                if reference_s is None:
                    continue
                transfer = run["bytes_per_worker"] / rate_bytes
                run["reference_s"] = reference_s
                run["transfer_s"] = transfer
                run["bound_s"] = reference_s + transfer
                run["overlap_bound_s"] = max(reference_s, transfer)


def _spread(runs: list[dict[str, Any]], key: str, fmt: str = ".1f") -> str:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return "-"
    mid = format(statistics.median(values), fmt)
    if len(values) == 1:
        return mid
    return f"{mid} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def table(results: dict[str, Any], target: float) -> str:
    """Markdown table: medians over the repetitions, (min-max) when there are several."""
    lines = [
        f"| link | strategy | training s | to {target:g}% s | final acc | KB/step/worker "
        "| vs dense | bound s | time / bound | time / overlap bound |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, per_strategy in results["runs"].items():
        dense = _median(per_strategy.get("dense", []), "train_s")
        for strategy, runs in per_strategy.items():
            steps = results["steps_per_epoch"] * runs[0]["epochs"]
            train = _median(runs, "train_s")
            reached = [r["time_to_target_s"] for r in runs]
            to_target = (
                "not reached" if all(t is None for t in reached)
                else _spread(runs, "time_to_target_s")
                + (f" ({reached.count(None)} of {len(runs)} not)" if None in reached else "")
            )  # fmt: skip
            ratios = [
                {"r": r["train_s"] / r["bound_s"], "o": r["train_s"] / r["overlap_bound_s"]}
                for r in runs
                if "bound_s" in r
            ]
            lines.append(
                f"| {rate} | {strategy} | {_spread(runs, 'train_s')} | {to_target} | "
                f"{_spread(runs, 'final_accuracy', '.2f')} | "
                f"{runs[0]['bytes_per_worker'] / steps / 1e3:.1f} | "
                f"{f'{dense / train:.2f}x' if dense else '-'} | "
                f"{_spread(runs, 'bound_s')} | {_spread(ratios, 'r', '.2f')} | "
                f"{_spread(ratios, 'o', '.2f')} |"
            )
    return "\n".join(lines)


def merge(results: dict[str, Any], paths: list[str]) -> None:
    """Add the runs of earlier ``results.json`` files (one run or a list per entry)."""
    for path in paths:
        earlier = json.loads(Path(path).read_text())
        for rate, per_strategy in earlier["runs"].items():
            for strategy, runs in per_strategy.items():
                runs = runs if isinstance(runs, list) else [runs]
                target = results["runs"].setdefault(rate, {}).setdefault(strategy, [])
                for run in runs:
                    target.append({k: v for k, v in run.items() if "bound" not in k})


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
    parser.add_argument("--repeats", type=int, default=1, help="sweeps over rates and strategies")
    parser.add_argument("--merge", nargs="*", default=[], help="earlier results.json to add")
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
        # --repeats 0 builds nothing: it only tabulates the --merge files
        with (
            EmulatedCluster(args.hosts, rates[0], args.delay)
            if args.repeats
            else contextlib.nullcontext() as cluster
        ):
            for repeat in range(args.repeats):
                for rate in rates:
                    cluster.set_link(rate, args.delay)
                    mbytes = 2.0 if rate.endswith("mbit") else 8.0
                    probe = cluster.measure_bandwidth(mbytes=mbytes)
                    results["probes"].setdefault(rate, []).append(probe)
                    print(
                        f"[{rate}] measured all-reduce bus bandwidth "
                        f"{probe['bus_bandwidth_bytes_per_s'] * 8 / 1e6:.1f} Mbit/s",
                        flush=True,
                    )
                    for strategy in args.strategies:
                        run = run_one(cluster, strategy, rate, args, out / f"rep{repeat}")
                        results["runs"].setdefault(rate, {}).setdefault(strategy, []).append(run)
                        print(
                            f"[{rate}] {strategy}: {run['train_s']:.1f} s training, "
                            f"final {run['final_accuracy']:.2f}%, wall {run['wall_s']:.0f} s",
                            flush=True,
                        )
                        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    except ClusterError as exc:
        print(f"cluster_e2e: {exc}", file=sys.stderr)
        return 2
    merge(results, args.merge)
    lower_bounds(results, args.reference)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = table(results, args.target)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
