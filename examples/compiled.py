"""Accordion under ``torch.compile(DDP(model))``.

Shows that ``state.register(model)`` finds the DDP module inside ``torch.compile``'s
``OptimizedModule`` and registers the hook there. Compiled under the default
``torch._dynamo.config.optimize_ddp`` (DDPOptimizer, which splits the graph at DDP's
bucket boundaries), the backward pass still hands each bucket to the hook. PowerSGD's
rank walks down the ladder 4, 2, 1 over 4 epochs; rank 0 prints the levels each epoch
used and the bytes sent against dense DDP's.

Run it on CPU with two processes (inductor compiles C++ kernels with the system's
compiler, so the first step takes a while)::

    torchrun --standalone --nproc-per-node 2 examples/compiled.py
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import accordion
from accordion import summarize

EPOCHS, STEPS, BATCH = 4, 3, 32
FEATURES, CLASSES = 32, 8


def batch(rank: int, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic batch, different on each rank, labelled by a fixed random linear map."""
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1000 * rank + 10 * epoch + step)
    x = torch.randn(BATCH, FEATURES, generator=gen)
    return x, (x @ teacher).argmax(dim=1)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                        nn.Linear(64, CLASSES))  # fmt: skip
    # compile the DDP module (not DDP of a compiled module): DDPOptimizer then keeps
    # DDP's buckets, and the hook runs outside the compiled graphs
    model = torch.compile(DDP(net))
    state = accordion.AccordionState(net, "powersgd", levels=(4, 2, 1))
    state.register(model)  # finds the DDP module inside the OptimizedModule
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    # a decay after 2 epochs: the default (guarded) rule opens the last rung only then
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
    used = []
    for epoch in range(EPOCHS):
        used.append(state.levels())
        for step in range(STEPS):
            x, y = batch(rank, epoch, step)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # compiled backward; the hook averages each bucket
            optimizer.step()
        scheduler.step()
        state.end_epoch(optimizer)
    if rank == 0:
        print(f"loss: {loss.item():.3f}")
        print(summarize(state, used))
    dist.barrier()  # gloo: every rank gets here before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
