"""Writes tests/data/accordion-format1.pt with the code of commit 5847b17 (checkpoint format 1).

Run it against that code: ``git worktree add /tmp/old 5847b17`` then
``PYTHONPATH=/tmp/old/src python tests/data/make_format1_fixture.py [OUT]`` (``OUT``
defaults to the fixture's own path).

The tests compare the levels and decisions exactly but the tensors and norms only up to
rounding, since another CPU's kernels may round differently. A decision taken from a
ratio close to ``ETA`` could flip with that rounding, so the script asserts that every
ratio of every check keeps at least ``MARGIN`` (relative) away from it.
"""

import sys
from pathlib import Path

import torch
from fixture_checks import check_clear_of_threshold
from torch import nn

from accordion.ddp import AccordionState

ETA = 2.0


def make_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def step(net, state, seed):
    gen = torch.Generator().manual_seed(seed)
    net.zero_grad()
    (net(torch.randn(5, 8, generator=gen))).pow(2).sum().backward()
    state.reduce_gradients()


out = {}
for unit in ("epoch", "step"):
    net = make_net()
    state = AccordionState(
        net, "powersgd", mild=2, aggressive=1, interval=2, eta=ETA, interval_unit=unit
    )
    end = state.end_epoch if unit == "epoch" else state.end_step
    for i in range(5):
        step(net, state, i)
        end(next_lr=0.1 if i < 3 else 0.05)
    saved = state.state_dict()
    for i in range(5, 9):
        step(net, state, i)
        end(next_lr=0.05)
    check_clear_of_threshold(state.stats()["checks"], ETA)
    out[unit] = {
        "checkpoint": saved,
        "weights": {k: v.clone() for k, v in net.state_dict().items()},
        "after": {
            "levels": state.levels(),
            "stats": state.stats(),
            "memory": {k: state.reducer.memory.get(k).clone() for k in state.reducer.memory.keys()},
        },
    }
target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "accordion-format1.pt"
torch.save(out, target)
print({u: (o["after"]["levels"], o["checkpoint"]["format"]) for u, o in out.items()})
