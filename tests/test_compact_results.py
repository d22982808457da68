"""benchmarks/compact_results.py: one compact results file that `compare --from` still reads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from accordion.harness.compare import load_results

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "compact_results.py"


def _script():
    spec = importlib.util.spec_from_file_location("compact_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _epoch(epoch: int, metric: float, nbytes: float) -> dict:
    return {"epoch": epoch, "train_loss": 1.0, "test_metric": metric, "floats": 10,
            "bytes": nbytes, "train_time_s": 1.0, "lr": 0.1, "batch_size": 8,
            "levels": {"w": 8}, "step_times_s": [0.1] * 50}  # fmt: skip


def _results(seed: int) -> dict:
    config = {"task": "mnist1d", "workers": 4, "seed": seed, "seeds": 1, "epochs": 2,
              "strategies": ["dense", "static:int:8"]}  # fmt: skip
    runs = [{"strategy": s, "seed": seed, "epochs": [_epoch(0, 50.0, b), _epoch(1, 90.0 + seed, b)],
             "checks": [{"epoch": 0}, {"epoch": 1}]}
            for s, b in (("dense", 400.0), ("static:int:8", 100.0))]  # fmt: skip
    return {"config": config, "runs": runs}


def test_each_run_keeps_its_last_epoch_without_per_step_series(tmp_path):
    files = []
    for seed in (0, 1):
        files.append(tmp_path / f"s{seed}.json")
        files[-1].write_text(json.dumps(_results(seed)))
    out = tmp_path / "compact.json"
    assert _script().main([*map(str, files), "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert len(written["runs"]) == 4
    for run in written["runs"]:
        (last,) = run["epochs"]
        assert last["epoch"] == 1 and last["test_metric"] == 90.0 + run["seed"]
        assert "step_times_s" not in last and "levels" not in last
        assert run["checks"] == [] and run["check_count"] == 2
    merged = load_results([out], baseline="dense")  # still a results.json
    assert {r["strategy"] for r in merged["runs"]} == {"dense", "static:int:8"}


def test_a_run_without_epochs_is_a_value_error():
    results = _results(0)
    results["runs"][0]["epochs"] = []
    with pytest.raises(ValueError, match="has no epochs"):
        _script().compact(results)
