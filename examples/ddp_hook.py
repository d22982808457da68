"""Accordion as a DDP communication hook, in a plain PyTorch training loop.

Shows the basic use: build an ``AccordionState`` from the model, register its hook on
the ``DistributedDataParallel`` module, and end every epoch in the state after the
scheduler stepped. PowerSGD's rank walks down the ladder 4, 2, 1 as the layers calm down
(rank 1 only after the learning rate's first decay). Rank 0 prints the levels each epoch
used and the bytes sent against dense DDP's.

Run it on CPU with two processes::

    torchrun --standalone --nproc-per-node 2 examples/ddp_hook.py
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import accordion
from accordion import summarize

EPOCHS, STEPS, BATCH = 4, 4, 32
FEATURES, CLASSES = 32, 8


def batch(rank: int, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic batch: each rank draws its own samples (a data-parallel shard), and a
    fixed random linear "teacher" labels them, so there is something to learn."""
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1000 * rank + 10 * epoch + step)
    x = torch.randn(BATCH, FEATURES, generator=gen)
    return x, (x @ teacher).argmax(dim=1)


def main() -> None:
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, ...
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                        nn.Linear(64, CLASSES))  # fmt: skip
    model = DDP(net)
    # built from the unwrapped net, so that its keys are the parameter names
    state = accordion.AccordionState(net, "powersgd", levels=(4, 2, 1))
    state.register(model)  # = model.register_comm_hook(state, accordion.accordion_hook)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    # a decay after 2 epochs: the default (guarded) rule opens the last rung only then
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
    used = []
    for epoch in range(EPOCHS):
        used.append(state.levels())  # the levels this epoch's steps use
        for step in range(STEPS):
            x, y = batch(rank, epoch, step)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # the hook compresses and averages the gradients
            optimizer.step()
        scheduler.step()
        state.end_epoch(optimizer)  # after scheduler.step(): it sees the next epoch's lr
    if rank == 0:
        print(f"loss: {loss.item():.3f}")
        print(summarize(state, used))
    dist.barrier()  # gloo: every rank gets here before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
