"""benchmarks/cluster_resnet.py without a cluster: summaries, bounds, the table, skips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from accordion.cluster import ClusterRun, ClusterRunError
from accordion.ddp import AccordionState
from benchmark_scripts import load_benchmark

bench = load_benchmark("cluster_resnet.py")


def _record(epoch: int, steps: list[float], nbytes: float, levels=None, compute=0.5) -> dict:
    return {"epoch": epoch, "step_times_s": steps, "bytes": nbytes, "test_metric": 10.0,
            "levels": levels or {}, "compute_step_s": compute}  # fmt: skip


def _args(*argv: str):
    return bench._parser().parse_args(list(argv))


def test_summarise_drops_the_warm_up_steps_across_epochs(tmp_path):
    levels = {"a.weight": 4, "b.weight": 2, "c.weight": 2}
    lines = [_record(0, [9.0, 8.0, 1.0], 300.0), _record(1, [2.0, 3.0], 500.0, levels)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    summary = bench.summarise(bench._records(path), warmup_steps=2)
    assert summary["steps"] == 5 and summary["measured_steps"] == 3
    assert summary["step_s_median"] == 2.0  # of 1, 2, 3: the 9 and 8 were warm-up
    assert (summary["step_s_min"], summary["step_s_max"]) == (1.0, 3.0)
    assert summary["bytes_per_step"] == 100.0  # the last epoch's running total over 5 steps
    assert summary["compute_step_s"] == 0.5
    assert summary["levels"] == {"2": 2, "4": 1}  # the last epoch's
    assert bench.summarise(lines, warmup_steps=0)["step_s_median"] == 3.0


@pytest.mark.parametrize(
    "records, warmup, match",
    [([], 0, "no epoch record"),
     ([{"epoch": 0, "bytes": 1.0, "test_metric": 1.0}], 0, "no step_times_s"),
     ([_record(0, [1.0, 2.0], 1.0)], 2, "none after the 2 warm-up steps"),
     ([_record(0, [1.0], 1.0)], -1, "warmup_steps must be an int >= 0")],
)  # fmt: skip
def test_summarise_rejects_records_it_cannot_time(records, warmup, match):
    with pytest.raises(ValueError, match=match):
        bench.summarise(records, warmup)


def test_the_bound_is_compute_plus_the_bytes_over_the_link():
    run = {"step_s_median": 0.6, "bytes_per_step": 1.25e6, "compute_step_s": 0.2}
    bench.add_bounds(run, bench.parse_bandwidth("100mbit"))  # 12.5e6 bytes/s
    assert run["transfer_s"] == pytest.approx(0.1)
    assert run["bound_s"] == pytest.approx(0.3)
    assert run["time_over_bound"] == pytest.approx(2.0)
    assert run["time_over_compute"] == pytest.approx(3.0)
    unmeasured = {"skipped": "no"}
    bench.add_bounds(unmeasured, 1.0)
    assert unmeasured == {"skipped": "no"}


def test_the_compute_to_communication_ratio_uses_the_dense_runs():
    dense = [{"step_s_median": 1.0, "bytes_per_step": 6.25e6, "compute_step_s": 0.5}]
    ratio = bench.comm_ratio({"dense": dense}, bench.parse_bandwidth("100mbit"))
    assert ratio["dense_transfer_s"] == pytest.approx(0.5)
    assert ratio["ratio"] == pytest.approx(1.0)
    assert bench.comm_ratio({"static:powersgd:4": dense}, 1.0) is None


def _run(median: float, kb: float, compute: float = 0.5, **extra) -> dict:
    return {
        "step_s_median": median, "step_s_min": median - 0.1, "step_s_max": median + 0.1,
        "bytes_per_step": kb * 1e3, "compute_step_s": compute, "levels": {}, **extra,
    }  # fmt: skip


def _results() -> dict:
    per_link = {
        "dense": [_run(2.0, 1250.0)],
        "torch-fp16": [_run(1.0, 625.0)],
        "torch-bf16": [{"skipped": "strategy 'torch-bf16': PyTorch's bf16 hook needs CUDA"}],
        "static:powersgd:4": [{"error": "ClusterRunError: host 1 exited | status 1\nmore"}],
        "accordion:powersgd:4,2,1": [_run(0.5, 100.0, levels={"2": 3, "4": 1})],
    }
    return {"reference": "10gbit", "runs": {"10gbit": json.loads(json.dumps(per_link)),
                                            "100mbit": per_link}}  # fmt: skip


def test_the_table_has_a_row_per_run_with_speed_ups_bounds_and_ratios():
    lines = bench.table(_results()).splitlines()
    assert lines[0] == bench.HEADER and lines[1] == "|---" * 10 + "|"
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in lines[2:12]}
    assert len(rows) == 10 and all(r.count("|") == 11 for r in rows.values())
    dense = rows[("100mbit", "dense")]
    # bound: 0.5 s + 1.25 MB / 12.5 MB/s; 2.0 s over it
    assert "| 2.000 (1.900-2.100) | 1250.0 | 0.500 | 0.600 | 3.33 | 4.00 | 1.00x | 0.50x |" in dense
    assert rows[("100mbit", "torch-fp16")].endswith("| 2.00x | 1.00x |")
    assert rows[("100mbit", "accordion:powersgd:4,2,1")].endswith("| 4.00x | 2.00x |")
    assert "| unshaped (10gbit) | dense | 2.000" in rows[("unshaped (10gbit)", "dense")]
    assert (
        "skipped: strategy 'torch-bf16': PyTorch's bf16 hook needs CUDA"
        in (rows[("100mbit", "torch-bf16")])
    )
    assert (
        "failed: ClusterRunError: host 1 exited / status 1 |"
        in (rows[("100mbit", "static:powersgd:4")])
    )
    text = "\n".join(lines)
    # 0.5 s of compute over 1.25 MB at 12.5 MB/s
    assert "- 100mbit: compute-to-communication ratio 5.00 (compute-only 0.500 s" in text
    assert (
        "- 100mbit accordion:powersgd:4,2,1: last epoch's levels (level: tensors) 2: 3, 4: 1"
        in text
    )


def test_bf16_is_skipped_with_the_harness_reason_and_dense_is_not(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = _args()
    assert "needs CUDA" in bench.skip_reason("torch-bf16", args)
    assert bench.skip_reason("dense", args) is None
    assert "32 training samples" in bench.skip_reason("dense", _args("--train-samples", "32"))


@pytest.mark.parametrize(
    "argv, match",
    [(["--rates", "fast"], "bandwidth"), (["--reference", "1tbit"], "outside"),
     (["--strategies", "nonsense:1"], "--strategies"), (["--warmup-steps", "14"], "leaves none"),
     (["--hosts", "1"], "--hosts"), (["--timeout", "0"], "--timeout"),
     (["--statistic", "median"], "statistic")],
)  # fmt: skip
def test_bad_arguments_are_usage_errors_before_any_cluster(argv, match, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        bench.main([*argv, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_runs_use_the_librarys_default_statistic_unless_told(tmp_path):
    default = AccordionState(nn.Linear(64, 64)).statistic
    for argv, expected in (([], default), (["--statistic", "rank0"], "rank0")):
        command = bench.train_command("accordion:powersgd:4,2,1", _args(*argv), tmp_path)
        assert command[command.index("--statistic") + 1] == expected


class FakeCluster:
    """Stands for EmulatedCluster: each run writes the metrics a real one would."""

    def __init__(self, hosts, bandwidth, delay="0", workers_per_host=1):
        self.workers_per_host = workers_per_host
        self.commands: list[list[str]] = []
        self.links: list[str] = []

    def __enter__(self):
        FakeCluster.last = self
        return self

    def __exit__(self, *exc):
        return None

    def set_link(self, bandwidth, delay="0"):
        self.links.append(bandwidth)

    def measure_bandwidth(self, mbytes=4.0):
        return {"bus_bandwidth_bytes_per_s": 1e6}

    def run(self, target, args, timeout=None, log_dir=None):
        self.commands.append(list(args))
        strategy = args[args.index("--strategy") + 1]
        if strategy == "static:powersgd:1":
            result = ClusterRun([0, 0, 1, 0], "", "", 1.0, None, failed_host=2)
            raise ClusterRunError("host 2 exited with status 1", result)
        out = Path(args[args.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        nbytes = 8e6 if strategy == "dense" else 2e6
        records = [_record(e, [3.0, 1.0, 1.0, 1.0], nbytes * (e + 1), compute=0.25) for e in (0, 1)]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_sweep_records_every_run_skips_and_failures_included(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "EmulatedCluster", FakeCluster)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    strategies = ["dense", "torch-bf16", "static:powersgd:1", "static:powersgd:4"]
    argv = ["--rates", "100mbit", "--strategies", *strategies, "--epochs", "2",
            "--train-samples", "256", "--warmup-steps", "1", "--out", str(tmp_path)]  # fmt: skip
    code = bench.main(argv)
    assert code == 0
    cluster = FakeCluster.last
    assert cluster.links == ["10gbit", "100mbit"]  # the reference first
    assert len(cluster.commands) == 6  # torch-bf16 never ran
    command = cluster.commands[0]
    for flag in ("--measure-compute", "--no-progress"):
        assert flag in command
    for flag, value in (("--model", "resnet18"), ("--task", "synthetic"), ("--epochs", "2"),
                        ("--train-samples", "256"), ("--batch-size", "64"),
                        ("--warmup-epochs", "0"), ("--threads", "1")):  # fmt: skip
        assert command[command.index(flag) + 1] == value
    results = json.loads((tmp_path / "results.json").read_text())
    runs = results["runs"]["100mbit"]
    assert "needs CUDA" in runs["torch-bf16"][0]["skipped"]
    assert "host 2 exited" in runs["static:powersgd:1"][0]["error"]
    dense = runs["dense"][0]
    assert dense["measured_steps"] == 7 and dense["step_s_median"] == 1.0
    assert dense["bytes_per_step"] == 2e6  # 16 MB over 8 steps
    assert dense["bound_s"] == pytest.approx(0.25 + 2e6 / 12.5e6)
    assert results["comm_ratio"]["100mbit"]["ratio"] == pytest.approx(0.25 / 0.16)
    table = (tmp_path / "table.md").read_text()
    assert table.strip() in capsys.readouterr().out
    # the first step of epoch 1 (3 s) is measured: only the run's first is warm-up
    assert "| 100mbit | static:powersgd:4 | 1.000 (1.000-3.000) | 500.0 |" in table


def test_repeats_zero_tabulates_merged_results_without_a_cluster(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "EmulatedCluster", None)  # building one would fail here
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(_results()))
    assert (
        bench.main(["--repeats", "0", "--merge", str(earlier), "--out", str(tmp_path / "o")]) == 0
    )
    table = (tmp_path / "o" / "table.md").read_text()
    assert "| 100mbit | dense | 2.000 (1.900-2.100) | 1250.0 | 0.500 | 0.600 | 3.33 |" in table
