"""The small model, per-rank data, inner step and straight-or-resumed run that the DiLoCo
tests share."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn


def net() -> nn.Module:
    """An 8 -> 32 -> 4 MLP, the same on every rank (seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s own batch at ``step``."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def loss_backward(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int,
                  step: int) -> torch.Tensor:  # fmt: skip
    """Zero the gradients, then MSE on this rank's batch and its backward; the loss (a
    closure for ``optimizer.step``)."""
    x, y = batch(rank, step)
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


def inner_step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    """One inner step of MSE on this rank's batch."""
    loss_backward(model, optimizer, rank, step)
    optimizer.step()


def straight_and_resumed(build: Callable[[], tuple], rank: int, steps: int,
                         save_after: int) -> tuple[tuple, tuple]:  # fmt: skip
    """A straight run of ``steps`` inner steps of ``build()``'s ``(net, inner, diloco)``,
    and one rebuilt by ``build()`` from the state dicts saved after step ``save_after``
    (0-based) that takes the rest: ``((net, diloco), (net2, diloco2))``."""
    net, inner, diloco = build()
    saved = None
    for step in range(steps):
        inner_step(net, inner, rank, step)
        diloco.step()
        if step == save_after:
            saved = copy.deepcopy((net.state_dict(), inner.state_dict(), diloco.state_dict()))
    net2, inner2, diloco2 = build()
    for part, state in zip((net2, inner2, diloco2), saved):
        part.load_state_dict(state)
    for step in range(save_after + 1, steps):
        inner_step(net2, inner2, rank, step)
        diloco2.step()
    return (net, diloco), (net2, diloco2)
