"""Time to the reference's final loss, from local seeds and timed cluster runs.

The harness evaluates at each epoch's end only. For every seed of a local
``accordion compare`` result, this finds the first epoch end at which a
strategy's validation loss is at or below the reference's final loss for that
seed, and prices it with the loop time (seconds) to that epoch end measured on
the emulated cluster (``metrics.jsonl`` of seed-0 runs, averaged over runs).
The cluster runs must reproduce the local seed 0 bitwise, or it stops.

    python benchmarks/time_to_target.py --local RESULT.json \\
        --log dense RUN1/metrics.jsonl --log dense RUN2/metrics.jsonl \\
        --log STRATEGY RUN/metrics.jsonl ...

Prints, per strategy, the reference's loop time over the strategy's time to
the target on each seed ("-" where a seed never reaches it).
"""

import argparse
import json
import statistics


def _epochs(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _loop_times(runs, local_epochs, strategy):
    """Mean cumulative loop time (s) at each epoch end over the cluster runs."""
    want = [e["val_loss"] for e in local_epochs]
    for path, epochs in runs:
        if [e["val_loss"] for e in epochs] != want:
            raise SystemExit(f"{path}: {strategy!r} does not reproduce the local seed 0")
    return [statistics.fmean(t) for t in zip(*[[e["train_time_s"] for e in ep] for _, ep in runs])]


def _first_reach(epochs, target):
    return next((i for i, e in enumerate(epochs) if e["val_loss"] <= target), None)


def report(local, logs, reference="dense"):
    """Per strategy: cluster loop times and per-seed speed-ups to the reference's loss."""
    runs = {(r["strategy"], r["seed"]): r["epochs"] for r in local["runs"]}
    seeds = sorted({s for (name, s) in runs if name == reference})
    missing = [name for name in logs if (name, 0) not in runs]
    if missing:
        raise SystemExit(f"the local result has no seed 0 of {missing}: the logs are seed 0's")
    times = {name: _loop_times(paths, runs[(name, 0)], name) for name, paths in logs.items()}
    ref_loop = times[reference][-1]
    lines = []
    for name, cum in times.items():
        loops = ", ".join(f"{ep[-1]['train_time_s']:.1f}" for _, ep in logs[name])
        ups = []
        for seed in seeds:
            at = _first_reach(runs[(name, seed)], runs[(reference, seed)][-1]["val_loss"])
            ups.append(None if at is None else ref_loop / cum[at])
        reached = [u for u in ups if u is not None]
        cells = " ".join("-" if u is None else f"{u:.2f}" for u in ups)
        mean = f", mean {statistics.fmean(reached):.2f}x" if reached else ""
        lines.append(
            f"{name}\n  loop {loops} s; {reference} loop / time to its final loss by seed: "
            f"{cells} ({len(reached)} of {len(ups)} reach it{mean})"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local", required=True, help="an accordion compare result JSON")
    parser.add_argument(
        "--log",
        nargs=2,
        action="append",
        required=True,
        metavar=("STRATEGY", "METRICS_JSONL"),
        help="a timed cluster run",
    )
    parser.add_argument("--reference", default="dense")
    args = parser.parse_args(argv)
    with open(args.local) as f:
        local = json.load(f)
    logs = {}
    for name, path in args.log:
        logs.setdefault(name, []).append((path, _epochs(path)))
    if args.reference not in logs:
        parser.error(f"--log needs at least one run of the reference {args.reference!r}")
    print(report(local, logs, args.reference))


if __name__ == "__main__":
    main()
