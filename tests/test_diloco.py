"""accordion.DiLoCo: inner steps without traffic, an outer step on the averaged
(compressed) pseudo-gradient every ``sync_every`` steps; real gloo processes."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import diloco_parts
from accordion import Controller, DiLoCo
from accordion.compress.transport import LocalTransport
from accordion.diloco import OUTER_LR, OUTER_MOMENTUM
from accordion.diloco_warmup import WarmupEnd
from distributed import run_processes

_net, _batch, _inner_step = diloco_parts.net, diloco_parts.batch, diloco_parts.inner_step


def _flat(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in net.parameters()])


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


# --- H = 1 with plain SGD outside is data-parallel SGD ---------------------------------


def _reference_sgd(world: int, steps: int, lr: float) -> torch.Tensor:
    """Data-parallel SGD in one process: every rank's gradient averaged each step."""
    net = _net()
    for step in range(steps):
        grads = []
        for rank in range(world):
            net.zero_grad()
            x, y = _batch(rank, step)
            nn.functional.mse_loss(net(x), y).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        with torch.no_grad():
            for i, p in enumerate(net.parameters()):
                p -= lr * sum(g[i] for g in grads) / world
    return _flat(net)


def _one_step_rounds(rank: int, world: int, out: str) -> None:
    net = _net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    diloco = DiLoCo(net, inner, 1, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
    for step in range(5):
        _inner_step(net, inner, rank, step)
        assert diloco.step()
    if rank == 0:
        torch.save(_flat(net), out)


def test_one_inner_sgd_step_per_round_with_a_plain_outer_step_is_data_parallel_sgd(tmp_path):
    out = tmp_path / "diloco.pt"
    run_processes(_one_step_rounds, 2, str(out))
    torch.testing.assert_close(torch.load(out), _reference_sgd(2, 5, 0.1), rtol=1e-5, atol=1e-6)


# --- drift between syncs, agreement after them, no traffic in between -------------------


def _drift_and_agree(rank: int, world: int, out: str) -> None:
    net = _net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    diloco = DiLoCo(net, inner, 3)
    record = []
    for step in range(6):
        _inner_step(net, inner, rank, step)
        synced = diloco.step()
        a, b = _gathered(_flat(net))
        record.append((synced, torch.equal(a, b), diloco.stats()["total_bytes"]))
    if rank == 0:
        torch.save(record, out)


@pytest.fixture(scope="module")
def drift(tmp_path_factory) -> list[tuple[bool, bool, float]]:
    """Per inner step of H = 3 on 2 ranks: (synced, ranks equal, bytes sent so far)."""
    out = tmp_path_factory.mktemp("diloco") / "record.pt"
    run_processes(_drift_and_agree, 2, str(out))
    return torch.load(out)


def test_between_syncs_the_ranks_drift_apart_and_each_sync_makes_them_bitwise_equal(drift):
    record = drift
    assert [r[0] for r in record] == [False, False, True, False, False, True]
    assert [r[1] for r in record] == [False, False, True, False, False, True]


def test_only_the_syncs_send_anything(drift):
    sent = [r[2] for r in drift]
    assert sent[0] == sent[1] == 0 < sent[2] == sent[3] == sent[4] < sent[5]


# --- compressed rounds -------------------------------------------------------------------


def _compressed_rounds(rank: int, world: int, out: str) -> None:
    net = _net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    state = Controller(net, "int", levels=(4, 4), interval_unit="step")
    diloco = DiLoCo(net, inner, 2, state=state)
    for step in range(6):
        _inner_step(net, inner, rank, step)
        diloco.step()
    memory = [state.reducer.memory.get(k) for k in ("0.weight", "2.weight")]
    stats = diloco.stats()
    if rank == 0:
        torch.save({"bytes": stats["total_bytes"], "rounds": stats["rounds"],
                    "step": stats["step"], "memory": memory,
                    "dense_floats": stats["dense_floats"]}, out)  # fmt: skip


def test_an_int4_sync_sends_less_than_a_dense_one_and_keeps_its_error_for_the_next(tmp_path):
    out = tmp_path / "compressed.pt"
    run_processes(_compressed_rounds, 2, str(out))
    got = torch.load(out)
    assert got["rounds"] == got["step"] == 3  # one step of the state per round
    dense_bytes = got["dense_floats"] * 4
    assert 0 < got["bytes"] < dense_bytes / 4  # 4-bit values and their scales
    assert all(m is not None and m.abs().sum() > 0 for m in got["memory"])


# --- resume -------------------------------------------------------------------------------


def _resume(rank: int, world: int, out: str) -> None:
    def build():
        net = _net()
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        state = Controller(net, "int", levels=(8, 4), interval=1, interval_unit="step")
        return net, inner, DiLoCo(net, inner, 2, state=state)

    (net, diloco), (net2, diloco2) = diloco_parts.straight_and_resumed(build, rank, 8, 3)
    if rank == 0:
        torch.save((_flat(net), _flat(net2), diloco.rounds, diloco2.rounds), out)


def test_a_run_resumed_from_its_state_dict_ends_bitwise_equal_to_a_straight_run(tmp_path):
    out = tmp_path / "resume.pt"
    run_processes(_resume, 2, str(out))
    straight, resumed, rounds, rounds2 = torch.load(out)
    assert torch.equal(straight, resumed)
    assert rounds == rounds2 == 4


def _loaded_dict_kept(rank: int, world: int, out: str) -> None:
    net = _net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    diloco = DiLoCo(net, inner, 2)
    for step in range(4):  # two rounds: the outer Nesterov momentum is set
        _inner_step(net, inner, rank, step)
        diloco.step()
    saved = diloco.state_dict()
    snapshot = copy.deepcopy(saved)
    net2 = _net()
    inner2 = torch.optim.AdamW(net2.parameters(), lr=1e-2)
    resumed = DiLoCo(net2, inner2, 2)
    resumed.load_state_dict(saved)
    for step in range(4, 6):
        _inner_step(net2, inner2, rank, step)
        resumed.step()
    buffers = [(saved["outer"]["state"][i]["momentum_buffer"],
                snapshot["outer"]["state"][i]["momentum_buffer"]) for i in saved["outer"]["state"]]
    if rank == 0:
        torch.save(all(torch.equal(a, b) for a, b in buffers), out)


def test_a_run_resumed_from_a_state_dict_leaves_that_dict_unchanged(tmp_path):
    out = tmp_path / "kept.pt"
    run_processes(_loaded_dict_kept, 2, str(out))
    assert torch.load(out) is True


# --- defaults and bad arguments -----------------------------------------------------------


def test_the_default_outer_optimizer_is_diloco_nesterov_sgd():
    net = _net()
    diloco = DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), 4)
    group = diloco.outer.param_groups[0]
    assert isinstance(diloco.outer, torch.optim.SGD) and group["nesterov"]
    assert (group["lr"], group["momentum"]) == (OUTER_LR, OUTER_MOMENTUM) == (0.7, 0.9)
    assert diloco.state.compressor_name == "dense"


def test_a_sync_restores_the_inner_loops_gradients():
    net = _net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    diloco = DiLoCo(net, inner, 1)
    _inner_step(net, inner, 0, 0)
    before = [p.grad.clone() for p in net.parameters()]
    diloco.step()
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), before))


@pytest.mark.parametrize(
    "value, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError),
                     ("2", TypeError)],
)  # fmt: skip
def test_a_bad_sync_every_is_refused_naming_it(value, error):
    net = _net()
    with pytest.raises(error, match=f"sync_every must be an int >= 1, got {value!r}"):
        DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), value)


def test_an_inner_optimizer_missing_parameters_is_refused_naming_them():
    net = _net()
    inner = torch.optim.SGD(net[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"lacks \['2.weight', '2.bias'\]"):
        DiLoCo(net, inner, 2)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [({"state": "dense"}, TypeError, "state must be an accordion Controller"),
     ({"outer_optimizer": 3}, TypeError, "outer_optimizer must be a callable or None, got 3"),
     ({"outer_optimizer": lambda ps: None}, TypeError, "must return a torch.optim.Optimizer")],
)  # fmt: skip
def test_bad_keyword_arguments_are_type_errors_naming_them(kwargs, error, match):
    net = _net()
    with pytest.raises(error, match=match):
        DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), 2, **kwargs)


def test_a_state_counting_epochs_or_bound_to_another_model_is_refused():
    net = _net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="interval_unit='step'"):
        DiLoCo(net, inner, 2, state=Controller(net, "int", levels=(8, 4)))
    other = Controller(_net(), "int", levels=(8, 4), interval_unit="step")
    with pytest.raises(ValueError, match="state must be bound to model"):
        DiLoCo(net, inner, 2, state=other)


def test_a_model_that_is_not_a_module_is_a_type_error():
    net = _net()
    with pytest.raises(TypeError, match="model must be an nn.Module, got str"):
        DiLoCo("net", torch.optim.SGD(net.parameters(), lr=0.1), 2)


def test_a_state_dict_of_another_model_is_refused_and_changes_nothing():
    net = _net()
    diloco = DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), 2)
    other = nn.Linear(3, 3)
    saved = DiLoCo(other, torch.optim.SGD(other.parameters(), lr=0.1), 2).state_dict()
    before = diloco.state_dict()
    with pytest.raises(ValueError, match="anchor must be 4 tensors"):
        diloco.load_state_dict(saved)
    after = diloco.state_dict()
    assert after["inner_steps"] == before["inner_steps"]
    assert all(torch.equal(a, b) for a, b in zip(after["anchor"], before["anchor"]))


def test_a_state_dict_with_a_bad_outer_optimiser_leaves_the_accordion_state_unchanged():
    net, twin = _net(), _net()
    diloco = DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), 2)
    source = DiLoCo(twin, torch.optim.SGD(twin.parameters(), lr=0.1), 2)
    saved = source.state_dict()
    saved["state"]["step"] = 7  # an Accordion state that a load would bring in
    saved["outer"]["param_groups"] = saved["outer"]["param_groups"] * 2  # of other groups
    with pytest.raises(ValueError):
        diloco.load_state_dict(saved)
    assert diloco.state.state_dict()["step"] == 0


def test_a_state_dict_with_a_bad_accordion_state_leaves_the_outer_optimiser_unchanged():
    net, twin = _net(), _net()
    diloco = DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), 2)
    source = DiLoCo(twin, torch.optim.SGD(twin.parameters(), lr=0.1), 2)
    for p in source.params:  # an outer momentum that a load would bring in
        source.outer.state[p]["momentum_buffer"] = torch.ones_like(p)
    saved = {**source.state_dict(), "state": {"not": "a controller state"}}
    with pytest.raises(ValueError):
        diloco.load_state_dict(saved)
    assert diloco.outer.state_dict()["state"] == {}


# --- a data-parallel warm-up before the rounds -----------------------------------------


def _warmup_then_rounds(rank: int, world: int, out: str) -> None:
    net = _net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    diloco = DiLoCo(net, inner, 2, warmup_steps=3)
    record = []
    for step in range(7):
        _inner_step(net, inner, rank, step)
        synced = diloco.step()
        a, b = _gathered(_flat(net))
        record.append((synced, torch.equal(a, b), diloco.sent()[1], diloco.rounds))
    if rank == 0:
        torch.save(record, out)


@pytest.fixture(scope="module")
def warmup(tmp_path_factory) -> list[tuple[bool, bool, float, int]]:
    """Per inner step of 3 warm-up steps then H = 2 on 2 ranks: (synced, ranks equal,
    bytes sent so far, rounds)."""
    out = tmp_path_factory.mktemp("warmup") / "record.pt"
    run_processes(_warmup_then_rounds, 2, str(out))
    return torch.load(out)


def test_warmup_steps_keep_the_ranks_bitwise_equal_then_rounds_of_h_follow(warmup):
    assert [r[1] for r in warmup] == [True, True, True, False, True, False, True]
    assert [r[0] for r in warmup] == [False, False, False, False, True, False, True]
    assert [r[3] for r in warmup] == [0, 0, 0, 0, 1, 1, 2]


def test_each_warmup_step_sends_a_dense_average_and_the_rounds_add_theirs(warmup):
    sent = [r[2] for r in warmup]
    step = sent[0]
    assert step > 0 and sent[1] == pytest.approx(2 * step) and sent[2] == pytest.approx(3 * step)
    assert sent[3] == sent[2] < sent[4] == sent[5] < sent[6]


def _warmup_sgd(rank: int, world: int, out: str, closure: bool = False) -> None:
    net = _net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    diloco = DiLoCo(net, inner, 10, warmup_steps=4)
    for step in range(4):
        if closure:  # as Lightning steps: the warm-up's average after the closure's backward
            inner.step(lambda step=step: diloco_parts.loss_backward(net, inner, rank, step))
        else:
            _inner_step(net, inner, rank, step)
        assert not diloco.step()
    if rank == 0:
        torch.save(_flat(net), out)


@pytest.mark.parametrize("closure", [False, True], ids=["step()", "step(closure)"])
def test_warmup_steps_with_plain_sgd_are_data_parallel_sgd(tmp_path, closure):
    out = tmp_path / "warmup-sgd.pt"
    run_processes(_warmup_sgd, 2, str(out), closure)
    torch.testing.assert_close(torch.load(out), _reference_sgd(2, 4, 0.1), rtol=1e-5, atol=1e-6)


def _resume_in_warmup(rank: int, world: int, out: str) -> None:
    def build():
        net = _net()
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        warm = Controller(net, "int", levels=(8, 8), interval_unit="step")
        return net, inner, DiLoCo(net, inner, 2, warmup_steps=3, warmup_state=warm)

    # saved after the second step: inside the warm-up
    (net, diloco), (net2, diloco2) = diloco_parts.straight_and_resumed(build, rank, 7, 1)
    if rank == 0:
        torch.save((_flat(net), _flat(net2), diloco.sent(), diloco2.sent()), out)


def test_a_run_resumed_inside_its_warmup_ends_bitwise_equal_to_a_straight_run(tmp_path):
    out = tmp_path / "resume-warmup.pt"
    run_processes(_resume_in_warmup, 2, str(out))
    straight, resumed, sent, sent2 = torch.load(out)
    assert torch.equal(straight, resumed)
    assert sent == sent2


def test_a_warmup_state_without_warmup_steps_or_shared_with_the_rounds_is_refused():
    net = _net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    state = Controller(net, "dense", interval_unit="step")
    with pytest.raises(ValueError, match="warmup_state needs warmup_steps >= 1"):
        DiLoCo(net, inner, 2, warmup_state=state)
    with pytest.raises(ValueError, match="warmup_state must be another state than state"):
        DiLoCo(net, inner, 2, state=state, warmup_steps=2, warmup_state=state)
    with pytest.raises(TypeError, match="warmup_state must be an accordion Controller"):
        DiLoCo(net, inner, 2, warmup_steps=2, warmup_state="dense")
    with pytest.raises(ValueError, match="warmup_steps must be"):
        DiLoCo(net, inner, 2, warmup_steps=-1)


def test_a_state_dict_with_or_without_a_warmup_must_match_the_diloco_loading_it():
    net, twin = _net(), _net()
    plain = DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), 2)
    warm = DiLoCo(twin, torch.optim.SGD(twin.parameters(), lr=0.1), 2, warmup_steps=2)
    with pytest.raises(ValueError, match="warmup_state must be None for a DiLoCo with"):
        plain.load_state_dict(warm.state_dict())
    with pytest.raises(ValueError, match="warmup_state must be a state dict"):
        warm.load_state_dict(plain.state_dict())


# --- the norm test that ends a warm-up sooner ------------------------------------------


def _grads_of_norm(params: list[nn.Parameter], norm: float) -> None:
    for p in params:
        p.grad = torch.zeros_like(p)
    params[0].grad.view(-1)[0] = norm


def test_the_warmup_test_is_calm_once_a_windows_summed_norm_changes_by_less_than_eta():
    params = [nn.Parameter(torch.zeros(3, 2)), nn.Parameter(torch.zeros(4))]
    test = WarmupEnd(params, eta=0.5, window=2)
    calm = []
    for step, norm in enumerate([10.0, 10.0, 2.0, 2.0, 1.5, 1.5], start=1):
        _grads_of_norm(params, norm)
        test.add(params)
        calm.append(test.calm_after(step, LocalTransport(), lr=1e-3))
    # windows: 20 (no window before: critical), 4 (ratio 0.8: critical), 3 (0.25: calm)
    assert calm == [False, False, False, False, False, True]
    assert [(c["step"], c["norm"]) for c in test.checks] == [(2, 20.0), (4, 4.0), (6, 3.0)]
    assert [c["ratio"] for c in test.checks] == [None, pytest.approx(0.8), pytest.approx(0.25)]


def test_a_window_in_which_the_learning_rate_rose_is_never_calm():
    params = [nn.Parameter(torch.zeros(4))]
    test = WarmupEnd(params, eta=0.5, window=2)
    calm = []
    # the same norm in every window; the rate rises through the second and third windows
    for step, lr in enumerate([1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 3.0], start=1):
        _grads_of_norm(params, 1.0)
        test.add(params)
        calm.append(test.calm_after(step, LocalTransport(), lr=lr))
    assert [c["lr_rose"] for c in test.checks] == [False, True, True, False]
    assert [c["ratio"] for c in test.checks] == [None, 0.0, 0.0, 0.0]
    assert calm == [False] * 7 + [True]


def _warmup_ended_by_the_test(rank: int, world: int, out: str, eta: float) -> None:
    net = _net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    diloco = DiLoCo(net, inner, 2, warmup_steps=8, warmup_eta=eta, warmup_window=2)
    record = []
    for step in range(10):
        _inner_step(net, inner, rank, step)
        synced = diloco.step()
        a, b = _gathered(_flat(net))
        record.append((synced, torch.equal(a, b)))
    if rank == 0:
        torch.save((record, diloco.warmup_end, diloco.stats()["warmup_steps_done"]), out)


def test_a_calm_second_window_ends_the_warmup_there_on_every_rank(tmp_path):
    out = tmp_path / "ended.pt"
    run_processes(_warmup_ended_by_the_test, 2, str(out), 1e6)  # any change is calm
    record, end, done = torch.load(out)
    assert (end, done) == (4, 4)
    assert [r[1] for r in record] == [True] * 4 + [False, True] * 3
    assert [r[0] for r in record] == [False] * 4 + [False, True] * 3


def test_a_warmup_the_test_never_finds_calm_lasts_warmup_steps(tmp_path):
    out = tmp_path / "never.pt"
    run_processes(_warmup_ended_by_the_test, 2, str(out), 1e-12)
    record, end, done = torch.load(out)
    assert (end, done) == (None, 8)
    assert [r[0] for r in record] == [False] * 9 + [True]


def _resume_mid_window(rank: int, world: int, out: str) -> None:
    def build():
        net = _net()
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        return net, inner, DiLoCo(net, inner, 2, warmup_steps=6, warmup_eta=1e6,
                                  warmup_window=2)  # fmt: skip

    # saved after the third step: one step into the second window
    (net, diloco), (net2, diloco2) = diloco_parts.straight_and_resumed(build, rank, 8, 2)
    if rank == 0:
        torch.save((_flat(net), _flat(net2), diloco.warmup_end, diloco2.warmup_end), out)


def test_a_run_resumed_inside_a_tested_window_ends_bitwise_equal_to_a_straight_run(tmp_path):
    out = tmp_path / "resume-window.pt"
    run_processes(_resume_mid_window, 2, str(out))
    straight, resumed, end, end2 = torch.load(out)
    assert torch.equal(straight, resumed)
    assert end == end2 == 4


@pytest.mark.parametrize("kwargs, error, match", [
    ({"warmup_eta": 0.5}, ValueError, "warmup_eta needs warmup_steps >= 1"),
    ({"warmup_steps": 4, "warmup_eta": 0.0}, ValueError, "warmup_eta must be > 0"),
    ({"warmup_steps": 4, "warmup_eta": "0.5"}, TypeError, "warmup_eta must be a number"),
    ({"warmup_steps": 4, "warmup_eta": 0.5, "warmup_window": 0}, ValueError,
     "warmup_window must be an int >= 1"),
])  # fmt: skip
def test_a_bad_warmup_test_argument_is_refused_naming_it(kwargs, error, match):
    net = _net()
    with pytest.raises(error, match=match):
        DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), 2, **kwargs)


def test_a_state_dict_with_or_without_a_warmup_test_must_match_the_diloco_loading_it():
    net, twin = _net(), _net()
    fixed = DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), 2, warmup_steps=4)
    tested = DiLoCo(twin, torch.optim.SGD(twin.parameters(), lr=0.1), 2, warmup_steps=4,
                    warmup_eta=0.5)  # fmt: skip
    with pytest.raises(ValueError, match="warmup_test must be None"):
        fixed.load_state_dict(tested.state_dict())
    with pytest.raises(ValueError, match="warmup_test must be a state dict"):
        tested.load_state_dict(fixed.state_dict())
    with pytest.raises(ValueError, match=r"warmup_end must be None or an int in \[1, 4\]"):
        tested.load_state_dict({**tested.state_dict(), "warmup_end": 5})
    assert tested.warmup_end is None and tested.warmup_test.checks == []


# --- SparseLoCo's decayed error feedback ------------------------------------------------------


def test_error_decay_carries_beta_times_the_last_residual_into_the_next_sync():
    net = _net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    state = Controller(net, "int", levels=(2, 2), interval_unit="step")
    diloco = DiLoCo(net, inner, 1, state=state, error_decay=0.5,
                    outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))  # fmt: skip
    _inner_step(net, inner, 0, 0)
    diloco.step()  # one worker: the sync leaves the parameters at the anchor
    anchor = [p.detach().clone() for p in net.parameters()]
    residual = state.reducer.memory.get("0.weight").clone()
    assert residual.abs().sum() > 0  # int2 leaves something unsent
    _inner_step(net, inner, 0, 1)
    moved = anchor[0] - net[0].weight.detach()  # the second pseudo-gradient
    diloco.step()
    sent = anchor[0] - net[0].weight.detach()  # plain SGD at lr 1 steps by what was sent
    # what was compressed = sent + left over = the pseudo-gradient + beta * the residual
    torch.testing.assert_close(sent + state.reducer.memory.get("0.weight"),
                               moved + 0.5 * residual, rtol=1e-5, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("value, error", [(1.5, ValueError), (-0.1, ValueError),
                                          ("0.9", TypeError)])  # fmt: skip
def test_a_bad_error_decay_is_refused_naming_it(value, error):
    net = _net()
    with pytest.raises(error, match="error_decay"):
        DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), 2, error_decay=value)


def test_an_outer_momentum_on_an_inner_sgd_momentum_warns():
    net = _net()
    with pytest.warns(UserWarning, match="stacks on the inner SGD's momentum 0.9"):
        DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), 4)


@pytest.mark.parametrize("inner_momentum, outer", [
    (0.9, lambda ps: torch.optim.SGD(ps, lr=1.0)),  # the plain average
    (0.0, None),  # no inner momentum: DiLoCo's default outer step
])
def test_one_momentum_alone_does_not_warn(inner_momentum, outer):
    net = _net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1, momentum=inner_momentum)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DiLoCo(net, inner, 4, outer_optimizer=outer)


def test_an_inner_adamw_with_the_default_outer_step_does_not_warn():
    net = _net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DiLoCo(net, torch.optim.AdamW(net.parameters(), lr=1e-3), 4)
