"""What a compressed step pays for on the small model: rounds, or arithmetic?

Runs ``--workers`` local gloo processes (1 thread each) training the MNIST-1D CNN under
DDP (one bucket: the model has 12 k parameters), and times the step (forward, backward
with the hook, optimizer step) for:

* ``dense``: plain DDP;
* ``rounds1`` / ``rounds2``: a hook that sends nothing useful but runs one or two
  sequential all-reduce phases through our transport (the bucket, or two 1,000-float
  slices of it), to price a round with no compression arithmetic;
* ``powersgd`` / ``powersgd1``: our hook, PowerSGD or one-round PowerSGD at ``--rank``;
* ``torch-powersgd``: PyTorch's ``powerSGD_hook`` at ``--rank``.

Prints the median step time (ms) of each over ``--reps`` interleaved repetitions of
``--steps`` steps, with their min-max::

    PYTHONPATH=src .venv/bin/python benchmarks/round_cost.py --reps 3
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.compress import AllReduce, TorchTransport
from accordion.ddp import AccordionState, accordion_hook
from accordion.models import MNIST1DCNN

CONFIGS = ("dense", "rounds1", "rounds2", "powersgd", "powersgd1", "torch-powersgd")


def _rounds_hook(rounds: int, world: int):
    transport = TorchTransport()

    def exchange(buffer: torch.Tensor):
        buffer.div_(world)
        if rounds == 1:
            yield [AllReduce(buffer)]
        else:  # two sequential phases of small slices: the price of a round alone
            yield [AllReduce(buffer[:1000])]
            yield [AllReduce(buffer[1000:2000])]
        return True

    def hook(_, bucket):
        buffer = bucket.buffer()
        return transport.run_async(exchange(buffer)).then(lambda _: buffer)

    return hook


def _attach(config: str, net: nn.Module, ddp: DDP, world: int, rank_r: int) -> None:
    if config in ("rounds1", "rounds2"):
        ddp.register_comm_hook(None, _rounds_hook(int(config[-1]), world))
    elif config in ("powersgd", "powersgd1"):
        state = AccordionState(net, compressor=config, mild=rank_r, aggressive=rank_r)
        ddp.register_comm_hook(state, accordion_hook)
    elif config == "torch-powersgd":
        state = torch_powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank_r, start_powerSGD_iter=2,
            min_compression_rate=0, use_error_feedback=True, warm_start=True,
        )  # fmt: skip
        ddp.register_comm_hook(state, torch_powersgd.powerSGD_hook)


def _time_config(config: str, rank: int, world: int, args) -> float:
    """Milliseconds per step of ``config`` on this rank (the same span on every rank)."""
    torch.manual_seed(0)
    net = MNIST1DCNN()
    ddp = DDP(net)
    _attach(config, net, ddp, world, args.rank)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 40, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            dist.barrier()
            start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    dist.barrier()
    return (time.perf_counter() - start) / args.steps * 1e3


def _worker(rank: int, world: int, path: str, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        for config in args.configs:
            ms = _time_config(config, rank, world, args)
            if rank == 0:
                queue.put((config, ms))
    finally:
        gc.collect()  # free the configs' DDP reducers while their process group still lives
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD rank (default 4)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    args = parser.parse_args(argv)
    if min(args.workers, args.steps, args.reps, args.rank) < 1 or args.warmup < 0:
        parser.error("--workers, --steps, --reps and --rank must be >= 1, --warmup >= 0")
    times: dict[str, list[float]] = {c: [] for c in args.configs}
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            queue = ctx.Queue()
            path = os.path.join(tmp, f"rendezvous{rep}")
            mp.start_processes(_worker, args=(args.workers, path, args, queue),
                               nprocs=args.workers, start_method="spawn")  # fmt: skip
            for _ in args.configs:  # rank 0 put one figure per configuration
                config, ms = queue.get(timeout=60)
                times[config].append(ms)
    print("| configuration | step ms | min-max |\n|---|---|---|")
    for config, values in times.items():
        print(f"| {config} | {statistics.median(values):.1f} | "
              f"{min(values):.1f}-{max(values):.1f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
