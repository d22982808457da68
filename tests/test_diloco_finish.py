"""DiLoCo.finish(): the last sync after the loop, so that a round cut short by the end of
training is averaged too; ``unsynced_steps`` says whether one is due. Real gloo processes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import diloco_parts
from accordion import Controller, DiLoCo, StreamingDiLoCo
from distributed import run_processes

_net, _inner_step = diloco_parts.net, diloco_parts.inner_step


def _flat(net) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in net.parameters()])


def _equal_across_ranks(t: torch.Tensor) -> bool:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return all(torch.equal(out[0], o) for o in out[1:])


def _build(kind=DiLoCo, **kwargs):
    net = _net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    state = Controller(net, "int", levels=(4, 4), interval_unit="step")
    return net, inner, kind(net, inner, 3, state=state, **kwargs)


def _finish_after(rank: int, steps: int, kind=DiLoCo, **kwargs) -> dict:
    """``steps`` inner steps with H = 3, then finish() twice; what each call saw and did."""
    net, inner, diloco = _build(kind, **kwargs)
    for step in range(steps):
        _inner_step(net, inner, rank, step)
        diloco.step()
    before = (diloco.unsynced_steps, diloco.rounds, diloco.sent()[1])
    first = diloco.finish()
    after = (diloco.unsynced_steps, diloco.rounds, diloco.sent()[1])
    second = diloco.finish()
    return {"before": before, "first": first, "after": after, "second": second,
            "again": diloco.sent()[1], "equal": _equal_across_ranks(_flat(net))}  # fmt: skip


def _cases(rank: int, world: int, out: str) -> None:
    got = {"mid_round": _finish_after(rank, 5), "round_end": _finish_after(rank, 6),
           "warmup": _finish_after(rank, 3, warmup_steps=4),
           "streamed": _finish_after(rank, 7, StreamingDiLoCo, fragments=3)}  # fmt: skip
    if rank == 0:
        torch.save(got, out)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("finish") / "cases.pt"
    run_processes(_cases, 2, str(out))
    return torch.load(out)


def test_finish_mid_round_syncs_the_last_steps_once_and_makes_the_ranks_equal(cases):
    got = cases["mid_round"]  # 5 steps, H = 3: one round, then 2 steps never averaged
    assert got["before"][:2] == (2, 1)
    assert got["first"] is True and got["after"][:2] == (0, 2)
    assert got["after"][2] > got["before"][2]  # the last sync is sent and counted
    assert got["equal"]


def test_a_second_finish_sends_nothing(cases):
    got = cases["mid_round"]
    assert got["second"] is False and got["again"] == got["after"][2]


def test_finish_at_a_rounds_end_sends_nothing(cases):
    got = cases["round_end"]  # 6 steps, H = 3: the last step synced
    assert got["before"][:2] == (0, 2)
    assert got["first"] is False and got["after"] == got["before"]


def test_finish_inside_the_warmup_sends_nothing_the_replicas_being_equal(cases):
    got = cases["warmup"]
    assert got["before"][:2] == (0, 0) and got["first"] is False
    assert got["equal"]


def test_streamed_fragments_landing_apart_leave_the_steps_unsynced_until_finish(cases):
    got = cases["streamed"]  # a fragment lands every step: never all equal at once
    assert got["before"][0] == 7
    assert got["first"] is True and got["after"][0] == 0 and got["equal"]


# --- resume -------------------------------------------------------------------------------


def _resumed_finish(rank: int, world: int, out: str) -> None:
    net, inner, diloco = _build()
    for step in range(4):
        _inner_step(net, inner, rank, step)
        diloco.step()
    saved = copy.deepcopy((net.state_dict(), inner.state_dict(), diloco.state_dict()))
    old = {k: v for k, v in saved[2].items() if k != "synced_at"}  # a file from before
    results = []
    for state in (saved[2], old):
        net2, inner2, diloco2 = _build()
        net2.load_state_dict(saved[0])
        inner2.load_state_dict(saved[1])
        diloco2.load_state_dict(state)
        results.append((diloco2.unsynced_steps, diloco2.finish(), _flat(net2)))
    diloco.finish()
    if rank == 0:
        torch.save((_flat(net), results), out)


def test_a_resumed_run_knows_its_unsynced_steps_and_finishes_bitwise_as_a_straight_one(tmp_path):
    out = tmp_path / "resumed.pt"
    run_processes(_resumed_finish, 2, str(out))
    straight, results = torch.load(out)
    for unsynced, synced, flat in results:  # with synced_at saved, and derived without it
        assert (unsynced, synced) == (1, True)
        assert torch.equal(flat, straight)


@pytest.mark.parametrize("value", [-1, 5, True, 1.0, "2"])
def test_a_bad_synced_at_is_refused_naming_it_and_changes_nothing(value):
    net, inner, diloco = _build()
    saved = {**diloco.state_dict(), "inner_steps": 4, "synced_at": value}
    with pytest.raises(ValueError, match="synced_at must be an int in \\[0, inner_steps=4\\]"):
        diloco.load_state_dict(saved)
    assert (diloco.inner_steps, diloco.unsynced_steps) == (0, 0)
