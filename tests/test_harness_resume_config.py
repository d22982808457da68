"""A checkpoint set belongs to one run: which settings may differ when a run resumes."""

from __future__ import annotations

import dataclasses

import pytest

from accordion.harness.config import TrainConfig
from accordion.harness.resume import check_same_run


def test_a_checkpoint_older_than_a_setting_resumes_when_the_setting_keeps_its_default():
    saved = TrainConfig().to_dict()
    for added in ("optimizer", "betas", "interval_unit"):  # settings newer than format 1
        del saved[added]
    check_same_run(TrainConfig(), saved, "ckpt")


def test_a_checkpoint_older_than_a_setting_is_refused_when_the_run_changes_it():
    saved = TrainConfig().to_dict()
    del saved["optimizer"]
    with pytest.raises(ValueError, match=r"another run \(optimizer: 'sgd' -> 'adamw'\)"):
        check_same_run(dataclasses.replace(TrainConfig(), optimizer="adamw"), saved, "ckpt")
