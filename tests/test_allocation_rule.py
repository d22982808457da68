"""L-GreCo's allocation rule: each layer's rung from the cheapest allocation whose summed
squared error stays within one reference rung's, measured on each rank's accumulator."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.audit import rung_gaps
from accordion.compress import compressor_class
from accordion.ddp import AccordionState, accordion_hook
from accordion.harness.strategies import parse_strategy
from accordion.policy import AllocationRule, Ladder, Observation, RegimeAllocationRule, make_rule
from accordion.policy.allocation import cheapest_within
from distributed import run_processes

LEVELS = ("nq/4", "nq/3", "nq/2", "nq/1")


def _ladder() -> Ladder:
    return Ladder(compressor_class("mixed"), LEVELS)


def _observation(names, rungs=None) -> Observation:
    return Observation(0, "step", False, dict.fromkeys(names, 1.0), rungs=rungs or {})


def test_cheapest_within_matches_every_allocation_tried():
    rng = random.Random(0)
    for _ in range(50):
        choices = [[(rng.uniform(1, 9), rng.uniform(0, 5)) for _ in range(3)] for _ in range(4)]
        budget = rng.uniform(2, 12)
        cost, picked = cheapest_within(choices, budget)
        feasible = [sum(c[i][0] for c, i in zip(choices, pick))
                    for pick in itertools.product(range(3), repeat=4)
                    if sum(c[i][1] for c, i in zip(choices, pick)) <= budget]  # fmt: skip
        if feasible:
            assert cost == pytest.approx(min(feasible))
            assert sum(c[i][1] for c, i in zip(choices, picked)) <= budget * (1 + 1e-9)


def test_the_layer_with_the_large_error_takes_bits_from_the_small_one():
    rule = AllocationRule(reference=2)
    sizes = [40.0, 30.0, 20.0, 10.0]  # bytes at 4, 3, 2 and 1 bits
    rule.measured({"big": [1.0, 4.0, 16.0, 64.0], "small": [0.01, 0.04, 0.16, 0.64]},
                  {"big": sizes, "small": sizes})  # fmt: skip
    rungs = rule.decide(_observation(["big", "small"]), _ladder())
    assert rungs["big"] < 2 < rungs["small"]  # 3 bits and 1 bit: 40 bytes, not 2 bits' 40
    assert rule.history[0]["budget"] == pytest.approx(16.16)
    assert rule.history[0]["bytes"] <= rule.history[0]["reference_bytes"]


def test_equal_relative_errors_and_sizes_keep_the_reference_rung():
    rule = AllocationRule(reference=1)
    same = [1.0, 4.0, 16.0, 64.0]  # a quantiser: about 4x the error per bit fewer
    rule.measured({"a": same, "b": same}, {"a": [4.0, 3.0, 2.0, 1.0], "b": [4.0, 3.0, 2.0, 1.0]})
    assert rule.decide(_observation(["a", "b"]), _ladder()) == {"a": 1, "b": 1}


def test_a_layer_not_measured_keeps_its_rung_and_the_measurement_is_used_once():
    rule = AllocationRule(reference=2)
    rule.measured({"a": [0.0, 0.0, 0.0, 0.0]}, {"a": [4.0, 3.0, 2.0, 1.0]})
    assert rule.decide(_observation(["a", "b"], {"b": 1}), _ladder()) == {"a": 3, "b": 1}
    assert rule.pending == {}
    assert rule.decide(_observation(["a"], {"a": 3}), _ladder()) == {"a": 3}
    assert len(rule.history) == 1


def test_a_reference_beyond_the_ladder_is_refused_naming_it():
    rule = AllocationRule(reference=4)
    rule.measured({"a": [0.0] * 4}, {"a": [1.0] * 4})
    with pytest.raises(ValueError, match="reference must be a rung of the ladder"):
        rule.decide(_observation(["a"]), _ladder())


def test_a_state_whose_reference_is_beyond_its_ladder_is_refused_before_training():
    net = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="reference must be a rung of the ladder"):
        AccordionState(net, "nq", levels=(4, 2), rule=AllocationRule(reference=2))


@pytest.mark.parametrize(("reference", "error"), [(-1, ValueError), (1.5, TypeError),
                                                  (True, TypeError)])  # fmt: skip
def test_a_reference_that_is_not_a_rung_index_is_refused(reference, error):
    with pytest.raises(error, match="reference"):
        AllocationRule(reference=reference)


def test_the_state_keeps_a_measurement_not_yet_decided():
    rule = AllocationRule(reference=1)
    rule.measured({"a": [1.0, 2.0, 3.0, 4.0]}, {"a": [4.0, 3.0, 2.0, 1.0]})
    other = make_rule("lgreco", reference=1)
    other.load_state_dict(rule.state_dict())
    assert other.pending == rule.pending
    assert other.decide(_observation(["a"]), _ladder()) == rule.decide(_observation(["a"]),
                                                                       _ladder())  # fmt: skip


def test_a_malformed_state_is_refused_naming_the_entry_and_changes_nothing():
    rule = AllocationRule()
    rule.measured({"a": [1.0, 2.0]}, {"a": [2.0, 1.0]})
    for bad in ({"a": [[1.0], [2.0, 1.0]]}, {"a": [[-1.0], [1.0]]}, {"a": "x"}, []):
        with pytest.raises(ValueError, match="AllocationRule pending"):
            rule.load_state_dict({"pending": bad, "history": []})
    assert rule.pending == {"a": ([1.0, 2.0], [2.0, 1.0])}


def test_a_strategy_names_the_rule_and_its_reference_rung():
    strategy = parse_strategy("accordion:mixed:nq/4,nq/3,nq/2,nq/1:lgreco:ref=2")
    assert (strategy.rule, strategy.reference, strategy.levels) == ("lgreco", 2, LEVELS)
    with pytest.raises(ValueError, match="ref=N is an option of the lgreco rules"):
        parse_strategy("accordion:mixed:nq/4,nq/2:audit:ref=1")
    with pytest.raises(ValueError, match="ref=4 must be a rung of the ladder"):
        parse_strategy("accordion:mixed:nq/4,nq/3,nq/2,nq/1:lgreco:ref=4")


class _Recording(AllocationRule):
    """Keeps every measurement it is handed."""

    def __init__(self, reference):
        super().__init__(reference)
        self.seen = []

    def measured(self, errors, sizes):
        self.seen.append((dict(errors), dict(sizes)))
        super().measured(errors, sizes)


def _measured_run(rank, world_size, out_dir):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    model = DDP(net)
    state = AccordionState(net, "mixed", levels=LEVELS, interval=3, interval_unit="step",
                           rule=_Recording(reference=2))  # fmt: skip
    model.register_comm_hook(state, accordion_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    grads, floats = [], []
    for _ in range(6):
        optimizer.zero_grad()
        x = torch.randn(8, 16, generator=gen)
        with model.no_sync():  # this rank's own gradient, before any averaging
            net(x).pow(2).mean().backward()
        grads.append([p.grad.detach().clone() for p in net.parameters()])
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        floats.append(state.ledger.total_bytes)
        optimizer.step()
        state.end_step(optimizer)
    torch.save({"seen": state.rule.seen, "history": state.rule.history, "local": grads,
                "floats": floats}, f"{out_dir}/rank{rank}.pt")  # fmt: skip


def test_each_window_measures_the_ranks_summed_errors_and_the_ranks_agree(tmp_path):
    run_processes(_measured_run, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert ranks[0]["history"] == ranks[1]["history"] and len(ranks[0]["history"]) == 2
    assert len(ranks[0]["seen"]) == 2  # steps 0 and 3
    errors, sizes = ranks[0]["seen"][0]
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert set(errors) == set(names) and errors == ranks[1]["seen"][0][0]
    for i, name in enumerate(names):  # step 0: no memory yet, the accumulator is the gradient
        local = [rung_gaps(_ladder(), [name], [r["local"][0][i]], {"seed": 0}) for r in ranks]
        expected = [sum(g[rung][0] ** 2 for g in local) for rung in range(len(LEVELS))]
        assert errors[name] == pytest.approx(expected, rel=1e-6)
        assert sizes[name][0] >= sizes[name][1] >= sizes[name][2] >= sizes[name][3] > 0
    assert sizes["0.weight"][0] > sizes["0.weight"][1] > sizes["0.weight"][2] > sizes["0.weight"][3]
    spent = ranks[0]["floats"]  # wire bytes after each step
    measurement = 2 * (2 - 1) / 2 * 8 * len(LEVELS) * len(names)  # a ring all-reduce of float64
    assert spent[0] == pytest.approx(spent[1] - spent[0] + measurement)  # compressed, + errors
    assert not math.isnan(ranks[0]["history"][0]["budget"])


def _measure_two(rule):
    sizes = [40.0, 30.0, 20.0, 10.0]
    rule.measured({"big": [1.0, 4.0, 16.0, 64.0], "small": [0.01, 0.04, 0.16, 0.64]},
                  {"big": sizes, "small": sizes})  # fmt: skip


def test_the_regime_rule_spends_the_mildest_budget_while_the_norms_move_and_more_when_calm():
    rule = RegimeAllocationRule(reference=2, eta=0.5)
    _measure_two(rule)  # the first check: no norms to compare, every layer critical
    assert rule.decide(_observation(["big", "small"]), _ladder()) == {"big": 0, "small": 0}
    assert rule.history[0]["critical"] == ["big", "small"]
    _measure_two(rule)  # the norms did not move: calm, the reference rung's budget
    rungs = rule.decide(_observation(["big", "small"]), _ladder())
    assert rungs["big"] < 2 < rungs["small"] and rule.history[1]["critical"] == []


def test_the_regime_rule_treats_a_decay_as_critical():
    rule = RegimeAllocationRule(reference=2)
    _measure_two(rule)
    rule.decide(_observation(["big", "small"]), _ladder())
    _measure_two(rule)
    decaying = Observation(1, "step", True, {"big": 1.0, "small": 1.0})
    assert rule.decide(decaying, _ladder()) == {"big": 0, "small": 0}


def test_the_regime_rule_state_keeps_its_norms_and_refuses_bad_ones():
    rule = RegimeAllocationRule(reference=2)
    _measure_two(rule)
    rule.decide(_observation(["big", "small"]), _ladder())
    other = make_rule("lgreco-regime", 0.5, reference=2)
    other.load_state_dict(rule.state_dict())
    assert other.norms == {"big": 1.0, "small": 1.0}
    with pytest.raises(ValueError, match="norms"):
        other.load_state_dict({**rule.state_dict(), "norms": {"big": -1.0}})
    assert other.norms == {"big": 1.0, "small": 1.0}
