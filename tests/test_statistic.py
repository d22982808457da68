"""The statistic part on its own: what each kind gathers, and the ranks' agreement on its
norms, driven over workers simulated in one process (``SimulatedTransport``)."""

from __future__ import annotations

import math

import pytest
import torch

from accordion.compress import ErrorFeedback, PowerSGD, Reducer, SimulatedTransport
from accordion.statistic import (
    STATISTICS,
    Layers,
    MeanStatistic,
    Rank0Statistic,
    ShardCombined,
    ShardedStatistic,
    make_statistic,
)
from accordion.statistics import shard_owners

SHAPES = {"a": (6, 5), "b": (4, 4), "bias": (4,), "c": (3, 2)}  # "bias": not compressed
WORLD = 2


def _layers() -> Layers:
    return Layers(SHAPES, Reducer(PowerSGD(2), ErrorFeedback()))


def _grads(worker: int, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * worker + step)
    return {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def _observed(statistic, worker: int, layers: Layers, steps: int = 2, world: int = WORLD):
    """``statistic`` after ``steps`` steps of worker ``worker``'s gradients, and their sums."""
    sums: dict[str, torch.Tensor] = {}
    for step in range(steps):
        grads = _grads(worker, step)
        statistic.observe(list(grads), list(grads.values()), layers, world, worker)
        for key, grad in grads.items():
            sums[key] = sums.get(key, 0) + grad
    return statistic, sums


def _agreed(statistics, layers, with_memory=False):
    transport = SimulatedTransport(WORLD)
    exchanges = [s.agreement(layers[w], WORLD, w, with_memory) for w, s in enumerate(statistics)]
    return transport.run(exchanges), transport


def test_each_kind_is_made_by_its_name_and_a_statistic_passes_through():
    assert [type(make_statistic(name)) for name in STATISTICS] == [
        Rank0Statistic, MeanStatistic, ShardedStatistic
    ]
    sharded = ShardedStatistic()
    assert make_statistic(sharded) is sharded


@pytest.mark.parametrize(("value", "error"), [("median", ValueError), (3, TypeError)])
def test_an_unknown_statistic_is_refused_naming_the_choices(value, error):
    with pytest.raises(error, match=r"statistic must be one of \('rank0', 'mean', 'sharded'\)"):
        make_statistic(value)


def test_the_sharded_statistic_over_two_workers_gives_every_worker_each_owners_norms():
    layers = [_layers(), _layers()]
    observed = [_observed(ShardedStatistic(), w, layers[w]) for w in range(WORLD)]
    results, transport = _agreed([s for s, _ in observed], layers)
    owners = shard_owners({k: s for k, s in SHAPES.items() if len(s) >= 2}, WORLD)
    expected = {k: float(observed[owners[k]][1][k].norm()) for k in owners}
    for grad_norms, memory_norms in results:
        assert grad_norms.keys() == expected.keys() and memory_norms == {}
        for key, norm in expected.items():
            assert grad_norms[key] == pytest.approx(norm, rel=1e-6)
    assert transport.bytes_sent > 0  # one all-reduce
    for worker, (statistic, _) in enumerate(observed):  # each keeps only its own layers
        assert set(statistic.sums.keys_in(SHAPES)) == {k for k, r in owners.items() if r == worker}


def test_the_rank0_statistic_gives_every_worker_rank_0s_norms():
    layers = [_layers(), _layers()]
    observed = [_observed(Rank0Statistic(), w, layers[w]) for w in range(WORLD)]
    results, _ = _agreed([s for s, _ in observed], layers)
    rank0 = observed[0][1]
    for grad_norms, _ in results:
        assert set(grad_norms) == {"a", "b", "c"}
        for key, norm in grad_norms.items():
            assert norm == pytest.approx(float(rank0[key].norm()), rel=1e-6)


def test_the_mean_statistic_averages_the_norms_over_the_workers():
    layers = [_layers(), _layers()]
    observed = [_observed(MeanStatistic(), w, layers[w]) for w in range(WORLD)]
    results, _ = _agreed([s for s, _ in observed], layers)
    for key in ("a", "b", "c"):
        mean = sum(float(sums[key].norm()) for _, sums in observed) / WORLD
        assert results[0][0][key] == pytest.approx(mean, rel=1e-6)
        assert results[1][0][key] == results[0][0][key]


def test_the_mean_statistic_leaves_out_a_worker_whose_every_gradient_was_not_finite():
    layers = [_layers(), _layers()]
    statistics = [MeanStatistic(), MeanStatistic()]
    good = _grads(0, 0)
    bad = {k: torch.full(s, math.inf) for k, s in SHAPES.items()}
    for worker, grads in enumerate((good, bad)):
        statistics[worker].observe(list(grads), list(grads.values()), layers[worker], WORLD,
                                   worker)  # fmt: skip
    results, _ = _agreed(statistics, layers)
    for grad_norms, _ in results:
        assert grad_norms["a"] == pytest.approx(float(good["a"].norm()), rel=1e-6)


def test_memory_norms_are_agreed_with_the_gradient_norms_when_asked_for():
    layers = [_layers(), _layers()]
    observed = [_observed(ShardedStatistic(), w, layers[w]) for w in range(WORLD)]
    memory = torch.ones(SHAPES["a"])
    owners = shard_owners({k: s for k, s in SHAPES.items() if len(s) >= 2}, WORLD)
    layers[owners["a"]].reducer.memory.update("a", memory)
    results, _ = _agreed([s for s, _ in observed], layers, with_memory=True)
    for _, memory_norms in results:
        assert memory_norms["a"] == pytest.approx(float(memory.norm()))
        assert memory_norms["b"] == 0.0  # no memory yet


def test_one_worker_agrees_without_a_collective():
    layers = _layers()
    statistic, sums = _observed(ShardedStatistic(), 0, layers, world=1)
    transport = SimulatedTransport(1)
    (grad_norms, _), = transport.run([statistic.agreement(layers, 1, 0)])
    assert transport.bytes_sent == 0
    assert grad_norms["b"] == pytest.approx(float(sums["b"].norm()), rel=1e-6)


def test_fsdps_shards_combine_into_the_whole_parameters_norm():
    shards = [({"w": 3.0}, {"w": 1.0}), ({"w": 4.0}, {"w": 0.0})]
    results = SimulatedTransport(2).run([ShardCombined.combination(*s) for s in shards])
    for grad_norms, memory_norms in results:
        assert grad_norms == {"w": pytest.approx(5.0)}
        assert memory_norms == {"w": pytest.approx(1.0)}


def test_a_shard_combined_statistic_has_its_inner_kinds_name_and_sums():
    inner = Rank0Statistic()
    combined = ShardCombined(inner, SimulatedTransport(2))
    assert combined.name == "rank0" and combined.source == "rank 0"
    assert combined.sums is inner.sums
    with pytest.raises(TypeError, match="inner must be"):
        ShardCombined("rank0", SimulatedTransport(2))
