"""Ranks that disagree raise, on every rank and within the job's timeout, instead of
hanging or silently picking different levels (real gloo processes)."""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from accordion.agreement import check_agreement
from accordion.compress import AllReduce
from accordion.compress.transport import CollectiveError, group_timeout
from accordion.ddp import AccordionState
from distributed import START_METHOD, _exit_quietly, join_or_kill, run_processes

TIMEOUT_S = 5  # the job's timeout in the timeout tests: short, so that they stay short


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _train_step(model, state, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(100 * rank + step)
    model.zero_grad()
    model(torch.randn(4, 8, generator=gen)).square().mean().backward()
    state.reduce_gradients()  # every collective of it runs on the private group


def _same(a, b) -> bool:
    """Deep equality of two state dicts (tensors compared exactly)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# --- a launcher whose default group has a short timeout ---------------------------------


def _timed_entry(rank, fn, world_size, store, sync, args) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=timeout)  # fmt: skip
    # a side store: ranks that failed at different times meet here, so that the
    # teardown barrier (bound by the same short timeout) starts on every rank together
    side = dist.FileStore(sync, world_size)
    try:
        fn(rank, world_size, side, *args)
    finally:
        side.set(f"done{rank}", "1")
        side.wait([f"done{r}" for r in range(world_size)], datetime.timedelta(seconds=60))
        dist.barrier()
        dist.destroy_process_group()
    _exit_quietly()


def run_with_timeout(fn, world_size: int, *args, timeout: float = 60.0) -> None:
    """:func:`distributed.run_processes` with a ``TIMEOUT_S`` default group; ``fn`` gets
    ``(rank, world_size, side_store, *args)``."""
    tmp = tempfile.mkdtemp(prefix="accordion-agree-")
    paths = (os.path.join(tmp, "store"), os.path.join(tmp, "sync"))
    ctx = mp.start_processes(_timed_entry, args=(fn, world_size, *paths, args),
                             nprocs=world_size, join=False, start_method=START_METHOD)  # fmt: skip
    join_or_kill(ctx, timeout)
    shutil.rmtree(tmp, ignore_errors=True)


# --- the private group's timeout --------------------------------------------------------


def _unpaired_exchange(rank, world_size, side):
    state = AccordionState(_model(), "powersgd", levels=(2, 1))
    transport = state.transport()
    assert group_timeout(transport.group) == datetime.timedelta(seconds=TIMEOUT_S)
    if rank == 1:  # never joins: rank 0's all-reduce waits for it until the timeout
        side.wait(["failed"], datetime.timedelta(seconds=60))
        return
    start = time.monotonic()
    with pytest.raises(CollectiveError) as info:
        transport.run(_one(AllReduce(torch.ones(3))))
    elapsed = time.monotonic() - start
    side.set("failed", "1")
    assert TIMEOUT_S - 1 <= elapsed < 4 * TIMEOUT_S, elapsed
    message = str(info.value)
    assert message.startswith("Accordion's exchange phase 1 (AllReduce of 1 tensor, 3 elements)")
    assert "failed on rank 0" in message
    assert isinstance(info.value.__cause__, BaseException)


def _one(op):
    yield [op]


def test_the_private_group_inherits_the_default_groups_timeout_and_names_the_failed_phase():
    run_with_timeout(_unpaired_exchange, 2)


# --- disagreeing ranks ------------------------------------------------------------------


def _different_lr(rank, world_size):
    model = _model()
    state = AccordionState(model, "powersgd", levels=(2, 1))
    _train_step(model, state, rank, 0)
    before = state.state_dict()
    with pytest.raises(RuntimeError) as info:
        state.end_epoch(next_lr=0.1 if rank == 0 else 0.01)
    assert str(info.value).startswith(
        "ranks disagree at end_epoch: epoch [0, 0], next lr [0.1, 0.01], decay [False, False]"
    )
    assert "every rank must call end_epoch once per epoch" in str(info.value)
    assert _same(state.state_dict(), before)
    # the state is usable: the next agreed call decides as usual
    assert set(state.end_epoch(next_lr=0.1)) == {"0.weight", "2.weight"}
    assert state.epoch == 1 and state.decider.detector.last_lr == 0.1


def test_ranks_given_different_next_lr_raise_on_every_rank_and_keep_their_state():
    run_processes(_different_lr, 2, timeout=60)


def _different_epochs(rank, world_size):
    model = _model()
    state = AccordionState(model, "powersgd", levels=(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = None
    for epoch in range(2):
        _train_step(model, state, rank, epoch)
        state.end_epoch(optimizer)
        saved = saved or state.state_dict()
    if rank == 1:  # resumes from the checkpoint of an earlier epoch than rank 0
        state.load_state_dict(saved)
    before = state.state_dict()
    with pytest.raises(RuntimeError, match=r"^ranks disagree at end_epoch: epoch \[2, 1\], "
                       r"next lr \[0\.1, 0\.1\], decay \[False, False\]"):  # fmt: skip
        state.end_epoch(optimizer)
    assert _same(state.state_dict(), before)


def test_ranks_at_different_epochs_raise_on_every_rank():
    run_processes(_different_epochs, 2, timeout=60)


def _extra_end_epoch(rank, world_size, side):
    model = _model()
    state = AccordionState(model, "powersgd", levels=(2, 1))
    _train_step(model, state, rank, 0)
    state.end_epoch(next_lr=0.1)
    start = time.monotonic()
    # rank 0 ends the epoch once more; rank 1 goes on training: the agreement's
    # all-gather meets rank 1's all-reduces, and both fail instead of hanging
    with pytest.raises(CollectiveError, match=r"^Accordion's exchange phase 1 \("):
        if rank == 0:
            state.end_epoch(next_lr=0.1)
        else:
            _train_step(model, state, rank, 1)
    assert time.monotonic() - start < 4 * TIMEOUT_S


def test_a_rank_calling_end_epoch_once_more_raises_within_the_timeout_on_every_rank():
    run_with_timeout(_extra_end_epoch, 2)


# --- what the agreement costs -----------------------------------------------------------


def _count_collectives(rank, world_size):
    model = _model()
    state = AccordionState(model, "powersgd", levels=(2, 1), interval=2)
    transport = state.transport()
    issued = []
    issue = transport._issue
    transport._issue = lambda op: issued.append((type(op).__name__, op.tensor.numel())) or issue(op)
    _train_step(model, state, rank, 0)
    issued.clear()
    state.end_epoch(next_lr=0.1)  # a check: agreement, statistics, the rule's broadcasts
    assert issued[0] == ("AllGather", 4) and len(issued) > 2, issued
    assert issued[1][0] == "AllReduce", issued  # the owners' norms (statistic="sharded")
    assert [op for op in issued[2:] if op[0] != "Broadcast"] == [], issued
    issued.clear()
    state.end_epoch(next_lr=0.1)  # no check (interval 2): only the agreement
    assert issued == [("AllGather", 4)], issued


def test_the_agreement_costs_one_all_gather_of_four_values_per_end_epoch():
    run_processes(_count_collectives, 2, timeout=60)


def test_a_single_worker_skips_the_agreement():
    class NoCollectives:
        world_size = 1

        def run(self, exchange):
            raise AssertionError("a single worker must not exchange anything")

    check_agreement(NoCollectives(), "end_step", ("step", 3), None, False)


@pytest.mark.parametrize(
    ("timeout", "error"), [(5, TypeError), (datetime.timedelta(0), ValueError)]
)
def test_a_timeout_that_is_not_a_positive_timedelta_is_refused(timeout, error):
    with pytest.raises(error, match="timeout"):
        AccordionState(nn.Linear(2, 2), "powersgd", levels=(2, 1), timeout=timeout)
