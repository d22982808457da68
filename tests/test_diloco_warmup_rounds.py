"""DiLoCo's warm-up of short rounds (``warmup_sync_every=K``): a sync every K inner steps,
each landing as the replicas' plain average, then the rounds of H; real gloo processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import diloco_parts
from accordion import DiLoCo, StreamingDiLoCo
from accordion.harness.strategies import parse_strategy
from distributed import run_processes

_net, _inner_step = diloco_parts.net, diloco_parts.inner_step


def _flat(net) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in net.parameters()])


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _rounds(rank: int, world: int, out: str) -> None:
    net = _net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    diloco = DiLoCo(net, inner, 3, warmup_steps=4, warmup_sync_every=2)
    record = []
    for step in range(7):
        _inner_step(net, inner, rank, step)
        before = _gathered(_flat(net))  # each replica's parameters before any sync
        mean = (before[0] + before[1]) / 2
        synced = diloco.step()
        after = _gathered(_flat(net))
        record.append({"synced": synced, "equal": torch.equal(after[0], after[1]),
                       "average": torch.allclose(after[0], mean, atol=1e-6),
                       "sent": diloco.sent()[1], "outer": len(diloco.outer.state)})  # fmt: skip
    if rank == 0:
        torch.save(record, out)


@pytest.fixture(scope="module")
def rounds(tmp_path_factory) -> list[dict]:
    """Per inner step of a 4-step warm-up of rounds of 2, then H = 3, on 2 ranks."""
    out = tmp_path_factory.mktemp("warmup-rounds") / "record.pt"
    run_processes(_rounds, 2, str(out))
    return torch.load(out)


def test_the_warmup_syncs_every_k_steps_then_rounds_of_h_follow(rounds):
    assert [r["synced"] for r in rounds] == [False, True, False, True, False, False, True]
    assert [r["equal"] for r in rounds] == [False, True, False, True, False, False, True]


def test_a_warmup_round_lands_as_the_replicas_plain_average(rounds):
    assert [r["average"] for r in rounds if r["synced"]][:2] == [True, True]


def test_the_warmup_rounds_leave_the_outer_optimiser_untouched(rounds):
    assert [r["outer"] for r in rounds] == [0, 0, 0, 0, 0, 0, 4]  # its first step: H's


def test_each_warmup_round_sends_one_sync_and_nothing_in_between(rounds):
    sent = [r["sent"] for r in rounds]
    assert sent[0] == 0 < sent[1] == sent[2] < sent[3] == sent[4] == sent[5] < sent[6]
    assert sent[3] == pytest.approx(2 * sent[1]) and sent[6] == pytest.approx(3 * sent[1])


def _ended(rank: int, world: int, out: str) -> None:
    net = _net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    diloco = DiLoCo(net, inner, 2, warmup_steps=8, warmup_sync_every=2, warmup_eta=1e6,
                    warmup_window=2)  # fmt: skip
    for step in range(6):
        _inner_step(net, inner, rank, step)
        diloco.step()
    ends = _gathered(torch.tensor([float(diloco.warmup_end)]))
    if rank == 0:
        torch.save((ends, diloco.rounds), out)


def test_the_norm_test_ends_a_warmup_of_rounds_at_the_same_step_on_every_rank(tmp_path):
    out = tmp_path / "ended.pt"
    run_processes(_ended, 2, str(out))
    ends, rounds = torch.load(out)
    assert [float(e) for e in ends] == [4.0, 4.0]  # calm at the second window
    assert rounds == 3  # two warm-up rounds (steps 2 and 4), one of H = 2 (step 6)


def _resumed(rank: int, world: int, out: str) -> None:
    def build():
        net = _net()
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        return net, inner, DiLoCo(net, inner, 3, warmup_steps=6, warmup_sync_every=2)

    # saved after step 2: inside the warm-up, between two of its syncs
    (net, _), (net2, _) = diloco_parts.straight_and_resumed(build, rank, 9, 2)
    if rank == 0:
        torch.save((_flat(net), _flat(net2)), out)


def test_a_run_resumed_inside_a_warmup_of_rounds_ends_bitwise_equal_to_a_straight_one(tmp_path):
    out = tmp_path / "resumed.pt"
    run_processes(_resumed, 2, str(out))
    straight, resumed = torch.load(out)
    assert torch.equal(straight, resumed)


# --- bad arguments ------------------------------------------------------------------------


def _inner(net):
    return torch.optim.AdamW(net.parameters(), lr=1e-2)


@pytest.mark.parametrize("value, error", [(0, ValueError), (1.5, TypeError), (True, TypeError)])
def test_a_bad_warmup_sync_every_is_refused_naming_it(value, error):
    net = _net()
    with pytest.raises(error, match="warmup_sync_every"):
        DiLoCo(net, _inner(net), 3, warmup_steps=4, warmup_sync_every=value)


def test_warmup_sync_every_without_a_warmup_is_refused():
    net = _net()
    with pytest.raises(ValueError, match="warmup_sync_every needs warmup_steps >= 1"):
        DiLoCo(net, _inner(net), 3, warmup_sync_every=2)


def test_a_warmup_state_for_a_warmup_of_rounds_is_refused():
    net = _net()
    with pytest.raises(ValueError, match="warmup_state must be None with warmup_sync_every=2"):
        DiLoCo(net, _inner(net), 3, warmup_steps=4, warmup_sync_every=2,
               warmup_state=object())  # fmt: skip


def test_streaming_diloco_refuses_a_warmup_of_rounds():
    net = _net()
    with pytest.raises(ValueError, match="StreamingDiLoCo syncs fragments"):
        StreamingDiLoCo(net, _inner(net), 4, fragments=2, warmup_steps=4, warmup_sync_every=2)


def test_the_harness_option_warmup_every_sets_the_warmups_rounds():
    s = parse_strategy("diloco:15:lr=0.5:warmup=180:warmup-eta=0.5:warmup-every=4+static:int:2")
    assert (s.warmup_sync_every, s.warmup_steps, s.warmup_eta) == (4, 180, 0.5)
    assert parse_strategy("diloco:15:warmup=10").warmup_sync_every == 1


@pytest.mark.parametrize("options, match", [
    ("warmup-every=4", "warmup-every needs warmup=N"),
    ("warmup=10:warmup-every=4:warmup-with=int/2", "it takes no warmup-with"),
    ("warmup=10:warmup-every=4:fragments=3", "warmup-every= changes whole rounds"),
])  # fmt: skip
def test_a_warmup_every_that_cannot_apply_is_a_value_error_naming_it(options, match):
    with pytest.raises(ValueError, match=match):
        parse_strategy(f"diloco:15:{options}")
