"""accordion.diloco_schedule.SyncSchedule and DiLoCo's ``sync_growth``: rounds of H
steps, or of H (peak lr / lr) ** p steps, longer (p > 0) or shorter (p < 0) as the inner
rate decays."""

from __future__ import annotations

import copy

import pytest
import torch

import diloco_parts
from accordion import Controller, DiLoCo, StreamingDiLoCo
from accordion.diloco_schedule import MAX_GROWTH, SyncSchedule
from distributed import run_processes


def _ends(schedule: SyncSchedule, rates: list[float]) -> list[int]:
    """The rounds' steps (from 1) at which ``schedule`` ends a round, one rate per step."""
    ends = []
    for t, lr in enumerate(rates, start=1):
        schedule.observe(lr)
        if schedule.due(t, lr):
            ends.append(t)
    return ends


def test_without_growth_every_round_is_sync_every_steps():
    schedule = SyncSchedule(3)
    assert _ends(schedule, [1.0, 0.5, 0.1, 0.01, 0.001, 1e-4, 1e-5]) == [3, 6]
    assert schedule.lengths == []  # fixed H keeps no record
    assert schedule.max_sync_every == MAX_GROWTH * 3


def test_a_round_lengthens_by_the_power_of_peak_over_its_first_steps_rate():
    schedule = SyncSchedule(2, growth=2, max_sync_every=8)
    schedule.observe(1.0)  # the peak
    assert [schedule.length_at(lr) for lr in (1.0, 0.8, 0.6, 0.5, 0.1)] == [2, 3, 6, 8, 8]
    # 2 * (1 / 0.8) ** 2 = 3.125 -> 3; 2 * (1 / 0.6) ** 2 = 5.6 -> 6; capped at 8


def test_each_rounds_length_is_set_by_its_first_step_and_kept_to_its_end():
    schedule = SyncSchedule(2, growth=1, max_sync_every=10)
    # round 1 starts at the peak (2 steps); round 2 starts at 0.25 (8 steps), however
    # the rate moves inside it; round 3 starts back at the peak
    rates = [1.0, 1.0] + [0.25] + [1.0] * 7 + [1.0, 1.0]
    assert _ends(schedule, rates) == [2, 10, 12]
    assert schedule.lengths == [2, 8, 2]


def test_a_negative_power_shortens_the_rounds_as_the_rate_decays_down_to_the_minimum():
    schedule = SyncSchedule(40, growth=-1, min_sync_every=12)
    schedule.observe(1.0)
    assert [schedule.length_at(lr) for lr in (1.0, 0.5, 0.4, 0.1, 0.0)] == [40, 20, 16, 12, 12]
    assert (schedule.max_sync_every, SyncSchedule(40, growth=-1).min_sync_every) == (40, 10)


def test_a_learning_rate_warmup_counts_as_the_peak_and_a_rate_of_zero_is_the_longest_round():
    schedule = SyncSchedule(4, growth=2, max_sync_every=12)
    for lr in (0.1, 0.5, 1.0):  # a warm-up, observed before the rounds start
        schedule.observe(lr)
    assert schedule.length_at(1.0) == 4 and schedule.length_at(0.5) == 12
    assert schedule.length_at(0.0) == 12


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(growth="2"), TypeError, "sync_growth must be a number"),
    (dict(growth=float("nan")), ValueError, "sync_growth must be finite"),
    (dict(max_sync_every=8), ValueError, "max_sync_every=8 needs sync_growth other than 0"),
    (dict(min_sync_every=2), ValueError, "min_sync_every=2 needs sync_growth other than 0"),
    (dict(growth=2.0, max_sync_every=3), ValueError, "max_sync_every must be an int >= 4"),
    (dict(growth=2.0, max_sync_every=8.0), TypeError, "max_sync_every must be an int"),
    (dict(growth=-1.0, min_sync_every=5), ValueError, r"min_sync_every must be an int in "
                                                      r"\[1, sync_every=4\], got 5"),
    (dict(growth=-1.0, min_sync_every=0), ValueError, "min_sync_every must be an int >= 1"),
])  # fmt: skip
def test_a_bad_schedule_argument_is_refused_naming_it(kwargs, error, match):
    with pytest.raises(error, match=match):
        SyncSchedule(4, **kwargs)


def test_a_negative_or_infinite_rate_is_refused():
    schedule = SyncSchedule(4, growth=2)
    for lr in (-0.1, float("inf")):
        with pytest.raises(ValueError, match="inner learning rate must be finite and >= 0"):
            schedule.observe(lr)


# --- DiLoCo with sync_growth -----------------------------------------------------------


def _decaying(growth: float, rates: list[float], start: int = 2, low: int | None = None):
    net = diloco_parts.net()
    inner = torch.optim.SGD(net.parameters(), lr=rates[0])
    bounds = {} if not growth else {"max_sync_every": 8} if growth > 0 else {"min_sync_every": low}
    diloco = DiLoCo(net, inner, start, sync_growth=growth, **bounds)
    synced = []
    for step, lr in enumerate(rates):
        inner.param_groups[0]["lr"] = lr
        diloco_parts.inner_step(net, inner, 0, step)
        if diloco.step():
            synced.append(step + 1)
    return diloco, synced


def test_diloco_with_growth_syncs_less_often_as_the_inner_rate_decays():
    rates = [1.0] * 4 + [0.5] * 16
    plain, plain_syncs = _decaying(0.0, rates)
    grown, grown_syncs = _decaying(2.0, rates)
    assert plain_syncs == list(range(2, 21, 2))
    assert grown_syncs == [2, 4, 12, 20]  # two rounds at the peak, then 2 * 2**2 = 8 steps
    assert grown.stats()["round_lengths"] == [2, 2, 8, 8]
    assert plain.stats()["round_lengths"] == []
    assert grown.state.ledger.total_bytes == plain.state.ledger.total_bytes * 4 / 10
    shrunk, shrunk_syncs = _decaying(-1.0, [1.0] * 8 + [0.25] * 8, start=8, low=2)
    assert shrunk_syncs == [8, 10, 12, 14, 16]  # one round of 8 at the peak, then 8 / 4


def _resume_growing(rank: int, world: int, out: str) -> None:
    def build():
        net = diloco_parts.net()
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        state = Controller(net, "int", levels=(4, 4), interval_unit="step")
        return net, inner, DiLoCo(net, inner, 2, state=state, sync_growth=2, max_sync_every=6)

    def run(parts, steps, saved=None):
        net, inner, diloco = parts
        for step in steps:
            inner.param_groups[0]["lr"] = 1e-2 if step < 4 else 5e-3  # rounds of 2, then 6
            diloco_parts.inner_step(net, inner, rank, step)
            diloco.step()
            if step == 6:  # inside the first 6-step round
                saved = copy.deepcopy([p.state_dict() for p in parts])
        return saved

    straight = build()
    saved = run(straight, range(16))
    resumed = build()
    for part, state in zip(resumed, saved):
        part.load_state_dict(state)
    run(resumed, range(7, 16))
    if rank == 0:
        flat = [torch.cat([p.detach().flatten() for p in parts[0].parameters()])
                for parts in (straight, resumed)]  # fmt: skip
        torch.save((*flat, straight[2].schedule.lengths, resumed[2].schedule.lengths), out)


def test_a_run_resumed_inside_a_grown_round_ends_bitwise_equal_to_a_straight_run(tmp_path):
    out = tmp_path / "grown.pt"
    run_processes(_resume_growing, 2, str(out))
    straight, resumed, lengths, resumed_lengths = torch.load(out)
    assert torch.equal(straight, resumed)
    assert lengths == resumed_lengths == [2, 2, 6, 6]


def test_a_state_dict_must_match_the_growth_of_the_diloco_loading_it():
    net = diloco_parts.net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    fixed = DiLoCo(net, inner, 2).state_dict()
    grown = DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), 2, sync_growth=1.0)
    with pytest.raises(ValueError, match="schedule must be a state dict for a DiLoCo with "
                                         "sync_growth=1"):  # fmt: skip
        grown.load_state_dict(fixed)
    old = {k: v for k, v in fixed.items() if k != "schedule"}  # saved before growth existed
    DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), 2).load_state_dict(old)
    with pytest.raises(ValueError, match="schedule must be None"):
        DiLoCo(net, inner, 2).load_state_dict(grown.state_dict())


def test_streaming_diloco_refuses_growing_rounds():
    net = diloco_parts.net()
    with pytest.raises(ValueError, match="sync_growth=2.0: StreamingDiLoCo's fragments"):
        StreamingDiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), 4, sync_growth=2.0)
