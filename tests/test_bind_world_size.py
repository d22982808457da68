"""A state built before ``init_process_group`` (world size 1 then) works at the real
world size: the transport, and with it the world size, is opened at the first exchange.

Real gloo processes, four for the two-phase exchange: each builds its state first, then
joins the group (file rendezvous), wraps the model in DDP and registers the hook.
"""

from __future__ import annotations

import json
import os
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.ddp import AccordionState, accordion_hook
from distributed import START_METHOD, join_or_kill

#: What the wire warning at the first exchange says, whatever its rungs.
HEAVY = "send at least as many bytes as a dense ring all-reduce"


def _launch(fn, world_size: int, out_dir: str, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world_size, store, out_dir)`` in ``world_size`` processes that join
    the gloo group themselves (``store``: the file rendezvous), killed after ``timeout`` s."""
    ctx = mp.start_processes(fn, args=(world_size, os.path.join(out_dir, "store"), out_dir),
                             nprocs=world_size, join=False, start_method=START_METHOD)  # fmt: skip
    join_or_kill(ctx, timeout)


def _join(rank: int, world_size: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size)  # fmt: skip


def _leave(out_dir: str, rank: int, result: dict) -> None:
    dist.barrier()  # gloo may abort at teardown without one
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # gloo's threads may abort at interpreter exit; the file is written


def _default_state_before_init(rank: int, world_size: int, store: str, out_dir: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    state = AccordionState(model)  # the default ladder, int8 -> int4 of "mixed"; world 1 now
    _join(rank, world_size, store)
    ddp = DDP(model)
    ddp.register_comm_hook(state, accordion_hook)
    torch.manual_seed(rank)
    ddp(torch.randn(8, 64)).square().sum().backward()
    server = state.compressor.state_dict()["parts"]["int"]["server_error"]
    _leave(out_dir, rank, {
        "world_size": state.transport().world_size,
        "server_error_worlds": [entry["world_size"] for entry in server],
        "grad": model.weight.grad.flatten()[:16].tolist(),
    })  # fmt: skip


def test_a_default_state_built_before_init_process_group_averages_in_two_phases(tmp_path):
    _launch(_default_state_before_init, 4, str(tmp_path))
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for rank in seen:
        assert rank["world_size"] == 4
        assert rank["server_error_worlds"] == [4]  # the owners kept a server error: two phases
        assert rank["grad"] == seen[0]["grad"]  # every rank decodes the same average


def _topk_state_before_init(rank: int, world_size: int, store: str, out_dir: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # top-k 0.6 sends 4.8 bytes an element, over dense's 4 at two workers
        state = AccordionState(model, "topk", levels=(0.6, 0.1))
        at_build = [str(w.message) for w in caught if HEAVY in str(w.message)]
        _join(rank, world_size, store)
        ddp = DDP(model)
        ddp.register_comm_hook(state, accordion_hook)
        for _ in range(2):
            ddp(torch.randn(4, 32)).square().sum().backward()
        heavy = [str(w.message) for w in caught if HEAVY in str(w.message)]
    _leave(out_dir, rank, {"at_build": at_build, "at_steps": heavy[len(at_build):]})


def test_a_state_built_before_init_process_group_warns_of_heavy_rungs_at_its_first_exchange(
    tmp_path,
):
    _launch(_topk_state_before_init, 2, str(tmp_path))
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["at_build"] == []  # no world size yet
        (message,) = seen["at_steps"]  # two steps, one warning
        assert "at 2 workers" in message
        assert "top-k 0.6 for 1 layer(s) ('weight')" in message
