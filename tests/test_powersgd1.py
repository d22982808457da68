"""Specifications of one-round PowerSGD (``powersgd1``): both factors in one all-reduce."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.accounting import wire_bytes
from accordion.compress import (
    AllReduce,
    OneRoundPowerSGD,
    PowerSGD,
    Reducer,
    SimulatedTransport,
    make_compressor,
)
from accordion.ddp import AccordionState, accordion_hook
from distributed import run_processes


def run_workers(reducers, keys, grads_per_worker):
    world = SimulatedTransport(len(reducers))
    world.run([r.exchange(keys, g, len(reducers)) for r, g in zip(reducers, grads_per_worker)])
    return world


def low_rank(n, m, r, gen):
    return torch.randn(n, r, generator=gen) @ torch.randn(r, m, generator=gen)


def noisy_copies(average, workers, gen):
    """Full-rank matrices, one per worker, whose mean is exactly ``average``."""
    noise = [torch.randn(average.shape, generator=gen, dtype=average.dtype) for _ in range(workers)]
    mean = sum(noise) / workers
    return [[average + n - mean] for n in noise]


def test_it_is_registered_with_powersgd_levels():
    comp = make_compressor("powersgd1", 4)
    assert isinstance(comp, OneRoundPowerSGD)
    assert comp.level("w") == 4
    with pytest.raises(ValueError, match="rank"):
        make_compressor("powersgd1", 0)


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_a_low_rank_average_is_recovered_after_a_few_steps(rank):
    # its first step projects on the seed bases; the bases then turn to the average's
    # column and row spaces, whatever each worker's own (full-rank) matrix is
    gen = torch.Generator().manual_seed(rank)
    workers = 4
    reducers = [Reducer(OneRoundPowerSGD(rank)) for _ in range(workers)]
    average = low_rank(40, 24, rank, gen)
    errors = []
    for _ in range(12):
        grads = noisy_copies(average, workers, gen)
        run_workers(reducers, ["w"], grads)
        errors.append(float((grads[0][0] - average).norm() / average.norm()))
    assert errors[0] > 0.05  # the first step is an approximation ...
    # ... but the bases and error feedback catch up (slower than PowerSGD's, whose basis
    # is fresh: here each step projects on the bases of the step before)
    assert errors[-1] < 2e-3 and errors[-1] < errors[0] / 300, errors


def test_a_rank_at_the_smaller_side_is_exact_at_the_first_step():
    # the compressor itself: the reducer would send it dense (a full rank does not pay)
    gen = torch.Generator().manual_seed(0)
    comps = [OneRoundPowerSGD(6) for _ in range(3)]
    grads = [torch.randn(6, 9, generator=gen) for _ in range(3)]
    mean = sum(grads) / 3
    exchanges = [c.exchange(["w"], [g.clone()], 3) for c, g in zip(comps, grads)]
    averages = SimulatedTransport(3).run(exchanges)
    torch.testing.assert_close(averages[0][0][0], mean)


def test_a_rank_below_four_warns_at_binding_and_four_does_not():
    # layers wide enough that rank 4 pays for each (a 4 x 32 one would go dense at it)
    wide = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 16))
    with pytest.warns(RuntimeWarning, match="rank 1 can lose accuracy"):
        AccordionState(wide, compressor="powersgd1", levels=(4, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AccordionState(wide, compressor="powersgd1", mild=4, aggressive=4)


def test_an_exchange_asks_for_one_all_reduce_of_powersgds_floats():
    shapes = [(16, 3, 3, 3), (16, 27), (10, 16)]
    comp = OneRoundPowerSGD(2)
    phases = []
    exchange = comp.exchange(["a", "b", "c"], [torch.randn(s) for s in shapes], 1)
    reply = None
    while True:
        try:
            phase = exchange.send(reply)
        except StopIteration:
            break
        phases.append(phase)
        reply = [op.tensor for op in phase]
    assert len(phases) == 1 and len(phases[0]) == 1
    assert isinstance(phases[0][0], AllReduce)
    floats = sum(PowerSGD.paper_floats(s, 2, 4) for s in shapes)  # (n + m) r per tensor
    assert phases[0][0].tensor.numel() == floats


def test_the_simulated_wire_bytes_equal_the_accounted_ones_and_powersgds():
    shapes = [(32, 3, 3, 3), (32,), (10, 32)]
    world = run_workers(
        [Reducer(OneRoundPowerSGD(2)) for _ in range(4)],
        ["a", "b", "c"],
        [[torch.randn(s) for s in shapes] for _ in range(4)],
    )
    accounted = sum(wire_bytes(s, "powersgd1", 2, 4) for s in shapes)
    assert world.bytes_sent == pytest.approx(accounted)
    assert accounted == pytest.approx(sum(wire_bytes(s, "powersgd", 2, 4) for s in shapes))


def test_every_worker_gets_the_same_average_and_keeps_the_same_bases():
    gen = torch.Generator().manual_seed(2)
    comps = [OneRoundPowerSGD(2) for _ in range(3)]
    reducers = [Reducer(c) for c in comps]
    for _ in range(3):
        grads = [[torch.randn(12, 8, generator=gen)] for _ in range(3)]
        run_workers(reducers, ["w"], grads)
        for g in grads[1:]:
            assert torch.equal(g[0], grads[0][0])
    for c in comps[1:]:
        assert torch.equal(c._p["w"], comps[0]._p["w"])
        assert torch.equal(c._q["w"], comps[0]._q["w"])


def test_the_residual_is_never_larger_than_the_input():
    # an orthogonal projection: error feedback cannot grow without bound
    gen = torch.Generator().manual_seed(4)
    comp = OneRoundPowerSGD(1)
    for _ in range(20):
        m = torch.randn(15, 11, generator=gen)
        original = m.clone()
        transport = SimulatedTransport(1)
        ((average, residual),) = transport.run([comp.exchange(["w"], [m], 1)])[0]
        torch.testing.assert_close(average + residual, original)
        assert residual.norm() <= original.norm() * (1 + 1e-6)


def test_its_state_round_trips_and_resumes_bitwise(tmp_path):
    gen = torch.Generator().manual_seed(6)
    steps = [[torch.randn(9, 7, generator=gen), torch.randn(5, 4, generator=gen)]
             for _ in range(4)]  # fmt: skip
    straight = Reducer(OneRoundPowerSGD(2))
    first = Reducer(OneRoundPowerSGD(2))
    for grads in steps[:2]:
        run_workers([straight], ["a", "b"], [[g.clone() for g in grads]])
        run_workers([first], ["a", "b"], [[g.clone() for g in grads]])
    torch.save(first.state_dict(), tmp_path / "s.pt")
    resumed = Reducer(OneRoundPowerSGD(1))
    resumed.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    for grads in steps[2:]:
        a, b = [g.clone() for g in grads], [g.clone() for g in grads]
        run_workers([straight], ["a", "b"], [a])
        run_workers([resumed], ["a", "b"], [b])
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_state_without_its_p_bases_is_refused_and_changes_nothing():
    comp = OneRoundPowerSGD(2)
    run_workers([Reducer(comp)], ["w"], [[torch.randn(6, 5)]])
    state = comp.state_dict()
    del state["p"]
    target = OneRoundPowerSGD(3)
    with pytest.raises(ValueError, match="p"):
        target.load_state_dict(state)
    assert target.default_level == 3 and not target._p


def test_a_p_basis_of_the_wrong_shape_fails_the_shape_check():
    comp = OneRoundPowerSGD(2)
    run_workers([Reducer(comp)], ["w"], [[torch.randn(6, 5)]])
    comp.check_shapes({"w": (6, 5)})
    with pytest.raises(ValueError, match=r"p\['w'\]"):
        comp.check_shapes({"w": (7, 5)})


def test_a_rank_change_keeps_working_and_sends_the_new_ranks_floats():
    gen = torch.Generator().manual_seed(8)
    comp = OneRoundPowerSGD(4)
    reducer = Reducer(comp)
    for level in (4, 1, 3):
        comp.set_level(level)
        world = run_workers([reducer], ["w"], [[torch.randn(12, 10, generator=gen)]])
        assert world.bytes_sent == pytest.approx(wire_bytes((12, 10), "powersgd1", level, 1))
        assert comp._p["w"].shape == (12, level) and comp._q["w"].shape == (10, level)


# --- over DDP, in real processes ------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(20, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _one_all_reduce_per_bucket(rank, world_size):
    torch.manual_seed(0)
    net = _Net()
    model = DDP(net)
    state = AccordionState(net, compressor="powersgd1", mild=2, aggressive=2)
    model.register_comm_hook(state, accordion_hook)
    calls = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        for step in range(3):
            gen = torch.Generator().manual_seed(100 * rank + step)
            model.zero_grad()
            model(torch.randn(8, 20, generator=gen)).square().mean().backward()
    finally:
        dist.all_reduce = original
    # one bucket: every step is one all-reduce of the biases and both factors together
    params = list(net.parameters())
    floats = sum(PowerSGD.paper_floats(tuple(p.shape), 2, 2) for p in params if p.dim() >= 2)
    floats += sum(p.numel() for p in params if p.dim() < 2)
    assert calls == [floats] * 3, calls
    grads = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    gathered = [torch.empty_like(grads) for _ in range(world_size)]
    dist.all_gather(gathered, grads)
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    assert state.ledger.total_floats > 0


def test_over_ddp_each_step_is_one_all_reduce_and_ranks_agree():
    run_processes(_one_all_reduce_per_bucket, 2)
