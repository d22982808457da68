"""Launch real ``torch.distributed`` worker processes for tests, with a hard timeout."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Workers fork from one server that imported torch once (started by ``conftest.py``):
#: "spawn" re-imports it in every worker (measured: 1.7 s per 2-worker launch, against
#: 0.05 s from the server).
START_METHOD = "forkserver"


def _entry(rank: int, fn, world_size: int, store: str, args: tuple) -> None:
    torch.set_num_threads(1)
    # a file rendezvous: a TCP port picked as free can be taken again before the workers bind
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        # gloo on torch 2.13 may abort at exit without a barrier before teardown
        dist.barrier()
        dist.destroy_process_group()
    _exit_quietly()


def _exit_quietly() -> None:
    # Even after a barrier, gloo's threads sometimes abort the process while C++ static
    # objects are destroyed at exit ("terminate called without an active exception");
    # the work is done and its files are written, so skip that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_processes(fn, world_size: int, *args, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes.

    ``fn`` must be a module-level function. Raises if a worker fails, and kills the
    workers and raises ``TimeoutError`` if they have not finished after ``timeout`` s,
    so that a hang fails fast.
    """
    store_dir = tempfile.mkdtemp(prefix="accordion-test-")
    store = os.path.join(store_dir, "store")
    ctx = mp.start_processes(
        _entry,
        args=(fn, world_size, store, args),
        nprocs=world_size,
        join=False,
        start_method=START_METHOD,
    )
    join_or_kill(ctx, timeout)
    shutil.rmtree(store_dir, ignore_errors=True)


def join_or_kill(ctx, timeout: float) -> None:
    """Join the processes of ``ctx`` (``mp.start_processes(join=False)``); re-raises a
    worker's error, and kills them all and raises ``TimeoutError`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"distributed workers did not finish within {timeout} s")


def set_torchrun_environment(rank: int, world_size: int) -> None:
    """Set the variables that ``torchrun`` / ``accelerate launch`` give each worker, for
    frameworks that read them (Accelerate, the Hugging Face Trainer) in a worker of
    :func:`run_processes`; ``OMP_NUM_THREADS`` keeps Accelerate from resetting torch's
    thread count."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
