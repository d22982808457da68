"""accordion.StreamingDiLoCo: fragments of the model synced in turn, each overlapped with
the next ``delay`` inner steps; real gloo processes, and a one-process reference."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import diloco_parts
from accordion import Controller, DiLoCo, StreamingDiLoCo
from accordion.diloco_streaming import split_fragments
from distributed import run_processes

_net, _batch, _inner_step = diloco_parts.net, diloco_parts.batch, diloco_parts.inner_step


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in params])


def _equal_across_ranks(t: torch.Tensor) -> bool:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return all(torch.equal(out[0], o) for o in out[1:])


def _plain_outer(params):
    return torch.optim.SGD(params, lr=0.7)


# --- the split ----------------------------------------------------------------------------


def test_split_fragments_cuts_in_order_into_parts_of_about_equal_size():
    assert split_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split_fragments([256, 32, 128, 4], 2) == [[0], [1, 2, 3]]
    assert split_fragments([5, 5, 5], 1) == [[0, 1, 2]]


def test_split_fragments_gives_every_fragment_a_tensor_even_when_one_dominates():
    assert split_fragments([1000, 1, 1, 1], 3) == [[0], [1], [2, 3]]
    assert split_fragments([1, 1, 1, 1000], 4) == [[0], [1], [2], [3]]


@pytest.mark.parametrize("count, error", [(0, ValueError), (5, ValueError), (1.5, TypeError),
                                          (True, TypeError)])  # fmt: skip
def test_split_fragments_refuses_a_bad_count_naming_it(count, error):
    with pytest.raises(error, match="fragments"):
        split_fragments([1, 2, 3, 4], count)


# --- one fragment, no delay: DiLoCo itself --------------------------------------------------


def _one_fragment_is_diloco(rank: int, world: int, out: str) -> None:
    results = []
    for streaming in (False, True):
        net = _net()
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        state = Controller(net, "int", levels=(4, 4), interval_unit="step")
        diloco = (StreamingDiLoCo(net, inner, 3, fragments=1, state=state) if streaming
                  else DiLoCo(net, inner, 3, state=state))  # fmt: skip
        for step in range(9):
            _inner_step(net, inner, rank, step)
            diloco.step()
        results.append((_flat(net.parameters()), diloco.stats()["total_bytes"], diloco.rounds))
    if rank == 0:
        torch.save(results, out)


def test_one_fragment_without_delay_is_diloco_bitwise(tmp_path):
    out = tmp_path / "one.pt"
    run_processes(_one_fragment_is_diloco, 2, str(out))
    (plain, plain_bytes, plain_rounds), (streamed, bytes_, rounds) = torch.load(out)
    assert torch.equal(plain, streamed)
    assert plain_bytes == bytes_ > 0 and plain_rounds == rounds == 3


# --- two fragments: each lands in turn, every H / F steps ---------------------------------


def _two_fragments(rank: int, world: int, out: str) -> None:
    net = _net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    diloco = StreamingDiLoCo(net, inner, 4, fragments=2)
    first, second = ([diloco.params[i] for i in index] for index in diloco.fragments)
    record = []
    for step in range(8):
        _inner_step(net, inner, rank, step)
        landed = diloco.step()
        record.append((landed, _equal_across_ranks(_flat(first)),
                       _equal_across_ranks(_flat(second)), diloco.rounds,
                       diloco.fragment_syncs))  # fmt: skip
    if rank == 0:
        torch.save((record, diloco.fragments, diloco.state.step), out)


@pytest.fixture(scope="module")
def two_fragments(tmp_path_factory):
    """Per inner step of H = 4, F = 2 on 2 ranks: (landed, fragment 0 equal across ranks,
    fragment 1 equal, rounds, fragment syncs), the fragments and the state's steps."""
    out = tmp_path_factory.mktemp("streaming") / "record.pt"
    run_processes(_two_fragments, 2, str(out))
    return torch.load(out)


def test_the_fragments_land_in_turn_one_every_h_over_f_steps(two_fragments):
    record, fragments, _ = two_fragments
    assert fragments == [[0], [1, 2, 3]]  # 256 weights, then 32 + 128 + 4
    assert [r[0] for r in record] == [False, True] * 4
    assert [r[4] for r in record] == [0, 1, 1, 2, 2, 3, 3, 4]


def test_a_landed_fragment_is_bitwise_equal_across_ranks_and_the_other_is_not(two_fragments):
    record, _, _ = two_fragments
    # step 2: fragment 0 lands; step 4: fragment 1 lands, fragment 0 has drifted again
    assert [(r[1], r[2]) for r in record[:4]] == [(False, False), (True, False),
                                                  (False, False), (False, True)]  # fmt: skip


def test_a_round_is_one_sync_of_every_fragment_and_one_step_of_the_state(two_fragments):
    record, _, state_steps = two_fragments
    assert [r[3] for r in record] == [0, 0, 0, 1, 1, 1, 1, 2]
    assert state_steps == 2


# --- against a one-process reference: delay and mix ---------------------------------------


def _reference(world: int, steps: int, h: int, fragments: list[list[int]], delay: int,
               mix: float) -> list[torch.Tensor]:  # fmt: skip
    """Streaming DiLoCo by hand: ``world`` replicas in one process, dense averages, the
    outer step plain SGD at lr 0.7. Returns replica 0's final parameters."""
    nets = [_net() for _ in range(world)]
    inners = [torch.optim.AdamW(n.parameters(), lr=1e-2) for n in nets]
    anchor = [p.detach().clone() for p in nets[0].parameters()]
    gap, started = h // len(fragments), {}
    for t in range(1, steps + 1):
        for rank, (net, inner) in enumerate(zip(nets, inners)):
            _inner_step(net, inner, rank, t - 1)
        fragment = (t - 1) // gap % len(fragments)
        if t % gap == (gap - delay) % gap:  # the average starts from these parameters
            started = {i: sum(anchor[i] - list(n.parameters())[i].detach() for n in nets) / world
                       for i in fragments[fragment]}  # fmt: skip
        if t % gap == 0:
            with torch.no_grad():
                for i, average in started.items():
                    anchor[i] = anchor[i] - 0.7 * average
                    for n in nets:
                        p = list(n.parameters())[i]
                        p.copy_((1 - mix) * anchor[i] + mix * p)
    return [p.detach().clone() for p in nets[0].parameters()]


def _delayed(rank: int, world: int, out: str, delay: int, mix: float) -> None:
    net = _net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    diloco = StreamingDiLoCo(net, inner, 6, fragments=2, delay=delay, mix=mix,
                             outer_optimizer=_plain_outer)  # fmt: skip
    for step in range(12):
        _inner_step(net, inner, rank, step)
        diloco.step()
    if rank == 0:
        torch.save(([p.detach() for p in net.parameters()], diloco.fragments), out)


@pytest.mark.parametrize("delay, mix", [(0, 0.0), (2, 0.0), (2, 0.5), (1, 1.0)])
def test_a_delayed_fragment_lands_as_the_paper_mixes_it(tmp_path, delay, mix):
    out = tmp_path / "delayed.pt"
    run_processes(_delayed, 2, str(out), delay, mix)
    got, fragments = torch.load(out)
    want = _reference(2, 12, 6, fragments, delay, mix)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _overlap_bytes(rank: int, world: int, out: str) -> None:
    net = _net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    diloco = StreamingDiLoCo(net, inner, 8, fragments=2, delay=2)
    sent = []
    for step in range(4):
        _inner_step(net, inner, rank, step)
        landed = diloco.step()
        sent.append((landed, diloco.sent()[1]))
    diloco.wait()
    if rank == 0:
        torch.save(sent, out)


def test_a_delayed_fragment_is_sent_when_it_starts_and_lands_delay_steps_later(tmp_path):
    out = tmp_path / "overlap.pt"
    run_processes(_overlap_bytes, 2, str(out))
    (l1, b1), (l2, b2), (l3, b3), (l4, b4) = torch.load(out)
    assert (l1, l2, l3, l4) == (False, False, False, True)  # gap 4: it lands at step 4
    assert b1 == 0 < b2 == b3 == b4  # started at step 2 = gap - delay, before it lands


# --- resume ---------------------------------------------------------------------------------


def _resume_in_flight(rank: int, world: int, out: str) -> None:
    def build():
        net = _net()
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        state = Controller(net, "int", levels=(4, 4), interval_unit="step")
        return net, inner, StreamingDiLoCo(net, inner, 6, fragments=3, delay=1, mix=0.5,
                                           state=state)  # fmt: skip

    net, inner, diloco = build()
    saved = None
    for step in range(12):
        _inner_step(net, inner, rank, step)
        diloco.step()
        if step == 4:  # the 5th step starts fragment 2's average (gap 2, delay 1)
            saved = copy.deepcopy((net.state_dict(), inner.state_dict(), diloco.state_dict()))
    net2, inner2, diloco2 = build()
    for part, state in zip((net2, inner2, diloco2), saved):
        part.load_state_dict(state)
    for step in range(5, 12):
        _inner_step(net2, inner2, rank, step)
        diloco2.step()
    if rank == 0:
        torch.save((_flat(net.parameters()), _flat(net2.parameters()), saved[2]["pending"]), out)


def test_a_run_resumed_with_a_fragment_in_flight_ends_bitwise_equal_to_a_straight_run(tmp_path):
    out = tmp_path / "resume.pt"
    run_processes(_resume_in_flight, 2, str(out))
    straight, resumed, pending = torch.load(out)
    assert pending is not None and pending["fragment"] == 2
    assert torch.equal(straight, resumed)


# --- bad arguments ----------------------------------------------------------------------------


def _streaming(**kwargs) -> StreamingDiLoCo:
    net = _net()
    return StreamingDiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), **kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"sync_every": 6, "fragments": 4}, ValueError, "multiple of the 4 fragments"),
    ({"sync_every": 6, "fragments": 5}, ValueError, "at most the 4"),
    ({"sync_every": 6, "fragments": 2, "delay": 3}, ValueError, "delay must be below .* 3"),
    ({"sync_every": 6, "fragments": 2, "delay": -1}, ValueError, "delay"),
    ({"sync_every": 6, "fragments": 2, "mix": 1.5}, ValueError, "mix must be >= 0 and <= 1"),
    ({"sync_every": 6, "fragments": 2, "mix": "half"}, TypeError, "mix must be a number"),
    ({"sync_every": 6, "fragments": "two"}, TypeError, "fragments must be an int"),
])  # fmt: skip
def test_a_bad_argument_is_refused_naming_it(kwargs, error, match):
    with pytest.raises(error, match=match):
        _streaming(**kwargs)


def test_explicit_fragments_must_hold_every_trainable_parameter_once():
    net = _net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    w0, b0, w2, b2 = net.parameters()
    diloco = StreamingDiLoCo(net, inner, 4, fragments=[[w0, w2], [b2, b0]])
    assert diloco.fragments == [[0, 2], [1, 3]]
    for bad in ([[w0, w2], [b0]], [[w0, w2], [b0, b2, w0]], [[w0, w2, b0, b2], []],
                [[w0, w2], [b0, b2, nn.Parameter(torch.zeros(1))]]):  # fmt: skip
        with pytest.raises(ValueError, match="fragments must"):
            StreamingDiLoCo(net, inner, 4, fragments=bad)


def test_a_plain_diloco_state_dict_or_a_bad_pending_entry_is_refused_and_changes_nothing():
    net = _net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    streaming = StreamingDiLoCo(net, inner, 4, fragments=2)
    plain = DiLoCo(net, inner, 4).state_dict()
    with pytest.raises(ValueError, match="pending"):
        streaming.load_state_dict(plain)
    bad = {**streaming.state_dict(), "inner_steps": 3,
           "pending": {"fragment": 1, "grads": [torch.zeros(2)]}}  # fmt: skip
    with pytest.raises(ValueError, match="pending grads"):
        streaming.load_state_dict(bad)
    assert streaming.inner_steps == 0
