"""The guarded ladder rule: scripted norms move layers along the ladder, decays count only
when the rate halves, the ranks agree, and its state resumes exactly."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.compress import PowerSGD
from accordion.ddp import AccordionState, accordion_hook
from accordion.policy import (
    DecayDetector,
    GuardedRule,
    Ladder,
    Observation,
    PaperRule,
    make_rule,
)
from distributed import run_processes

LADDER = Ladder(PowerSGD, (4, 2, 1))


def _drive(rule, norms, decayed=()):
    """Feed one norm per check for layer "w"; return the rung after each check."""
    rungs, out = {}, []
    for i, norm in enumerate(norms):
        obs = Observation(i, "epoch", False, {"w": norm}, rungs=rungs, decayed=i in decayed)
        rungs = rule.decide(obs, LADDER)
        out.append(rungs["w"])
    return out


def _open() -> GuardedRule:
    """A guarded rule with the whole ladder open from the start."""
    return GuardedRule(wait_for_decay=False)


def test_calm_checks_descend_the_ladder_one_rung_at_a_time():
    assert _drive(_open(), [1.0, 1.0, 1.0, 1.0, 1.0]) == [0, 1, 2, 2, 2]


def test_the_last_rung_waits_for_the_first_decay():
    assert _drive(GuardedRule(), [1.0] * 6, decayed={3}) == [0, 1, 1, 2, 2, 2]


def test_a_norm_that_grows_right_after_a_descent_steps_back_and_blocks_that_rung():
    # descend to rung 2 at check 2, then the norm jumps by 80%: back to rung 1, and calm
    # checks afterwards keep it there
    assert _drive(_open(), [1.0, 1.0, 1.0, 1.8, 1.8, 1.8, 1.8]) == [0, 1, 2, 1, 1, 1, 1]


def test_a_decay_lifts_the_block_and_the_layer_descends_again():
    norms = [1.0, 1.0, 1.0, 1.8, 1.8, 0.5, 0.5, 0.5]
    assert _drive(_open(), norms, decayed={5}) == [0, 1, 2, 1, 1, 0, 1, 2]


def test_a_norm_that_falls_after_a_descent_moves_up_one_rung_without_a_block():
    assert _drive(_open(), [1.0, 1.0, 1.0, 0.4, 0.4, 0.4]) == [0, 1, 2, 1, 2, 2]


def test_a_growing_norm_without_a_descent_before_it_moves_up_one_rung_without_a_block():
    # at rung 2 for two checks (no probation), then a jump: one rung up, and back down
    assert _drive(_open(), [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0]) == [0, 1, 2, 2, 1, 2, 2]


def test_with_a_block_a_relapse_keeps_the_layer_off_the_rung_for_that_many_checks():
    rule = GuardedRule(wait_for_decay=False, block=2)
    # relapse at check 3; checks 4 and 5 stay blocked; check 6 may descend again
    assert _drive(rule, [1.0, 1.0, 1.0, 1.8, 1.8, 1.8, 1.8, 1.8]) == [0, 1, 2, 1, 1, 1, 2, 2]


def test_by_default_a_relapse_blocks_the_rung_for_five_checks():
    norms = [1.0, 1.0, 1.0, 1.8] + [1.8] * 6
    assert _drive(_open(), norms) == [0, 1, 2, 1, 1, 1, 1, 1, 1, 2]


def test_with_block_none_a_relapse_blocks_the_rung_until_the_next_decay():
    rule = GuardedRule(wait_for_decay=False, block=None)
    assert _drive(rule, [1.0, 1.0, 1.0, 1.8] + [1.8] * 8) == [0, 1, 2] + [1] * 9


def test_with_a_block_each_further_relapse_doubles_it():
    rule = GuardedRule(wait_for_decay=False, block=1)
    norms = [1.0, 1.0, 1.0, 1.8, 1.8, 1.8, 3.3, 3.3, 3.3, 3.3]
    # first relapse at 3: blocked at 4; descends at 5; second relapse at 6: blocked 7, 8
    assert _drive(rule, norms) == [0, 1, 2, 1, 1, 2, 1, 1, 1, 2]


def test_the_guarded_rule_records_relapses_in_its_history():
    rule = _open()
    _drive(rule, [1.0, 1.0, 1.0, 1.8])
    layer = rule.history[-1]["layers"]["w"]
    assert layer["relapse"] is True and layer["limit"] == 1 and layer["rung"] == 1
    assert layer["ratio"] == pytest.approx(0.8)


def test_a_guarded_rule_loaded_from_its_state_decides_as_the_original():
    rng = random.Random(3)
    script = [rng.choice([1.0, 1.2, 2.0, 0.4]) for _ in range(30)]
    original = GuardedRule(block=2)
    first = _drive(original, script[:12], decayed={4})
    copy = GuardedRule(block=2)
    copy.load_state_dict(original.state_dict())
    rungs = {"w": first[-1]}

    def rest(rule):
        out, current = [], dict(rungs)
        for i, norm in enumerate(script[12:], start=12):
            current = rule.decide(Observation(i, "epoch", False, {"w": norm}, rungs=current),
                                  LADDER)  # fmt: skip
            out.append(current["w"])
        return out

    assert rest(copy) == rest(original)
    assert copy.state_dict() == original.state_dict()


def test_a_malformed_guarded_state_is_a_value_error_and_changes_nothing():
    rule = GuardedRule()
    _drive(rule, [1.0, 1.0, 1.0])
    before = rule.state_dict()
    with pytest.raises(ValueError, match="GuardedRule.state_dict"):
        rule.load_state_dict({"norms": {"w": 1.0}, "history": []})
    with pytest.raises(ValueError, match="GuardedRule.state_dict"):
        rule.load_state_dict({**before, "limits": {"w": -1}})
    with pytest.raises(ValueError, match="GuardedRule.state_dict"):
        rule.load_state_dict({**before, "lifts": {"w": 3}})  # a lift without a block
    assert rule.state_dict() == before


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"eta": 0}, ValueError), ({"eta": "0.5"}, TypeError), ({"decay_drop": 1.0}, ValueError),
     ({"decay_drop": 0}, ValueError), ({"decay_drop": True}, TypeError),
     ({"decay_drop": math.nan}, ValueError), ({"wait_for_decay": 1}, TypeError),
     ({"block": 0}, ValueError), ({"block": 2.0}, TypeError)],
)  # fmt: skip
def test_bad_guarded_rule_arguments_are_clear_errors(kwargs, error):
    name = next(iter(kwargs))
    with pytest.raises(error, match=name):
        GuardedRule(**kwargs)


def test_make_rule_passes_the_rule_s_own_options():
    rule = make_rule("guarded", 0.3, block=4)
    assert isinstance(rule, GuardedRule) and (rule.eta, rule.block) == (0.3, 4)
    with pytest.raises(ValueError, match="rule must be one of"):
        make_rule("median")


# --- what counts as a decay -------------------------------------------------------------


def _cosine(epoch: int, epochs: int = 60, warmup: int = 3, peak: float = 0.1) -> float:
    if epoch < warmup:
        return peak * (epoch + 1) / warmup
    t = (epoch - warmup) / (epochs - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * t))


def test_with_a_drop_a_cosine_schedule_decays_only_each_time_its_rate_halves():
    detector = DecayDetector(0.5)
    decays = [e for e in range(60) if detector.decay(_cosine(e), None)]
    rates = [_cosine(e) for e in decays]
    # each counted decay is at half (or less) of the previous one's rate; warm-up is none
    assert decays and decays[0] > 3
    assert rates[0] <= 0.05 + 1e-12
    assert all(b <= 0.5 * a + 1e-12 for a, b in zip(rates, rates[1:]))
    assert len(decays) < 12


def test_without_a_drop_every_fall_of_the_rate_is_a_decay():
    detector = DecayDetector()
    falls = sum(_cosine(e) < _cosine(e - 1) for e in range(1, 60))
    assert falls > 50
    assert sum(detector.decay(_cosine(e), None) for e in range(60)) == falls


def test_with_a_drop_a_step_decay_by_ten_is_a_decay():
    detector = DecayDetector(0.5)
    assert [detector.decay(lr, None) for lr in (0.1, 0.1, 0.01, 0.01, 0.001)] == [
        False, False, True, False, True]  # fmt: skip


@pytest.mark.parametrize("drop", [0, 1, 1.5, -0.1])
def test_a_drop_outside_zero_one_is_a_value_error(drop):
    with pytest.raises(ValueError, match="drop"):
        DecayDetector(drop)


# --- in the controller --------------------------------------------------------------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))


def _epochs(state, net, lrs, gen, steps=2, then=None):
    """Train ``len(lrs)`` epochs through ``reduce_gradients`` (``then``: the rate after
    the last one, default the last one's); the rungs after each."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lrs[0])
    out = []
    for epoch, lr in enumerate(lrs):
        for group in optimizer.param_groups:
            group["lr"] = lr
        for _ in range(steps):
            optimizer.zero_grad()
            net(torch.randn(8, 12, generator=gen)).pow(2).mean().backward()
            state.reduce_gradients()
            optimizer.step()
        next_lr = lrs[epoch + 1] if epoch + 1 < len(lrs) else (then or lr)
        state.end_epoch(next_lr=next_lr)
        out.append(state.rungs())
    return out


def test_under_a_cosine_schedule_the_guarded_rule_compresses_where_the_paper_rule_cannot():
    lrs = [_cosine(e, epochs=20) for e in range(20)]
    rungs = {}
    for name, rule in (("paper", PaperRule()), ("guarded", GuardedRule(eta=10.0))):
        net = _mlp()
        state = AccordionState(net, "powersgd", levels=(4, 2, 1), interval=1, rule=rule)
        rungs[name] = _epochs(state, net, lrs, torch.Generator().manual_seed(0))
    # the paper's override sees a decay at every epoch after warm-up: always the mildest
    assert all(r == 0 for step in rungs["paper"][3:-1] for r in step.values())
    assert sum(r == LADDER.top for step in rungs["guarded"] for r in step.values()) > 10


@pytest.mark.parametrize("interval", [1, 2])
def test_a_guarded_state_resumes_exactly_from_its_state_dict(interval):
    lrs = [0.1] * 4 + [0.01] * 4  # the decay comes after epoch 3: between checks at interval 2
    net = _mlp()
    state = AccordionState(net, "powersgd", levels=(4, 2, 1), interval=interval,
                           rule=GuardedRule())  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    _epochs(state, net, lrs[:4], gen, then=lrs[4])
    saved = state.state_dict()
    assert saved["decayed"] is (interval == 2) and saved["decay_reference"] == 0.01
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    after = _epochs(state, net, lrs[4:], gen.manual_seed(1))
    net2 = _mlp()
    net2.load_state_dict(weights)
    resumed = AccordionState(net2, "powersgd", levels=(4, 2, 1), interval=interval,
                             rule=GuardedRule())  # fmt: skip
    resumed.load_state_dict(saved)
    assert _epochs(resumed, net2, lrs[4:], gen.manual_seed(1)) == after
    assert resumed.rule.state_dict() == state.rule.state_dict()
    assert torch.equal(
        torch.cat([p.reshape(-1) for p in net.parameters()]),
        torch.cat([p.reshape(-1) for p in net2.parameters()]),
    )


# --- four real workers whose local norms disagree ------------------------------------------


def _guarded_four_ranks(rank, world_size, out_dir):
    net = _mlp()
    model = DDP(net)
    state = AccordionState(net, "powersgd", levels=(4, 2, 1), interval=1, rule=GuardedRule())
    model.register_comm_hook(state, accordion_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    levels = []
    for epoch in range(8):
        # each rank scales its loss by its own schedule: alone, the ranks' norm tests
        # would decide differently at most checks
        scale = (1 + rank) ** (epoch % 3)
        for _ in range(2):
            optimizer.zero_grad()
            (scale * model(torch.randn(8, 12, generator=gen)).pow(2).mean()).backward()
            levels.append(state.levels())
            optimizer.step()
        state.end_epoch(next_lr=0.05)
    torch.save({"levels": levels, "history": state.rule.history}, f"{out_dir}/rank{rank}.pt")


def test_four_ranks_with_disagreeing_local_norms_agree_on_every_rung_at_every_step(tmp_path):
    run_processes(_guarded_four_ranks, 4, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    assert all(r["levels"] == ranks[0]["levels"] for r in ranks[1:])
    assert all(r["history"] == ranks[0]["history"] for r in ranks[1:])
    assert len({level for step in ranks[0]["levels"] for level in step.values()}) >= 2
