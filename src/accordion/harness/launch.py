"""Starting the workers: under ``torchrun``, or as local gloo processes started here."""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def in_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another env:// launcher)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def backend() -> str:
    """NCCL when CUDA is present, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def default_threads(workers: int) -> int:
    """Torch threads per worker so that the workers share the CPU cores without oversubscribing."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def _shutdown() -> None:
    # gloo on torch 2.13 may abort at exit unless every rank passes a barrier first
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, fn, world: int, store: str, result_path: str, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    # a file rendezvous: a TCP port picked as free can be taken before the workers bind it
    dist.init_process_group(backend(), init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, rank, *args)
    finally:
        _shutdown()
    if rank == 0:
        # a file, not a queue: a large result would fill a pipe that nobody reads while
        # the parent waits in join()
        with open(result_path, "wb") as f:
            pickle.dump(result, f)
    # Even after a barrier, gloo's threads sometimes abort the process while C++ static
    # objects are destroyed at exit ("terminate called without an active exception");
    # the work is done and the result written, so skip that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable[..., Any], workers: int, *args: Any) -> Any:
    """Run ``fn(rank, world_size, local_rank, *args)`` on every worker; return rank 0's result.

    Under ``torchrun`` the process group comes from the environment and ``workers`` is
    ignored (every rank returns its own result). Otherwise ``workers`` local processes are
    started (``workers == 1`` runs in this process without a process group). ``fn`` and
    ``args`` must be picklable.
    """
    if in_torchrun():
        dist.init_process_group(backend())
        try:
            return fn(
                dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), *args
            )
        finally:
            _shutdown()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    if workers == 1:
        return fn(0, 1, 0, *args)
    with tempfile.TemporaryDirectory(prefix="accordion-") as tmp:
        result_path = os.path.join(tmp, "result.pkl")
        store = os.path.join(tmp, "store")
        mp.start_processes(
            _spawned, args=(fn, workers, store, result_path, args), nprocs=workers,
            join=True, start_method="spawn",
        )  # fmt: skip
        with open(result_path, "rb") as f:
            return pickle.load(f)
