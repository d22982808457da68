"""`accordion train --checkpoint-dir`: a run that resumes says so, and from which set."""

from __future__ import annotations

from accordion.cli import main

TINY = ["train", "--task", "synthetic", "--synthetic-shape", "40", "--train-samples", "64",
        "--test-samples", "32", "--batch-size", "32", "--threads", "1", "--no-progress",
        "--strategy", "dense"]  # fmt: skip


def test_only_a_resumed_run_prints_the_set_it_resumed_from_and_its_step(tmp_path, capsys):
    checkpoints = tmp_path / "ckpt"
    assert main([*TINY, "--epochs", "1", "--checkpoint-dir", str(checkpoints)]) == 0
    fresh = capsys.readouterr()
    assert "resumed" not in fresh.err + fresh.out
    assert main([*TINY, "--epochs", "2", "--checkpoint-dir", str(checkpoints)]) == 0
    resumed = capsys.readouterr().err
    assert f"resumed from {checkpoints / 'step-00000001'} (step 1: 1 of 2 epochs done)\n" in resumed
