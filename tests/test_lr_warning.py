"""The warnings of ``end_epoch`` / ``end_step`` in one process: a call that gives no
learning rate (decays cannot be detected), and the idle warning across a checkpoint
taken mid-period (the flag that gradients came through travels with the state)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from accordion.ddp import AccordionState
from accordion.policy import PaperRule

BLIND = "cannot detect learning-rate decays"
IDLE = "no gradient passed through this Accordion state"


def make_net() -> nn.Module:
    torch.manual_seed(0)  # every layer compressed at every level of (4, 2, 1)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))


def step(net: nn.Module, state: AccordionState) -> None:
    net.zero_grad()
    net(torch.randn(5, 16)).pow(2).sum().backward()
    state.reduce_gradients()


def _end(state: AccordionState, **lr) -> None:
    """One end of period for the state's unit, after one step."""
    step(state.params.module, state)
    (state.end_epoch if state.interval_unit == "epoch" else state.end_step)(**lr)


@pytest.mark.parametrize("unit", ["epoch", "step"])
def test_an_end_without_a_learning_rate_warns_once_that_decays_cannot_be_detected(unit):
    state = AccordionState(make_net(), "powersgd", levels=(4, 2, 1), interval_unit=unit)
    with pytest.warns(RuntimeWarning, match=BLIND) as caught:
        _end(state)
    text = str(caught[0].message)
    assert f"state.end_{unit}(optimizer)" in text
    assert "next_lr=" in text and "lr_will_decay=" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _end(state)  # once per state


def test_the_warning_says_the_guarded_rule_keeps_layers_off_the_last_rung():
    state = AccordionState(make_net(), "powersgd", levels=(4, 2, 1))  # the guarded rule
    with pytest.warns(RuntimeWarning, match="off the last rung of the ladder until a first decay"):
        _end(state)


def test_the_warning_does_not_speak_of_a_last_rung_for_a_rule_that_does_not_wait():
    state = AccordionState(make_net(), "powersgd", levels=(4, 2, 1), rule=PaperRule(0.5))
    with pytest.warns(RuntimeWarning, match=BLIND) as caught:
        _end(state)
    assert "last rung" not in str(caught[0].message)


@pytest.mark.parametrize("unit", ["epoch", "step"])
@pytest.mark.parametrize("source", ["optimizer", "next_lr", "lr_will_decay"])
def test_an_end_given_a_learning_rate_source_does_not_warn(unit, source):
    net = make_net()
    state = AccordionState(net, "powersgd", levels=(4, 2, 1), interval_unit=unit)
    given = {"optimizer": torch.optim.SGD(net.parameters(), lr=0.1), "next_lr": 0.1,
             "lr_will_decay": False}[source]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            _end(state, **{source: given})


def test_a_static_ladder_does_not_warn_without_a_learning_rate():
    state = AccordionState(make_net(), "powersgd", mild=2, aggressive=2)  # nothing to decide
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _end(state)


# --- the idle warning across checkpoints ---------------------------------------------------


def _saved_mid_epoch() -> dict:
    """A state dict saved after a step and before its end_epoch, as Lightning saves."""
    state = AccordionState(make_net(), "powersgd", levels=(4, 2, 1), interval=1)
    step(state.params.module, state)
    return state.state_dict()


def test_a_state_saved_mid_epoch_resumes_without_the_idle_warning():
    resumed = AccordionState(make_net(), "powersgd", levels=(4, 2, 1), interval=1)
    resumed.load_state_dict(_saved_mid_epoch())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.end_epoch(next_lr=0.1)  # the gradients of the epoch came before the save


def test_a_checkpoint_written_before_the_flag_was_saved_resumes_without_the_idle_warning():
    saved = _saved_mid_epoch()
    del saved["observed"]  # as older files
    resumed = AccordionState(make_net(), "powersgd", levels=(4, 2, 1), interval=1)
    resumed.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.end_epoch(next_lr=0.1)


def test_the_idle_warning_still_fires_after_a_resume_when_no_gradient_comes():
    resumed = AccordionState(make_net(), "powersgd", levels=(4, 2, 1), interval=1)
    resumed.load_state_dict(_saved_mid_epoch())
    resumed.end_epoch(next_lr=0.1)  # the saved epoch: it had gradients
    with pytest.warns(RuntimeWarning, match=IDLE):
        resumed.end_epoch(next_lr=0.1)  # an epoch without any


def test_a_malformed_observed_entry_is_refused_naming_it_and_changes_nothing():
    saved = _saved_mid_epoch()
    saved["observed"] = "yes"
    fresh = AccordionState(make_net(), "powersgd", levels=(4, 2, 1), interval=1)
    before = fresh.stats()
    with pytest.raises(ValueError, match="observed"):
        fresh.load_state_dict(saved)
    assert fresh.stats() == before and fresh.step == 0
