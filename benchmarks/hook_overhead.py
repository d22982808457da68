"""Step time of our hook against plain DDP and PyTorch's PowerSGD hooks, side by side.

Two local gloo workers train ResNet-18 (CIFAR layout) on CIFAR-shaped random data. For
each configuration the script measures the median step time (forward, backward with the
hook, optimizer step) over ``--steps`` steps after ``--warmup`` steps, repeated ``--reps``
times in interleaved order (so that a slow phase of the machine hits every configuration),
and prints each median with its spread, and the ratio to PyTorch's ``powerSGD_hook`` at
the same rank. It also times our compression alone (one process, no communication) per
step.

    PYTHONPATH=src .venv/bin/python benchmarks/hook_overhead.py --steps 20 --reps 3

``--only torch`` (or ``accordion``, ``plain``) runs only the configurations whose names
contain one of the words; ``HOOK_OVERHEAD_TRACE=1`` prints each configuration as it
starts.

Numbers depend on the machine; on a shared 2-core machine expect noise of several percent.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.calibration import measure_step_compute
from accordion.compress import PowerSGD, Reducer, SimulatedTransport
from accordion.ddp import AccordionState, accordion_hook
from accordion.models import get_model
from accordion.policy import GuardedRule

RANKS = (1, 2, 4)
# torch 2.13's batched_powerSGD_hook passes a 2-D matrix to _orthogonalize, which asserts
# 3-D (AssertionError on the first compressed step); it is measured where it works.
BATCHED_WORKS = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13)


def configurations() -> list[tuple[str, str, int | None]]:
    configs = [("plain DDP", "ddp", None)]
    for rank in RANKS:
        configs += [
            (f"torch powerSGD_hook r{rank}", "torch", rank),
            (f"accordion static r{rank}", "ours", rank),
        ]
        if BATCHED_WORKS:
            configs.append((f"torch batched_powerSGD_hook r{rank}", "torch-batched", rank))
    configs.append(("accordion adaptive 4,1", "adaptive", 4))
    configs.append(("accordion guarded 4,2,1", "guarded", 4))
    configs.append(("accordion auto r4 (cost model)", "auto", 4))
    return configs


def attach(kind: str, rank: int | None, net: nn.Module, model: DDP, step) -> None:
    if kind in ("torch", "torch-batched"):
        state = torch_psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
            min_compression_rate=2, use_error_feedback=True, warm_start=True,
        )  # fmt: skip
        hook = torch_psgd.powerSGD_hook if kind == "torch" else torch_psgd.batched_powerSGD_hook
        model.register_comm_hook(state, hook)
    elif kind == "ours":
        model.register_comm_hook(AccordionState(net, "powersgd", rank, rank), accordion_hook)
    elif kind == "auto":
        state = AccordionState(net, "powersgd", rank, rank)
        model.register_comm_hook(state, accordion_hook)
        # the step's computation, this link and the compression costs
        report = state.calibrate(compute_s=measure_step_compute(model, step))
        if dist.get_rank() == 0:
            print(
                f"auto: {len(report['dense_keys'])} of {len(report['tensors'])} matrices dense, "
                f"link {report['bandwidth'] / 1e6:.0f} MB/s, latency "
                f"{report['latency'] * 1e6:.0f} us",
                flush=True,
            )
    elif kind == "adaptive":
        # no epoch ends within the run: rank 4 plus the check epoch's accumulation
        state = AccordionState(net, "powersgd", 4, 1, interval=1, eta=1e-3)
        model.register_comm_hook(state, accordion_hook)
    elif kind == "guarded":
        # the guarded rule checks every epoch, so it gathers its statistic at every step
        state = AccordionState(net, "powersgd", levels=(4, 2, 1), interval=1, rule=GuardedRule())
        model.register_comm_hook(state, accordion_hook)


def step_times(kind, rank, batch, warmup, steps, world) -> list[float]:
    torch.manual_seed(0)
    net = get_model("resnet18")
    model = DDP(net)
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    attach(kind, rank, net, model, lambda: nn.functional.cross_entropy(model(x), y).backward())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when the slowest does
        if i >= warmup:
            times.append(elapsed.item())
    return times


def worker(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[str, list[float]] = {}
    for _ in range(args.reps):
        for name, kind, r in configurations():
            if args.only and not any(part in name for part in args.only):
                continue
            if os.environ.get("HOOK_OVERHEAD_TRACE"):
                print(f"rank {rank}: {name}", flush=True)
            times = step_times(kind, r, args.batch, args.warmup, args.steps, world)
            results.setdefault(name, []).append(statistics.median(times))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out)


def compression_only(rank: int, steps: int = 20) -> float:
    """Seconds per step of our PowerSGD compression of ResNet-18's gradients, no network."""
    net = get_model("resnet18")
    names = [n for n, _ in net.named_parameters()]
    grads = [torch.randn_like(p) for p in net.parameters()]
    reducer, world = Reducer(PowerSGD(rank)), SimulatedTransport(1)
    for _ in range(3):
        world.run([reducer.exchange(names, [g.clone() for g in grads], 1)])
    start = time.perf_counter()
    for _ in range(steps):
        world.run([reducer.exchange(names, [g.clone() for g in grads], 1)])
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="samples per worker per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--only", nargs="*", default=[], help="run configurations naming these")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.pt")
        mp.start_processes(worker, args=(2, port, args, out), nprocs=2, start_method="spawn")
        results = torch.load(out)
    torch.set_num_threads(args.threads)
    print(
        f"ResNet-18, 2 gloo workers, batch {args.batch}/worker, median of {args.steps} steps "
        f"after {args.warmup}, {args.reps} interleaved repetitions (min-max of the medians)"
    )
    header = f"{'configuration':<34} {'step ms':>9} {'spread':>15} {'vs torch hook':>14}"
    print(f"{header} {'vs plain DDP':>13}")
    plain = statistics.median(results.get("plain DDP", [math.nan]))
    for name, kind, rank in configurations():
        if name not in results:
            continue
        medians = results[name]
        mid = statistics.median(medians)
        ref = results.get(f"torch powerSGD_hook r{rank}") if rank else None
        static = ref and kind in ("ours", "torch", "torch-batched")
        ratio = f"{mid / statistics.median(ref):.2f}x" if static else "-"
        spread = f"{min(medians) * 1e3:.0f}-{max(medians) * 1e3:.0f}"
        print(f"{name:<34} {mid * 1e3:>9.1f} {spread:>15} {ratio:>14} {mid / plain:>12.2f}x")
    for rank in RANKS:
        print(f"our compression alone, rank {rank}: {compression_only(rank) * 1e3:.1f} ms/step")


if __name__ == "__main__":
    main()
