"""Measurements for the cost model, in one process (the link is measured in test_ddp.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accordion.calibration import measure_compute, measure_step_compute
from accordion.compress import PowerSGD


def bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def test_measure_step_compute_leaves_weights_buffers_grads_and_rng_as_they_were():
    net = bn_net()
    x = torch.randn(16, 6)
    net(x).sum().backward()  # a gradient from before, to be kept
    before = {k: v.clone() for k, v in net.state_dict().items()}
    grads = [p.grad.clone() for p in net.parameters()]
    rng = torch.get_rng_state()

    def step():
        net(torch.randn(16, 6)).pow(2).sum().backward()  # moves BatchNorm stats, draws

    seconds = measure_step_compute(net, step, steps=3)
    assert seconds > 0
    for key, value in net.state_dict().items():
        assert torch.equal(value, before[key]), key
    for param, grad in zip(net.parameters(), grads):
        assert torch.equal(param.grad, grad)
    assert torch.equal(torch.get_rng_state(), rng)


def test_measure_step_compute_restores_the_model_even_when_the_step_fails():
    net = bn_net()
    before = {k: v.clone() for k, v in net.state_dict().items()}

    def step():
        net(torch.randn(4, 6)).sum().backward()
        raise RuntimeError("out of memory, say")

    with pytest.raises(RuntimeError, match="out of memory"):
        measure_step_compute(net, step, steps=1, warmup=0)
    for key, value in net.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in net.parameters())


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"model": "net"}, TypeError, "model must be an nn.Module"),
        ({"step": 3}, TypeError, "step must be a callable"),
        ({"steps": 0}, ValueError, "steps must be an int >= 1, got 0"),
        ({"warmup": -1}, ValueError, "warmup must be an int >= 0, got -1"),
    ],
)
def test_measure_step_compute_rejects_bad_arguments(kwargs, error, match):
    args = {"model": bn_net(), "step": lambda: None, **kwargs}
    with pytest.raises(error, match=match):
        measure_step_compute(args.pop("model"), args.pop("step"), **args)


def test_measure_compute_gives_one_non_negative_time_per_shape_and_reuses_repeats():
    shapes = [(64, 32), (8,), (64, 32), (16, 4, 3)]
    times = measure_compute(lambda: PowerSGD(2), shapes, repeats=2)
    assert len(times) == 4
    assert all(t >= 0 for t in times)
    assert times[0] == times[2]  # one measurement per distinct shape


def test_measure_compute_rejects_zero_repeats():
    with pytest.raises(ValueError, match="repeats must be an int >= 1, got 0"):
        measure_compute(lambda: PowerSGD(2), [(4, 4)], repeats=0)
