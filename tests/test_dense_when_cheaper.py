"""A layer whose level sends at least as much as dense is averaged dense at that level.

The issue's example: a 3 x 64 matrix at PowerSGD rank 8 has ``r' = 3`` and would send
``(3 + 64) * 3 = 201`` floats a step against its 192 dense ones. It goes dense while it
is at that rank (``Compressor.pays``), is counted dense, is named in one warning when
the state is bound, and is compressed again on a rung whose level pays (rank 1: 67).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.accounting import paper_floats, wire_bytes
from accordion.compress import (
    HalfPrecision,
    LocalTransport,
    OneRoundPowerSGD,
    PowerSGD,
    Reducer,
    TopK,
)
from accordion.ddp import AccordionState, accordion_hook
from accordion.plan import make_plan
from accordion.policy import Rule
from distributed import run_processes

DENSE_3X64 = 3 * 64  # 192 floats
RANK8_3X64 = (3 + 64) * 3  # r' = min(3, 64, 8) = 3: 201 floats
RANK1_3X64 = (3 + 64) * 1  # 67 floats


def narrow_net(seed: int = 0) -> nn.Module:
    """One 3 x 64 weight, no bias: the issue's layer."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 3, bias=False))


def backward(net: nn.Module, seed: int, rank: int = 0) -> None:
    gen = torch.Generator().manual_seed(1_000 * rank + seed)
    net.zero_grad()
    net(torch.randn(8, net[0].in_features, generator=gen)).pow(2).sum().backward()


class ToRung(Rule):
    """Puts every layer on ``rung`` at each check and remembers what it observed."""

    name = "to-rung"
    default_interval = 1

    def __init__(self, rung: int):
        super().__init__()
        self.rung = rung
        self.seen: list[set[str]] = []

    def decide(self, observation, ladder):
        self.seen.append(set(observation.grad_norms))
        return dict.fromkeys(observation.grad_norms, self.rung)


def quiet_state(*args, **kwargs) -> AccordionState:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return AccordionState(*args, **kwargs)


# --- the decision, in the compressor contract -------------------------------------------


def test_a_level_pays_only_while_it_sends_less_than_dense():
    assert not PowerSGD.pays((3, 64), 8)  # 201 >= 192 floats
    assert PowerSGD.pays((3, 64), 1)  # 67 < 192
    assert not PowerSGD.pays((4, 4), 2)  # 16 == 16: at least as much
    assert not OneRoundPowerSGD.pays((3, 64), 8)
    # top-k: a fraction is a choice of level, the same share of every tensor
    assert TopK.pays((10, 10), 0.49) and TopK.pays((10, 10), 0.99)
    assert HalfPrecision.pays((3, 64), "bf16") and HalfPrecision.pays((7,), "fp16")


def test_the_accounting_and_the_plan_count_such_a_layer_dense():
    assert paper_floats((3, 64), "powersgd", 8, 4) == DENSE_3X64
    assert wire_bytes((3, 64), "powersgd", 8, 4) == wire_bytes((3, 64), "dense", None, 4)
    assert paper_floats((3, 64), "powersgd", 1, 4) == RANK1_3X64
    dense, rank8, rank1 = make_plan([(3, 64), (3,)], "powersgd", [8, 1], 4, 10, 1e9, 0.0)
    assert rank8.floats_per_step == dense.floats_per_step == DENSE_3X64 + 3
    assert rank8.bytes_per_step == dense.bytes_per_step
    assert rank8.comm_time_per_step_s == dense.comm_time_per_step_s
    assert rank1.floats_per_step == RANK1_3X64 + 3


# --- the hook's work, in one process -----------------------------------------------------


def test_a_3x64_layer_at_rank_8_is_averaged_dense_and_counted_192_floats_a_step():
    net = narrow_net()
    state = quiet_state(net, "powersgd", mild=8, aggressive=8)
    for step in range(3):
        backward(net, step)
        local = net[0].weight.grad.clone()
        state.reduce_gradients()
        # one worker: the dense mean is the gradient itself, bit for bit
        assert torch.equal(net[0].weight.grad, local)
    assert "0.weight" not in state.compressor._q  # never through PowerSGD
    assert state.reducer.memory.get("0.weight") is None
    layer = state.stats()["layers"]["0.weight"]
    assert layer["floats"] == 3 * DENSE_3X64  # not 3 * 201
    assert layer["level"] == 8  # it keeps its level: the rung is the rule's


def test_on_a_ladder_8_1_the_layer_is_dense_at_rung_0_and_compressed_at_rung_1():
    net = narrow_net()
    rule = ToRung(1)
    state = quiet_state(net, "powersgd", levels=(8, 1), interval=1, interval_unit="step",
                        rule=rule)  # fmt: skip
    backward(net, 0)
    state.reduce_gradients()  # rung 0, rank 8: dense
    assert state.ledger.layers["0.weight"].floats == DENSE_3X64
    assert "0.weight" not in state.compressor._q
    state.end_step(lr_will_decay=False)  # the check: the statistic was collected while dense
    assert rule.seen == [{"0.weight"}]
    assert state.rungs() == {"0.weight": 1} and state.levels() == {"0.weight": 1}
    backward(net, 1)
    local = net[0].weight.grad.clone()
    state.reduce_gradients()  # rung 1, rank 1: compressed again
    assert state.ledger.layers["0.weight"].floats == DENSE_3X64 + RANK1_3X64
    assert state.compressor._q["0.weight"].shape == (64, 1)
    assert not torch.equal(net[0].weight.grad, local)  # a rank-1 estimate
    residual = state.reducer.memory.get("0.weight")
    torch.testing.assert_close(net[0].weight.grad + residual, local)


def test_a_layer_going_dense_after_being_compressed_sends_what_its_memory_owes():
    # 8 x 6: rank 1 sends 14 floats of 48; rank 4 would send 56, and its estimate (r' = 4
    # < 6) would not be the mean, so only the dense path gives grad + memory exactly
    comp = PowerSGD(1)
    reducer, transport = Reducer(comp), LocalTransport()
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(8, 6, generator=gen)
    transport.run(reducer.exchange(["w"], [grad], 1))  # rank 1: compressed, memory kept
    owed = reducer.memory.get("w").clone()
    assert owed.abs().sum() > 0
    comp.set_level(4, keys=["w"])  # rank 4 sends more than dense: "w" goes dense
    grad = torch.randn(8, 6, generator=gen)
    expected = grad + owed
    transport.run(reducer.exchange(["w"], [grad], 1))
    assert torch.equal(grad, expected)  # its debt went with it
    assert reducer.memory.get("w") is None  # and the memory is zero (forgotten)
    comp.set_level(1, keys=["w"])  # a level that pays: compressed again
    transport.run(reducer.exchange(["w"], [torch.randn(8, 6, generator=gen)], 1))
    assert reducer.memory.get("w") is not None


# --- the warning -------------------------------------------------------------------------


def test_the_warning_names_the_layer_and_its_levels_once_at_bind():
    net = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 3))  # 48x64 pays at 8
    with pytest.warns(RuntimeWarning) as record:
        state = AccordionState(net, "powersgd", levels=(8, 1))
    messages = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    assert messages == [
        "1 layer(s) send at least as much as dense at some levels and go dense there: "
        "'2.weight' (3x48) at rank 8 (levels [8, 1])"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning at the steps
        for _ in range(2):
            net.zero_grad()
            net(torch.randn(4, 64)).sum().backward()
            state.reduce_gradients()
            state.end_epoch(lr_will_decay=False)


def test_when_every_layer_goes_dense_at_a_level_one_warning_keeps_the_lower_rank_advice():
    with pytest.warns(RuntimeWarning) as record:
        AccordionState(narrow_net(), "powersgd", levels=(8, 1))
    messages = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1
    assert "1 layer(s) send at least as much as dense" in messages[0]
    assert "'0.weight' (3x64) at rank 8" in messages[0]
    assert "PowerSGD rank 8 sends at least as much as dense for every" in messages[0]
    assert "choose a lower rank" in messages[0]


def test_a_lazily_bound_state_lists_such_layers_once_every_layer_was_seen():
    net = narrow_net()
    state = AccordionState(None, "powersgd", levels=(8, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backward(net, 0)
        state.reduce_gradients(list(net.parameters()))  # binds the layers
        state.end_epoch(lr_will_decay=False)
    with pytest.warns(RuntimeWarning, match=r"'#0' \(3x64\) at rank 8"):
        backward(net, 1)
        state.reduce_gradients(list(net.parameters()))


def test_no_warning_for_a_model_where_every_level_pays():
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = AccordionState(net, "powersgd", levels=(8, 1))
        net(torch.randn(4, 64)).sum().backward()
        state.reduce_gradients()
    assert "0.weight" in state.compressor._q and "2.weight" in state.compressor._q
    for level in (8, 1):  # 16x32 at rank 8: 384 floats of 512; 32x64: 768 of 2048
        state.compressor.set_level(level)
        assert all(state.reducer.sends_compressed(p.grad, k)
                   for k, p in net.named_parameters() if p.dim() == 2)  # fmt: skip


# --- two processes -----------------------------------------------------------------------


def _dense_layer_matches_the_plain_average(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 3))
    twin = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 3))
    twin.load_state_dict(net.state_dict())
    ddp = DDP(net)
    state = quiet_state(net, "powersgd", levels=(8, 1))
    ddp.register_comm_hook(state, accordion_hook)
    for step in range(3):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * rank + step))
        for model in (ddp, twin):
            model.zero_grad()
            model(x).pow(2).sum().backward()
        # the plain dense average, as DDP's all-reduce computes it
        expected = twin[2].weight.grad / world_size
        dist.all_reduce(expected)
        assert torch.equal(net[2].weight.grad, expected), step
        compressed = net[0].weight.grad
        gathered = [torch.empty_like(compressed) for _ in range(world_size)]
        dist.all_gather(gathered, compressed)  # the compressed layer agrees too
        assert all(torch.equal(g, gathered[0]) for g in gathered)
    assert "2.weight" not in state.compressor._q and "0.weight" in state.compressor._q
    assert state.ledger.layers["2.weight"].floats == 3 * DENSE_3X64


def test_two_ranks_agree_and_the_hook_averages_such_a_layer_as_plain_dense():
    run_processes(_dense_layer_matches_the_plain_average, 2)
