"""`accordion train --checkpoint-dir` with Adam's noise correction (``adam-noise``): the
correction's averages, the quantiser's residual variances and the noise history are in
the checkpoint set, so a resumed run ends bitwise equal to a straight one."""

from __future__ import annotations

import pytest
import torch

from accordion.cli import main

PER_STEP = "static:nq:2:adam-noise"
# 5 steps per epoch: the first epoch ends inside the 7-step corrected warm-up
WARMUP = "diloco:3:warmup=7:warmup-with=nq/2:adam-noise+static:int:4"


def _train(strategy: str) -> list[str]:
    return ["train", "--task", "synthetic", "--synthetic-shape", "40", "--train-samples", "160",
            "--test-samples", "32", "--batch-size", "32", "--threads", "1", "--no-progress",
            "--optimizer", "adamw", "--lr", "0.003", "--workers", "2",
            "--strategy", strategy]  # fmt: skip


def _rank0(checkpoints, step: int) -> dict:
    return torch.load(checkpoints / f"step-{step:08d}" / "rank-0.pt", weights_only=False)


def _model(saved: dict) -> dict[str, torch.Tensor]:
    replica = saved["extra"].get("replica")
    return replica["model"] if replica is not None else saved["model"]


@pytest.mark.parametrize("strategy", [PER_STEP, WARMUP])
def test_a_resumed_adam_noise_run_ends_bitwise_equal_to_a_straight_one(tmp_path, strategy):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    tiny = _train(strategy)
    assert main([*tiny, "--epochs", "3", "--checkpoint-dir", str(straight)]) == 0
    assert main([*tiny, "--epochs", "1", "--checkpoint-dir", str(resumed)]) == 0
    assert main([*tiny, "--epochs", "3", "--checkpoint-dir", str(resumed)]) == 0
    ours, theirs = _rank0(resumed, 3), _rank0(straight, 3)
    assert ours["extra"]["adam_noise"]["corrected_steps"] == (
        theirs["extra"]["adam_noise"]["corrected_steps"]) > 0  # fmt: skip
    for name, tensor in _model(ours).items():
        assert torch.equal(tensor, _model(theirs)[name]), name
    assert [e["test_metric"] for e in ours["extra"]["records"]] == [
        e["test_metric"] for e in theirs["extra"]["records"]]  # fmt: skip
