"""Per-step wall times and the compute-only step time in the harness's epoch records."""

from __future__ import annotations

import csv
import json

import pytest

from accordion.cli.parser import build_parser
from accordion.cli.run_config import _make_config
from accordion.harness.compare import run_compare, slug
from accordion.harness.launch import run_distributed
from accordion.harness.train import TrainConfig, train_run

TINY = dict(
    task="synthetic", synthetic_shape=(40,), train_samples=128, test_samples=64, epochs=3,
    batch_size=32, interval=1, decay_epochs=(2,), threads=1, progress=False, batch_switch_epoch=1,
)  # fmt: skip
#: Optimizer steps per epoch: 128 samples at a global batch of 32, then 64 for batch-fixed.
EXPECTED_STEPS = {
    "dense": [4, 4, 4],
    "batch-fixed:32,64": [4, 2, 2],
    "accordion:powersgd:2,1:auto": [4, 4, 4],
}


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """One 2-worker compare with ``measure_compute`` (one process spawn for all runs)."""
    out = tmp_path_factory.mktemp("steps")
    config = TrainConfig(**TINY, measure_compute=True)
    results = run_compare(config, list(EXPECTED_STEPS), seeds=1, workers=2, out=out)
    return out, {run["strategy"]: run for run in results["runs"]}


def test_every_epoch_record_has_one_positive_time_per_optimizer_step(compared):
    out, runs = compared
    for strategy, expected in EXPECTED_STEPS.items():
        lines = (out / "runs" / slug(strategy) / "seed0" / "metrics.jsonl").read_text()
        records = [json.loads(line) for line in lines.splitlines()]
        assert [len(r["step_times_s"]) for r in records] == expected, strategy
        assert [len(r["step_times_s"]) for r in runs[strategy]["epochs"]] == expected
        for record in records:
            assert len(record["step_times_s"]) == TINY["train_samples"] // record["batch_size"]
            assert all(isinstance(t, float) and t > 0 for t in record["step_times_s"])
            # the steps are part of the epoch's training time
            assert sum(record["step_times_s"]) < record["train_time_s"]


def test_measure_compute_records_one_positive_agreed_time_in_every_epoch(compared):
    _, runs = compared
    for strategy, run in runs.items():
        values = {e["compute_step_s"] for e in run["epochs"]}
        assert len(values) == 1, strategy  # measured once, before training
        assert values.pop() > 0
    # an :auto strategy reuses the measurement it calibrates with rather than taking two
    auto = runs["accordion:powersgd:2,1:auto"]
    assert auto["epochs"][0]["compute_step_s"] == auto["calibration"]["step_compute_s"]


def test_metrics_csv_keeps_its_scalar_columns_next_to_the_list_field(compared):
    out, runs = compared
    with (out / "runs" / slug("dense") / "seed0" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    assert list(rows[0]) == [
        "epoch", "train_loss", "test_metric", "floats", "bytes", "train_time_s", "lr"
    ]  # fmt: skip
    assert float(rows[-1]["bytes"]) == runs["dense"]["epochs"][-1]["bytes"]


def _alone(rank, world, local_rank, configs):
    return [train_run(c, rank, world, local_rank).as_dict() for c in configs]


def test_measuring_changes_nothing_the_run_computes_and_is_off_by_default():
    plain, measured = run_distributed(
        _alone, 1, [TrainConfig(**TINY), TrainConfig(**TINY, measure_compute=True)]
    )
    assert all("compute_step_s" not in e for e in plain["epochs"])
    assert all(e["compute_step_s"] > 0 for e in measured["epochs"])
    for key in ("train_loss", "test_metric", "floats", "bytes", "levels"):
        assert [e[key] for e in plain["epochs"]] == [e[key] for e in measured["epochs"]], key


def test_a_resumed_run_keeps_the_step_times_of_the_epochs_before_the_checkpoint(tmp_path):
    common = dict(TINY, checkpoint_dir=str(tmp_path / "ckpt"), out=str(tmp_path / "out"))
    first = TrainConfig(**{**common, "epochs": 2})
    # measure_compute may change on resume: it does not change the run
    second = TrainConfig(**common, measure_compute=True)
    (before,) = run_distributed(_alone, 1, [first])
    (after,) = run_distributed(_alone, 1, [second])
    assert after["epochs"][:2] == before["epochs"]  # restored from the checkpoint's extra
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [len(r["step_times_s"]) for r in records] == [4, 4, 4]
    assert records[:2] == before["epochs"] and records[2]["compute_step_s"] > 0
    assert "compute_step_s" not in records[0]


def test_the_flag_sets_measure_compute_and_a_non_bool_is_refused():
    parser = build_parser()
    for argv, expected in ((["train"], False), (["train", "--measure-compute"], True)):
        args = parser.parse_args(argv)
        assert _make_config(args, args.parser).measure_compute is expected
    with pytest.raises(TypeError, match="measure_compute must be a bool"):
        TrainConfig(**TINY, measure_compute=1).validate()
