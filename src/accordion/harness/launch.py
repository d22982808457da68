"""Starting the workers: under ``torchrun``, or as local gloo processes started here."""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from .._validate import check_int
from ..checkpoint.rendezvous import RENDEZVOUS_DIR, default_backend, init_process_group


def in_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another env:// launcher)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def backend() -> str:
    """NCCL when CUDA is present, gloo otherwise."""
    return default_backend()


def default_threads(workers: int) -> int:
    """Torch threads per worker so that the workers share the CPU cores without
    oversubscribing: cores // ``workers``, where under ``torchrun`` ``workers`` is ignored
    (as ``--workers`` is) for ``LOCAL_WORLD_SIZE``, this machine's workers."""
    if in_torchrun():
        # the count --workers LOCAL_WORLD_SIZE gets: another count changes float sums' order
        workers = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ["WORLD_SIZE"])
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


def _run_alone(fn: Callable[..., Any], args: tuple) -> Any:
    """``fn(0, 1, 0, *args)`` in this process, inside a one-process group.

    The training wraps its model in DDP, which needs a default process group even for one
    worker. The group gets a file rendezvous in a temporary folder (no port to pick) and is
    destroyed afterwards, so that the caller can start another run or group later. A
    one-process group the caller already initialised is used as it is.
    """
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(
                f"workers=1 inside a process group of {dist.get_world_size()} processes: "
                "call fn on every rank instead, or destroy the group first"
            )
        return fn(0, 1, 0, *args)
    with tempfile.TemporaryDirectory(prefix="accordion-") as tmp:
        store = os.path.join(tmp, "store")
        dist.init_process_group(backend(), init_method=f"file://{store}", rank=0, world_size=1)
        try:
            return fn(0, 1, 0, *args)
        finally:
            _shutdown()


def _torchrun_init(rendezvous: str | None) -> None:
    """The process group of a ``torchrun`` worker: from the environment, or through a
    file rendezvous per restart attempt in folder ``rendezvous``, which must be
    ``<checkpoint-dir>/.rendezvous`` (see :func:`accordion.checkpoint.init_process_group`).
    """
    if rendezvous is None:
        dist.init_process_group(backend())
        return
    folder = os.path.abspath(rendezvous)
    if os.path.basename(folder) != RENDEZVOUS_DIR:
        raise ValueError(f"rendezvous must be a folder named {RENDEZVOUS_DIR}, got {rendezvous!r}")
    init_process_group(os.path.dirname(folder), backend())


def run_distributed(
    fn: Callable[..., Any], workers: int, *args: Any, rendezvous: str | None = None
) -> Any:
    """Run ``fn(rank, world_size, local_rank, *args)`` on every worker; return rank 0's result.

    Under ``torchrun`` the process group comes from the environment (or, with
    ``rendezvous``, the folder ``<checkpoint-dir>/.rendezvous``, a file rendezvous per
    restart attempt: see :func:`_torchrun_init`) and ``workers`` is ignored (every rank
    returns its own result). Otherwise ``workers`` local processes are started;
    ``workers == 1`` runs in this process, in a one-process group of its own (see
    :func:`_run_alone`). With several workers ``fn`` and ``args`` must be picklable.
    """
    if in_torchrun():
        _torchrun_init(rendezvous)
        try:
            return fn(
                dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), *args
            )
        finally:
            _shutdown()
    check_int("workers", workers, 1)
    if workers == 1:
        return _run_alone(fn, args)
    with tempfile.TemporaryDirectory(prefix="accordion-") as tmp:
        result_path = os.path.join(tmp, "result.pkl")
        store = os.path.join(tmp, "store")
        mp.start_processes(
            _spawned, args=(fn, workers, store, result_path, args), nprocs=workers,
            join=True, start_method="spawn",
        )  # fmt: skip
        with open(result_path, "rb") as f:
            return pickle.load(f)
