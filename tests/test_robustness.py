"""Robustness: non-finite gradients never stop the rule, checkpoints load all or nothing,
and bad arguments (process group, PowerSGD rank, learning rate) fail early and clearly."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.ddp import AccordionState, accordion_hook
from accordion.policy import PaperRule
from accordion.statistics import GradientSums
from distributed import run_processes


def make_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def step(net, state, seed: int = 0, poison: str | None = None) -> None:
    """One backward and reduce_gradients; ``poison`` names a parameter whose gradient is
    made NaN before Accordion sees it (as an AMP overflow would)."""
    gen = torch.Generator().manual_seed(seed)
    net.zero_grad()
    net(torch.randn(5, 8, generator=gen)).pow(2).sum().backward()
    if poison is not None:
        dict(net.named_parameters())[poison].grad[0, 0] = math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the reducer's non-finite warning
        state.reduce_gradients()


def same(a, b) -> bool:
    """Deep equality of nested state dicts, tensors compared exactly (dtype and shape too)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))  # fmt: skip
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return (isinstance(a, Mapping) and isinstance(b, Mapping) and a.keys() == b.keys()
                and all(same(a[k], b[k]) for k in a))  # fmt: skip
    if isinstance(a, list | tuple) or isinstance(b, list | tuple):
        return (type(a) is type(b) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))  # fmt: skip
    return type(a) is type(b) and a == b


# --- non-finite gradients: the statistic ------------------------------------------------


def test_a_non_finite_gradient_adds_nothing_to_the_sum_and_is_counted_as_skipped():
    sums = GradientSums()
    good = [torch.randn(4, 3), torch.randn(4, 3)]
    bad = torch.randn(4, 3)
    bad[1, 2] = math.inf
    for grad in (good[0], bad, good[1]):
        sums.add("w", grad)
    assert torch.equal(sums.state_dict()["sums"]["w"], good[0] + good[1])
    assert sums.skipped_steps() == {"w": 1}
    assert bool(sums.valid(["w"])[0])


def test_a_check_after_a_non_finite_step_decides_from_the_finite_steps_only():
    net = make_net()
    state = AccordionState(net, "powersgd", mild=2, aggressive=1, interval=1, rule=PaperRule())
    expected = torch.zeros(16, 8)
    for i in range(3):
        step(net, state, seed=i, poison="0.weight" if i == 1 else None)
        if i != 1:
            expected += _local_grad(net, i)
    state.end_epoch(next_lr=0.1)  # would have remembered a NaN norm before the fix
    record = state.rule.history[-1]["layers"]["0.weight"]
    assert record["new_norm"] == pytest.approx(float(expected.norm()), rel=1e-6)
    assert state.epoch == 1
    assert state.stats()["statistic_skipped_steps"] == {"0.weight": 1}


def _local_grad(net, seed: int) -> torch.Tensor:
    """The local gradient of ``net``'s first weight at ``step(seed)`` (before averaging)."""
    copy_ = copy.deepcopy(net)
    copy_.zero_grad()
    gen = torch.Generator().manual_seed(seed)
    copy_(torch.randn(5, 8, generator=gen)).pow(2).sum().backward()
    return copy_[0].weight.grad


def test_a_layer_whose_every_gradient_of_a_window_was_non_finite_keeps_its_rung():
    net = make_net()
    state = AccordionState(net, "powersgd", mild=2, aggressive=1, interval=1,
                           interval_unit="step", rule=PaperRule(eta=10.0))  # fmt: skip
    for i in range(2):  # two calm windows: every layer at the aggressive rung
        step(net, state, seed=i)
        state.end_step(next_lr=0.1)
    assert state.rungs() == {"0.weight": 1, "2.weight": 1}
    remembered = state.rule.norms["0.weight"]
    step(net, state, seed=2, poison="0.weight")
    with pytest.warns(RuntimeWarning, match=r"statistic of 1 layer.*keep their rung"):
        state.end_step(next_lr=0.1)
    assert state.rungs() == {"0.weight": 1, "2.weight": 1}
    assert state.rule.norms["0.weight"] == remembered  # compared again at the next window
    step(net, state, seed=3)
    state.end_step(next_lr=0.1)
    assert state.rule.history[-1]["layers"]["0.weight"]["old_norm"] == remembered


def test_non_finite_accumulators_of_an_older_checkpoint_only_skip_one_check():
    net = make_net()
    state = AccordionState(net, "powersgd", mild=2, aggressive=1, interval=1, rule=PaperRule())
    step(net, state)
    saved = state.state_dict()
    # the plain map of sums that versions before the finite check saved, poisoned
    saved["accumulators"] = {k: torch.full_like(t, math.nan)
                             for k, t in saved["accumulators"]["sums"].items()}  # fmt: skip
    state.load_state_dict(saved)
    with pytest.warns(RuntimeWarning, match="is not finite"):
        state.end_epoch(next_lr=0.1)
    step(net, state, seed=1)
    state.end_epoch(next_lr=0.1)
    assert state.epoch == 2
    assert all(math.isfinite(v["new_norm"]) for v in state.rule.history[-1]["layers"].values())


def test_skipped_steps_survive_a_checkpoint():
    net = make_net()
    state = AccordionState(net, "powersgd", mild=2, aggressive=1, interval=1)
    step(net, state, poison="2.weight")
    other = AccordionState(make_net(), "powersgd", mild=2, aggressive=1, interval=1)
    other.load_state_dict(state.state_dict())
    assert other.stats()["statistic_skipped_steps"] == {"2.weight": 1}
    assert same(other.state_dict(), state.state_dict())


def _non_finite_worker(rank: int, world: int, statistic: str, bad_rank: int, every: bool):
    """Train 3 epochs under DDP with the hook; ``bad_rank``'s first-layer gradient is NaN
    at one step (or every step, ``every``) of the check epoch 0, and the step is skipped
    (as GradScaler does). Checks each decision's norm, the levels and the ranks' agreement."""
    net = make_net()
    model = DDP(net)
    state = AccordionState(net, "powersgd", mild=2, aggressive=1, interval=1,
                           statistic=statistic, rule=PaperRule(eta=10.0))  # fmt: skip
    model.register_comm_hook(state, accordion_hook)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    levels = []
    for epoch in range(3):
        for i in range(3):
            poison = rank == bad_rank and epoch == 0 and (every or i == 1)
            nan = (lambda g: torch.full_like(g, math.nan))  # noqa: E731 - one step's overflow
            hook = net[0].weight.register_hook(nan) if poison else None
            optimizer.zero_grad()
            gen = torch.Generator().manual_seed(100 * rank + 10 * epoch + i)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                model(torch.randn(4, 8, generator=gen)).pow(2).sum().backward()
            if hook is not None:
                hook.remove()
            if all(bool(torch.isfinite(p.grad).all()) for p in net.parameters()):
                optimizer.step()
        local = (float(state.sums.norms(["0.weight"])[0]), bool(state.sums.valid(["0.weight"])[0]))
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
        state.end_epoch(next_lr=0.01)
        assert state.epoch == epoch + 1
        if statistic == "rank0":
            expected = gathered[0][0]
        else:
            norms = [norm for norm, valid in gathered if valid]
            expected = sum(norms) / len(norms)
        got = state.rule.history[-1]["layers"]["0.weight"]["new_norm"]
        assert math.isclose(got, expected, rel_tol=1e-9), (epoch, got, expected)
        levels.append(state.levels())
    everyone = [None] * world
    dist.all_gather_object(everyone, (levels, state.rule.history))
    assert all(e == everyone[0] for e in everyone)
    assert levels[0] == {"0.weight": 2, "2.weight": 2}  # the first check: critical
    assert levels[-1] == {"0.weight": 1, "2.weight": 1}  # calm since: switched
    skipped = {"0.weight": 3 if every else 1} if rank == bad_rank else {}
    assert state.stats()["statistic_skipped_steps"] == skipped


@pytest.mark.parametrize(
    "statistic,bad_rank,every", [("rank0", 0, False), ("mean", 1, True)], ids=["rank0", "mean"]
)
def test_non_finite_gradients_on_a_deciding_rank_never_stop_the_rule(statistic, bad_rank, every):
    run_processes(_non_finite_worker, 2, statistic, bad_rank, every, timeout=90)


# --- checkpoints: all or nothing --------------------------------------------------------


def _trained(seed: int) -> AccordionState:
    """A state with memories, factors, sums of a period in progress, a rule history and
    rungs: the parts a checkpoint holds."""
    net = make_net()
    state = AccordionState(net, "powersgd", levels=(4, 2, 1), interval=1)
    for i in range(3):
        step(net, state, seed=seed + i)
        state.end_epoch(next_lr=0.1)
    step(net, state, seed=seed + 9)
    return state


def _drop(*path):
    def tamper(state):
        for key in path[:-1]:
            state = state[key]
        del state[path[-1]]
    return tamper


def _set(value, *path):
    def tamper(state):
        for key in path[:-1]:
            state = state[key]
        state[path[-1]] = value
    return tamper


_REQUIRED = ("format world_size rank config shapes reducer accumulators rule rungs ledger "
             "epoch step last_lr").split()  # fmt: skip
_Q = ("reducer", "compressor", "q", "0.weight")
_MEMORY = ("reducer", "memory", "memory", "0.weight")
TAMPERED = {
    **{f"missing-{key}": (_drop(key), key) for key in _REQUIRED},
    "unknown-entry": (_set(1, "extra"), r"unknown entries \['extra'\]"),
    "unknown-config-key": (_set(1, "config", "extra"), "config"),
    "missing-config-key": (_drop("config", "levels"), r"config lacks keys \['levels'\]"),
    "missing-reducer-memory": (_drop("reducer", "memory"), r"reducer .*missing keys \['memory'\]"),
    "unknown-reducer-key": (_set(1, "reducer", "extra"), "reducer"),
    "missing-compressor-q": (_drop("reducer", "compressor", "q"), r"missing keys \['q'\]"),
    "unknown-compressor-key": (_set(1, "reducer", "compressor", "extra"), "extra"),
    "wrong-q-shape": (_set(torch.randn(8, 3), *_Q), r"q\['0.weight'\] has shape \(8, 3\)"),
    "non-finite-q": (_set(torch.full((8, 2), math.nan), *_Q), "inf or NaN"),
    "wrong-memory-shape": (_set(torch.zeros(3, 3), *_MEMORY), r"memory\['0.weight'\] has shape"),
    "non-finite-memory": (_set(torch.full((16, 8), math.inf), *_MEMORY), "inf or NaN"),
    "memory-of-no-parameter": (_set(torch.zeros(2), "reducer", "memory", "memory", "x"), "'x'"),
    "level-off-the-ladder": (_set(7, "reducer", "compressor", "levels", "0.weight"),
                             "not on this state's ladder"),  # fmt: skip
    "invalid-level": (_set(0, "reducer", "compressor", "levels", "0.weight"), "rank must be"),
    "level-as-str": (_set("2", "reducer", "compressor", "levels", "0.weight"), "rank must be"),
    "default-level-off-the-ladder": (_set(3, "reducer", "compressor", "default_level"),
                                     "default_level"),  # fmt: skip
    "unknown-dense-key": (_set(["x"], "reducer", "dense_keys"), "dense_keys"),
    "negative-non-finite-steps": (_set(-1, "reducer", "non_finite_steps"), "non_finite_steps"),
    "epoch-as-str": (_set("3", "epoch"), "epoch"),
    "negative-epoch": (_set(-1, "epoch"), "epoch"),
    "step-as-float": (_set(1.5, "step"), "step"),
    "rung-out-of-range": (_set(3, "rungs", "0.weight"), r"rung of '0.weight'"),
    "rung-as-bool": (_set(True, "rungs", "0.weight"), r"rung of '0.weight'"),
    "rung-of-no-parameter": (_set(0, "rungs", "x"), "rungs"),
    "wrong-sum-shape": (_set(torch.zeros(2, 2), "accumulators", "sums", "0.weight"),
                        r"accumulators\['0.weight'\] has shape"),  # fmt: skip
    "unknown-accumulators-key": (_set({}, "accumulators", "extra"), "unknown keys"),
    "ledger-missing-steps": (_drop("ledger", "layers", "0.weight", "steps"), "ledger"),
    "ledger-negative-floats": (_set(-5, "ledger", "layers", "0.weight", "floats"), "ledger"),
    "unknown-rule-key": (_set(1, "rule", "extra"), "rule"),
    "rule-norm-as-str": (_set("1.5", "rule", "norms", "0.weight"), "rule"),
    "nan-last-lr": (_set(math.nan, "last_lr"), "last_lr"),
    "str-last-lr": (_set("0.1", "last_lr"), "last_lr"),
    "decayed-as-str": (_set("yes", "decayed"), "decayed"),
    "wrong-shape": (_set([16, 9], "shapes", "0.weight"), "does not match the model"),
    "shape-as-str": (_set("16x8", "shapes", "0.weight"), "shapes"),
    "other-world-size": (_set(2, "world_size"), "world size"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_a_tampered_checkpoint_is_a_value_error_naming_it_and_changes_nothing(case):
    tamper, match = TAMPERED[case]
    saved = _trained(seed=0).state_dict()
    tamper(saved)
    target = _trained(seed=100)
    before = target.state_dict()
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(saved)
    assert same(target.state_dict(), before)


def test_a_checkpoint_still_loads_after_a_refused_one():
    source, target = _trained(seed=0), _trained(seed=100)
    bad = source.state_dict()
    bad["rungs"]["0.weight"] = 9
    with pytest.raises(ValueError):
        target.load_state_dict(bad)
    target.load_state_dict(source.state_dict())
    assert same(target.state_dict(), source.state_dict())


# --- arguments --------------------------------------------------------------------------


@pytest.mark.parametrize("group,name", [("world", "str"), (0, "int"), (object(), "object")])
def test_a_process_group_that_is_not_one_is_a_type_error_naming_it(group, name):
    with pytest.raises(TypeError, match=rf"process_group must be None .*ProcessGroup.*got {name}"):
        AccordionState(make_net(), process_group=group)


def test_a_powersgd_rank_beyond_the_largest_useful_one_is_refused():
    with pytest.raises(ValueError, match=r"rank must be an int >= 1 and <= 65536 .*got 1000000000"):
        AccordionState(make_net(), "powersgd", mild=10**9)


def test_a_rank_that_sends_more_than_dense_for_every_layer_warns_at_binding():
    with pytest.warns(RuntimeWarning, match="PowerSGD rank 64 sends at least as much as dense"):
        AccordionState(make_net(), "powersgd", mild=64, aggressive=1)


def test_a_lazily_bound_state_warns_of_such_a_rank_once_every_layer_was_seen():
    net = make_net()
    state = AccordionState(None, "powersgd", mild=64, aggressive=1)
    for i in range(2):
        net.zero_grad()
        net(torch.randn(5, 8)).sum().backward()
        if i == 0:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                state.reduce_gradients(list(net.parameters()))  # binds the layers
        else:
            with pytest.warns(RuntimeWarning, match="sends at least as much as dense"):
                state.reduce_gradients(list(net.parameters()))


def test_a_ladder_whose_levels_pay_for_every_layer_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AccordionState(make_net(), "powersgd", mild=2, aggressive=1)  # each layer pays


@pytest.mark.parametrize(
    "lr,error", [(math.nan, ValueError), (math.inf, ValueError), (-0.1, ValueError),
                 ("0.1", TypeError), (True, TypeError), (None, TypeError)],  # fmt: skip
)
@pytest.mark.parametrize("unit", ["epoch", "step"])
def test_a_bad_optimizer_learning_rate_is_refused_and_counts_nothing(lr, error, unit):
    net = make_net()
    state = AccordionState(net, "powersgd", mild=2, aggressive=1, interval=1, interval_unit=unit)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    step(net, state)
    optimizer.param_groups[0]["lr"] = lr
    before = state.state_dict()
    end = state.end_epoch if unit == "epoch" else state.end_step
    with pytest.raises(error, match=r"optimizer.param_groups\[0\]\['lr'\] must be a finite"):
        end(optimizer)
    assert same(state.state_dict(), before)


@pytest.mark.parametrize("lr,error", [(math.nan, ValueError), ("0.1", TypeError)])
def test_a_bad_next_lr_is_refused_naming_it(lr, error):
    state = AccordionState(make_net(), "powersgd", mild=2, aggressive=1)
    with pytest.raises(error, match=r"next_lr must be a finite number >= 0"):
        state.end_epoch(next_lr=lr)
    assert state.epoch == 0
