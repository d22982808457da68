"""A restartable training job: DDP with the Accordion hook, a checkpoint set every epoch.

Shows ``accordion.checkpoint.init_process_group`` (the workers meet through a file in
the checkpoint folder, fresh for every restart attempt, where gloo's env:// rendezvous
often fails after a restart) and ``accordion.Checkpointer`` (every rank's file of a
step written atomically, the set marked complete once all are written). When
``torchrun`` restarts the workers after one died, or when the job is launched again on
the same folder, it resumes from the newest complete set: weights, optimizer,
scheduler, each rank's Accordion state (error-feedback memories, levels, the rule's
history, the ledger of bytes sent) and the random state. Rank 0 says whether it
resumed, then prints the levels the epochs of this attempt used and the bytes sent over
the whole run against dense DDP's.

Run it on CPU with two processes, restarted up to 3 times if a worker dies::

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 examples/restartable.py ckpt

and again with more epochs, to see it resume where it stopped::

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 examples/restartable.py ckpt \\
        --epochs 4
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import accordion
from accordion import summarize
from accordion.checkpoint import init_process_group

STEPS, BATCH = 4, 32
FEATURES, CLASSES = 32, 8


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="A restartable Accordion training job.")
    parser.add_argument("checkpoint_dir", help="shared by every rank; resumed from if it has a set")
    parser.add_argument("--epochs", type=int, default=2, help="epochs of the whole run")
    return parser.parse_args()


def batch(rank: int, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic batch that is a function of the epoch, the step and the rank only, so
    the epoch saved in a checkpoint is the data position: a resumed run sees the same
    batches as an uninterrupted one."""
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1000 * rank + 10 * epoch + step)
    x = torch.randn(BATCH, FEATURES, generator=gen)
    return x, (x @ teacher).argmax(dim=1)


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, epoch: int):
    for step in range(STEPS):
        x, y = batch(rank, epoch, step)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # the hook compresses and averages the gradients
        optimizer.step()
    return loss


def main() -> None:
    args = arguments()
    init_process_group(args.checkpoint_dir)  # not dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                        nn.Linear(64, CLASSES))  # fmt: skip
    model = DDP(net)
    state = accordion.AccordionState(net, "powersgd", levels=(4, 2, 1))
    state.register(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
    saver = accordion.Checkpointer(args.checkpoint_dir, keep=2)
    # every rank loads the same set (rank 0 chooses it), or none on a fresh start
    restored = saver.load_latest(model=net, optimizer=optimizer, scheduler=scheduler,
                                 accordion=state)  # fmt: skip
    start = 0 if restored is None else restored.extra["epoch"]
    if rank == 0:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        told = "fresh start" if restored is None else f"resumed from step {restored.step}"
        print(f"attempt {attempt}: {told}", flush=True)
    used = []
    for epoch in range(start, args.epochs):
        used.append(state.levels())
        loss = train_epoch(model, optimizer, rank, epoch)
        scheduler.step()
        state.end_epoch(optimizer)
        # the step of a set is the number of epochs done: what a resume starts from
        saver.save(epoch + 1, model=net, optimizer=optimizer, scheduler=scheduler,
                   accordion=state, extra={"epoch": epoch + 1})  # fmt: skip
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.3f}", flush=True)
    if rank == 0:
        print(summarize(state, used, first=start))
    dist.barrier()  # gloo: every rank gets here before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
