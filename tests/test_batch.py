"""Specification of accordion.batch: Accordion's batch-size lever (Agarwal et al. 2021).

Scripted statistics are worked out by hand: a gradient made of tensors filled with the
constant ``c`` and 4 entries in all has norm ``2 c``; r = |old - new| / old, critical iff
r >= eta (0.5).
"""

from __future__ import annotations

import copy
import io
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from accordion.batch import BatchSizeController, BatchSizes, accumulation_loss_scale
from accordion.policy import Ladder
from numerics import assert_equal_up_to_rounding

SMALL, LARGE = 8, 64


def grads_of(c: float) -> list[torch.Tensor]:
    """A model's gradient of norm 2c: 4 entries equal to c, in two tensors."""
    return [torch.full((3,), c), torch.full((1,), c)]


def adaptive(**kwargs) -> BatchSizeController:
    kwargs.setdefault("interval", 2)
    return BatchSizeController(SMALL, LARGE, micro_batch=2, world_size=2, **kwargs)


def run_epoch(ctrl, epoch, c=1.0, steps=4, lr_will_decay=False) -> int:
    for _ in range(steps):
        ctrl.observe(grads_of(c))
        ctrl.step()
    return ctrl.end_epoch(epoch, lr_will_decay=lr_will_decay)


def last_statistic(ctrl) -> float:
    return ctrl.checks[-1]["layers"]["model"]["new_norm"]


# --------------------------------------------------------------------- gradient accumulation


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


def test_accumulated_micro_batches_match_one_step_on_the_concatenated_batch():
    torch.manual_seed(0)
    ctrl = BatchSizeController(16, 64, micro_batch=4, world_size=1)
    assert ctrl.accumulation_steps == 4
    scale = accumulation_loss_scale(ctrl.accumulation_steps)
    big = _mlp()
    accumulated = copy.deepcopy(big)
    loss_fn = nn.MSELoss()  # mean-reduced
    opts = [
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        for m in (big, accumulated)
    ]
    # two steps, so that the momentum buffer built on the first acts on the second
    for _ in range(2):
        x, y = torch.randn(16, 5), torch.randn(16, 3)
        for opt in opts:
            opt.zero_grad()
        loss_fn(big(x), y).backward()
        for xm, ym in zip(x.split(4), y.split(4)):
            (loss_fn(accumulated(xm), ym) * scale).backward()
        for p, q in zip(big.parameters(), accumulated.parameters()):
            torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=0)
        for opt in opts:
            opt.step()
    for p, q in zip(big.parameters(), accumulated.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=0)


def test_accumulation_loss_scale_is_one_over_the_steps():
    assert accumulation_loss_scale(8) == 1 / 8
    with pytest.raises(ValueError, match="accumulation_steps"):
        accumulation_loss_scale(0)


def test_accumulation_steps_follow_the_batch_in_force():
    ctrl = BatchSizeController(
        512, 4096, micro_batch=128, world_size=4, mode="fixed", fixed_switch_epoch=1
    )
    assert (ctrl.batch_size, ctrl.accumulation_steps) == (512, 1)
    ctrl.end_epoch(0)
    assert (ctrl.batch_size, ctrl.accumulation_steps) == (4096, 8)


# ----------------------------------------------------------------------- adaptive decisions


def test_training_starts_small_and_epoch_zero_keeps_it_small():
    ctrl = adaptive()
    assert ctrl.batch_size == SMALL
    assert run_epoch(ctrl, 0, c=1.0) == SMALL
    assert ctrl.history == [{"epoch": 0, "batch_size": SMALL}]


def test_calm_check_switches_to_the_large_batch():
    ctrl = adaptive()
    run_epoch(ctrl, 0, c=1.0)  # statistic 2.0
    assert run_epoch(ctrl, 1, c=9.0) == SMALL  # not a check: ignored
    # |2.0 - 2.4| / 2.0 = 0.2 < 0.5
    assert run_epoch(ctrl, 2, c=1.2) == LARGE
    assert last_statistic(ctrl) == pytest.approx(2.4)
    assert run_epoch(ctrl, 3, c=1.2, steps=1) == LARGE


def test_sharp_change_switches_back_to_the_small_batch():
    ctrl = adaptive()
    run_epoch(ctrl, 0, c=1.0)
    run_epoch(ctrl, 1)
    run_epoch(ctrl, 2, c=1.2)  # statistic 2.4 -> large
    run_epoch(ctrl, 3, steps=1)
    # |2.4 - 0.8| / 2.4 = 0.67 >= 0.5
    assert run_epoch(ctrl, 4, c=0.4, steps=1) == SMALL
    assert ctrl.checks[-1]["layers"]["model"]["critical"] is True


def test_lr_decay_forces_the_small_batch_until_the_next_check():
    ctrl = adaptive()
    run_epoch(ctrl, 0, c=1.0)
    run_epoch(ctrl, 1)
    assert run_epoch(ctrl, 2, c=1.0) == LARGE  # r = 0
    assert run_epoch(ctrl, 3, steps=1, lr_will_decay=True) == SMALL
    # the next check compares 2.0 with 2.0 again: calm, back to large
    assert run_epoch(ctrl, 4, c=1.0) == LARGE


def test_statistic_is_the_norm_of_the_mean_per_step_gradient():
    # the same mean gradient over 8 small-batch steps and 1 large-batch step
    many, one = adaptive(), adaptive()
    run_epoch(many, 0, c=0.75, steps=8)
    run_epoch(one, 0, c=0.75, steps=1)
    assert last_statistic(many) == pytest.approx(1.5)
    assert last_statistic(one) == pytest.approx(1.5)
    # steps of different gradients average: (1 + 3) / 2 = 2 per entry -> norm 4
    mixed = adaptive()
    mixed.observe(grads_of(1.0))
    mixed.observe(grads_of(3.0))
    assert mixed.statistic() == pytest.approx(4.0)


def test_observe_accumulates_only_in_check_epochs():
    ctrl = adaptive()
    ctrl.observe(grads_of(1.0))
    assert ctrl.observed_steps == 1
    ctrl.end_epoch(0)
    ctrl.observe(grads_of(1.0))  # epoch 1, interval 2: nothing to gather
    assert ctrl.observed_steps == 0 and ctrl.statistic() is None


def test_check_epoch_without_observed_steps_raises():
    ctrl = adaptive()
    with pytest.raises(ValueError, match="no optimizer step was observed"):
        ctrl.end_epoch(0)


def test_epochs_must_increase():
    ctrl = adaptive()
    run_epoch(ctrl, 0)
    with pytest.raises(ValueError, match="increasing order"):
        ctrl.end_epoch(0)


def test_observe_rejects_a_change_of_tensor_shapes_within_an_epoch():
    ctrl = adaptive()
    ctrl.observe(grads_of(1.0))
    with pytest.raises(ValueError, match="same tensors"):
        ctrl.observe([torch.ones(4)])
    with pytest.raises(TypeError, match="grads"):
        ctrl.observe(torch.ones(4))


# ------------------------------------------------------------------------------ fixed mode


def test_fixed_mode_switches_at_the_switch_epoch_whatever_the_statistic_and_decays():
    ctrl = adaptive(mode="fixed", fixed_switch_epoch=3)
    ctrl.observe(grads_of(1.0))
    assert ctrl.observed_steps == 0  # no statistic in fixed mode
    decided = [ctrl.end_epoch(e, lr_will_decay=(e == 3)) for e in range(5)]
    # the batch for epoch e + 1 is large iff e + 1 >= 3
    assert decided == [SMALL, SMALL, LARGE, LARGE, LARGE]
    assert ctrl.checks == []


def test_fixed_mode_with_switch_epoch_zero_starts_large():
    ctrl = adaptive(mode="fixed", fixed_switch_epoch=0)
    assert ctrl.batch_size == LARGE


# --------------------------------------------------------------------------- learning rate


def test_lr_factor_scales_linearly_with_the_batch():
    ctrl = adaptive(mode="fixed", fixed_switch_epoch=1)
    assert ctrl.lr_factor() == 1.0
    ctrl.end_epoch(0)
    assert ctrl.lr_factor() == LARGE / SMALL


def test_lr_factor_scales_with_the_square_root_of_the_batch():
    ctrl = adaptive(mode="fixed", fixed_switch_epoch=1, lr_scaling="sqrt")
    ctrl.end_epoch(0)
    assert ctrl.lr_factor() == pytest.approx(math.sqrt(LARGE / SMALL))


def test_lr_factor_warms_up_linearly_after_a_switch_to_the_large_batch():
    ctrl = adaptive(mode="fixed", fixed_switch_epoch=1, warmup_steps=10)
    ctrl.end_epoch(0)
    assert ctrl.lr_factor(0) == 1.0
    assert ctrl.lr_factor(5) == pytest.approx(4.5)  # halfway from 1 to 8
    assert ctrl.lr_factor(10) == 8.0
    assert ctrl.lr_factor(25) == 8.0
    for _ in range(5):
        ctrl.step()
    assert ctrl.lr_factor() == pytest.approx(4.5)


def test_lr_factor_drops_at_once_after_a_switch_to_the_small_batch():
    ctrl = adaptive(warmup_steps=10)
    run_epoch(ctrl, 0, c=1.0)
    run_epoch(ctrl, 1)
    run_epoch(ctrl, 2, c=1.0)  # -> large, warm-up starts
    for _ in range(20):
        ctrl.step()
    assert ctrl.lr_factor() == 8.0
    assert ctrl.end_epoch(3, lr_will_decay=True) == SMALL
    assert ctrl.steps_since_switch == 0
    assert ctrl.lr_factor() == 1.0


# ------------------------------------------------------------------------------ accounting


def test_floats_per_epoch_count_one_all_reduce_per_optimizer_step():
    ctrl = BatchSizeController(
        512, 4096, micro_batch=128, world_size=4, mode="fixed", fixed_switch_epoch=1
    )
    # 50,000 samples: 97 steps of 512 (tail dropped), 12 steps of 4096
    assert ctrl.floats_per_epoch(1000, 50_000) == 97_000
    ctrl.end_epoch(0)
    assert ctrl.floats_per_epoch(1000, 50_000) == 12_000


# --------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"small": 8, "large": 8}, ValueError, "small must be < large"),
        ({"small": 64, "large": 8}, ValueError, "small must be < large"),
        ({"small": 8, "large": 66}, ValueError, r"large must be a multiple.*2 \* 2 = 4"),
        ({"small": 6, "large": 64}, ValueError, "small must be a multiple"),
        ({"small": 8.0, "large": 64}, TypeError, "small must be an int"),
        ({"small": True, "large": 64}, TypeError, "small must be an int"),
        ({"small": 8, "large": "64"}, TypeError, "large must be an int"),
        ({"small": 0, "large": 64}, ValueError, "small must be an int >= 1"),
        ({"micro_batch": 0}, ValueError, "micro_batch must be an int >= 1"),
        ({"world_size": 0}, ValueError, "world_size must be an int >= 1"),
        ({"mode": "auto"}, ValueError, r"mode must be one of \('adaptive', 'fixed'\)"),
        ({"lr_scaling": "cubic"}, ValueError, r"lr_scaling must be one of \('linear', 'sqrt'\)"),
        ({"warmup_steps": -1}, ValueError, "warmup_steps must be an int >= 0"),
        ({"fixed_switch_epoch": -1}, ValueError, "fixed_switch_epoch must be an int >= 0"),
        ({"interval": 0}, ValueError, "interval"),
        ({"eta": 0.0}, ValueError, "eta"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
    args = {"small": 8, "large": 64, "micro_batch": 2, "world_size": 2, **kwargs}
    with pytest.raises(error, match=match):
        BatchSizeController(**args)


# ---------------------------------------------------------------------------- checkpoints


def _roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_dict_round_trip_continues_identically():
    original = adaptive(warmup_steps=10)
    run_epoch(original, 0, c=1.0)
    run_epoch(original, 1)
    run_epoch(original, 2, c=1.0)  # -> large, warm-up under way
    for _ in range(3):
        original.step()
    original.end_epoch(3)
    original.observe(grads_of(0.5))  # epoch 4 half done: a partial statistic
    original.step()
    resumed = adaptive(warmup_steps=10)
    resumed.load_state_dict(_roundtrip(original.state_dict()))
    assert resumed.lr_factor() == original.lr_factor() == pytest.approx(1 + 7 * 4 / 10)
    for ctrl in (original, resumed):
        # mean entry (0.5 + 1.1) / 2 = 0.8 -> statistic 1.6; |2.0 - 1.6| / 2.0 = 0.2 < 0.5
        assert run_epoch(ctrl, 4, c=1.1, steps=1) == LARGE
        assert run_epoch(ctrl, 5, steps=2) == LARGE
        # statistic 0.2: |1.6 - 0.2| / 1.6 = 0.875 >= 0.5
        assert run_epoch(ctrl, 6, c=0.1, steps=2) == SMALL
    assert resumed.history == original.history
    assert resumed.checks == original.checks
    assert resumed.lr_factor() == original.lr_factor()


def test_load_state_dict_with_a_different_config_raises_naming_the_field():
    state = _roundtrip(adaptive().state_dict())
    other = BatchSizeController(SMALL, 2 * LARGE, micro_batch=2, world_size=2, interval=2)
    with pytest.raises(ValueError, match="large"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="warmup_steps"):
        adaptive(warmup_steps=5).load_state_dict(state)


def test_check_resumable_refuses_the_middle_of_an_accumulation_window():
    ctrl = adaptive()  # 8 samples / (2 * 2) = 2 micro-batches per step
    assert ctrl.accumulation_steps == 2
    with pytest.raises(ValueError, match="middle of an accumulation window"):
        ctrl.check_resumable(3)


def test_check_resumable_accepts_an_optimizer_step_boundary():
    assert adaptive().check_resumable(6) == 3


# ------------------------------------------------------------------- the policy underneath


def test_the_batch_sizes_are_a_ladder_of_two_rungs_small_first():
    ctrl = adaptive()
    ladder = Ladder(BatchSizes, (ctrl.small, ctrl.large))
    assert (ladder.mildest, ladder.most_aggressive, ladder.top) == (SMALL, LARGE, 1)
    assert [BatchSizes.label(level) for level in ladder.levels] == ["batch 8", "batch 64"]


def test_a_decay_at_a_check_epoch_overrides_that_check():
    ctrl = adaptive()
    run_epoch(ctrl, 0, c=1.0)
    run_epoch(ctrl, 1)
    # r = 0 would be calm, but the learning rate decays: small until the next check
    assert run_epoch(ctrl, 2, c=1.0, lr_will_decay=True) == SMALL
    assert ctrl.checks[-1]["lr_will_decay"] is True
    assert run_epoch(ctrl, 3) == SMALL
    assert run_epoch(ctrl, 4, c=1.0) == LARGE


def test_a_skipped_check_epoch_compares_with_the_last_check_that_ran():
    ctrl = adaptive()
    run_epoch(ctrl, 0, c=1.0)  # statistic 2.0
    run_epoch(ctrl, 1)
    # epoch 2 is never ended: epoch 4 compares with epoch 0, |2.0 - 2.4| / 2.0 = 0.2
    assert run_epoch(ctrl, 4, c=1.2) == LARGE
    assert ctrl.checks[-1]["layers"]["model"]["old_norm"] == pytest.approx(2.0)
    assert [check["epoch"] for check in ctrl.checks] == [0, 4]


def test_a_decay_before_the_first_check_keeps_the_small_batch():
    ctrl = adaptive()
    assert ctrl.end_epoch(1, lr_will_decay=True) == SMALL  # epoch 0 never ended
    assert ctrl.state_dict()["detector"]["decay_override"] is True


def test_a_gradient_that_is_not_finite_makes_the_check_refuse_and_changes_nothing():
    ctrl = adaptive()
    ctrl.observe(grads_of(1.0))
    ctrl.observe([torch.full((3,), math.inf), torch.ones(1)])
    assert math.isnan(ctrl.statistic())
    before = ctrl.state_dict()
    with pytest.raises(ValueError, match="finite"):
        ctrl.end_epoch(0)
    assert ctrl.history == [] and ctrl.current_epoch == 0
    # the poison survives a checkpoint: the resumed check refuses too
    resumed = adaptive()
    resumed.load_state_dict(_roundtrip(before))
    with pytest.raises(ValueError, match="finite"):
        resumed.end_epoch(0)


def test_load_state_dict_refuses_a_malformed_detector_entry_and_changes_nothing():
    ctrl = adaptive()
    run_epoch(ctrl, 0, c=1.0)
    state = _roundtrip(ctrl.state_dict())
    del state["detector"]["norms"]
    fresh = adaptive()
    with pytest.raises(ValueError, match=r"RegimeDetector state_dict: missing keys \['norms'\]"):
        fresh.load_state_dict(state)
    assert fresh.state_dict() == adaptive().state_dict()
    with pytest.raises(ValueError, match="state must be a Mapping"):
        fresh.load_state_dict([1, 2])


# ------------------------------------------------------------- checkpoints of earlier versions

FIXTURE = Path(__file__).parent / "data" / "batch-controller-v1.pt"


def _assert_checks_equal(actual, expected):
    """Checks equal: decisions exactly, norms and ratios up to rounding."""
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert (got["epoch"], got["lr_will_decay"]) == (want["epoch"], want["lr_will_decay"])
        for name, layer in want["layers"].items():
            mine = got["layers"][name]
            assert mine["critical"] is layer["critical"]
            for key in ("old_norm", "ratio"):
                assert (mine[key] is None) == (layer[key] is None)
            floats = [k for k in ("old_norm", "new_norm", "ratio") if layer[k] is not None]
            assert_equal_up_to_rounding(
                torch.tensor([mine[k] for k in floats], dtype=torch.float64),
                torch.tensor([layer[k] for k in floats], dtype=torch.float64),
                terms=100,  # the statistic sums a few steps of 17 entries
            )


def test_a_checkpoint_of_the_regime_detector_version_loads_and_continues_identically():
    fixture = torch.load(FIXTURE, weights_only=True)
    ctrl = BatchSizeController(**fixture["config"])
    ctrl.load_state_dict(fixture["checkpoint"])
    grads = iter(fixture["grads_after"])
    decided, lr_factors = [], []
    for epoch, (_scale, steps, decay) in enumerate(fixture["epochs"]):
        if epoch < 6:
            continue
        for _ in range(steps - (fixture["saved_after"] if epoch == 6 else 0)):
            lr_factors.append(ctrl.lr_factor())
            ctrl.observe(next(grads))
            ctrl.step()
        decided.append(ctrl.end_epoch(epoch, lr_will_decay=decay))
    after = fixture["after"]
    assert decided == after["decided"] == [32, 32, 8]  # large, large, small
    assert lr_factors == after["lr_factors"] and ctrl.lr_factor() == after["lr_factor"]
    assert ctrl.history == after["history"]
    _assert_checks_equal(ctrl.checks, after["checks"])
    state, expected = ctrl.state_dict(), after["state"]
    _assert_checks_equal(state["detector"].pop("history"), expected["detector"].pop("history"))
    norms, expected_norms = state["detector"].pop("norms"), expected["detector"].pop("norms")
    assert norms.keys() == expected_norms.keys()
    assert_equal_up_to_rounding(
        torch.tensor(list(norms.values())), torch.tensor(list(expected_norms.values())), terms=100
    )
    assert state == expected


def test_a_checkpoint_of_the_regime_detector_version_saves_back_the_same_state():
    fixture = torch.load(FIXTURE, weights_only=True)
    for config, state in (
        (fixture["config"], fixture["checkpoint"]),
        (fixture["fixed"]["config"], fixture["fixed"]["state"]),
    ):
        ctrl = BatchSizeController(**config)
        ctrl.load_state_dict(state)
        resaved = ctrl.state_dict()
        saved_sums, sums = state["accumulator"], resaved["accumulator"]
        assert (saved_sums is None) == (sums is None)
        for got, want in zip(sums or [], saved_sums or []):
            assert torch.equal(got, want) and got.dtype == want.dtype  # a copy
        assert {**resaved, "accumulator": None} == {**state, "accumulator": None}


def test_the_fixed_mode_state_keeps_the_layout_of_the_regime_detector_version():
    fixed = torch.load(FIXTURE, weights_only=True)["fixed"]
    ctrl = BatchSizeController(**fixed["config"])
    ctrl.end_epoch(0)
    ctrl.end_epoch(1, lr_will_decay=True)
    assert ctrl.state_dict() == fixed["state"]
