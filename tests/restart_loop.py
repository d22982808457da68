"""A hand-written training loop that ``torchrun --max-restarts`` can restart: DDP with
the Accordion hook, a checkpoint set every epoch, and the workers meeting through
:func:`accordion.checkpoint.init_process_group` (``--init env``: plain env://).

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 3 \\
        tests/restart_loop.py CKPT_DIR FINAL.pt

Rank 0 prints one line per attempt, ``attempt K: fresh start`` or ``attempt K: resumed
from step N``, and writes the final weights to ``FINAL.pt``. The data of a step is a
function of the epoch, the step and the rank, so the epoch is the data position.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.checkpoint import Checkpointer, init_process_group
from accordion.ddp import AccordionState, accordion_hook


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint_dir")
    parser.add_argument("final")
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4, help="steps per epoch")
    parser.add_argument("--sleep", type=float, default=0.03, help="s per step: pacing only")
    parser.add_argument("--init", choices=("file", "env"), default="file")
    return parser.parse_args()


def _batch(epoch: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * epoch + 10 * step + rank)
    return torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen)


def main() -> None:
    args = _arguments()
    if args.init == "file":
        init_process_group(args.checkpoint_dir)
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # identical initial weights on every rank
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32),
                        nn.ReLU(), nn.Linear(32, 4))  # fmt: skip
    model = DDP(net)
    state = AccordionState(net, "powersgd", levels=(2, 1))
    model.register_comm_hook(state, accordion_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=8, gamma=0.5)
    saver = Checkpointer(args.checkpoint_dir, keep=2)
    restored = saver.load_latest(model=net, optimizer=optimizer, scheduler=scheduler,
                                 accordion=state)  # fmt: skip
    start = 0 if restored is None else restored.extra["epoch"]
    if rank == 0:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        told = "fresh start" if restored is None else f"resumed from step {restored.step}"
        print(f"attempt {attempt}: {told}", flush=True)
    for epoch in range(start, args.epochs):
        for step in range(args.steps):
            x, y = _batch(epoch, step, rank)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()  # the hook averages
            optimizer.step()
            time.sleep(args.sleep)
        scheduler.step()
        state.end_epoch(optimizer)
        saver.save(epoch + 1, model=net, optimizer=optimizer, scheduler=scheduler,
                   accordion=state, extra={"epoch": epoch + 1})  # fmt: skip
    if rank == 0:
        torch.save(net.state_dict(), args.final)
    dist.barrier()  # gloo: every rank passes a barrier before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
