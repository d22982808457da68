"""The learning-rate schedules of TrainConfig: step decays and cosine with warm-up."""

from __future__ import annotations

import contextlib
import io

import pytest

from accordion.cli import main
from accordion.harness import launch
from accordion.harness.train import TrainConfig

STEPS = 7  # optimizer steps per epoch of the fractional-epoch grids below


def _cosine(**settings) -> TrainConfig:
    values = {"epochs": 20, "lr": 0.4, "warmup_epochs": 5, "warmup_start_lr": 0.1,
              "schedule": "cosine", "min_lr_factor": 0.05, **settings}  # fmt: skip
    return TrainConfig(**values)


def _grid(config: TrainConfig, start: float) -> list[float]:
    """Every step's fractional epoch from ``start`` to the end of training."""
    first = round(start * STEPS)
    return [s / STEPS for s in range(first, config.epochs * STEPS)]


def test_cosine_reaches_the_peak_lr_at_the_end_of_warm_up():
    assert _cosine().lr_at(5) == pytest.approx(0.4)


def test_cosine_warms_up_linearly_as_the_step_schedule_does():
    cosine, step = _cosine(), _cosine(schedule="step")
    for epoch in (0, 1.5, 2.25, 4.9):
        assert cosine.lr_at(epoch) == step.lr_at(epoch)
    assert cosine.lr_at(0) == pytest.approx(0.1) and cosine.lr_at(2.5) == pytest.approx(0.25)


def test_cosine_ends_at_min_lr_factor_times_lr():
    config = _cosine()
    assert config.lr_at(config.epochs) == pytest.approx(0.05 * 0.4)
    last_step = config.lr_at(config.epochs - 1 / STEPS)
    assert last_step == pytest.approx(0.05 * 0.4, abs=1e-4)


def test_cosine_is_half_way_between_lr_and_the_minimum_half_way_through():
    assert _cosine(min_lr_factor=0.0).lr_at(12.5) == pytest.approx(0.2)


def test_cosine_never_rises_after_warm_up():
    config = _cosine()
    rates = [config.lr_at(e) for e in _grid(config, config.warmup_epochs)]
    assert all(later <= earlier for earlier, later in zip(rates, rates[1:]))
    assert min(rates) >= 0.05 * 0.4


def test_cosine_ignores_the_decay_epochs():
    assert _cosine(decay_epochs=(8, 12)).lr_at(13) == _cosine(decay_epochs=()).lr_at(13)


def test_cosine_without_warm_up_starts_at_lr():
    config = _cosine(warmup_epochs=0)
    assert config.lr_at(0) == pytest.approx(0.4)
    assert config.lr_at(10) == pytest.approx(0.4 * (0.05 + 0.95 * 0.5))


def test_the_step_schedule_is_the_default_and_decays_at_the_decay_epochs():
    config = TrainConfig(lr=0.4, warmup_epochs=0, decay_epochs=(3, 6), decay_factor=0.5)
    assert config.schedule == "step" and config.min_lr_factor == 0.0
    assert [config.lr_at(e) for e in (0, 2.9, 3, 5.5, 6)] == pytest.approx(
        [0.4, 0.4, 0.2, 0.2, 0.1]
    )


def test_an_unknown_schedule_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"schedule must be one of \('step', 'cosine'\)"):
        TrainConfig(schedule="linear").validate()


def test_a_schedule_that_is_not_a_string_is_a_type_error():
    with pytest.raises(TypeError, match="schedule"):
        TrainConfig(schedule=None).validate()


@pytest.mark.parametrize("factor", [-0.1, 1.5])
def test_a_min_lr_factor_outside_zero_to_one_is_a_value_error_naming_it(factor):
    with pytest.raises(ValueError, match="min_lr_factor must be >= 0 and <= 1"):
        _cosine(min_lr_factor=factor).validate()


def test_the_cli_passes_schedule_and_min_lr_factor_to_the_run(monkeypatch, capsys):
    seen = []

    def fake(fn, workers, config, **options):
        seen.append(config)
        return {"epochs": [{"test_metric": 50.0, "floats": 10, "train_time_s": 0.1}]}

    monkeypatch.setattr(launch, "run_distributed", fake)
    assert main(["train", "--schedule", "cosine", "--min-lr-factor", "0.1", "--epochs", "3"]) == 0
    assert seen[0].schedule == "cosine" and seen[0].min_lr_factor == 0.1
    assert "test 50.00" in capsys.readouterr().out


def test_the_cli_rejects_an_unknown_schedule_naming_it(capsys):
    with pytest.raises(SystemExit) as info:
        main(["compare", "--strategies", "dense", "--schedule", "linear"])
    assert info.value.code == 2
    assert "schedule must be one of ('step', 'cosine'), got 'linear'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "compare"])
def test_the_help_states_the_schedule_defaults(command):
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(buffer.getvalue().split())
    assert "--schedule" in text and "(default step)" in text
    assert "--min-lr-factor" in text and "of --lr, 0 to 1 (default 0)" in text
