"""`accordion train --checkpoint-dir` with a DiLoCo strategy: each rank saves its own
replica (model, inner optimiser, rounds), and a resumed run ends bitwise equal to a
straight one, also when it resumes inside the warm-up and between two syncs."""

from __future__ import annotations

import pytest
import torch

from accordion.cli import main

# 5 optimizer steps per epoch, syncs every 3: epoch ends fall between syncs, and the
# first epoch ends inside the 7-step data-parallel warm-up
STRATEGY = "diloco:3:warmup=7:warmup-with=int/4+static:int:4"
# streamed: a fragment lands every 2 steps after the warm-up, started 1 step before, so
# the second epoch (step 10) ends with a fragment in flight
STREAMED = "diloco:4:warmup=7:fragments=2:delay=1:mix=0.5+static:int:4"


def _train(workers: int = 2, strategy: str = STRATEGY) -> list[str]:
    return ["train", "--task", "synthetic", "--synthetic-shape", "40", "--train-samples", "160",
            "--test-samples", "32", "--batch-size", "32", "--threads", "1", "--no-progress",
            "--workers", str(workers), "--strategy", strategy]  # fmt: skip


TINY = _train()


def _replicas(checkpoints, step: int) -> list[dict]:
    folder = checkpoints / f"step-{step:08d}"
    return [torch.load(folder / f"rank-{r}.pt", weights_only=False)["extra"] for r in (0, 1)]


@pytest.mark.parametrize("strategy", [STRATEGY, STREAMED])
def test_a_resumed_diloco_run_ends_bitwise_equal_to_a_straight_one(tmp_path, strategy):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    tiny = _train(strategy=strategy)
    assert main([*tiny, "--epochs", "3", "--checkpoint-dir", str(straight)]) == 0
    assert main([*tiny, "--epochs", "2", "--checkpoint-dir", str(resumed)]) == 0
    assert main([*tiny, "--epochs", "3", "--checkpoint-dir", str(resumed)]) == 0
    ours, theirs = _replicas(resumed, 3), _replicas(straight, 3)
    assert [e["records"][-1]["test_metric"] for e in ours] == [
        e["records"][-1]["test_metric"] for e in theirs]  # fmt: skip
    for mine, straight_one in zip(ours, theirs):
        for name, tensor in mine["replica"]["model"].items():
            assert torch.equal(tensor, straight_one["replica"]["model"][name]), name
        assert mine["replica"]["diloco"]["rounds"] == straight_one["replica"]["diloco"]["rounds"]
    # between syncs the two ranks' replicas differ: each resumed from its own file
    models = [e["replica"]["model"] for e in ours]
    assert any(not torch.equal(models[0][k], models[1][k]) for k in models[0])


def test_a_diloco_checkpoint_refuses_another_number_of_workers_naming_both(tmp_path):
    checkpoints = tmp_path / "ckpt"
    assert main([*TINY, "--epochs", "1", "--checkpoint-dir", str(checkpoints)]) == 0
    with pytest.raises(Exception, match="saved by 2 workers.*got 1"):
        main([*_train(workers=1), "--epochs", "2", "--checkpoint-dir", str(checkpoints)])
