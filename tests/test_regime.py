"""Specification of Accordion's critical-regime rule (Agarwal et al. 2021), per tensor and
checked every ``interval`` epochs or every window of steps, through the shims of
accordion.regime over ``accordion.policy.PaperRule`` and ``Schedule``; their state is the
layout of ``accordion.batch.state`` (a BatchSizeController's ``"detector"`` entry).

Ratios are worked out by hand in the comments: r = |old - new| / old, critical iff r >= eta.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from accordion.regime import RegimeDetector, StepRegimeDetector

# A scripted run with interval=2, eta=0.5 that passes through every branch of the rule:
# (epoch, norms, lr_will_decay, expected decision).
SCRIPT = [
    # epoch 0: nothing to compare yet, every tensor critical
    (0, {"a": 4.0, "b": 4.0, "c": 4.0, "z": 0.0}, False,
     {"a": True, "b": True, "c": True, "z": True}),
    # not a check epoch: the decision stands, norms ignored
    (1, {}, False, {"a": True, "b": True, "c": True, "z": True}),
    # a: |4-1|/4 = 0.75 >= 0.5; b: |4-3|/4 = 0.25 < 0.5; c: |4-2|/4 = 0.5 exactly;
    # z: old norm 0 -> infinite ratio; n: no old norm -> infinite ratio
    (2, {"a": 1.0, "b": 3.0, "c": 2.0, "z": 5.0, "n": 1.0}, False,
     {"a": True, "b": False, "c": True, "z": True, "n": True}),
    (3, {}, False, {"a": True, "b": False, "c": True, "z": True, "n": True}),
    # a, b, c, z unchanged (r = 0); n: |1-3|/1 = 2.0
    (4, {"a": 1.0, "b": 3.0, "c": 2.0, "z": 5.0, "n": 3.0}, False,
     {"a": False, "b": False, "c": False, "z": False, "n": True}),
    # decay at a non-check epoch: everything critical until the next check
    (5, {}, True, {"a": True, "b": True, "c": True, "z": True, "n": True}),
    # next check decides normally: every r = 0 -> not critical
    (6, {"a": 1.0, "b": 3.0, "c": 2.0, "z": 5.0, "n": 3.0}, False,
     {"a": False, "b": False, "c": False, "z": False, "n": False}),
    (7, {}, False, {"a": False, "b": False, "c": False, "z": False, "n": False}),
    # decay at a check epoch: r = 0 everywhere, but the override wins
    (8, {"a": 1.0, "b": 3.0, "c": 2.0, "z": 5.0, "n": 3.0}, True,
     {"a": True, "b": True, "c": True, "z": True, "n": True}),
    # the override holds through the non-check epoch; a new name there is critical too
    (9, {"m": 7.0}, False, {"a": True, "b": True, "c": True, "z": True, "n": True, "m": True}),
    # m was never checked: no old norm, critical; the rest r = 0
    (10, {"a": 1.0, "b": 3.0, "c": 2.0, "z": 5.0, "n": 3.0, "m": 7.0}, False,
     {"a": False, "b": False, "c": False, "z": False, "n": False, "m": True}),
    # a new name between checks is critical, the others keep their decision
    (11, {"p": 1.0}, False,
     {"a": False, "b": False, "c": False, "z": False, "n": False, "m": True, "p": True}),
]  # fmt: skip


def run(detector: RegimeDetector, script: list) -> list[dict[str, bool]]:
    """Feed a script to a detector and return its decisions."""
    return [detector.end_epoch(e, norms, decay) for e, norms, decay, _ in script]


# ----------------------------------------------------------------------------- the rule


def test_scripted_run_follows_the_rule_at_every_epoch():
    detector = RegimeDetector(interval=2, eta=0.5)
    for (epoch, _, _, expected), got in zip(SCRIPT, run(detector, SCRIPT)):
        assert got == expected, f"epoch {epoch}"


def test_epoch_zero_makes_every_tensor_critical():
    detector = RegimeDetector(interval=10)
    assert detector.end_epoch(0, {"w": 3.0, "v": 0.0}) == {"w": True, "v": True}


def test_non_check_epoch_keeps_the_decision_and_ignores_norms():
    detector = RegimeDetector(interval=2, eta=0.5)
    detector.end_epoch(0, {"w": 4.0})
    assert detector.end_epoch(2, {"w": 3.0}) == {"w": False}  # 0.25 < 0.5
    # a huge change at a non-check epoch changes nothing
    assert detector.end_epoch(3, {"w": 1000.0}) == {"w": False}
    # and is not remembered: the next check still compares 3.0 with 3.0
    assert detector.end_epoch(4, {"w": 3.0}) == {"w": False}


def test_non_check_epoch_with_empty_norms_returns_the_decision_in_force():
    detector = RegimeDetector(interval=5)
    detector.end_epoch(0, {"w": 1.0, "b": 2.0})
    assert detector.end_epoch(1, {}) == {"w": True, "b": True}


def test_non_check_epoch_makes_unseen_names_critical():
    detector = RegimeDetector(interval=2, eta=0.5)
    detector.end_epoch(0, {"w": 4.0})
    detector.end_epoch(2, {"w": 4.0})  # r = 0: not critical
    assert detector.end_epoch(3, {"new": 1.0}) == {"w": False, "new": True}
    assert detector.critical == {"w": False, "new": True}


def test_ratio_above_eta_is_critical():
    detector = RegimeDetector(interval=1, eta=0.5)
    detector.end_epoch(0, {"w": 4.0})
    assert detector.end_epoch(1, {"w": 1.0}) == {"w": True}  # |4-1|/4 = 0.75


def test_ratio_below_eta_is_not_critical():
    detector = RegimeDetector(interval=1, eta=0.5)
    detector.end_epoch(0, {"w": 4.0})
    assert detector.end_epoch(1, {"w": 3.0}) == {"w": False}  # |4-3|/4 = 0.25


@pytest.mark.parametrize("new", [2.0, 6.0])  # |4-2|/4 = |4-6|/4 = 0.5, exact in binary
def test_ratio_exactly_eta_is_critical(new: float):
    detector = RegimeDetector(interval=1, eta=0.5)
    detector.end_epoch(0, {"w": 4.0})
    assert detector.end_epoch(1, {"w": new}) == {"w": True}


def test_growing_norm_counts_like_a_shrinking_one():
    detector = RegimeDetector(interval=1, eta=0.5)
    detector.end_epoch(0, {"w": 4.0})
    assert detector.end_epoch(1, {"w": 7.0}) == {"w": True}  # |4-7|/4 = 0.75


@pytest.mark.parametrize("new", [0.0, 1.0])
def test_old_norm_zero_is_critical(new: float):
    detector = RegimeDetector(interval=1, eta=0.5)
    detector.end_epoch(0, {"w": 0.0})
    assert detector.end_epoch(1, {"w": new}) == {"w": True}
    assert detector.history[-1]["layers"]["w"]["ratio"] is None


def test_name_with_no_old_norm_is_critical_at_a_check():
    detector = RegimeDetector(interval=1, eta=0.5)
    detector.end_epoch(0, {"w": 4.0})
    assert detector.end_epoch(1, {"w": 4.0, "late": 1.0}) == {"w": False, "late": True}


def test_name_missing_at_a_check_is_forgotten():
    detector = RegimeDetector(interval=1, eta=0.5)
    detector.end_epoch(0, {"w": 4.0, "gone": 4.0})
    assert detector.end_epoch(1, {"w": 4.0}) == {"w": False}
    # back again: its remembered norm was dropped, so it has no old norm
    assert detector.end_epoch(2, {"w": 4.0, "gone": 4.0}) == {"w": False, "gone": True}


def test_custom_eta_moves_the_threshold():
    detector = RegimeDetector(interval=1, eta=0.2)
    detector.end_epoch(0, {"w": 4.0})
    assert detector.end_epoch(1, {"w": 3.0}) == {"w": True}  # 0.25 >= 0.2


def test_checks_happen_only_every_interval_epochs():
    detector = RegimeDetector(interval=3, eta=0.5)
    detector.end_epoch(0, {"w": 4.0})
    assert detector.end_epoch(1, {"w": 4.0}) == {"w": True}
    assert detector.end_epoch(2, {"w": 4.0}) == {"w": True}
    assert detector.end_epoch(3, {"w": 4.0}) == {"w": False}  # r = 0 at the check
    assert [record["epoch"] for record in detector.history] == [0, 3]


def test_skipped_check_epoch_compares_with_the_last_check_that_ran():
    detector = RegimeDetector(interval=10, eta=0.5)
    detector.end_epoch(0, {"w": 4.0})
    detector.end_epoch(5, {})
    detector.end_epoch(15, {})  # epoch 10 never reported: not checked
    assert detector.end_epoch(20, {"w": 3.0}) == {"w": False}  # |4-3|/4 against epoch 0
    assert detector.history[-1]["layers"]["w"]["old_norm"] == 4.0
    assert [record["epoch"] for record in detector.history] == [0, 20]


def test_first_call_after_epoch_zero_is_a_check_with_no_old_norms():
    detector = RegimeDetector(interval=10)
    assert detector.end_epoch(10, {"w": 1.0}) == {"w": True}


# ------------------------------------------------------------- learning-rate decay override


def test_decay_makes_every_tensor_critical_until_the_next_check():
    detector = RegimeDetector(interval=4, eta=0.5)
    detector.end_epoch(0, {"w": 4.0, "v": 4.0})
    assert detector.end_epoch(4, {"w": 4.0, "v": 4.0}) == {"w": False, "v": False}
    assert detector.end_epoch(5, {}, lr_will_decay=True) == {"w": True, "v": True}
    assert detector.decay_override
    assert detector.end_epoch(6, {}) == {"w": True, "v": True}
    assert detector.end_epoch(7, {}) == {"w": True, "v": True}


def test_next_check_after_a_decay_decides_normally():
    detector = RegimeDetector(interval=4, eta=0.5)
    detector.end_epoch(0, {"w": 4.0, "v": 4.0})
    detector.end_epoch(4, {"w": 4.0, "v": 4.0})
    detector.end_epoch(5, {}, lr_will_decay=True)
    # w: |4-1|/4 = 0.75 critical; v: 0 not critical
    assert detector.end_epoch(8, {"w": 1.0, "v": 4.0}) == {"w": True, "v": False}
    assert not detector.decay_override


def test_decay_at_a_check_epoch_overrides_that_check():
    detector = RegimeDetector(interval=2, eta=0.5)
    detector.end_epoch(0, {"w": 4.0})
    assert detector.end_epoch(2, {"w": 4.0}, lr_will_decay=True) == {"w": True}  # r = 0
    assert detector.end_epoch(3, {}) == {"w": True}
    # the norms of the decay epoch were still remembered: |4-4|/4 = 0
    assert detector.end_epoch(4, {"w": 4.0}) == {"w": False}


def test_decay_at_a_check_epoch_still_writes_history():
    detector = RegimeDetector(interval=2, eta=0.5)
    detector.end_epoch(0, {"w": 4.0})
    detector.end_epoch(2, {"w": 3.0}, lr_will_decay=True)
    assert detector.history[-1] == {
        "epoch": 2,
        "lr_will_decay": True,
        "layers": {"w": {"old_norm": 4.0, "new_norm": 3.0, "ratio": 0.25, "critical": True}},
    }


# ------------------------------------------------------------------------------- history


def test_history_records_old_norm_new_norm_ratio_and_decision():
    detector = RegimeDetector(interval=2, eta=0.5)
    detector.end_epoch(0, {"w": 4.0, "z": 0.0})
    detector.end_epoch(1, {"w": 99.0})  # not a check: no record
    detector.end_epoch(2, {"w": 1.0, "z": 2.0, "n": 5.0})
    assert detector.history == [
        {
            "epoch": 0,
            "lr_will_decay": False,
            "layers": {
                "w": {"old_norm": None, "new_norm": 4.0, "ratio": None, "critical": True},
                "z": {"old_norm": None, "new_norm": 0.0, "ratio": None, "critical": True},
            },
        },
        {
            "epoch": 2,
            "lr_will_decay": False,
            "layers": {
                "w": {"old_norm": 4.0, "new_norm": 1.0, "ratio": 0.75, "critical": True},
                "z": {"old_norm": 0.0, "new_norm": 2.0, "ratio": None, "critical": True},
                "n": {"old_norm": None, "new_norm": 5.0, "ratio": None, "critical": True},
            },
        },
    ]


def test_history_is_json_serialisable():
    detector = RegimeDetector(interval=2, eta=0.5)
    run(detector, SCRIPT)
    assert json.loads(json.dumps(detector.history, allow_nan=False)) == detector.history


def test_history_has_one_record_per_check_epoch():
    detector = RegimeDetector(interval=2, eta=0.5)
    run(detector, SCRIPT)
    assert [record["epoch"] for record in detector.history] == [0, 2, 4, 6, 8, 10]


# ------------------------------------------------------------------------ inputs and API


def test_needs_statistic_is_true_only_at_check_epochs():
    detector = RegimeDetector(interval=3)
    assert [detector.needs_statistic(e) for e in range(7)] == [
        True, False, False, True, False, False, True
    ]  # fmt: skip


def test_norms_may_be_numpy_scalars_or_zero_dim_tensors():
    detector = RegimeDetector(interval=1, eta=0.5)
    detector.end_epoch(0, {"w": np.float32(4.0), "v": torch.tensor(4.0), "i": 4})
    got = detector.end_epoch(1, {"w": np.float64(1.0), "v": torch.tensor(3.0), "i": np.array(4)})
    assert got == {"w": True, "v": False, "i": False}
    assert all(
        type(layer["new_norm"]) is float for layer in detector.history[-1]["layers"].values()
    )


def test_critical_property_is_a_copy_of_the_decision_in_force():
    detector = RegimeDetector(interval=2)
    assert detector.critical == {}
    detector.end_epoch(0, {"w": 1.0})
    detector.critical["w"] = False
    assert detector.critical == {"w": True}


def test_end_epoch_returns_a_fresh_dict():
    detector = RegimeDetector(interval=2)
    result = detector.end_epoch(0, {"w": 1.0})
    result["w"] = False
    assert detector.end_epoch(1, {}) == {"w": True}


def test_earlier_epoch_raises():
    detector = RegimeDetector(interval=2)
    detector.end_epoch(3, {})
    with pytest.raises(ValueError, match=r"epoch must be greater than the last epoch given \(3\)"):
        detector.end_epoch(2, {"w": 1.0})


def test_repeated_epoch_raises():
    detector = RegimeDetector(interval=2)
    detector.end_epoch(0, {"w": 1.0})
    with pytest.raises(ValueError, match="increasing order, got 0"):
        detector.end_epoch(0, {"w": 1.0})


def test_empty_norms_at_a_check_epoch_raises():
    detector = RegimeDetector(interval=2)
    detector.end_epoch(0, {"w": 1.0})
    with pytest.raises(ValueError, match="at least one tensor at a check epoch.*epoch 2"):
        detector.end_epoch(2, {})


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"interval": 0}, ValueError, "interval must be an int >= 1, got 0"),
        ({"interval": -3}, ValueError, "interval must be an int >= 1, got -3"),
        ({"interval": 2.0}, TypeError, "interval must be an int >= 1, got 2.0"),
        ({"interval": True}, TypeError, "interval must be an int >= 1, got True"),
        ({"interval": "10"}, TypeError, "interval must be an int >= 1, got '10'"),
        ({"eta": 0.0}, ValueError, "eta must be a finite float > 0"),
        ({"eta": -0.5}, ValueError, "got -0.5"),
        ({"eta": math.nan}, ValueError, "got nan"),
        ({"eta": math.inf}, ValueError, "got inf"),
        ({"eta": "0.5"}, TypeError, "eta must be a finite float > 0.*got '0.5'"),
        ({"eta": True}, TypeError, "eta must be a finite float > 0.*got True"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict, error: type, fragment: str):
    with pytest.raises(error, match=fragment):
        RegimeDetector(**kwargs)


def test_properties_report_the_configuration():
    detector = RegimeDetector(interval=5, eta=0.25)
    assert (detector.interval, detector.eta, detector.last_epoch) == (5, 0.25, None)
    steps = StepRegimeDetector(interval_steps=7, eta=0.25)
    assert (steps.interval_steps, steps.eta, steps.windows) == (7, 0.25, 0)


def test_constructor_accepts_an_int_eta():
    assert RegimeDetector(eta=1).eta == 1.0


@pytest.mark.parametrize(
    ("epoch", "norms", "decay", "error", "fragment"),
    [
        (-1, {}, False, ValueError, "epoch must be an int >= 0, got -1"),
        (1.0, {}, False, TypeError, "epoch must be an int >= 0, got 1.0"),
        (True, {}, False, TypeError, "epoch must be an int >= 0, got True"),
        (0, [("w", 1.0)], False, TypeError, "norms must be a Mapping.*got list"),
        (0, {1: 1.0}, False, TypeError, "norms keys must be tensor names \\(str\\), got 1"),
        (0, {"w": -1.0}, False, ValueError, r"norms\['w'\] must be a finite float >= 0.*-1.0"),
        (0, {"w": math.nan}, False, ValueError, r"norms\['w'\] must be a finite.*got nan"),
        (0, {"w": math.inf}, False, ValueError, r"norms\['w'\] must be a finite.*got inf"),
        (0, {"w": torch.tensor(math.nan)}, False, ValueError, r"norms\['w'\].*got nan"),
        (0, {"w": "1.0"}, False, TypeError, r"norms\['w'\] must be a finite.*got '1.0'"),
        (0, {"w": True}, False, TypeError, r"norms\['w'\] must be a finite.*got True"),
        (0, {"w": None}, False, TypeError, r"norms\['w'\] must be a finite.*got None"),
        (0, {"w": torch.ones(2)}, False, TypeError, r"norms\['w'\].*or a 0-d tensor"),
        (0, {"w": torch.tensor(1 + 1j)}, False, TypeError, r"norms\['w'\] must be a finite"),
        (0, {"w": 1.0}, 1, TypeError, "lr_will_decay must be a bool, got 1"),
        (0, {"w": 1.0}, None, TypeError, "lr_will_decay must be a bool, got None"),
    ],
)
def test_end_epoch_rejects_bad_arguments(epoch, norms, decay, error: type, fragment: str):
    detector = RegimeDetector(interval=2)
    with pytest.raises(error, match=fragment):
        detector.end_epoch(epoch, norms, decay)


def test_rejected_call_leaves_the_detector_unchanged():
    detector = RegimeDetector(interval=2)
    detector.end_epoch(0, {"w": 1.0})
    before = detector.state_dict()
    with pytest.raises(ValueError):
        detector.end_epoch(2, {"w": 1.0, "v": -1.0})
    assert detector.state_dict() == before
    assert detector.end_epoch(2, {"w": 1.0}) == {"w": False}


@pytest.mark.parametrize(
    ("step", "error"), [(-1, ValueError), (0.5, TypeError), (False, TypeError)]
)
def test_needs_statistic_rejects_bad_epochs(step, error: type):
    with pytest.raises(error, match="epoch must be an int >= 0"):
        RegimeDetector().needs_statistic(step)


# ------------------------------------------------------------------------- checkpointing


def test_state_dict_round_trip_continues_identically(tmp_path):
    reference = RegimeDetector(interval=2, eta=0.5)
    expected = run(reference, SCRIPT)
    for cut in range(len(SCRIPT) + 1):
        first = RegimeDetector(interval=2, eta=0.5)
        before = run(first, SCRIPT[:cut])
        path = tmp_path / f"regime_{cut}.pt"
        torch.save(first.state_dict(), path)
        resumed = RegimeDetector(interval=2, eta=0.5)
        resumed.load_state_dict(torch.load(path, weights_only=True))
        after = run(resumed, SCRIPT[cut:])
        assert before + after == expected, f"cut at {cut}"
        assert resumed.state_dict() == reference.state_dict(), f"cut at {cut}"


def test_state_dict_holds_the_documented_keys():
    detector = RegimeDetector(interval=2, eta=0.5)
    run(detector, SCRIPT[:6])  # stops right after the decay at epoch 5
    state = detector.state_dict()
    assert state["interval"] == 2
    assert state["eta"] == 0.5
    assert state["last_epoch"] == 5
    assert state["norms"] == {"a": 1.0, "b": 3.0, "c": 2.0, "z": 5.0, "n": 3.0}
    assert state["critical"] == {"a": True, "b": True, "c": True, "z": True, "n": True}
    assert state["decay_override"] is True
    assert len(state["history"]) == 3


def test_state_dict_is_a_copy():
    detector = RegimeDetector(interval=2)
    detector.end_epoch(0, {"w": 1.0})
    state = detector.state_dict()
    state["history"][0]["layers"]["w"]["critical"] = False
    state["norms"]["w"] = 9.0
    assert detector.history[0]["layers"]["w"]["critical"] is True
    assert detector.state_dict()["norms"] == {"w": 1.0}


def test_load_state_dict_rejects_another_interval():
    state = RegimeDetector(interval=5).state_dict()
    with pytest.raises(ValueError, match=r"state\['interval'\] is 5 .* interval is 10"):
        RegimeDetector(interval=10).load_state_dict(state)


def test_load_state_dict_rejects_another_eta():
    state = RegimeDetector(eta=0.3).state_dict()
    with pytest.raises(ValueError, match=r"state\['eta'\] is 0.3 .* eta is 0.5"):
        RegimeDetector(eta=0.5).load_state_dict(state)


def test_load_state_dict_rejects_missing_and_unknown_keys():
    state = RegimeDetector().state_dict()
    del state["norms"]
    state["extra"] = 1
    with pytest.raises(ValueError, match=r"missing keys \['norms'\], unknown keys \['extra'\]"):
        RegimeDetector().load_state_dict(state)


def test_load_state_dict_rejects_a_non_mapping():
    # a checkpoint is a value: a malformed one, a non-Mapping included, is a ValueError
    with pytest.raises(ValueError, match="state must be a Mapping"):
        RegimeDetector().load_state_dict([1, 2])


def test_load_state_dict_rejects_bad_values():
    state = RegimeDetector().state_dict()
    state["critical"] = {"w": 1}
    with pytest.raises(TypeError, match=r"state\['critical'\] must be a Mapping"):
        RegimeDetector().load_state_dict(state)


def test_load_state_dict_rejects_a_history_that_is_not_a_list():
    state = RegimeDetector().state_dict()
    state["history"] = {}
    with pytest.raises(TypeError, match=r"state\['history'\] must be a list"):
        RegimeDetector().load_state_dict(state)


# ---------------------------------------------------------------------- step-based variant

# interval_steps=3, eta=0.5: (norms of the window, lr_will_decay, expected decision)
STEP_SCRIPT = [
    ({"a": 4.0, "b": 4.0}, False, {"a": True, "b": True}),  # first window: all critical
    ({"a": 1.0, "b": 3.0}, False, {"a": True, "b": False}),  # 0.75 and 0.25
    ({"a": 1.0, "b": 3.0}, True, {"a": True, "b": True}),  # r = 0, but the lr decays
    ({"a": 1.0, "b": 3.0}, False, {"a": False, "b": False}),  # decided normally again
    ({"a": 2.0, "b": 3.0}, False, {"a": True, "b": False}),  # |1-2|/1 = 1.0
]


def run_windows(detector: StepRegimeDetector, script: list) -> list[dict[str, bool]]:
    """Feed a window script to a step detector and return its decisions."""
    return [detector.end_window(norms, decay) for norms, decay, _ in script]


def test_step_variant_follows_the_rule_window_by_window():
    detector = StepRegimeDetector(interval_steps=3, eta=0.5)
    for index, ((_, _, expected), got) in enumerate(
        zip(STEP_SCRIPT, run_windows(detector, STEP_SCRIPT))
    ):
        assert got == expected, f"window {index}"
    assert detector.windows == len(STEP_SCRIPT)


def test_step_variant_history_counts_windows():
    detector = StepRegimeDetector(interval_steps=3, eta=0.5)
    run_windows(detector, STEP_SCRIPT)
    assert [record["epoch"] for record in detector.history] == [0, 1, 2, 3, 4]
    assert detector.history[1]["layers"]["a"]["ratio"] == 0.75


def test_step_variant_always_needs_the_statistic():
    detector = StepRegimeDetector(interval_steps=4)
    assert all(detector.needs_statistic(step) for step in range(10))


def test_step_variant_window_ends_on_the_last_step_of_each_window():
    detector = StepRegimeDetector(interval_steps=3)
    assert [s for s in range(10) if detector.window_ends(s)] == [2, 5, 8]


def test_step_variant_empty_window_raises():
    detector = StepRegimeDetector(interval_steps=3)
    with pytest.raises(ValueError, match="at least one tensor"):
        detector.end_window({})


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"interval_steps": 0}, ValueError, "interval_steps must be an int >= 1, got 0"),
        ({"interval_steps": 1.5}, TypeError, "interval_steps must be an int >= 1, got 1.5"),
        ({"interval_steps": 3, "eta": -1.0}, ValueError, "eta must be a finite float > 0"),
    ],
)
def test_step_variant_constructor_rejects_bad_arguments(kwargs: dict, error: type, fragment):
    with pytest.raises(error, match=fragment):
        StepRegimeDetector(**kwargs)


def test_step_variant_state_dict_round_trip_continues_identically(tmp_path):
    reference = StepRegimeDetector(interval_steps=3, eta=0.5)
    expected = run_windows(reference, STEP_SCRIPT)
    for cut in range(len(STEP_SCRIPT) + 1):
        first = StepRegimeDetector(interval_steps=3, eta=0.5)
        before = run_windows(first, STEP_SCRIPT[:cut])
        path = tmp_path / f"step_{cut}.pt"
        torch.save(first.state_dict(), path)
        resumed = StepRegimeDetector(interval_steps=3, eta=0.5)
        resumed.load_state_dict(torch.load(path, weights_only=True))
        assert resumed.windows == cut
        after = run_windows(resumed, STEP_SCRIPT[cut:])
        assert before + after == expected, f"cut at {cut}"
        assert resumed.state_dict() == reference.state_dict(), f"cut at {cut}"


def test_step_variant_load_rejects_another_interval_steps():
    state = StepRegimeDetector(interval_steps=3).state_dict()
    with pytest.raises(ValueError, match=r"state\['interval_steps'\] is 3 .* is 4"):
        StepRegimeDetector(interval_steps=4).load_state_dict(state)


def test_step_variant_load_rejects_another_eta():
    state = StepRegimeDetector(interval_steps=3, eta=0.3).state_dict()
    with pytest.raises(ValueError, match=r"state\['eta'\] is 0.3"):
        StepRegimeDetector(interval_steps=3, eta=0.5).load_state_dict(state)


def test_step_variant_load_rejects_inconsistent_window_count():
    detector = StepRegimeDetector(interval_steps=3)
    detector.end_window({"a": 1.0})
    state = detector.state_dict()
    state["windows"] = 5
    fresh = StepRegimeDetector(interval_steps=3)
    with pytest.raises(ValueError, match=r"state\['windows'\] is 5 .*last_epoch'\] is 0"):
        fresh.load_state_dict(state)
    assert fresh.windows == 0 and fresh.critical == {}
