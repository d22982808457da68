"""benchmarks/loopback_loop.py's arithmetic, and benchmarks/round_cost.py on 2 workers."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


loop = _load("loopback_loop")


def test_the_loop_time_is_the_last_epochs_train_time(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps({"epoch": e, "train_time_s": t})
                              for e, t in [(0, 1.5), (1, 3.25)]) + "\n")  # fmt: skip
    assert loop.loop_seconds(path) == 3.25


def test_an_empty_metrics_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="metrics.jsonl"):
        loop.loop_seconds(path)


def test_ratios_are_paired_by_repetition_before_the_median():
    rows = loop.summarise({"dense": [10.0, 20.0, 10.0], "c": [13.0, 22.0, 30.0]})
    c = next(r for r in rows if r["strategy"] == "c")
    # per repetition 1.3, 1.1 and 3.0: the median of the ratios, not a ratio of medians
    assert c["ratio"] == pytest.approx(1.3)
    assert (c["ratio_min"], c["ratio_max"]) == pytest.approx((1.1, 3.0))
    assert c["median_s"] == 22.0
    assert "| c | 22.00 (13.00-30.00) | 1.30x (1.10-3.00) |" in loop.table(rows)


def test_without_a_dense_run_there_is_no_ratio():
    rows = loop.summarise({"c": [1.0]})
    assert rows[0]["ratio"] is None
    assert "| c | 1.00 (1.00-1.00) | - |" in loop.table(rows)


def test_round_cost_prints_a_time_for_every_configuration():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, str(ROOT / "benchmarks" / "round_cost.py"), "--workers", "2",
               "--steps", "2", "--warmup", "1", "--reps", "1"]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1].strip() for line in proc.stdout.splitlines()[2:]]
    assert rows == ["dense", "rounds1", "rounds2", "powersgd", "powersgd1", "torch-powersgd"]
