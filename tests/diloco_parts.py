"""The small model, per-rank data and inner step that the DiLoCo tests share."""

from __future__ import annotations

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


def inner_step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    """One inner step of MSE on this rank's batch."""
    x, y = batch(rank, step)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
