"""ResNet-18 step times on an emulated cluster, at several link rates, against a bound.

Builds ``--hosts`` emulated hosts (``accordion.cluster``: network namespaces, a bridge,
every link limited by tc) and, for each link rate (plus the ``--reference`` link, fast
enough that sending costs almost nothing: the "unshaped" rows) and each strategy, runs
``accordion train --task synthetic --model resnet18 --measure-compute`` (CIFAR-shaped
3x32x32 samples, a global batch of 64) as one torchrun node per host. Per run:

* the median wall time of an optimizer step on rank 0 after the first ``--warmup-steps``
  (the harness's ``step_times_s``), with the fastest and slowest of those steps;
* the bytes each worker sent per step (ring collectives; the ``bytes`` of the metrics
  over every step of the run);
* the compute-only step time: forward and backward without communication, measured once
  before training (``compute_step_s``; compression's own computation is not in it);
* a lower bound, compute-only time + bytes per step / link rate: the step if sending
  only added its transfer time and nothing overlapped (overlap can beat it; compression
  compute and per-message costs push a run above it), and time / bound;
* per link, the compute-to-communication ratio: compute-only time / (dense bytes per
  step / link rate). The paper's setting has a ratio near 1 (a dense all-reduce takes
  about as long as a step's computation).

``torch-bf16`` needs CUDA, which the cluster's workers never have: it is recorded as
skipped with the harness's reason. A failed run is recorded with its error and the sweep
goes on. ``results.json`` is rewritten after every run, so a killed sweep keeps what it had.
Needs root and ``ip``/``tc`` (as ``accordion cluster``).

    sudo PYTHONPATH=src .venv/bin/python benchmarks/cluster_resnet.py --out runs/resnet
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from accordion.cluster import ClusterError, ClusterRunError, EmulatedCluster
from accordion.cluster.emulated import MAX_RATE_BITS, MIN_RATE_BITS
from accordion.costmodel import parse_bandwidth


def _sibling(name: str):
    """A script of this folder as a module (benchmarks/ is no package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_e2e = _sibling("cluster_e2e")
_records, _safe, _median, merge = _e2e._records, _e2e._safe, _e2e._median, _e2e.merge

STRATEGIES = (
    "dense",
    "torch-fp16",
    "torch-bf16",
    "torch-powersgd:4",
    "static:powersgd:4",
    "static:powersgd:1",
    "static:half:fp16",
    "static:half:bf16",
    "static:powersgd1:4",
    "accordion:powersgd:4,2,1",
    "accordion:powersgd1:4,2,1",
    "accordion:powersgd:4,2,1:auto",
)
TEST_SAMPLES = 64  # evaluation is not timed: as few as the harness's sharding allows
HEADER = (
    "| link | strategy | median step s (min-max) | KB/step/worker | compute-only s | bound s "
    "| time/bound | time/compute-only | vs dense | vs torch-fp16 |"
)


def train_config(strategy: str, args: argparse.Namespace):
    """The ``TrainConfig`` the cluster's ``accordion train`` runs with (for validation)."""
    from accordion.harness.train import TrainConfig

    return TrainConfig(
        task="synthetic", model="resnet18", strategy=strategy, epochs=args.epochs,
        train_samples=args.train_samples, test_samples=TEST_SAMPLES,
        batch_size=args.batch_size, warmup_epochs=0, threads=1, progress=False,
        seed=args.seed, measure_compute=True, statistic=args.statistic,
    )  # fmt: skip


def train_command(strategy: str, args: argparse.Namespace, directory: Path) -> list[str]:
    """``accordion train``'s arguments for one run logging to ``directory``."""
    return [
        "train", "--task", "synthetic", "--model", "resnet18", "--strategy", strategy,
        "--epochs", str(args.epochs), "--train-samples", str(args.train_samples),
        "--test-samples", str(TEST_SAMPLES), "--batch-size", str(args.batch_size),
        "--warmup-epochs", "0", "--threads", "1", "--no-progress", "--seed", str(args.seed),
        "--measure-compute", "--statistic", args.statistic, "--out", str(directory),
    ]  # fmt: skip


def skip_reason(strategy: str, args: argparse.Namespace) -> str | None:
    """Why the harness refuses ``strategy`` on ``args.hosts`` workers here (e.g.
    ``torch-bf16`` without CUDA), or ``None``; builds nothing and reads no data."""
    try:
        train_config(strategy, args).validate(world=args.hosts * args.workers_per_host)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


def level_counts(levels: dict[str, Any]) -> dict[str, int]:
    """How many tensors are at each level (``{"4": 12, "2": 9}``) of a ``levels`` record."""
    return dict(sorted(Counter(str(level) for level in levels.values()).items()))


def summarise(records: list[dict[str, Any]], warmup_steps: int) -> dict[str, Any]:
    """One run's step times (s, rank 0's, the first ``warmup_steps`` dropped), bytes per
    step per worker, compute-only step time (s) and last-epoch levels, from its
    ``metrics.jsonl`` records. ``ValueError`` when the records cannot give them."""
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if not records:
        raise ValueError("the run wrote no epoch record")
    missing = [r.get("epoch") for r in records if "step_times_s" not in r]
    if missing:
        raise ValueError(f"epoch records {missing} have no step_times_s (an older harness?)")
    steps = [t for r in records for t in r["step_times_s"]]
    measured = steps[warmup_steps:]
    if not measured:
        raise ValueError(
            f"the run took {len(steps)} steps, none after the {warmup_steps} warm-up steps: "
            "train more samples or epochs, or give fewer --warmup-steps"
        )
    last = records[-1]
    return {
        "epochs": len(records),
        "steps": len(steps),
        "measured_steps": len(measured),
        "step_s_median": statistics.median(measured),
        "step_s_min": min(measured),
        "step_s_max": max(measured),
        "bytes_per_step": last["bytes"] / len(steps),
        "compute_step_s": last.get("compute_step_s"),
        "levels": level_counts(last.get("levels", {})),
        "final_accuracy": last["test_metric"],
    }


def add_bounds(run: dict[str, Any], rate_bytes: float) -> None:
    """Add ``transfer_s`` (bytes per step / ``rate_bytes``, bytes/s), ``bound_s``
    (compute-only + transfer, s), ``time_over_bound`` and ``time_over_compute`` to a
    measured run with a compute-only time; leave other runs as they are."""
    if "step_s_median" not in run or not run.get("compute_step_s"):
        return
    transfer = run["bytes_per_step"] / rate_bytes
    run["transfer_s"] = transfer
    run["bound_s"] = run["compute_step_s"] + transfer
    run["time_over_bound"] = run["step_s_median"] / run["bound_s"]
    run["time_over_compute"] = run["step_s_median"] / run["compute_step_s"]


def comm_ratio(per_strategy: dict[str, list[dict[str, Any]]], rate_bytes: float):
    """The link's compute-to-communication ratio from its dense runs: ``compute_s`` (s),
    ``dense_transfer_s`` (dense bytes per step / ``rate_bytes``, s) and ``ratio``; ``None``
    without a measured dense run."""
    dense = _measured(per_strategy.get("dense", []))
    compute = _median(dense, "compute_step_s")
    if compute is None:
        return None
    transfer = _median(dense, "bytes_per_step") / rate_bytes
    return {"compute_s": compute, "dense_transfer_s": transfer, "ratio": compute / transfer}


def finish(results: dict[str, Any]) -> None:
    """Add the bounds to every run and the ratio of every link (idempotent)."""
    results["comm_ratio"] = {}
    for rate, per_strategy in results["runs"].items():
        rate_bytes = parse_bandwidth(rate)
        for runs in per_strategy.values():
            for run in runs:
                add_bounds(run, rate_bytes)
        results["comm_ratio"][rate] = comm_ratio(per_strategy, rate_bytes)


def _measured(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if "step_s_median" in r]


def _cell(runs: list[dict[str, Any]], key: str, fmt: str) -> str:
    value = _median(runs, key)
    return "-" if value is None else format(value, fmt)


def _short(text: str, limit: int = 160) -> str:
    """One table-safe line of an error message."""
    line = next((s.strip() for s in str(text).splitlines() if s.strip()), "")
    line = line.replace("|", "/")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _speedup(reference: float | None, median: float) -> str:
    return f"{reference / median:.2f}x" if reference else "-"


def _row(label: str, strategy: str, runs: list[dict[str, Any]], dense, fp16) -> str:
    """One table row: medians over the run's repetitions."""
    measured = _measured(runs)
    if not measured:
        first = runs[0]
        what = f"skipped: {_short(first['skipped'])}" if "skipped" in first else (
            f"failed: {_short(first.get('error', 'no result'))}")  # fmt: skip
        return f"| {label} | {strategy} | {what} |" + " - |" * 7
    median = _median(measured, "step_s_median")
    low = min(r["step_s_min"] for r in measured)
    high = max(r["step_s_max"] for r in measured)
    failed = len(runs) - len(measured)
    note = f" [{failed} of {len(runs)} not measured]" if failed else ""
    return (
        f"| {label} | {strategy} | {median:.3f} ({low:.3f}-{high:.3f}){note} | "
        f"{_median(measured, 'bytes_per_step') / 1e3:.1f} | "
        f"{_cell(measured, 'compute_step_s', '.3f')} | {_cell(measured, 'bound_s', '.3f')} | "
        f"{_cell(measured, 'time_over_bound', '.2f')} | "
        f"{_cell(measured, 'time_over_compute', '.2f')} | "
        f"{_speedup(dense, median)} | {_speedup(fp16, median)} |"
    )


def link_label(rate: str, reference: str) -> str:
    """The table's name of a link: the reference is the "unshaped" one."""
    return f"unshaped ({rate})" if rate == reference else rate


def table(results: dict[str, Any]) -> str:
    """The markdown table (medians over repetitions), then a line per link with its
    compute-to-communication ratio and the levels the Accordion runs ended at."""
    finish(results)
    lines, notes = [HEADER, "|---" * 10 + "|"], []
    for rate, per_strategy in results["runs"].items():
        label = link_label(rate, results.get("reference"))
        dense = _median(_measured(per_strategy.get("dense", [])), "step_s_median")
        fp16 = _median(_measured(per_strategy.get("torch-fp16", [])), "step_s_median")
        for strategy, runs in per_strategy.items():
            lines.append(_row(label, strategy, runs, dense, fp16))
        ratio = results["comm_ratio"].get(rate)
        notes.append(
            f"- {label}: compute-to-communication ratio {ratio['ratio']:.2f} (compute-only "
            f"{ratio['compute_s']:.3f} s / dense all-reduce {ratio['dense_transfer_s']:.3f} s)"
            if ratio else f"- {label}: compute-to-communication ratio - (no measured dense run)"
        )  # fmt: skip
        for strategy, runs in per_strategy.items():
            levels = [r["levels"] for r in _measured(runs) if r.get("levels")]
            if strategy.startswith("accordion") and levels:
                shown = ", ".join(f"{level}: {n}" for level, n in levels[-1].items())
                notes.append(f"- {label} {strategy}: last epoch's levels (level: tensors) "
                             f"{shown}")  # fmt: skip
    return "\n".join(lines + [""] + notes)


def run_one(cluster, strategy: str, rate: str, args, out: Path) -> dict[str, Any]:
    """Train ``strategy`` on the cluster's current link; its summary, or ``{"error":
    ...}`` when the run failed, timed out or left no usable metrics."""
    directory = out / _safe(rate) / _safe(strategy)
    metrics = directory / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # a failed run must not be read as an earlier one
    started = time.monotonic()
    try:
        cluster.run("accordion", train_command(strategy, args, directory),
                    timeout=args.timeout, log_dir=directory / "logs")  # fmt: skip
        summary = summarise(_records(metrics), args.warmup_steps)
    except (ClusterRunError, TimeoutError, OSError, ValueError, KeyError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "wall_s": time.monotonic() - started}
    summary["wall_s"] = time.monotonic() - started
    summary.update(_e2e.calibration_summary(directory))
    return summary


def _describe(run: dict[str, Any]) -> str:
    if "skipped" in run:
        return f"skipped: {_short(run['skipped'])}"
    if "error" in run:
        return f"FAILED: {_short(run['error'], 300)}"
    return (
        f"median step {run['step_s_median']:.3f} s, compute-only "
        f"{run['compute_step_s'] or float('nan'):.3f} s, "
        f"{run['bytes_per_step'] / 1e3:.1f} KB/step, wall {run['wall_s']:.0f} s"
    )


def _write(out: Path, results: dict[str, Any]) -> None:
    finish(results)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


def _probe(cluster, rate: str, results: dict[str, Any]) -> None:
    """The all-reduce bus bandwidth the link gives (recorded; a failure is only noted)."""
    try:
        probe = cluster.measure_bandwidth(mbytes=2.0 if rate.endswith("mbit") else 8.0)
    except (ClusterRunError, TimeoutError, RuntimeError) as exc:
        probe = {"error": f"{type(exc).__name__}: {exc}"}
    results["probes"].setdefault(rate, []).append(probe)
    if "bus_bandwidth_bytes_per_s" in probe:
        print(f"[{rate}] measured all-reduce bus bandwidth "
              f"{probe['bus_bandwidth_bytes_per_s'] * 8 / 1e6:.1f} Mbit/s", flush=True)  # fmt: skip


def sweep(cluster, args, rates: list[str], skipped: dict[str, str], results, out: Path):
    """Every repetition, link and strategy in turn; results.json after each run."""
    for repeat in range(args.repeats):
        for rate in rates:
            cluster.set_link(rate, args.delay)
            _probe(cluster, rate, results)
            for strategy in args.strategies:
                if strategy in skipped:
                    run = {"skipped": skipped[strategy]}
                else:
                    run = run_one(cluster, strategy, rate, args, out / f"rep{repeat}")
                results["runs"].setdefault(rate, {}).setdefault(strategy, []).append(run)
                print(f"[{rate}] {strategy}: {_describe(run)}", flush=True)
                _write(out, results)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--hosts", type=int, default=4, help="emulated hosts (default 4)")
    add("--workers-per-host", type=int, default=1,
        help="workers a host, sharing its link (default 1)")  # fmt: skip
    add("--rates", nargs="+", default=["100mbit", "300mbit", "1gbit"], help="link rates")
    add(
        "--reference",
        default="10gbit",
        help="the 'unshaped' link (default 10gbit; at most "
        f"{MAX_RATE_BITS / 1e9:g}gbit, but veths on one machine move far less anyway)",
    )
    add("--delay", default="0", help="one-way delay between hosts, e.g. 1ms (default 0)")
    add("--strategies", nargs="+", default=list(STRATEGIES))
    add("--epochs", type=int, default=2)
    add("--train-samples", type=int, default=448, help="per epoch (default 448: 7 steps)")
    add("--batch-size", type=int, default=64, help="global batch (default 64)")
    add("--warmup-steps", type=int, default=3, help="first steps of a run not measured")
    add("--seed", type=int, default=0)
    add("--statistic", default="sharded",
        help="Accordion's statistic (default sharded, the library's; the harness's is rank0)")
    add("--timeout", type=float, default=1800.0, help="seconds per run (default 1800)")
    add(
        "--repeats",
        type=int,
        default=1,
        help="sweeps over rates and strategies; 0: only tabulate the --merge files",
    )
    add("--merge", nargs="*", default=[], help="earlier results.json to add")
    add("--out", default="runs/cluster_resnet")
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Usage errors (exit 2) before anything is built; the links in sweep order."""
    from accordion.harness.strategies import parse_strategy

    rates = [args.reference, *[r for r in args.rates if r != args.reference]]
    for rate in rates:
        try:
            bits = parse_bandwidth(rate) * 8
        except (TypeError, ValueError) as exc:
            parser.error(f"argument --rates/--reference: {exc}")
        if not MIN_RATE_BITS <= bits <= MAX_RATE_BITS:
            parser.error(f"argument --rates/--reference: {rate!r} is outside "
                         f"{MIN_RATE_BITS} to {MAX_RATE_BITS:g} bit/s")  # fmt: skip
    for name in ("hosts", "repeats", "warmup_steps"):
        if getattr(args, name) < (2 if name == "hosts" else 0):
            parser.error(f"argument --{name.replace('_', '-')}: too small, got "
                         f"{getattr(args, name)}")  # fmt: skip
    if not args.timeout > 0:
        parser.error(f"argument --timeout: must be > 0 seconds, got {args.timeout}")
    for strategy in args.strategies:
        try:
            parse_strategy(strategy)
        except (TypeError, ValueError) as exc:
            parser.error(f"argument --strategies: {exc}")
    reason = skip_reason("dense", args)  # a refusal of every strategy is a usage error
    if reason is not None:
        parser.error(reason)
    steps = args.epochs * (args.train_samples // args.batch_size)
    if args.warmup_steps >= steps:
        parser.error(f"argument --warmup-steps: {args.warmup_steps} leaves none of the "
                     f"run's {steps} steps to measure")  # fmt: skip
    return rates


def main(argv: list[str] | None = None) -> int:
    """Run the sweep (or only tabulate ``--merge`` files with ``--repeats 0``)."""
    parser = _parser()
    args = parser.parse_args(argv)
    rates = _check_args(parser, args)
    skipped = {s: r for s in args.strategies if (r := skip_reason(s, args)) is not None}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "hosts": args.hosts, "workers_per_host": args.workers_per_host,
        "epochs": args.epochs, "train_samples": args.train_samples,
        "batch_size": args.batch_size, "warmup_steps": args.warmup_steps,
        "reference": args.reference, "delay": args.delay, "seed": args.seed,
        "probes": {}, "runs": {},
    }  # fmt: skip
    try:
        with (
            EmulatedCluster(args.hosts, rates[0], args.delay,
                            workers_per_host=args.workers_per_host)
            if args.repeats
            else contextlib.nullcontext() as cluster
        ):
            sweep(cluster, args, rates, skipped, results, out)
    except ClusterError as exc:
        print(f"cluster_resnet: {exc}", file=sys.stderr)
        return 2
    merge(results, args.merge)
    _write(out, results)
    text = table(results)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
