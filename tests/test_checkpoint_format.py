"""Checkpoints written before the policy layer (format 1) still load, and resume exactly.

``tests/data/accordion-format1.pt`` was written by ``tests/data/make_format1_fixture.py``
with the code of commit 5847b17: for each interval unit, a format-1 checkpoint after 5
calls, the weights then, and what 4 more calls of that code gave (levels, statistics,
error-feedback memory).

That fixture was written on another CPU, whose kernels may round differently: the levels,
decisions and counters must be the same, the tensors and norms only up to rounding (the
fixture's script asserts that no decision came from a ratio near the threshold).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from accordion.ddp import AccordionState
from accordion.policy import PaperRule
from numerics import assert_equal_up_to_rounding, rounding_tolerance

FIXTURE = Path(__file__).parent / "data" / "accordion-format1.pt"
#: Rounded terms behind a value of the fixture: 4 steps of reductions over at most 16.
TERMS = 4 * 16


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def step(net, state, seed):
    gen = torch.Generator().manual_seed(seed)
    net.zero_grad()
    net(torch.randn(5, 8, generator=gen)).pow(2).sum().backward()
    state.reduce_gradients()


def _resumed(unit: str):
    saved = torch.load(FIXTURE, weights_only=True)[unit]
    net = make_net()
    net.load_state_dict(saved["weights"])
    state = AccordionState(net, "powersgd", mild=2, aggressive=1, interval=2, rule=PaperRule(2.0),
                           interval_unit=unit)  # fmt: skip
    state.load_state_dict(saved["checkpoint"])
    end = state.end_epoch if unit == "epoch" else state.end_step
    for i in range(5, 9):
        step(net, state, i)
        end(next_lr=0.05)
    return state, saved["after"]


def _assert_same_checks(got: list, want: list) -> None:
    """The same checks with the same decisions; norms and ratios up to rounding."""
    tol = rounding_tolerance(torch.float32, TERMS)
    assert [(c["epoch"], c["lr_will_decay"]) for c in got] == [
        (c["epoch"], c["lr_will_decay"]) for c in want
    ]
    for check, expected in zip(got, want):
        assert check.keys() == expected.keys()
        assert check["layers"].keys() == expected["layers"].keys()
        for name, layer in check["layers"].items():
            old = expected["layers"][name]
            assert layer["critical"] == old["critical"], (check["epoch"], name)
            for field in ("old_norm", "new_norm", "ratio"):  # None: none yet, or infinite
                want = old[field] if old[field] is None else pytest.approx(old[field], rel=tol)
                assert layer[field] == want, (field, name)


@pytest.mark.numerics
@pytest.mark.parametrize("unit", ["epoch", "step"])
def test_a_format_1_checkpoint_resumes_with_the_levels_and_checks_the_old_code_reached(unit):
    state, after = _resumed(unit)
    assert state.levels() == after["levels"]
    stats = state.stats()
    _assert_same_checks(stats["checks"], after["stats"]["checks"])
    assert stats["layers"] == after["stats"]["layers"]  # levels, shapes and sent counts
    assert (stats["epoch"], stats["step"]) == (after["stats"]["epoch"], after["stats"]["step"])


@pytest.mark.numerics
@pytest.mark.parametrize("unit", ["epoch", "step"])
def test_a_format_1_checkpoint_resumes_with_the_same_error_feedback_memory(unit):
    state, after = _resumed(unit)
    assert state.reducer.memory.keys() == after["memory"].keys()
    for key, memory in after["memory"].items():
        assert_equal_up_to_rounding(state.reducer.memory.get(key), memory, terms=TERMS, msg=key)


def test_a_format_1_checkpoint_of_another_configuration_is_refused():
    saved = torch.load(FIXTURE, weights_only=True)["epoch"]["checkpoint"]
    state = AccordionState(
        make_net(), "powersgd", mild=4, aggressive=1, interval=2, rule=PaperRule(2.0)
    )
    with pytest.raises(ValueError, match="levels is \\[2, 1\\]"):
        state.load_state_dict(saved)


@pytest.mark.parametrize("fmt", [0, 3, None, "1"])
def test_a_checkpoint_of_an_unknown_format_is_refused_with_the_readable_formats(fmt):
    saved = AccordionState(make_net()).state_dict()
    saved["format"] = fmt
    with pytest.raises(ValueError, match=r"format 2, or an older format in \(1, 2\)"):
        AccordionState(make_net()).load_state_dict(saved)


def test_a_truncated_format_1_checkpoint_is_a_value_error_not_a_key_error():
    saved = dict(torch.load(FIXTURE, weights_only=True)["epoch"]["checkpoint"])
    del saved["detector"]
    with pytest.raises(ValueError, match="incomplete or malformed"):
        AccordionState(make_net()).load_state_dict(saved)


def _trained_state():
    net = make_net()
    state = AccordionState(net, "powersgd", mild=2, aggressive=1, interval=1)
    for i in range(3):
        step(net, state, i)
        state.end_epoch(next_lr=0.1)
    return state


@pytest.mark.parametrize(
    "tamper",
    [
        lambda s: s["rungs"].update({"0.weight": 7}),  # no such rung
        lambda s: s["reducer"]["compressor"].pop("q"),  # PowerSGD's factors missing
        lambda s: s.update(epoch=-1),
        lambda s: s["ledger"].update(layers=[1, 2]),
        lambda s: s["rule"].pop("norms"),
    ],
)
def test_a_failed_load_leaves_the_state_as_it_was(tamper):
    saved = _trained_state().state_dict()
    fresh = AccordionState(make_net(), "powersgd", mild=2, aggressive=1, interval=1)
    before = (fresh.stats(), fresh.levels(), fresh.rungs(), fresh.reducer)
    tamper(saved)
    with pytest.raises(ValueError):
        fresh.load_state_dict(saved)
    assert (fresh.stats(), fresh.levels(), fresh.rungs(), fresh.reducer) == before
