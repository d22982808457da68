"""Accordion in a hand-written data-parallel loop, without DDP (as the paper's own code).

Shows ``state.reduce_gradients()``: called after ``backward()``, it averages every
``p.grad`` of the model in place over the process group, with the same compression,
statistics and decisions as the DDP hook. The state counts optimizer steps here
(``interval_unit="step"``, ``end_step`` after every step) and checks every 3 steps;
PowerSGD goes from rank 2 (mild) to rank 1 (aggressive) once the layers calm down.
Rank 0 prints the levels each window of 3 steps used and the bytes sent against
dense averaging's.

Run it on CPU with two processes::

    torchrun --standalone --nproc-per-node 2 examples/manual_loop.py
"""

import torch
import torch.distributed as dist
from torch import nn

import accordion
from accordion import summarize

WINDOWS, INTERVAL, BATCH = 4, 3, 32  # 4 windows of 3 steps
FEATURES, OUTPUTS = 32, 8


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic regression batch, different on each rank: a fixed random linear map
    of the inputs (scaled to unit variance), plus noise."""
    teacher = torch.randn(FEATURES, OUTPUTS, generator=torch.Generator().manual_seed(0))
    teacher /= FEATURES**0.5
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, FEATURES, generator=gen)
    return x, x @ teacher + 0.1 * torch.randn(BATCH, OUTPUTS, generator=gen)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # no DDP to broadcast the weights: the same seed on every rank
    net = nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, OUTPUTS))
    # wait_for_decay=False: this short run has no learning-rate decay, and the guarded
    # rule would otherwise keep the last rung (rank 1) closed until the first one
    rule = accordion.GuardedRule(wait_for_decay=False)
    state = accordion.AccordionState(net, "powersgd", mild=2, aggressive=1, interval=INTERVAL,
                                     interval_unit="step", rule=rule)  # fmt: skip
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    used = []
    for step in range(WINDOWS * INTERVAL):
        if step % INTERVAL == 0:
            used.append(state.levels())  # the levels of this window's steps
        x, y = batch(rank, step)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        state.reduce_gradients()  # averages every p.grad in place, compressed
        optimizer.step()
        state.end_step(optimizer)  # after every optimizer step
    if rank == 0:
        print(f"loss: {loss.item():.3f}")
        print(summarize(state, used, unit="window"))
    dist.barrier()  # gloo: every rank gets here before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
