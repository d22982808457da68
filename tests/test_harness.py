"""The training harness end to end: `accordion train` and `accordion compare`."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accordion.cli import main
from accordion.harness.compare import run_compare, slug
from accordion.harness.strategies import parse_strategy
from accordion.harness.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
ALL_FAMILIES = [
    "dense",
    "static:powersgd:2",
    "static:topk:0.2",
    "accordion:powersgd:2,1",
    "accordion:topk:0.5,0.1",
    "torch-powersgd:1",
    "torch-fp16",
    "static-batch:64",
    "batch-fixed:32,64",
    "batch:32,64+accordion:powersgd:2,1",
    "accordion:powersgd:2,1:auto",
    "static:half:fp16",
    "accordion:powersgd:4,2,1",
    "diloco:2",
    "diloco:2+static:int:4",
    "diloco:2:warmup=4",
    "diloco:2:warmup=4:warmup-with=int/4",
    "diloco:4",
    "diloco:4:fragments=2:delay=1",
]
TINY = dict(
    task="synthetic", synthetic_shape=(40,), train_samples=128, test_samples=64, epochs=3,
    batch_size=32, interval=1, decay_epochs=(2,), threads=1, progress=False, batch_switch_epoch=1,
)  # fmt: skip


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-m", "accordion", *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )  # fmt: skip


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """One 2-worker compare of every strategy family (one process spawn for all runs)."""
    out = tmp_path_factory.mktemp("compare")
    results = run_compare(TrainConfig(**TINY), ALL_FAMILIES, seeds=1, workers=2, out=out)
    return out, results


def test_every_strategy_family_trains_end_to_end_with_two_workers(compared):
    _, results = compared
    assert [r["strategy"] for r in results["runs"]] == ALL_FAMILIES
    for run in results["runs"]:
        assert len(run["epochs"]) == 3
        assert all(0.0 <= e["test_metric"] <= 100.0 for e in run["epochs"])
        floats = [e["floats"] for e in run["epochs"]]
        assert floats == sorted(floats) and floats[0] > 0


def test_diloco_every_2_steps_sends_half_of_dense_and_int4_less_again(compared):
    _, results = compared
    sent = {r["strategy"]: r["epochs"][-1]["bytes"] for r in results["runs"]}
    assert sent["diloco:2"] == pytest.approx(sent["dense"] / 2, rel=1e-9)
    assert 0 < sent["diloco:2+static:int:4"] < sent["diloco:2"] / 4


def test_a_diloco_warmup_sends_one_dense_average_per_step_then_one_per_round(compared):
    _, results = compared
    sent = {r["strategy"]: r["epochs"][-1]["bytes"] for r in results["runs"]}
    # 12 steps: 4 data-parallel ones, then 4 rounds of 2 steps
    assert sent["diloco:2:warmup=4"] == pytest.approx(sent["dense"] * 8 / 12, rel=1e-9)
    # an int4 warm-up: its 4 steps send less than a quarter of dense's each
    compressed = sent["diloco:2:warmup=4:warmup-with=int/4"]
    assert compressed < sent["diloco:2:warmup=4"] - sent["dense"] * 4 / 12 * 3 / 4


def test_a_streamed_diloco_syncs_each_fragment_every_h_steps_sending_what_diloco_sends(compared):
    _, results = compared
    runs = {r["strategy"]: r for r in results["runs"]}
    streamed, plain = runs["diloco:4:fragments=2:delay=1"], runs["diloco:4"]
    # 12 steps: a fragment lands every 2, each of the 2 every 4, as DiLoCo's 3 rounds
    assert (streamed["diloco"]["fragment_syncs"], streamed["diloco"]["rounds"]) == (6, 3)
    assert streamed["epochs"][-1]["bytes"] == plain["epochs"][-1]["bytes"] > 0
    assert "fragment_syncs" not in plain["diloco"]


def test_a_diloco_ef_decay_reaches_the_syncs_error_feedback(tmp_path):
    plain, dropped = "diloco:2+static:int:2", "diloco:2:ef-decay=0+static:int:2"
    results = run_compare(TrainConfig(**TINY), [plain, dropped], seeds=1, workers=1,
                          out=tmp_path)  # fmt: skip
    losses = {r["strategy"]: [e["train_loss"] for e in r["epochs"]] for r in results["runs"]}
    assert losses[plain][0] == losses[dropped][0]  # epoch 0: same until a residual is carried
    assert losses[plain][-1] != losses[dropped][-1]


def test_diloco_rounds_that_grow_or_shrink_with_the_rate_follow_its_decay(tmp_path):
    # TINY's rate rises for 8 steps to 0.08875, then drops 10x for the last 4
    fixed, grown, shrunk = "diloco:2", "diloco:2:grow=1:max=4", "diloco:4:grow=-1:min=1"
    results = run_compare(TrainConfig(**TINY), [fixed, grown, shrunk], seeds=1, workers=1,
                          out=tmp_path)  # fmt: skip
    runs = {r["strategy"]: r for r in results["runs"]}
    assert runs[grown]["diloco"]["round_lengths"] == [2, 2, 2, 2, 4]  # 2 * 8.875, capped
    assert runs[shrunk]["diloco"]["round_lengths"] == [4, 4, 1, 1, 1, 1]  # 4 / 8.875 -> 1
    assert "round_lengths" not in runs[fixed]["diloco"]
    sent = {name: run["epochs"][-1]["bytes"] for name, run in runs.items()}
    assert sent[grown] == pytest.approx(sent[fixed] * 5 / 6, rel=1e-9)
    assert sent[shrunk] == pytest.approx(sent[fixed], rel=1e-9)  # 6 rounds each


def test_diloco_final_1_syncs_once_more_after_the_last_step_when_a_round_was_cut_short(tmp_path):
    # 12 steps: H = 5 leaves steps 11-12 unsynced, H = 4 ends on a sync
    names = ["diloco:5", "diloco:5:final=1", "diloco:4", "diloco:4:final=1"]
    results = run_compare(TrainConfig(**TINY), names, seeds=1, workers=1, out=tmp_path)
    runs = {r["strategy"]: r for r in results["runs"]}
    assert [runs[n]["diloco"]["rounds"] for n in names] == [2, 3, 3, 3]
    sent = {n: [e["bytes"] for e in runs[n]["epochs"]] for n in names}
    assert sent["diloco:5:final=1"][:2] == sent["diloco:5"][:2]  # only the last epoch's end
    assert sent["diloco:5:final=1"][-1] == pytest.approx(sent["diloco:5"][-1] * 3 / 2, rel=1e-9)
    assert sent["diloco:4:final=1"] == sent["diloco:4"]


def test_a_diloco_warmup_ended_by_its_norm_test_sends_less_and_records_where(tmp_path):
    # no learning-rate warm-up: a window in which the rate rises is never calm
    config = TrainConfig(**{**TINY, "interval_unit": "step", "interval": 2, "warmup_epochs": 0})
    fixed, tested = "diloco:2:warmup=8", "diloco:2:warmup=8:warmup-eta=1e6"  # always calm
    results = run_compare(config, [fixed, tested], seeds=1, workers=2, out=tmp_path)
    runs = {r["strategy"]: r for r in results["runs"]}
    # 12 steps: 8 data-parallel then 2 rounds, or 4 (calm at the second window) then 4
    assert runs[fixed]["diloco"]["warmup_steps_done"] == 8
    assert runs[tested]["diloco"]["warmup_steps_done"] == 4
    assert [c["step"] for c in runs[tested]["diloco"]["warmup_checks"]] == [2, 4]
    sent = {name: run["epochs"][-1]["bytes"] for name, run in runs.items()}
    assert sent[tested] == pytest.approx(sent[fixed] * 8 / 10, rel=1e-9)


def test_an_auto_strategy_records_the_cost_models_measurements(compared):
    _, results = compared
    runs = {r["strategy"]: r for r in results["runs"]}
    assert parse_strategy("accordion:powersgd:2,1:auto").auto
    calibration = runs["accordion:powersgd:2,1:auto"]["calibration"]
    assert calibration["bandwidth"] > 0 and len(calibration["link_samples"]) >= 2
    assert calibration["step_compute_s"] > 0  # measured on the first batch, no traffic
    assert set(calibration["dense_keys"]) <= set(calibration["tensors"])
    assert runs["accordion:powersgd:2,1"]["calibration"] is None


def test_each_run_writes_well_formed_json_lines_and_csv(compared):
    out, _ = compared
    for strategy in ALL_FAMILIES:
        run_dir = out / "runs" / slug(strategy)
        lines = (run_dir / "seed0" / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert [r["epoch"] for r in records] == [0, 1, 2]
        for key in ("train_loss", "test_metric", "floats", "bytes", "train_time_s", "levels"):
            assert all(key in r for r in records)
        with (run_dir / "seed0" / "metrics.csv").open() as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == 3
        assert float(rows[-1]["floats"]) == records[-1]["floats"]


def test_accordion_runs_log_each_layers_level_and_the_checks(compared):
    _, results = compared
    run = next(r for r in results["runs"] if r["strategy"] == "accordion:powersgd:2,1")
    assert set(run["epochs"][0]["levels"]) == {
        "conv1.weight", "conv2.weight", "conv3.weight", "linear.weight"
    }  # fmt: skip
    assert set(run["epochs"][0]["levels"].values()) == {2}  # training starts mild
    assert run["checks"][0]["epoch"] == 0


def test_compressed_strategies_send_less_than_dense(compared):
    _, results = compared
    sent = {row["strategy"]: row["floats"] for row in results["table"]}
    for strategy in ("static:powersgd:2", "accordion:powersgd:2,1", "torch-powersgd:1"):
        assert sent[strategy] < sent["dense"]


def test_a_static_half_strategy_sends_half_the_dense_bytes_through_the_hook(compared):
    _, results = compared
    table = {row["strategy"]: row for row in results["table"]}
    runs = {r["strategy"]: r for r in results["runs"]}
    assert table["static:half:fp16"]["bytes"] == table["dense"]["bytes"] / 2
    assert table["static:half:fp16"]["floats"] == table["dense"]["floats"]  # paper floats
    levels = runs["static:half:fp16"]["epochs"][-1]["levels"]
    assert set(levels.values()) == {"fp16"} and "linear.bias" in levels  # biases too


def test_a_three_rung_strategy_starts_at_the_mildest_rung(compared):
    _, results = compared
    run = next(r for r in results["runs"] if r["strategy"] == "accordion:powersgd:4,2,1")
    assert (run["mild"], run["aggressive"]) == (4, 1)
    assert set(run["epochs"][0]["levels"].values()) == {4}
    # the default (guarded) rule moves a layer by one rung at most per check
    rung = {4: 0, 2: 1, 1: 2}
    for before, after in zip(run["epochs"], run["epochs"][1:]):
        for key, level in after["levels"].items():
            assert abs(rung[level] - rung[before["levels"][key]]) <= 1


def test_batch_strategies_record_the_batch_size_and_send_once_per_global_batch(compared):
    _, results = compared
    runs = {r["strategy"]: r for r in results["runs"]}
    fixed = runs["batch-fixed:32,64"]["epochs"]
    assert [e["batch_size"] for e in fixed] == [32, 64, 64]
    per_epoch = [b["floats"] - a["floats"] for a, b in zip(fixed, fixed[1:])]
    first = fixed[0]["floats"]
    # 128 samples: 4 steps of 32, then 2 steps of 64 (one all-reduce per global batch)
    assert per_epoch == [first // 2, first // 2]
    assert runs["static-batch:64"]["epochs"][0]["floats"] == first // 2


def test_compare_writes_results_json_with_the_table(compared):
    out, results = compared
    saved = json.loads((out / "results.json").read_text())
    assert [row["strategy"] for row in saved["table"]] == ALL_FAMILIES
    static = next(r for r in saved["table"] if r["strategy"] == "static:powersgd:2")
    assert static["data_vs_mild"] == pytest.approx(1.0)


def test_compare_cli_prints_the_table_and_writes_the_plots(tmp_path):
    result = run_cli(
        "compare", "--task", "synthetic", "--synthetic-shape", "40", "--train-samples", "64",
        "--test-samples", "32", "--epochs", "2", "--batch-size", "32", "--interval", "1",
        "--workers", "2", "--no-progress", "--strategies", "static:powersgd:2",
        "accordion:powersgd:2,1", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "accordion:powersgd:2,1" in result.stdout and "less than mild" in result.stdout
    for name in ("results.json", "accuracy.png", "data_sent.png", "levels.png", "norm_ratios.png"):
        assert (tmp_path / name).stat().st_size > 0
        if name.endswith(".png"):
            assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_cli_runs_one_strategy_and_reports_it(tmp_path):
    result = run_cli(
        "train", "--task", "synthetic", "--synthetic-shape", "40", "--train-samples", "64",
        "--test-samples", "32", "--epochs", "2", "--batch-size", "32", "--workers", "2",
        "--no-progress", "--strategy", "accordion:topk:0.5,0.1", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "accordion:topk:0.5,0.1: test" in result.stdout
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_train_runs_under_torchrun_and_only_rank_0_reports(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "-m", "accordion", "train", "--task", "synthetic", "--synthetic-shape", "40",
            "--train-samples", "64", "--test-samples", "32", "--epochs", "2",
            "--batch-size", "32", "--no-progress", "--strategy", "static:powersgd:1",
            "--out", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("static:powersgd:1: test") == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def _train_twice(rank, world, local_rank):
    from accordion.harness.train import train_run

    runs = [train_run(TrainConfig(**TINY, strategy="accordion:powersgd:2,1"), rank, world)
            for _ in range(2)]  # fmt: skip
    return [[(e["train_loss"], e["test_metric"], e["floats"]) for e in r.epochs] for r in runs]


def test_runs_are_deterministic_given_the_seed_on_cpu():
    from accordion.harness.launch import run_distributed

    first, second = run_distributed(_train_twice, 2)
    assert first == second


def test_a_missing_data_directory_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="cifar-10"):
        run_compare(
            TrainConfig(task="cifar10", data_dir=str(tmp_path / "nowhere"), epochs=1),
            ["dense"], seeds=1, workers=1, out=tmp_path / "out",
        )  # fmt: skip


@pytest.mark.parametrize(
    "text",
    [
        "sgd", "static:powersgd", "accordion:powersgd:2", "static:qsgd:2", "static:topk:2",
        "static:powersgd:2:fast", "dense:auto", "torch-powersgd:1:auto",
    ],
)  # fmt: skip
def test_malformed_strategies_are_rejected_with_the_allowed_forms(text):
    with pytest.raises(ValueError, match="strategy"):
        parse_strategy(text)


def test_the_cli_rejects_an_unknown_strategy_naming_the_argument(capsys):
    with pytest.raises(SystemExit) as info:
        main(["compare", "--strategies", "fast", "--epochs", "1"])
    assert info.value.code == 2
    assert "--strategies" in capsys.readouterr().err


def test_the_cli_rejects_an_unknown_task(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--task", "imagenet"])
    assert "--task" in capsys.readouterr().err


def test_the_library_never_imports_the_harness():
    code = (
        "import sys, accordion, accordion.ddp, accordion.compress, "
        "accordion.plan, accordion.models, accordion.accounting, accordion.costmodel, "
        "accordion.cli; "
        "print([m for m in sys.modules if m.startswith('accordion.harness')])"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "[]", out.stderr


def _large_result(rank, world, local_rank):
    return list(range(300_000)) if rank == 0 else None


def test_local_workers_return_a_result_larger_than_a_pipe_buffer():
    from accordion.harness.launch import run_distributed

    assert run_distributed(_large_result, 2) == list(range(300_000))


def test_the_cli_rejects_an_unknown_preset_and_knows_the_papers(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--preset", "imagenet-resnet50"])
    err = capsys.readouterr().err
    assert "--preset" in err and "cifar10-resnet18" in err and "wikitext2-lstm" in err


def test_a_bad_batch_strategy_is_rejected_before_any_process_starts(tmp_path):
    with pytest.raises(ValueError, match="SMALL"):
        run_compare(TrainConfig(**TINY), ["batch:64,32"], seeds=1, workers=2, out=tmp_path)
