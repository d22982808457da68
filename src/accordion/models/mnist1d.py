"""A small 1-D CNN for the MNIST-1D benchmark (Greydanus, 2020)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["MNIST1DCNN"]


class MNIST1DCNN(nn.Module):
    """Three stride-2 Conv1d(kernel 5, padding 2) + ReLU layers, then a linear classifier.

    With the default ``length=40`` the sequence shrinks 40 -> 20 -> 10 -> 5, so the
    classifier is ``Linear(width * 5, num_classes)``.
    """

    def __init__(self, num_classes: int = 10, width: int = 32, length: int = 40) -> None:
        """Build the CNN for signals of ``length`` samples with ``width`` channels per conv."""
        super().__init__()
        self.length = length
        self.conv1 = nn.Conv1d(1, width, kernel_size=5, stride=2, padding=2)
        self.conv2 = nn.Conv1d(width, width, kernel_size=5, stride=2, padding=2)
        self.conv3 = nn.Conv1d(width, width, kernel_size=5, stride=2, padding=2)
        self.relu = nn.ReLU()
        out_length = length
        for _ in range(3):
            # Conv1d output length for kernel 5, padding 2, stride 2: ceil(L / 2).
            out_length = (out_length + 2 * 2 - 5) // 2 + 1
        self.linear = nn.Linear(width * out_length, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Map ``[batch, length]`` or ``[batch, 1, length]`` signals to ``[batch, num_classes]``."""
        if x.dim() == 2:
            x = x.unsqueeze(1)
        if x.dim() != 3 or x.size(1) != 1 or x.size(2) != self.length:
            raise ValueError(
                f"expected input [batch, {self.length}] or [batch, 1, {self.length}], "
                f"got shape {tuple(x.shape)}"
            )
        out = self.relu(self.conv1(x))
        out = self.relu(self.conv2(out))
        out = self.relu(self.conv3(out))
        return self.linear(torch.flatten(out, 1))
