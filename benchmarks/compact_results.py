"""Merge ``accordion compare`` results into one compact file for ``docs/results/``.

Each run keeps its configuration, seed, and its last epoch's record only (final metrics,
floats, bytes, counted bytes), without per-step times, per-layer levels or the rule's
per-check history (``checks``, kept as their number, ``check_count``); the file is still
a ``results.json`` that ``accordion compare --from FILE --baseline dense`` reads.

    PYTHONPATH=src .venv/bin/python benchmarks/compact_results.py runs/s*/results.json \\
        --out docs/results/scaling-charlm-tiny-w4.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from accordion.harness.compare import load_results

#: Per-epoch keys too bulky for a summary: per-step series and per-layer records.
BULKY = ("step_times_s", "levels")


def compact(results: dict[str, Any]) -> dict[str, Any]:
    """``results`` (merged ``config`` and ``runs``) with each run's epochs cut to its last
    record, that record without :data:`BULKY` keys, and its checks counted, not kept."""
    runs = []
    for run in results["runs"]:
        if not run.get("epochs"):
            raise ValueError(f"run {run.get('strategy')!r} seed {run.get('seed')} has no epochs")
        last = {k: v for k, v in run["epochs"][-1].items() if k not in BULKY}
        checks = run.get("checks") or []
        runs.append({**run, "epochs": [last], "checks": [], "check_count": len(checks)})
    return {"config": results["config"], "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="results.json files of one workload")
    parser.add_argument("--out", required=True, help="the compact JSON to write")
    args = parser.parse_args(argv)
    try:
        merged = load_results(args.files)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    Path(args.out).write_text(json.dumps(compact(merged), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
