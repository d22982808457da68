"""accordion.DiLoCo over DistributedDataParallel replicas (the hybrid setup): DDP averages
the gradients inside each replica at every step, DiLoCo the pseudo-gradients across the
replicas every H steps; real gloo processes, world 4 = 2 replicas of 2 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from accordion import Controller, DiLoCo
from distributed import run_processes
from test_diloco import _flat, _gathered, _inner_step, _net, _reference_sgd

TIMEOUT = 90.0  # s per run: a hang (groups created out of order) fails fast


def _groups(rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's replica group and cross-replica group; every rank creates all four,
    in one order: the replicas {0, 1} and {2, 3}, then {0, 2} and {1, 3}."""
    replicas = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    crosses = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return replicas[rank // 2], crosses[rank % 2]


def _hybrid(rank: int, world: int, inner_lr: float):
    """A DDP replica, its inner optimiser and a dense state over the cross group."""
    replica, cross = _groups(rank)
    ddp = DistributedDataParallel(_net(), process_group=replica)
    inner = torch.optim.SGD(ddp.parameters(), lr=inner_lr)
    state = Controller(ddp.module, "dense", interval_unit="step", process_group=cross)
    return replica, cross, ddp, inner, state


# --- H = 2 across replicas, DDP inside them --------------------------------------------


def _rounds_over_replicas(rank: int, world: int, out: str) -> None:
    replica, cross = _groups(rank)
    ddp = DistributedDataParallel(_net(), process_group=replica)
    inner = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    state = Controller(ddp.module, "dense", interval_unit="step", process_group=cross)
    diloco = DiLoCo(ddp, inner, 2, state=state)
    record = []
    for step in range(6):
        _inner_step(ddp, inner, rank, step)
        synced = diloco.step()
        flats = _gathered(_flat(ddp.module))
        in_replicas = torch.equal(flats[0], flats[1]) and torch.equal(flats[2], flats[3])
        across = torch.equal(flats[0], flats[2])
        record.append((synced, in_replicas, across, diloco.sent()[1]))
    if rank == 0:
        torch.save({"record": record, "keys": sorted(state.params.shapes),
                    "world": state.transport().world_size}, out)  # fmt: skip


@pytest.fixture(scope="module")
def rounds(tmp_path_factory) -> dict:
    """Per inner step of H = 2 over 2 DDP replicas of 2 ranks: (synced, each replica's
    ranks equal, the replicas equal, bytes sent through the state so far)."""
    out = tmp_path_factory.mktemp("hybrid") / "record.pt"
    run_processes(_rounds_over_replicas, 4, str(out), timeout=TIMEOUT)
    return torch.load(out)


def test_the_ranks_of_a_replica_are_bitwise_equal_after_every_inner_step(rounds):
    assert [r[1] for r in rounds["record"]] == [True] * 6


def test_the_replicas_drift_apart_between_syncs_and_each_sync_makes_them_bitwise_equal(rounds):
    record = rounds["record"]
    assert [r[0] for r in record] == [False, True] * 3
    assert [r[2] for r in record] == [False, True] * 3


def test_only_the_syncs_send_anything_through_the_diloco_state(rounds):
    sent = [r[3] for r in rounds["record"]]
    assert sent[0] == 0 < sent[1] == sent[2] < sent[3] == sent[4] < sent[5]
    assert sent[3] == pytest.approx(2 * sent[1]) and sent[5] == pytest.approx(3 * sent[1])


def test_the_state_averages_over_the_cross_group_and_names_the_wrapped_modules_parameters(
    rounds,
):
    assert rounds["world"] == 2  # {0, 2}: one rank per replica
    assert rounds["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]  # no "module."


# --- H = 1 with plain SGD: data-parallel SGD over all ranks -----------------------------


def _one_step_rounds_over_replicas(rank: int, world: int, out: str) -> None:
    _, _, ddp, inner, state = _hybrid(rank, world, 0.1)
    diloco = DiLoCo(ddp, inner, 1, state=state,
                    outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))  # fmt: skip
    for step in range(5):
        _inner_step(ddp, inner, rank, step)
        assert diloco.step()
    flats = _gathered(_flat(ddp.module))
    assert all(torch.equal(flats[0], f) for f in flats[1:])
    if rank == 0:
        torch.save(flats[0], out)


def test_one_sgd_step_per_round_over_ddp_replicas_is_data_parallel_sgd_over_all_ranks(tmp_path):
    out = tmp_path / "hybrid-sgd.pt"
    run_processes(_one_step_rounds_over_replicas, 4, str(out), timeout=TIMEOUT)
    torch.testing.assert_close(torch.load(out), _reference_sgd(4, 5, 0.1), rtol=1e-5, atol=1e-6)


# --- a data-parallel warm-up across the replicas -----------------------------------------


def _warmup_over_replicas(rank: int, world: int, out: str) -> None:
    _, cross, ddp, inner, state = _hybrid(rank, world, 0.1)
    warm = Controller(ddp.module, "dense", interval_unit="step", process_group=cross)
    diloco = DiLoCo(ddp, inner, 10, state=state, warmup_steps=4, warmup_state=warm)
    for step in range(4):
        _inner_step(ddp, inner, rank, step)
        assert not diloco.step()
    flats = _gathered(_flat(ddp.module))
    assert all(torch.equal(flats[0], f) for f in flats[1:])
    if rank == 0:
        torch.save(flats[0], out)


def test_a_warmup_across_ddp_replicas_with_plain_sgd_is_data_parallel_sgd_over_all_ranks(
    tmp_path,
):
    out = tmp_path / "hybrid-warmup.pt"
    run_processes(_warmup_over_replicas, 4, str(out), timeout=TIMEOUT)
    torch.testing.assert_close(torch.load(out), _reference_sgd(4, 4, 0.1), rtol=1e-5, atol=1e-6)


# --- states over DDP's own ranks are refused -----------------------------------------------


def _refused(build) -> str | None:
    try:
        build()
    except ValueError as error:
        return str(error)
    return None


def _ddp_over_the_default_group(rank: int, world: int, out: str) -> None:
    ddp = DistributedDataParallel(_net())
    inner = torch.optim.SGD(ddp.parameters(), lr=0.1)
    before = _flat(ddp.module)
    message = _refused(lambda: DiLoCo(ddp, inner, 2))
    unchanged = torch.equal(before, _flat(ddp.module)) and not inner._optimizer_step_pre_hooks
    if rank == 0:
        torch.save((message, unchanged), out)


def test_ddp_over_the_default_group_with_the_default_state_is_refused_naming_both_groups(
    tmp_path,
):
    out = tmp_path / "refused.pt"
    run_processes(_ddp_over_the_default_group, 2, str(out), timeout=TIMEOUT)
    message, unchanged = torch.load(out)
    assert message is not None
    assert message.startswith("state (None: a dense Controller on the default group) averages "
                              "over ranks [0, 1], and the DistributedDataParallel model's "
                              "process group over ranks [0, 1]")  # fmt: skip
    assert "nothing to average" in message and "process_group=cross" in message
    assert unchanged


def _states_over_the_replica(rank: int, world: int, out: str) -> None:
    replica, cross, ddp, inner, state = _hybrid(rank, world, 0.1)
    own = Controller(ddp.module, "dense", interval_unit="step", process_group=replica)
    messages = {
        "state": _refused(lambda: DiLoCo(ddp, inner, 2, state=own)),
        "warmup_state": _refused(lambda: DiLoCo(ddp, inner, 2, state=state, warmup_steps=2)),
    }
    untouched = (not inner._optimizer_step_pre_hooks and state.step == own.step == 0
                 and state.ledger.total_bytes == own.ledger.total_bytes == 0)  # fmt: skip
    if rank == 0:
        torch.save((messages, untouched), out)


@pytest.fixture(scope="module")
def over_the_replica(tmp_path_factory) -> tuple[dict[str, str | None], bool]:
    """Rank 0's refusals in world 4 with DDP over {0, 1}: a state over {0, 1}, and a
    warm-up without its own state (the default group); whether anything changed."""
    out = tmp_path_factory.mktemp("refused") / "refused.pt"
    run_processes(_states_over_the_replica, 4, str(out), timeout=TIMEOUT)
    return torch.load(out)


def test_a_state_over_the_ddp_replicas_own_group_is_refused_and_changes_nothing(
    over_the_replica,
):
    messages, untouched = over_the_replica
    assert messages["state"] is not None
    assert messages["state"].startswith("state averages over ranks [0, 1], and the "
                                        "DistributedDataParallel model's process group over "
                                        "ranks [0, 1]: DDP already keeps ranks [1] equal to "
                                        "this one (rank 0)")  # fmt: skip
    assert untouched


def test_a_warmup_over_ddp_replicas_without_a_cross_replica_warmup_state_is_refused(
    over_the_replica,
):
    message = over_the_replica[0]["warmup_state"]
    assert message is not None
    assert message.startswith("warmup_state (None: a dense Controller on the default group) "
                              "averages over ranks [0, 1, 2, 3], and the "
                              "DistributedDataParallel model's process group over ranks "
                              "[0, 1]")  # fmt: skip
    assert "Give warmup_state= a Controller(model.module" in message
