"""``accordion train`` and ``compare``: one worker trains, and usage errors come before any worker.

Every usage error must exit 2 (argparse's usage error) naming the argument, the value and what
is allowed, at once: the workers are replaced by a stub that fails the test if it is called.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import accordion.harness.compare as compare
import accordion.harness.data as hd
import accordion.harness.data.mnist1d as hd_mnist1d
import accordion.harness.launch as launch
from accordion.cli import main

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["train", "compare"]
# A tiny real run: 64 synthetic signals, two steps of 32.
TINY = [
    "--task", "synthetic", "--synthetic-shape", "40", "--train-samples", "64",
    "--test-samples", "32", "--batch-size", "32", "--epochs", "1", "--interval", "1",
    "--batch-switch-epoch", "1", "--no-progress", "--threads", "1",
]  # fmt: skip


@pytest.fixture
def no_workers(monkeypatch, tmp_path):
    """Fail the test if a worker is started; run in an empty folder (compare's default --out)."""

    def started(*args, **kwargs):
        raise AssertionError("a worker was started before the usage error")

    monkeypatch.setattr(launch, "run_distributed", started)
    monkeypatch.setattr(compare, "run_distributed", started)
    monkeypatch.chdir(tmp_path)


def usage_error(capsys, command: str, *argv: str) -> str:
    """Run ``accordion COMMAND ARGV`` in-process; assert a fast exit 2 and return stderr."""
    strategy = ["--strategy", "dense"] if command == "train" else ["--strategies", "dense"]
    if any(flag in argv for flag in ("--strategy", "--strategies")):
        strategy = []
    start = time.perf_counter()
    with pytest.raises(SystemExit) as info:
        main([command, *strategy, *argv])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert elapsed < 10, f"the usage error took {elapsed:.1f} s"
    assert f"accordion {command}: error: argument " in err
    return err


def strategy_flag(command: str) -> str:
    return "--strategy" if command == "train" else "--strategies"


# ------------------------------------------------------------------------------ one worker


def test_train_with_the_default_one_worker_trains_and_writes_its_logs(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(
        [sys.executable, "-m", "accordion", "train", *TINY, "--strategy", "dense",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "dense: test" in result.stdout and "after 1 epochs" in result.stdout
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_compare_with_one_worker_trains_every_strategy_family(tmp_path, capsys):
    strategies = [
        "dense", "static:powersgd:2", "accordion:topk:0.5,0.1", "torch-powersgd:1",
        "batch-fixed:16,32", "batch:16,32+accordion:powersgd:2,1",
        "accordion:powersgd:2,1:auto", "static:half:fp16",
    ]  # fmt: skip
    argv = ["compare", *TINY, "--workers", "1", "--no-plots", "--out", str(tmp_path)]
    assert main([*argv, "--strategies", *strategies]) == 0
    out = capsys.readouterr().out
    assert all(f"\n{text} " in out for text in strategies), out
    assert (tmp_path / "results.json").is_file()


def test_one_worker_runs_in_a_process_group_of_its_own_removed_afterwards():
    def inside(rank, world, local_rank):
        return rank, world, local_rank, dist.get_world_size()

    assert launch.run_distributed(inside, 1) == (0, 1, 0, 1)
    assert not dist.is_initialized()
    assert launch.run_distributed(inside, 1) == (0, 1, 0, 1)  # and again


def test_one_worker_removes_its_process_group_when_the_run_raises():
    def fails(rank, world, local_rank):
        raise RuntimeError("the run failed")

    with pytest.raises(RuntimeError, match="the run failed"):
        launch.run_distributed(fails, 1)
    assert not dist.is_initialized()


# ------------------------------------------------------------------------------ usage errors


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_model_is_a_usage_error_listing_the_models(no_workers, capsys, command):
    err = usage_error(capsys, command, "--model", "nosuchmodel")
    assert "argument --model:" in err and "'nosuchmodel'" in err
    assert "'resnet18'" in err and "'mnist1d-cnn'" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_model_that_does_not_read_the_tasks_inputs_is_a_usage_error(no_workers, capsys, command):
    err = usage_error(capsys, command, "--task", "mnist1d", "--model", "resnet18")
    assert "argument --model:" in err and "'resnet18' reads images" in err
    assert "models for signals: mnist1d-cnn" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_statistic_is_a_usage_error_listing_rank0_and_mean(no_workers, capsys, command):
    err = usage_error(capsys, command, "--statistic", "median")
    assert "argument --statistic:" in err and "('rank0', 'mean', 'sharded'), got 'median'" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_task_is_a_usage_error_listing_the_tasks(no_workers, capsys, command):
    err = usage_error(capsys, command, "--task", "imagenet")
    assert "argument --task:" in err and "got 'imagenet'" in err
    assert all(task in err for task in hd.TASKS)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_batch_that_the_workers_cannot_share_is_a_usage_error(no_workers, capsys, command):
    err = usage_error(capsys, command, "--batch-size", "3", "--workers", "2")
    assert "argument --batch-size:" in err
    assert "batch_size (3) must be a multiple of the number of workers (2)" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_batch_strategy_size_that_the_workers_cannot_share_is_a_usage_error(
    no_workers, capsys, command
):
    err = usage_error(
        capsys, command, strategy_flag(command), "batch-fixed:32,63", "--workers", "2"
    )
    assert f"argument {strategy_flag(command)}:" in err and "'batch-fixed:32,63'" in err
    assert "(63) must be a multiple of the number of workers (2)" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_large_batch_not_a_multiple_of_the_small_is_a_usage_error(no_workers, capsys, command):
    err = usage_error(capsys, command, strategy_flag(command), "batch:30,64", "--workers", "2")
    assert f"argument {strategy_flag(command)}:" in err
    assert "LARGE (64) must be a multiple of SMALL (30)" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_batch_larger_than_the_training_set_is_a_usage_error(no_workers, capsys, command):
    err = usage_error(capsys, command, "--train-samples", "100", "--batch-size", "128")
    assert "argument --batch-size:" in err
    assert "batch_size (128) must be at most the 100 training samples" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_more_samples_than_the_dataset_has_is_a_usage_error(no_workers, capsys, command):
    err = usage_error(capsys, command, "--task", "mnist1d", "--train-samples", "20000")
    assert "argument --train-samples:" in err
    assert "train_samples=20000 exceeds the 16000 samples available in mnist1d" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_an_out_path_under_a_file_is_a_usage_error(no_workers, capsys, tmp_path, command):
    (tmp_path / "a-file").write_text("")
    err = usage_error(capsys, command, "--out", str(tmp_path / "a-file" / "logs"))
    assert "argument --out: cannot write" in err and "a-file" in err
    assert "Not a directory" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in read-only folders")
@pytest.mark.parametrize("command", COMMANDS)
def test_a_read_only_out_folder_is_a_usage_error(no_workers, capsys, tmp_path, command):
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    err = usage_error(capsys, command, "--out", str(folder))
    assert "argument --out: cannot write" in err and "Permission denied" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_file_task_without_data_dir_is_a_usage_error(no_workers, capsys, command):
    err = usage_error(capsys, command, "--task", "cifar10")
    assert "argument --data-dir:" in err and "required by task 'cifar10'" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_data_dir_without_the_tasks_files_is_a_usage_error_listing_the_paths(
    no_workers, capsys, tmp_path, command
):
    err = usage_error(capsys, command, "--task", "cifar10", "--data-dir", str(tmp_path))
    assert "argument --data-dir: cifar10 files not found" in err
    assert str(tmp_path / "cifar-10-batches-py" / "data_batch_1") in err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_data_dir_for_the_synthetic_task_is_a_usage_error(no_workers, capsys, tmp_path, command):
    err = usage_error(capsys, command, "--task", "synthetic", "--data-dir", str(tmp_path))
    assert "argument --data-dir:" in err and "has no use for task 'synthetic'" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unwritable_mnist1d_cache_folder_is_a_usage_error(no_workers, capsys, tmp_path, command):
    (tmp_path / "a-file").write_text("")
    err = usage_error(capsys, command, "--data-dir", str(tmp_path / "a-file"))
    assert "argument --data-dir: cannot write the MNIST-1D cache" in err


# ------------------------------------------------------------------------------ --data-dir, mnist1d


def test_mnist1d_data_dir_is_where_the_generated_dataset_is_cached(monkeypatch, tmp_path):
    import mnist1d.data

    # 300 samples behind an empty in-process cache of their own, and no ACCORDION_CACHE
    monkeypatch.setattr(hd_mnist1d, "_MNIST1D_NUM_SAMPLES", 300)
    fresh = functools.lru_cache(hd_mnist1d._mnist1d_arrays.__wrapped__)
    monkeypatch.setattr(hd_mnist1d, "_mnist1d_arrays", fresh)
    monkeypatch.delenv("ACCORDION_CACHE", raising=False)
    folder = tmp_path / "cache"
    generated = hd.load_task("mnist1d", folder, train_samples=240, test_samples=60)
    assert [p.name for p in folder.iterdir()] == ["mnist1d_n300.npz"]
    assert hd.mnist1d_cache_file(folder) == folder / "mnist1d_n300.npz"
    hd_mnist1d._mnist1d_arrays.cache_clear()
    monkeypatch.setattr(mnist1d.data, "make_dataset", lambda *a, **k: 1 / 0)
    cached = hd.load_task("mnist1d", folder, train_samples=240, test_samples=60)
    assert (generated.x_train == cached.x_train).all() and (generated.y_test == cached.y_test).all()


@pytest.mark.parametrize("command", COMMANDS)
def test_the_help_says_what_data_dir_does_for_each_task(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "mnist1d: directory the generated dataset is cached in" in text
    assert "synthetic: not allowed" in text


@pytest.mark.parametrize("seeds,error", [(0, ValueError), (True, TypeError), (2.0, TypeError)])
def test_compare_refuses_a_bad_seed_count_naming_it_before_any_run(tmp_path, seeds, error):
    base = compare.TrainConfig(task="synthetic", epochs=1)
    with pytest.raises(error, match="seeds must be an int >= 1"):
        compare.run_compare(base, ["dense"], seeds, 1, tmp_path)
    assert not any(tmp_path.iterdir())  # nothing ran


@pytest.mark.parametrize("workers,error", [(0, ValueError), (True, TypeError), ("2", TypeError)])
def test_run_distributed_refuses_a_bad_worker_count_naming_it(workers, error):
    with pytest.raises(error, match="workers must be an int >= 1"):
        launch.run_distributed(print, workers)
