"""AdamW under DDP at 2 bits, then Adam's momentum at 1 bit: the transformer recipe.

On the character-level transformers of ``docs/dense-quality.md`` this kept the quality of
uncompressed training at 21.8x fewer bytes than dense. Three pieces:

- ``AccordionState(net, "nq", levels=(2, 2))``: the DDP hook averages the gradients at
  2 bits (``nq``, one scale per 64 values);
- ``AdamNoiseCorrection(optimizer, state)``: takes the 2-bit code's own noise out of
  Adam's second moment, without which 2 bits lose quality under AdamW;
- ``MomentumExchange(optimizer, state, freeze_at, level=1)``: from ``freeze_at`` steps on
  (22% of the run in the measured runs) Adam's second moment is held and the ranks
  average their momenta at 1 bit instead of their gradients (1-bit Adam's exchange),
  through the same DDP hook. The loop's one change: it stops clipping at the freeze (the
  exchange clips, over the ranks, before it sends).

The model is a bigram character model (an embedding and an MLP) on a synthetic text.
Rank 0 prints the state's level each window of 6 steps used, the step of the freeze, and
the bytes sent (the momenta's included) against dense DDP's.

Run it on CPU with two processes::

    torchrun --standalone --nproc-per-node 2 examples/adamw_momentum.py
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import accordion
from accordion import summarize

WINDOWS, INTERVAL, BATCH = 4, 6, 64  # 4 windows of 6 steps
FREEZE_AT, CLIP = 8, 1.0
VOCAB, WIDTH = 64, 64


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs of a character and the next one, from a fixed random bigram table (the
    "text"); each rank draws its own pairs, a data-parallel shard."""
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randint(VOCAB, (BATCH,), generator=gen)
    return x, torch.multinomial(table[x].softmax(dim=1), 1, generator=gen).squeeze(1)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                        nn.Linear(2 * WIDTH, VOCAB))  # fmt: skip
    state = accordion.AccordionState(net, "nq", levels=(2, 2), interval=INTERVAL,
                                     interval_unit="step")  # fmt: skip
    ddp = state.register(DDP(net))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3, betas=(0.9, 0.95))
    accordion.AdamNoiseCorrection(optimizer, state)  # first: the freeze holds its moment
    exchange = accordion.MomentumExchange(optimizer, state, FREEZE_AT, level=1, clip=CLIP)
    used = []
    for step in range(WINDOWS * INTERVAL):
        if step % INTERVAL == 0:
            used.append(state.levels())  # the gradients' level in this window
        x, y = batch(rank, step)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()  # the hook: the gradients at 2 bits; past the freeze, the momenta at 1
        if not exchange.active:  # past the freeze the exchange clips before it sends
            nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
        optimizer.step()
        state.end_step(optimizer)
    if rank == 0:
        print(f"loss: {loss.item():.3f}")
        print(f"momentum: 1 bit from step {exchange.frozen_at} of {exchange.steps}")
        print(summarize(state, used, unit="window"))
    dist.barrier()  # gloo: every rank gets here before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
