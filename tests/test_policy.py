"""The policy layer: ladders, schedules, rules, and rules plugged into the controller."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.batch import BatchSizes
from accordion.compress import PowerSGD, TopK
from accordion.ddp import AccordionState, accordion_hook
from accordion.policy import Ladder, PaperRule, Schedule
from distributed import run_processes
from rule_after_epoch import ClimbEveryK

# --- the ladder -------------------------------------------------------------------------


def test_a_ladder_keeps_its_levels_mildest_first():
    ladder = Ladder(PowerSGD, (4, 2, 1))
    assert (ladder.mildest, ladder.most_aggressive, ladder.top, len(ladder)) == (4, 1, 2, 3)
    assert ladder.adaptive


def test_a_ladder_of_equal_levels_is_static():
    assert not Ladder(TopK, (0.1, 0.1)).adaptive


@pytest.mark.parametrize("levels", [(1, 2), (4, 1, 2), (0.5,)])
def test_a_ladder_out_of_order_or_too_short_is_a_value_error(levels):
    cls = TopK if isinstance(levels[0], float) else PowerSGD
    with pytest.raises(ValueError, match="levels must"):
        Ladder(cls, levels)


def test_a_ladder_of_a_bare_string_is_a_type_error():
    with pytest.raises(TypeError, match="levels must be a sequence"):
        Ladder(PowerSGD, "421")


@pytest.mark.parametrize(("rung", "error"), [(3, ValueError), (-1, ValueError), (True, TypeError)])
def test_a_rung_outside_the_ladder_is_rejected(rung, error):
    with pytest.raises(error, match="rung of 'w'"):
        Ladder(PowerSGD, (4, 2, 1)).check_rung("w", rung)


def test_a_ladder_of_a_compressor_keeps_it_as_its_kind_and_compressor():
    ladder = Ladder(PowerSGD, (4, 2, 1))
    assert ladder.kind is ladder.compressor is PowerSGD
    assert repr(ladder) == "Ladder(powersgd, (4, 2, 1))"


def test_a_ladder_holds_batch_sizes_smallest_first():
    ladder = Ladder(BatchSizes, (512, 4096))
    assert (ladder.mildest, ladder.most_aggressive, ladder.top) == (512, 4096, 1)
    assert repr(ladder) == "Ladder(batch, (512, 4096))"
    assert BatchSizes.label(512) == "batch 512"


@pytest.mark.parametrize(
    ("levels", "error"), [((4096, 512), ValueError), ((0, 512), ValueError), ((8.0, 16), TypeError)]
)
def test_a_ladder_of_batch_sizes_out_of_order_or_not_batches_is_rejected(levels, error):
    with pytest.raises(error, match="levels must|batch size"):
        Ladder(BatchSizes, levels)


def test_a_ladder_of_something_that_is_not_a_level_kind_is_a_type_error():
    with pytest.raises(TypeError, match="kind must be a level kind.*lacks check_level"):
        Ladder(type("Kind", (), {"name": "k"}), (1, 2))


# --- the schedule -----------------------------------------------------------------------


def test_an_epoch_schedule_checks_every_interval_epochs_from_epoch_zero():
    schedule = Schedule(3, "epoch")
    assert [schedule.check_index(e) for e in range(7)] == [0, None, None, 3, None, None, 6]
    assert [schedule.collecting(e) for e in range(4)] == [True, False, False, True]


def test_a_step_schedule_checks_at_each_window_end_and_always_collects():
    schedule = Schedule(2, "step")
    assert [schedule.check_index(s) for s in range(1, 7)] == [None, 0, None, 1, None, 2]
    assert schedule.collecting(5)


# --- a rule plugged in, on a ladder of three rungs ----------------------------------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))  # fmt: skip


def _climb_through_three_rungs(rank, world_size, out_dir):
    net = _mlp()
    model = DDP(net)
    state = AccordionState(net, "powersgd", levels=(4, 2, 1), interval=1, rule=ClimbEveryK(2))
    model.register_comm_hook(state, accordion_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    levels, grads = [], []
    for _epoch in range(6):
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.randn(8, 12, generator=gen)).pow(2).mean().backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]))
            levels.append(state.levels())
            optimizer.step()
        state.end_epoch(next_lr=0.05)
    torch.save({"levels": levels, "grads": grads, "seen": state.rule.seen,
                "rungs": state.rungs()}, f"{out_dir}/rank{rank}.pt")  # fmt: skip


def test_a_plugged_in_rule_drives_three_rungs_and_the_ranks_agree_at_every_step(tmp_path):
    run_processes(_climb_through_three_rungs, 2, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    seen_levels = {level for step in r0["levels"] for level in step.values()}
    assert seen_levels == {4, 2, 1}  # every layer passed through every rung
    # the decision of epoch e's end holds from epoch e + 1: rung (e // 2) from epoch e + 1
    assert [step["0.weight"] for step in r0["levels"][::2]] == [4, 4, 4, 2, 2, 1]
    assert r0["levels"] == r1["levels"]
    assert all(torch.equal(a, b) for a, b in zip(r0["grads"], r1["grads"]))
    assert r0["rungs"] == {"0.weight": 2, "2.weight": 2, "4.weight": 2}


def test_a_rule_sees_the_same_agreed_statistics_on_every_rank(tmp_path):
    run_processes(_climb_through_three_rungs, 2, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["seen"] == r1["seen"]
    assert all(set(s["memory_norms"]) == set(s["grad_norms"]) for s in r0["seen"])
    # the memory is what compression still owes: nothing before the first step, then > 0
    assert any(v > 0 for s in r0["seen"][1:] for v in s["memory_norms"].values())


class _RankDependent(PaperRule):
    """A faulty rule: rank 1 always picks the most aggressive rung."""

    def decide(self, observation, ladder):
        rungs = super().decide(observation, ladder)
        return dict.fromkeys(rungs, ladder.top) if dist.get_rank() == 1 else rungs


def _faulty_rule_is_overruled(rank, world_size, out_dir):
    import warnings

    net = _mlp()
    model = DDP(net)
    state = AccordionState(net, "powersgd", levels=(4, 2, 1), interval=1, rule=_RankDependent())
    model.register_comm_hook(state, accordion_hook)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(8, 12)).pow(2).mean().backward()
        state.end_epoch(next_lr=0.1)
    torch.save({"levels": state.levels(), "warned": [str(w.message) for w in caught]},
               f"{out_dir}/rank{rank}.pt")  # fmt: skip


def test_a_rule_deciding_differently_on_another_rank_is_overruled_by_rank_0(tmp_path):
    run_processes(_faulty_rule_is_overruled, 2, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["levels"] == r1["levels"] == {"0.weight": 4, "2.weight": 4, "4.weight": 4}
    assert r0["warned"] == []
    assert any("rank 0's decision applies" in w for w in r1["warned"])


def test_a_rule_that_is_not_a_rule_is_a_type_error():
    with pytest.raises(TypeError, match="rule must be an accordion.policy.Rule"):
        AccordionState(_mlp(), rule=lambda observation, ladder: {})


def test_eta_with_another_rule_is_a_value_error():
    with pytest.raises(ValueError, match="eta is the default rule's threshold"):
        AccordionState(_mlp(), eta=0.3, rule=ClimbEveryK(1))


def test_levels_and_mild_together_are_a_value_error():
    with pytest.raises(ValueError, match="levels or mild/aggressive"):
        AccordionState(_mlp(), levels=(4, 2, 1), mild=4)


def test_a_state_on_a_ladder_reports_its_levels_and_rungs():
    state = AccordionState(_mlp(), "topk", levels=(0.9, 0.5, 0.1), interval=1)
    assert set(state.levels().values()) == {0.9}
    assert (state.mild, state.aggressive, state.stats()["ladder"]) == (0.9, 0.1, [0.9, 0.5, 0.1])
