"""Ladders across compressors: the ``mixed`` compressor, whose levels are other compressors'."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from accordion.accounting import paper_floats, wire_bytes
from accordion.compress import (
    ErrorFeedback,
    HalfPrecision,
    Mixed,
    PowerSGD,
    Reducer,
    SimulatedTransport,
)
from accordion.compress.mixed import split_level
from accordion.ddp import AccordionState
from accordion.harness.strategies import parse_strategy
from accordion.policy import Ladder

LADDER = ("dense", "half/bf16", "powersgd/16", "powersgd/4", "powersgd/1")


def run_workers(reducers, keys, grads_per_worker):
    """One step of simulated workers; grads are replaced in place by the averages."""
    world = SimulatedTransport(len(reducers))
    world.run([r.exchange(keys, g, len(reducers)) for r, g in zip(reducers, grads_per_worker)])


def worker_grads(workers, shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(workers)]


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def step(net, state, seed=0):
    gen = torch.Generator().manual_seed(seed)
    net.zero_grad()
    net(torch.randn(8, 32, generator=gen)).pow(2).sum().backward()
    state.reduce_gradients()


# --- levels -----------------------------------------------------------------------------


def test_a_mixed_level_is_written_as_its_compressor_and_level():
    assert Mixed.check_level(("powersgd", 4)) == "powersgd/4"
    assert Mixed.parse_level(" topk/0.010 ") == "topk/0.01"
    assert Mixed.check_level("dense") == "dense"
    assert Mixed.label("half/bf16") == "half/bf16"


@pytest.mark.parametrize(
    "level,error,match",
    [
        ("bf16", ValueError, "NAME/LEVEL"),
        ("qsgd/4", ValueError, "names a compressor other than mixed and dense"),
        ("mixed/powersgd/4", ValueError, "other than mixed"),
        ("powersgd/0", ValueError, "rank must be an int >= 1"),
        (4, TypeError, "a mixed level must be"),
    ],
)
def test_a_bad_mixed_level_is_refused_naming_it(level, error, match):
    with pytest.raises(error, match=match):
        Mixed.check_level(level)


def test_mixed_levels_are_ordered_by_the_bytes_they_send():
    ladder = Ladder(Mixed, LADDER)
    order = [Mixed.aggressiveness(level) for level in ladder.levels]
    assert order == sorted(order) and order[0] == 0.0 and order[1] == 1.0
    with pytest.raises(ValueError, match="compresses less than"):
        Ladder(Mixed, ("powersgd/4", "half/bf16"))


def test_a_strategy_string_takes_a_ladder_across_compressors():
    strategy = parse_strategy("accordion:mixed:half/bf16,topk/0.1,topk/0.01")
    assert strategy.compressor == "mixed"
    assert strategy.levels == ("half/bf16", "topk/0.1", "topk/0.01")


# --- the exchange ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "level,part", [("half/bf16", HalfPrecision("bf16")), ("powersgd/2", PowerSGD(2))]
)
def test_each_tensor_is_sent_by_the_compressor_of_its_level(level, part):
    shapes = [(12, 10), (12, 10)]
    mixed_grads, part_grads = worker_grads(2, shapes, 1), worker_grads(2, shapes, 1)
    mixed = [Reducer(Mixed.build(level)) for _ in range(2)]
    alone = [Reducer(type(part).build(part.default_level)) for _ in range(2)]
    run_workers(mixed, ["a", "b"], mixed_grads)
    run_workers(alone, ["a", "b"], part_grads)
    # the same code on the same inputs on one machine: bitwise equal
    for got, expected in zip(mixed_grads[0], part_grads[0]):
        assert torch.equal(got, expected)


def test_tensors_at_levels_of_two_compressors_travel_in_one_exchange():
    reducers = [Reducer(Mixed.build("half/bf16")) for _ in range(2)]
    for r in reducers:
        r.compressor.set_level("powersgd/1", ["w"])
    grads = worker_grads(2, [(16, 8), (16, 8)], 2)
    mean = [(grads[0][i] + grads[1][i]) / 2 for i in range(2)]
    run_workers(reducers, ["w", "h"], grads)
    assert torch.linalg.matrix_rank(grads[0][0]) == 1  # powersgd/1: a rank-1 estimate
    torch.testing.assert_close(grads[0][1], mean[1], rtol=0.02, atol=0.02)  # bf16 rounding
    assert set(reducers[0].compressor.state_dict()["parts"]) == {"half", "powersgd"}


def test_error_feedback_carries_across_a_change_of_compressor():
    reducer = Reducer(Mixed.build("powersgd/1"), ErrorFeedback())
    gen = torch.Generator().manual_seed(3)
    total_in = torch.zeros(12, 10, dtype=torch.float64)
    total_out = torch.zeros(12, 10, dtype=torch.float64)
    for level in ("powersgd/1", "half/bf16", "topk/0.1", "powersgd/4"):
        reducer.compressor.set_level(level, ["w"])
        g = torch.randn(12, 10, generator=gen, dtype=torch.float64)
        total_in += g
        grads = [g.clone()]
        run_workers([reducer], ["w"], [grads])
        total_out += grads[0]
        assert reducer.memory.get("w") is not None  # each compressor left a residual
    torch.testing.assert_close(total_out + reducer.memory.get("w"), total_in)


def test_a_tensor_the_level_compressor_does_not_take_goes_dense_and_without_warning():
    net = make_net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = AccordionState(net, "mixed", levels=("half/bf16", "powersgd/4"))
    bias = "0.bias"
    assert state.reducer.pays((64,), "half/bf16")
    assert not state.reducer.pays((64,), "powersgd/4")
    assert Mixed.applies_at((64,), "half/bf16") and not Mixed.applies_at((64,), "powersgd/4")
    assert state.levels()[bias] == "half/bf16"


@pytest.mark.parametrize("level", ["half/bf16", "powersgd/4", "topk/0.1", "dense"])
def test_a_mixed_level_costs_what_its_compressor_sends(level):
    shape = (64, 32)
    part, part_level = split_level(level)
    expected = wire_bytes(shape, part.name, part_level, 4, 4)
    assert wire_bytes(shape, "mixed", level, 4, 4) == expected
    assert paper_floats(shape, "mixed", level, 4) == paper_floats(shape, part.name, part_level, 4)


# --- state ------------------------------------------------------------------------------


def test_a_mixed_state_round_trips_with_its_parts_warm_start():
    net = make_net()
    state = AccordionState(net, "mixed", levels=LADDER[1:], interval=1)
    for epoch in range(3):
        step(net, state, seed=epoch)
        state.end_epoch(next_lr=0.1)
    saved = state.state_dict()
    other = AccordionState(make_net(), "mixed", levels=LADDER[1:], interval=1)
    other.load_state_dict(saved)
    assert other.levels() == state.levels()
    parts = other.reducer.compressor.state_dict()["parts"]
    expected = state.reducer.compressor.state_dict()["parts"]
    assert parts.keys() == expected.keys()
    assert str(parts) == str(expected)


def test_a_mixed_state_with_an_unknown_part_is_refused_and_changes_nothing():
    comp = Mixed.build("powersgd/4")
    state = comp.state_dict()
    state["parts"] = {"qsgd": {}}
    with pytest.raises(ValueError, match="mixed parts must map compressor names"):
        comp.load_state_dict(state)
    assert comp.state_dict()["parts"] == {}
