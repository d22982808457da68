"""The audit rule: one step per period averaged dense, each rung's error measured on it,
and each layer held at the most compressed rung within the error budget."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.audit import relative_errors
from accordion.compress import compressor_class
from accordion.ddp import AccordionState, accordion_hook
from accordion.harness.strategies import parse_strategy
from accordion.policy import AuditRule, Ladder, Observation, make_rule
from distributed import run_processes

LEVELS = ("int/8", "int/4", "powersgd/4", "powersgd/1")


def _ladder(levels=LEVELS) -> Ladder:
    return Ladder(compressor_class("mixed"), levels)


def _observation(names, rungs=None) -> Observation:
    return Observation(0, "step", False, dict.fromkeys(names, 1.0), rungs=rungs or {})


def test_a_rank_one_average_has_no_error_at_powersgd_rank_one():
    g = torch.outer(torch.randn(32), torch.randn(16))
    errors = relative_errors(_ladder(), ["w"], [g], {"seed": 0})["w"]
    assert errors[3] < 1e-5  # the second pass finds the one direction exactly
    assert 0 < errors[0] < errors[1] < 0.2  # int8 then int4 round, and int4 more


def test_a_rung_that_sends_a_tensor_dense_has_no_error_to_choose():
    errors = relative_errors(_ladder(), ["bias"], [torch.randn(32)], {"seed": 0})["bias"]
    assert errors[0] > 0 and math.isnan(errors[2]) and math.isnan(errors[3])


def test_the_rule_holds_each_layer_at_the_most_compressed_rung_within_tau():
    rule = AuditRule(tau=0.3)
    rule.measured({"a": [0.01, 0.1, 0.5, 0.9], "b": [0.01, 0.1, 0.2, 0.25], "c": [0.4] * 4})
    rungs = rule.decide(_observation(["a", "b", "c"]), _ladder())
    assert rungs == {"a": 1, "b": 3, "c": 0}


def test_a_layer_is_judged_on_the_worse_of_its_last_two_audits():
    rule = AuditRule(tau=0.3)
    rule.measured({"a": [0.01, 0.1, 0.5, 0.9]})
    rule.decide(_observation(["a"]), _ladder())
    rule.measured({"a": [0.01, 0.1, 0.2, 0.9]})  # one good audit of rung 2
    assert rule.decide(_observation(["a"]), _ladder()) == {"a": 1}
    rule.measured({"a": [0.01, 0.1, 0.2, 0.9]})
    assert rule.decide(_observation(["a"]), _ladder()) == {"a": 2}


def test_a_layer_without_an_audit_keeps_its_rung():
    rule = AuditRule()
    assert rule.decide(_observation(["a"], rungs={"a": 2}), _ladder()) == {"a": 2}


def test_the_state_keeps_the_errors_of_an_audit_not_yet_decided():
    rule = AuditRule()
    rule.measured({"a": [0.01, 0.5, 0.6, 0.7]})
    resumed = AuditRule()
    resumed.load_state_dict(rule.state_dict())
    assert resumed.decide(_observation(["a"]), _ladder()) == {"a": 0}
    assert resumed.pending == {} and resumed.previous == {"a": [0.01, 0.5, 0.6, 0.7]}


def test_a_malformed_state_is_refused_naming_the_entry_and_changes_nothing():
    rule = AuditRule()
    rule.measured({"a": [0.1]})
    with pytest.raises(ValueError, match=r"pending\['a'\]"):
        rule.load_state_dict({"pending": {"a": ["x"]}, "previous": {}, "history": []})
    assert rule.pending == {"a": [0.1]}


RANGE = r"tau must be > 0 and <= 1 and finite, got "
NUMBER = r"tau must be a number, got "


@pytest.mark.parametrize("tau, error, message", [
    (0, ValueError, RANGE + "0"), (1.5, ValueError, RANGE + "1.5"),
    ("0.3", TypeError, NUMBER + "'0.3'"), (math.nan, ValueError, RANGE + "nan"),
    (True, TypeError, NUMBER + "True")])  # fmt: skip
def test_tau_outside_0_to_1_is_refused_naming_it(tau, error, message):
    with pytest.raises(error, match=message):
        AuditRule(tau)


def test_make_rule_refuses_eta_for_the_audit_rule():
    with pytest.raises(ValueError, match="eta is the norm test's threshold"):
        make_rule("audit", 0.5)
    assert make_rule("audit", tau=0.2).tau == 0.2


def test_a_strategy_names_the_audit_rule_and_its_budget():
    strategy = parse_strategy("accordion:mixed:int/8,int/4,powersgd/4:audit:tau=0.2")
    assert (strategy.rule, strategy.tau, strategy.levels) == ("audit", 0.2, LEVELS[:3])
    with pytest.raises(ValueError, match="tau=X is an option of the audit rule"):
        parse_strategy("accordion:powersgd:4,1:guarded:tau=0.2")


def _audited_run(rank, world_size, out_dir):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model = DDP(net)
    state = AccordionState(net, "mixed", levels=LEVELS, interval=3, interval_unit="step",
                           rule=AuditRule(tau=0.3))  # fmt: skip
    model.register_comm_hook(state, accordion_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    record = []
    for _ in range(6):
        optimizer.zero_grad()
        x = torch.randn(8, 16, generator=gen)
        net_copy = [p.detach().clone() for p in net.parameters()]
        model(x).pow(2).mean().backward()
        grads = [p.grad.detach().clone() for p in net.parameters()]
        record.append({"levels": state.levels(), "grads": grads, "params": net_copy, "x": x,
                       "floats": state.ledger.total_floats})  # fmt: skip
        optimizer.step()
        state.end_step(optimizer)
    torch.save({"record": record, "history": state.rule.history,
                "dense_floats": state.dense_floats()}, f"{out_dir}/rank{rank}.pt")  # fmt: skip


def _local_grads(params, x):
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        for p, value in zip(net.parameters(), params):
            p.copy_(value)
    net(x).pow(2).mean().backward()
    return [p.grad for p in net.parameters()]


def test_the_first_step_of_each_window_is_averaged_dense_and_the_ranks_agree(tmp_path):
    run_processes(_audited_run, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    # repr: the errors of rungs that send a tensor dense are NaN, which equals nothing
    assert repr(ranks[0]["history"]) == repr(ranks[1]["history"])
    assert len(ranks[0]["history"]) == 2
    for step in (0, 3):  # the audited steps: the exact mean of the ranks' gradients
        local = [_local_grads(r["record"][step]["params"], r["record"][step]["x"]) for r in ranks]
        for got, g0, g1 in zip(ranks[0]["record"][step]["grads"], *local):
            torch.testing.assert_close(got, (g0 + g1) / 2)
    # step 4, after the first check, is compressed: not the exact mean
    local = [_local_grads(r["record"][4]["params"], r["record"][4]["x"]) for r in ranks]
    assert not torch.allclose(ranks[0]["record"][4]["grads"][0], (local[0][0] + local[1][0]) / 2)
    floats = [r["floats"] for r in ranks[0]["record"]]  # each after its step's backward
    per_step = ranks[0]["dense_floats"] / 6
    assert floats[0] == floats[3] - floats[2] == per_step  # audits are counted dense
    assert floats[4] - floats[3] < per_step
    decided = ranks[0]["history"][0]["layers"]
    assert set(decided) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all(len(layer["errors"]) == len(LEVELS) for layer in decided.values())
