"""benchmarks/time_to_target.py: per-seed time to the reference's final loss."""

from __future__ import annotations

import json

import pytest

from benchmark_scripts import load_benchmark

bench = load_benchmark("time_to_target.py")


def _epochs(losses, times):
    return [{"val_loss": v, "train_time_s": t} for v, t in zip(losses, times)]


def _local():
    """Two seeds: 'fast' reaches dense's final loss at epoch 0 on seed 0, never on seed 1."""
    runs = [
        {"strategy": "dense", "seed": 0, "epochs": _epochs([2.0, 1.5], [5.0, 10.0])},
        {"strategy": "dense", "seed": 1, "epochs": _epochs([2.0, 1.4], [5.0, 10.0])},
        {"strategy": "fast", "seed": 0, "epochs": _epochs([1.5, 1.45], [2.0, 4.0])},
        {"strategy": "fast", "seed": 1, "epochs": _epochs([1.6, 1.41], [2.0, 4.0])},
    ]
    return {"runs": runs}


def _write(tmp_path, name, losses, times):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in _epochs(losses, times)))
    return str(path)


def test_speed_up_is_reference_loop_over_time_to_first_epoch_at_target(tmp_path, capsys):
    dense = _write(tmp_path, "d", [2.0, 1.5], [6.0, 12.0])
    fast = _write(tmp_path, "f", [1.5, 1.45], [3.0, 5.0])
    local = tmp_path / "local.json"
    local.write_text(json.dumps(_local()))
    bench.main(["--local", str(local), "--log", "dense", dense, "--log", "fast", fast])
    out = capsys.readouterr().out
    assert "4.00 - (1 of 2 reach it, mean 4.00x)" in out  # 12 s / 3 s on seed 0


def test_cluster_run_that_does_not_reproduce_the_local_seed_is_refused(tmp_path):
    dense = _write(tmp_path, "d", [2.0, 1.5000001], [6.0, 12.0])
    local = tmp_path / "local.json"
    local.write_text(json.dumps(_local()))
    with pytest.raises(SystemExit, match="does not reproduce"):
        bench.main(["--local", str(local), "--log", "dense", dense])


def test_loop_times_average_over_runs_of_one_strategy(tmp_path, capsys):
    runs = [_write(tmp_path, f"d{i}", [2.0, 1.5], [6.0, t]) for i, t in enumerate((10.0, 14.0))]
    fast = _write(tmp_path, "f", [1.5, 1.45], [3.0, 5.0])
    local = tmp_path / "local.json"
    local.write_text(json.dumps(_local()))
    argv = ["--local", str(local), "--log", "dense", runs[0], "--log", "dense", runs[1]]
    bench.main(argv + ["--log", "fast", fast])
    assert "mean 4.00x" in capsys.readouterr().out  # (10 + 14) / 2 = 12 s over 3 s


def test_a_logged_strategy_missing_from_the_local_result_is_refused(tmp_path):
    dense = _write(tmp_path, "d", [2.0, 1.5], [6.0, 12.0])
    local = tmp_path / "local.json"
    local.write_text(json.dumps(_local()))
    argv = ["--local", str(local), "--log", "dense", dense, "--log", "other", dense]
    with pytest.raises(SystemExit, match="no seed 0 of \\['other'\\]"):
        bench.main(argv)
