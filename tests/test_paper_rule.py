"""Specification of Accordion's critical-regime rule (Agarwal et al. 2021) on the one policy
stack: :class:`accordion.policy.PaperRule` decides at the checks of a
:class:`accordion.policy.Schedule`, and the :class:`accordion.policy.Decider` holds the
decision between checks (and the learning-rate decay override), for the hook and the
batch-size controller alike.

Ratios are worked out by hand in the comments: r = |old - new| / old, critical iff r >= eta.
Critical is rung 0 (the mildest), the rest the last rung of the ladder.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from accordion.compress import PowerSGD
from accordion.policy import Decider, Ladder, Observation, PaperRule, Schedule, paper_check

LADDER = Ladder(PowerSGD, (2, 1))


class _Host:
    """A single rank's host for a Decider: the statistics are the norms given to it."""

    source = "rank 0"

    def __init__(self) -> None:
        self.norms: dict[str, float] = {}

    def agree(self, call, counter, lr, decay) -> None:
        pass

    def compressed(self) -> list[str]:
        return ["layer"]  # something has a level: the ladder is adaptive

    def applied(self) -> list[str]:
        return list(self.norms)

    def statistics(self) -> tuple[dict[str, float], dict[str, float]]:
        return dict(self.norms), {}

    def agreed_rungs(self, keys, rungs):
        return rungs

    def set_level(self, level, keys) -> None:
        pass

    def checked(self) -> None:
        pass


def drive(interval: int, eta: float, script: list, unit: str = "epoch"):
    """Feed ``script`` ((norms of the period, lr_will_decay) per epoch or step) through a
    Decider on ``Schedule(interval, unit)`` and ``PaperRule(eta)``; return the rule and
    the decision (name -> critical) after each period (``None``: a step with no check)."""
    rule, host = PaperRule(eta), _Host()
    decider = Decider(LADDER, rule, Schedule(interval, unit))
    decisions = []
    for norms, decay in script:
        host.norms = norms
        decider.observed = True  # a gradient came through: no "idle hook" warning
        decisions.append(decider.end(None, None, decay, host))
    return rule, decisions


def check(rule: PaperRule, index: int, norms: dict, decay: bool = False) -> dict[str, bool]:
    """One check of ``rule`` at epoch ``index``: name -> critical."""
    rungs = rule.decide(Observation(index, "epoch", decay, norms), LADDER)
    return {name: rung == 0 for name, rung in rungs.items()}


def decided(names: str, critical: str) -> dict[str, bool]:
    """A decision over one-letter tensor names: those in ``critical`` are critical."""
    return {name: name in critical for name in names}


#: Norms of a check at which nothing moved since the one before (r = 0 for each).
STEADY = {"a": 1.0, "b": 3.0, "c": 2.0, "z": 5.0, "n": 3.0}

# A scripted run with interval=2, eta=0.5 that passes through every branch of the rule:
# (epoch's norms, gathered at check epochs only, lr_will_decay, expected decision).
SCRIPT = [
    # epoch 0: nothing to compare yet, every tensor critical
    ({"a": 4.0, "b": 4.0, "c": 4.0, "z": 0.0}, False,
     decided("abcz", critical="abcz")),
    # not a check epoch: the decision stands
    ({}, False, decided("abcz", critical="abcz")),
    # a: |4-1|/4 = 0.75 >= 0.5; b: |4-3|/4 = 0.25 < 0.5; c: |4-2|/4 = 0.5 exactly;
    # z: old norm 0 -> infinite ratio; n: no old norm -> infinite ratio
    ({"a": 1.0, "b": 3.0, "c": 2.0, "z": 5.0, "n": 1.0}, False,
     decided("abczn", critical="aczn")),
    ({}, False, decided("abczn", critical="aczn")),
    # a, b, c, z unchanged (r = 0); n: |1-3|/1 = 2.0
    (STEADY, False, decided("abczn", critical="n")),
    # decay at a non-check epoch: everything critical until the next check
    ({}, True, decided("abczn", critical="abczn")),
    # next check decides normally: every r = 0 -> not critical
    (STEADY, False, decided("abczn", critical="")),
    ({}, False, decided("abczn", critical="")),
    # decay at a check epoch: r = 0 everywhere, but the override wins
    (STEADY, True, decided("abczn", critical="abczn")),
    # the override holds through the non-check epoch
    ({}, False, decided("abczn", critical="abczn")),
    # m was never checked: no old norm, critical; the rest r = 0
    ({**STEADY, "m": 7.0}, False, decided("abcznm", critical="m")),
    ({}, False, decided("abcznm", critical="m")),
]  # fmt: skip

#: The checks of SCRIPT: (epoch, norms, lr_will_decay, expected decision).
CHECKS = [(e, n, d, x) for e, (n, d, x) in enumerate(SCRIPT) if e % 2 == 0]


def run_checks(rule: PaperRule, checks: list) -> list[dict[str, bool]]:
    """Feed checks to a rule and return its decisions."""
    return [check(rule, epoch, norms, decay) for epoch, norms, decay, _ in checks]


# ----------------------------------------------------------------------------- the rule


def test_a_scripted_run_follows_the_rule_at_every_epoch():
    _, decisions = drive(2, 0.5, [(norms, decay) for norms, decay, _ in SCRIPT])
    for epoch, ((_, _, expected), got) in enumerate(zip(SCRIPT, decisions)):
        assert got == expected, f"epoch {epoch}"


def test_the_first_check_makes_every_tensor_critical_a_zero_norm_too():
    assert check(PaperRule(), 0, {"w": 3.0, "v": 0.0}) == {"w": True, "v": True}


def test_the_decision_of_a_check_stands_until_the_next_check():
    script = [({"w": 4.0}, False), ({}, False), ({"w": 3.0}, False), ({}, False)]
    _, decisions = drive(2, 0.5, script)
    assert decisions == [{"w": True}, {"w": True}, {"w": False}, {"w": False}]  # 0.25 < 0.5


def test_a_ratio_above_eta_is_critical():
    assert paper_check({"w": 1.0}, {"w": 4.0}, 0.5, False)[0] == {"w": True}  # 0.75


def test_a_ratio_below_eta_is_not_critical():
    assert paper_check({"w": 3.0}, {"w": 4.0}, 0.5, False)[0] == {"w": False}  # 0.25


@pytest.mark.parametrize("new", [2.0, 6.0])  # |4-2|/4 = |4-6|/4 = 0.5, exact in binary
def test_a_ratio_of_exactly_eta_is_critical(new: float):
    decision, layers = paper_check({"w": new}, {"w": 4.0}, 0.5, False)
    assert decision == {"w": True}
    assert layers["w"]["ratio"] == 0.5


def test_a_growing_norm_counts_like_a_shrinking_one():
    decision, layers = paper_check({"w": 7.0}, {"w": 4.0}, 0.5, False)  # |4-7|/4 = 0.75
    assert decision == {"w": True}
    assert layers["w"]["ratio"] == 0.75


@pytest.mark.parametrize("new", [0.0, 1.0])
def test_an_old_norm_of_zero_is_critical(new: float):
    rule = PaperRule(0.5)
    check(rule, 0, {"w": 0.0})
    assert check(rule, 1, {"w": new}) == {"w": True}
    assert rule.history[-1]["layers"]["w"]["ratio"] is None


def test_a_name_with_no_old_norm_is_critical_at_a_check():
    rule = PaperRule(0.5)
    check(rule, 0, {"w": 4.0})
    assert check(rule, 1, {"w": 4.0, "late": 1.0}) == {"w": False, "late": True}


def test_a_name_missing_at_a_check_is_forgotten():
    rule = PaperRule(0.5)
    check(rule, 0, {"w": 4.0, "gone": 4.0})
    assert check(rule, 1, {"w": 4.0}) == {"w": False}
    assert rule.norms == {"w": 4.0}
    # back again: its remembered norm was dropped, so it has no old norm
    assert check(rule, 2, {"w": 4.0, "gone": 4.0}) == {"w": False, "gone": True}


def test_a_custom_eta_moves_the_threshold():
    rule = PaperRule(eta=0.2)
    check(rule, 0, {"w": 4.0})
    assert check(rule, 1, {"w": 3.0}) == {"w": True}  # 0.25 >= 0.2


def test_checks_happen_only_every_interval_epochs():
    script = [({"w": 4.0}, False), ({}, False), ({}, False), ({"w": 4.0}, False)]
    rule, decisions = drive(3, 0.5, script)
    assert decisions == [{"w": True}, {"w": True}, {"w": True}, {"w": False}]  # r = 0 at 3
    assert [record["epoch"] for record in rule.history] == [0, 3]


def test_a_skipped_check_compares_with_the_last_check_that_ran():
    rule = PaperRule(0.5)
    check(rule, 0, {"w": 4.0})
    # check 10 never ran
    assert check(rule, 20, {"w": 3.0}) == {"w": False}  # |4-3|/4 against epoch 0
    assert rule.history[-1]["layers"]["w"]["old_norm"] == 4.0
    assert [record["epoch"] for record in rule.history] == [0, 20]


def test_a_first_check_after_epoch_zero_has_no_old_norms():
    assert check(PaperRule(), 10, {"w": 1.0}) == {"w": True}


# ------------------------------------------------------------- learning-rate decay override


def test_a_decay_makes_every_tensor_critical_until_the_next_check():
    script = [({"w": 4.0, "v": 4.0}, False), ({}, False), ({}, False), ({}, False),
              ({"w": 4.0, "v": 4.0}, False), ({}, True), ({}, False), ({}, False)]  # fmt: skip
    _, decisions = drive(4, 0.5, script)
    assert decisions[4] == {"w": False, "v": False}
    assert decisions[5:] == [{"w": True, "v": True}] * 3


def test_the_next_check_after_a_decay_decides_by_the_ratios_again():
    script = [({"w": 4.0, "v": 4.0}, False), ({}, False), ({}, False), ({}, False),
              ({"w": 4.0, "v": 4.0}, False), ({}, True), ({}, False), ({}, False),
              ({"w": 1.0, "v": 4.0}, False)]  # fmt: skip
    _, decisions = drive(4, 0.5, script)
    assert decisions[-1] == {"w": True, "v": False}  # w: |4-1|/4 = 0.75; v: 0


def test_a_decay_at_a_check_overrides_that_check_but_its_norms_are_remembered():
    rule = PaperRule(0.5)
    check(rule, 0, {"w": 4.0})
    assert check(rule, 2, {"w": 4.0}, decay=True) == {"w": True}  # r = 0
    assert rule.norms == {"w": 4.0}
    assert check(rule, 4, {"w": 4.0}) == {"w": False}  # |4-4|/4 = 0


def test_a_decay_at_a_check_still_writes_history():
    rule = PaperRule(0.5)
    check(rule, 0, {"w": 4.0})
    check(rule, 2, {"w": 3.0}, decay=True)
    assert rule.history[-1] == {
        "epoch": 2,
        "lr_will_decay": True,
        "layers": {"w": {"old_norm": 4.0, "new_norm": 3.0, "ratio": 0.25, "critical": True}},
    }


# ------------------------------------------------------------------------------- history


def test_the_history_records_old_norm_new_norm_ratio_and_decision_per_check():
    rule, _ = drive(2, 0.5, [({"w": 4.0, "z": 0.0}, False), ({}, False),
                             ({"w": 1.0, "z": 2.0, "n": 5.0}, False)])  # fmt: skip
    assert rule.history == [
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


def test_the_history_is_json_serialisable():
    rule, _ = drive(2, 0.5, [(norms, decay) for norms, decay, _ in SCRIPT])
    assert len(rule.history) == 6
    assert json.loads(json.dumps(rule.history, allow_nan=False)) == rule.history


# ------------------------------------------------------------------------ arguments


@pytest.mark.parametrize(
    ("interval", "error"),
    [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError), ("10", TypeError)],
)
def test_a_schedule_rejects_an_interval_that_is_not_an_int_of_at_least_one(interval, error):
    with pytest.raises(error, match=f"interval must be an int >= 1, got {interval!r}"):
        Schedule(interval, "epoch")


@pytest.mark.parametrize(
    ("eta", "error", "fragment"),
    [
        (0.0, ValueError, "eta must be a finite float > 0"),
        (-0.5, ValueError, "got -0.5"),
        (math.nan, ValueError, "got nan"),
        (math.inf, ValueError, "got inf"),
        ("0.5", TypeError, "eta must be a finite float > 0.*got '0.5'"),
        (True, TypeError, "eta must be a finite float > 0.*got True"),
    ],
)
def test_the_paper_rule_rejects_an_eta_that_is_not_a_finite_float_above_zero(eta, error, fragment):
    with pytest.raises(error, match=fragment):
        PaperRule(eta)


def test_the_paper_rule_takes_an_int_eta_as_a_float():
    eta = PaperRule(eta=1).eta
    assert eta == 1.0 and type(eta) is float


# ------------------------------------------------------------------------- checkpointing


def test_a_paper_rule_loaded_from_its_saved_state_decides_as_the_original(tmp_path):
    reference = PaperRule(0.5)
    expected = run_checks(reference, CHECKS)
    for cut in range(len(CHECKS) + 1):
        first = PaperRule(0.5)
        before = run_checks(first, CHECKS[:cut])
        path = tmp_path / f"paper_{cut}.pt"
        torch.save(first.state_dict(), path)
        resumed = PaperRule(0.5)
        resumed.load_state_dict(torch.load(path, weights_only=True))
        after = run_checks(resumed, CHECKS[cut:])
        assert before + after == expected, f"cut at {cut}"
        assert resumed.state_dict() == reference.state_dict(), f"cut at {cut}"


def test_the_paper_rule_state_holds_the_norms_of_the_last_check_and_the_history():
    rule = PaperRule(0.5)
    run_checks(rule, CHECKS[:3])  # the checks at epochs 0, 2 and 4
    state = rule.state_dict()
    assert set(state) == {"norms", "history"}
    assert state["norms"] == {"a": 1.0, "b": 3.0, "c": 2.0, "z": 5.0, "n": 3.0}
    assert [record["epoch"] for record in state["history"]] == [0, 2, 4]


def test_the_paper_rule_state_is_a_copy():
    rule = PaperRule()
    check(rule, 0, {"w": 1.0})
    state = rule.state_dict()
    state["history"][0]["layers"]["w"]["critical"] = False
    state["norms"]["w"] = 9.0
    assert rule.history[0]["layers"]["w"]["critical"] is True
    assert rule.state_dict()["norms"] == {"w": 1.0}


def _loaded_after_refusal(state) -> ValueError:
    """The error of a rule with one check refusing ``state``; asserts nothing changed."""
    rule = PaperRule()
    check(rule, 0, {"w": 1.0})
    before = rule.state_dict()
    with pytest.raises(ValueError) as refused:
        rule.load_state_dict(state)
    assert rule.state_dict() == before, "a refused state changed the rule"
    return refused.value


def test_a_paper_rule_state_with_missing_and_unknown_keys_is_refused_naming_them():
    state = PaperRule().state_dict()
    del state["norms"]
    state["extra"] = 1
    error = _loaded_after_refusal(state)
    assert "missing keys ['norms'], unknown keys ['extra']" in str(error)


def test_a_paper_rule_state_that_is_not_a_mapping_is_a_value_error():
    assert "state must be a Mapping from PaperRule.state_dict()" in str(
        _loaded_after_refusal([1, 2])
    )


def test_a_paper_rule_state_with_a_negative_norm_is_refused_naming_it():
    state = {"norms": {"w": -1.0}, "history": []}
    assert "PaperRule norms['w'] must be a number >= 0" in str(_loaded_after_refusal(state))


def test_a_paper_rule_state_with_a_history_that_is_not_a_list_is_refused():
    state = {"norms": {}, "history": {}}
    assert "state must come from PaperRule.state_dict()" in str(_loaded_after_refusal(state))


# ---------------------------------------------------------------------- windows of steps

# interval 3 steps, eta=0.5: (norms of the window, lr_will_decay, expected decision)
STEP_SCRIPT = [
    ({"a": 4.0, "b": 4.0}, False, {"a": True, "b": True}),  # first window: all critical
    ({"a": 1.0, "b": 3.0}, False, {"a": True, "b": False}),  # 0.75 and 0.25
    ({"a": 1.0, "b": 3.0}, True, {"a": True, "b": True}),  # r = 0, but the lr decays
    ({"a": 1.0, "b": 3.0}, False, {"a": False, "b": False}),  # decided normally again
    ({"a": 2.0, "b": 3.0}, False, {"a": True, "b": False}),  # |1-2|/1 = 1.0
]


def _steps(script: list, interval_steps: int) -> list:
    """Each window of ``script`` as ``interval_steps`` steps; the window's statistic and
    decay are given at its last step, where the check is."""
    steps = []
    for norms, decay, _ in script:
        steps += [(norms, False)] * (interval_steps - 1) + [(norms, decay)]
    return steps


def test_on_a_step_schedule_the_rule_decides_window_by_window_at_each_window_end():
    _, decisions = drive(3, 0.5, _steps(STEP_SCRIPT, 3), unit="step")
    assert decisions[2::3] == [expected for _, _, expected in STEP_SCRIPT]
    assert all(d is None for i, d in enumerate(decisions) if i % 3 != 2)


def test_on_a_step_schedule_the_history_counts_windows():
    rule, _ = drive(3, 0.5, _steps(STEP_SCRIPT, 3), unit="step")
    assert [record["epoch"] for record in rule.history] == [0, 1, 2, 3, 4]
    assert rule.history[1]["layers"]["a"]["ratio"] == 0.75
