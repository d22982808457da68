"""accordion.checkpoint.Checkpointer: consistent sets, a kill during a save, mixed sets,
and a changed world size, in real gloo processes."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.checkpoint import Checkpointer, sets
from accordion.checkpoint.reshard import old_ranks, reshard
from accordion.ddp import AccordionState
from distributed import run_processes


def _net() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)]
    return nn.Sequential(*layers)


def _job():
    net = _net()
    ddp = DDP(net)
    state = AccordionState(net, "powersgd", levels=(4, 2, 1), interval=1)
    state.register(ddp)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    return net, ddp, state, optimizer


def _epoch(ddp, state, optimizer, epoch: int) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    for step in range(3):
        gen = torch.Generator().manual_seed(1000 * epoch + 10 * rank + step)
        x = torch.randn(8, 8, generator=gen)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), x[:, :2]).backward()
        optimizer.step()
    torch.rand(1)  # the loop draws from the global RNG: resuming must restore it
    state.end_epoch(optimizer)


def _params(net) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def _resume_run(rank, world_size, folder):
    net, ddp, state, optimizer = _job()
    saver = Checkpointer(folder)
    for epoch in range(4):
        _epoch(ddp, state, optimizer, epoch)
        if epoch in (1, 2):
            saver.save(epoch + 1, model=net, optimizer=optimizer, accordion=state,
                       extra={"epoch": epoch + 1})  # fmt: skip
    straight = (_params(net), state.stats(), torch.rand(1))
    net, ddp, state, optimizer = _job()  # a restarted job: fresh objects
    restored = Checkpointer(folder).load_latest(model=net, optimizer=optimizer, accordion=state)
    for epoch in range(restored.extra["epoch"], 4):
        _epoch(ddp, state, optimizer, epoch)
    resumed = (_params(net), state.stats(), torch.rand(1))
    torch.save((straight, resumed, restored.step), os.path.join(folder, f"out{rank}.pt"))


def test_a_resumed_job_ends_bitwise_equal_to_an_uninterrupted_one(tmp_path):
    run_processes(_resume_run, 2, str(tmp_path))
    for rank in range(2):
        straight, resumed, step = torch.load(tmp_path / f"out{rank}.pt")
        assert step == 3  # the newest complete set
        assert all(torch.equal(a, b) for a, b in zip(straight[0], resumed[0]))
        assert straight[1] == resumed[1]  # levels, history, ledger
        assert torch.equal(straight[2], resumed[2])  # the RNG continued where it was


def _killed_during_save(rank, world_size, folder):
    net, ddp, state, optimizer = _job()
    saver = Checkpointer(folder)
    _epoch(ddp, state, optimizer, 0)
    saver.save(1, model=net, optimizer=optimizer, accordion=state)
    _epoch(ddp, state, optimizer, 1)
    if rank == 1:  # killed while it writes its file of set 2, after rank 0 wrote its own
        sets.atomic_save = lambda obj, path: os._exit(1)
    saver.save(2, model=net, optimizer=optimizer, accordion=state)


def _load_after_kill(rank, world_size, folder, out):
    net, ddp, state, optimizer = _job()
    restored = Checkpointer(folder).load_latest(model=net, optimizer=optimizer, accordion=state)
    torch.save((restored.step, state.epoch), os.path.join(out, f"rank{rank}.pt"))


def test_a_worker_killed_during_a_save_leaves_the_previous_set_as_the_newest(tmp_path):
    folder = tmp_path / "ckpt"
    with pytest.raises(Exception):  # noqa: B017 - the job dies: rank 1 exited, rank 0 failed
        run_processes(_killed_during_save, 2, str(folder), timeout=60)
    assert (folder / "step-00000002" / "rank-0.pt").is_file()  # rank 0 wrote its file ...
    assert not (folder / "step-00000002" / "COMPLETE.json").exists()  # ... never completed
    assert Checkpointer(folder).latest() == folder / "step-00000001"
    run_processes(_load_after_kill, 2, str(folder), str(tmp_path))
    assert torch.load(tmp_path / "rank0.pt") == (1, 1)
    assert torch.load(tmp_path / "rank1.pt") == (1, 1)


def _two_runs(rank, world_size, first, second):
    for folder in (first, second):
        net, ddp, state, optimizer = _job()
        _epoch(ddp, state, optimizer, 0)
        Checkpointer(folder).save(1, model=net, optimizer=optimizer, accordion=state)


def _load_mixed(rank, world_size, folder, out):
    net, ddp, state, optimizer = _job()
    before = state.stats()
    with pytest.raises(ValueError, match="does not belong to the set") as error:
        Checkpointer(folder).load_latest(model=net, optimizer=optimizer, accordion=state)
    assert state.stats() == before  # nothing was loaded
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(str(error.value))


def test_a_set_mixing_files_of_two_runs_is_refused_on_every_rank(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    run_processes(_two_runs, 2, str(first), str(second))
    # rank 1's file of another run, with the same step: the stamp's run id differs
    shutil.copy(second / "step-00000001" / "rank-1.pt", first / "step-00000001" / "rank-1.pt")
    run_processes(_load_mixed, 2, str(first), str(tmp_path))
    for rank in range(2):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert "rank-1.pt" in message and "run_id" in message


def _save_two(rank, world_size, folder):
    net, ddp, state, optimizer = _job()
    for epoch in range(3):
        _epoch(ddp, state, optimizer, epoch)
    Checkpointer(folder).save(3, model=net, optimizer=optimizer, accordion=state)
    torch.save(state.state_dict(), os.path.join(folder, f"state{rank}.pt"))


def _resume_alone(rank, world_size, folder):
    net, ddp, state, optimizer = _job()
    with pytest.warns(RuntimeWarning, match="world size changed from 2 to 1"):
        Checkpointer(folder).load_latest(model=net, optimizer=optimizer, accordion=state)
    loaded = state.state_dict()
    _epoch(ddp, state, optimizer, 3)  # training continues
    torch.save((loaded, state.epoch), os.path.join(folder, "alone.pt"))


def test_a_job_resumed_on_fewer_workers_keeps_levels_history_ledger_and_the_memories_mean(
    tmp_path,
):
    run_processes(_save_two, 2, str(tmp_path))
    run_processes(_resume_alone, 1, str(tmp_path))
    saved = [torch.load(tmp_path / f"state{r}.pt") for r in range(2)]
    loaded, epoch = torch.load(tmp_path / "alone.pt")
    assert epoch == 4
    for key in ("rungs", "rule", "ledger", "epoch", "step"):
        assert loaded[key] == saved[0][key], key
    memory = loaded["reducer"]["memory"]["memory"]
    old = [s["reducer"]["memory"]["memory"] for s in saved]
    assert memory.keys() == old[0].keys()
    for key, tensor in memory.items():
        torch.testing.assert_close(tensor, (old[0][key] + old[1][key]) / 2)


def test_reshard_drop_starts_the_memories_at_zero_with_a_warning():
    state = {"reducer": {"memory": {"memory": {"w": torch.ones(2)}}}, "world_size": 2, "rank": 0}
    with pytest.warns(RuntimeWarning, match="start at zero"):
        out = reshard({0: state, 1: state}, 2, 1, 0, policy="drop")
    assert out["reducer"]["memory"]["memory"] == {} and out["world_size"] == 1


def test_old_ranks_maps_old_ranks_onto_new_ones_by_their_remainder():
    assert old_ranks(0, 4, 2) == [0, 2] and old_ranks(1, 4, 2) == [1, 3]
    assert old_ranks(1, 1, 2) == []  # a grown job: the new rank owes nothing


def test_latest_skips_a_set_whose_marker_lists_a_missing_file(tmp_path):
    for step in (1, 2):
        folder = tmp_path / f"step-{step:08d}"
        folder.mkdir()
        (folder / "rank-0.pt").write_bytes(b"")
        marker = {"format": 1, "step": step, "world_size": 2, "run_id": "x",
                  "files": ["rank-0.pt", "rank-1.pt"]}  # fmt: skip
        (folder / "COMPLETE.json").write_text(json.dumps(marker))
    (tmp_path / "step-00000001" / "rank-1.pt").write_bytes(b"")
    assert Checkpointer(tmp_path).latest() == tmp_path / "step-00000001"


def test_a_save_keeps_only_the_newest_complete_sets(tmp_path):
    saver = Checkpointer(tmp_path, keep=2)
    net = _net()
    for step in range(1, 5):
        saver.save(step, model=net)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004"]


def test_load_latest_returns_none_when_there_is_no_complete_set(tmp_path):
    (tmp_path / "step-00000001").mkdir()  # begun, never completed
    assert Checkpointer(tmp_path).load_latest(model=_net()) is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"keep": 0}, ValueError, "keep"), ({"world_change": "mean"}, ValueError, "world_change"),
     ({"directory": 3}, TypeError, "directory")],
)  # fmt: skip
def test_checkpointer_arguments_are_checked(tmp_path, kwargs, error, match):
    kwargs = {"directory": tmp_path, **kwargs}
    with pytest.raises(error, match=match):
        Checkpointer(**kwargs)
