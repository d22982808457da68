"""benchmarks/rule_signals/layer_allocation.py: the exact allocation its study reports."""

from __future__ import annotations

import itertools
import random
import sys

import pytest
import torch

from benchmark_scripts import BENCHMARKS, load_benchmark

sys.path.insert(0, str(BENCHMARKS / "rule_signals"))  # the study imports lm_probe
try:
    study = load_benchmark("rule_signals/layer_allocation.py")
finally:
    sys.path.remove(str(BENCHMARKS / "rule_signals"))


def test_the_allocation_is_the_cheapest_of_every_one_within_the_budget():
    rng = random.Random(0)
    for _ in range(40):
        sizes = [[rng.uniform(1, 9) for _ in range(3)] for _ in range(4)]
        errors = [[rng.uniform(0, 5) for _ in range(3)] for _ in range(4)]
        budget = sum(e[1] for e in errors)  # the middle option everywhere fits
        cost, error, picked = study.allocate(sizes, errors, budget)
        every = [
            (sum(s[i] for s, i in zip(sizes, pick)), sum(e[i] for e, i in zip(errors, pick)))
            for pick in itertools.product(range(3), repeat=4)
        ]
        assert cost == pytest.approx(min(c for c, e in every if e <= budget))
        assert error <= budget * (1 + 1e-9)
        assert cost == pytest.approx(sum(s[i] for s, i in zip(sizes, picked)))


def test_a_tensor_costs_its_packed_codes_and_a_scale_per_block_of_a_row():
    # 256 rows of 64: 2 bits per element, and one fp16 scale per row's block of 64
    assert study.nq_bytes((256, 64), 2) == 256 * 64 * 2 // 8 + 2 * 256
    assert [study.nq_bytes((70, 64), b) for b in study.BITS] == [
        70 * 64 * b // 8 + 2 * 70 for b in study.BITS
    ]


def test_a_shadow_average_is_the_workers_mean_and_leaves_their_gradients_alone():
    sys.path.insert(0, str(BENCHMARKS / "rule_signals"))
    try:
        import lm_probe as probe
    finally:
        sys.path.remove(str(BENCHMARKS / "rule_signals"))
    from accordion.compress import ErrorFeedback, Reducer, SimulatedTransport, make_compressor

    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(8, 4, generator=gen), torch.randn(3, generator=gen)]
             for _ in range(probe.WORKERS)]  # fmt: skip
    before = [[g.clone() for g in gw] for gw in grads]
    reducers = [Reducer(make_compressor("dense"), ErrorFeedback()) for _ in range(probe.WORKERS)]
    shadow = probe.shadow_average(reducers, SimulatedTransport(probe.WORKERS), grads)
    for i, s in enumerate(shadow):
        assert torch.allclose(s, sum(gw[i] for gw in grads) / probe.WORKERS)
    assert all(torch.equal(g, b) for gw, bw in zip(grads, before) for g, b in zip(gw, bw))
