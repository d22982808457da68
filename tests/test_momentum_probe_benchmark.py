"""benchmarks/rule_signals/momentum_probe.py: the exchange and the clip its probe reports."""

from __future__ import annotations

import sys

import pytest
import torch

from accordion.compress import ErrorFeedback, Reducer, make_compressor
from benchmark_scripts import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS / "rule_signals"))  # the probe imports its siblings
try:
    import momentum_probe as probe
finally:
    sys.path.remove(str(BENCHMARKS / "rule_signals"))


def _two_workers(seed: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(6, 4, generator=gen), torch.randn(5, generator=gen)] for _ in range(2)]


def test_an_exchange_of_momenta_at_a_lossless_level_is_their_mean():
    momenta = _two_workers(0)
    expected = [(a + b) / 2 for a, b in zip(*momenta)]
    reducers = [Reducer(make_compressor("dense"), ErrorFeedback()) for _ in range(2)]
    for got, want in zip(probe.moment_exchange(reducers, momenta), expected):
        assert torch.allclose(got, want)


def test_the_rms_clip_clips_the_root_mean_square_of_the_workers_own_norms():
    grads = _two_workers(1)
    squares = [sum(float(g.square().sum()) for g in gw) for gw in grads]
    rms = (sum(squares) / 2) ** 0.5
    assert rms > 1  # so that the clip at 1.0 binds
    assert probe.clip_after_freeze("momentum1-rms", grads) == pytest.approx(1 / rms, rel=1e-5)


def test_the_oracle_clip_clips_the_norm_of_the_true_average():
    grads = _two_workers(2)
    norm = float(torch.cat([((a + b) / 2).reshape(-1) for a, b in zip(*grads)]).norm())
    assert norm > 1
    assert probe.clip_after_freeze("momentum1", grads) == pytest.approx(1 / norm, rel=1e-5)


def test_the_update_error_is_the_root_of_the_summed_squared_errors_over_the_summed_squares():
    sums = [0.0, 0.0]
    probe.noise_probe.update_error(sums, [torch.tensor([3.0, 0.0])], [torch.tensor([0.0, 0.0])])
    probe.noise_probe.update_error(sums, [torch.tensor([1.0])], [torch.tensor([4.0])])
    assert sums == [9.0 + 9.0, 16.0]
    assert probe.noise_probe.relative(sums) == pytest.approx((18 / 16) ** 0.5)
    assert probe.noise_probe.relative([0.0, 0.0]) is None


def test_before_the_freeze_the_clipped_average_is_folded_into_adams_two_moments():
    grads = _two_workers(2)
    m, v, s = ([torch.zeros_like(g) for g in grads[0]] for _ in range(3))
    reducers = [Reducer(make_compressor("dense"), ErrorFeedback()) for _ in range(2)]
    probe.first_moment(m, v, s, grads, reducers)
    mean = [(a + b) / 2 for a, b in zip(*grads)]
    coef = probe.noise_probe.clip_factor(mean)
    assert coef < 1  # so that the clip shows
    b1, b2 = probe.probe.BETAS
    for mi, vi, si, avg in zip(m, v, s, mean):
        torch.testing.assert_close(mi, (1 - b1) * coef * avg)
        torch.testing.assert_close(vi, (1 - b2) * (coef * avg) ** 2)
        assert si.eq(0).all()  # a lossless exchange predicts no noise
