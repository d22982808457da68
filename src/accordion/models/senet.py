"""SENet-18 for 32x32 inputs (CIFAR-10/100), as in kuangliu/pytorch-cifar.

Pre-activation basic blocks whose residual branch is rescaled channel-wise by a
squeeze-and-excitation gate built from two 1x1 convolutions (reduction 16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PreActSEBlock", "SENet18"]


class PreActSEBlock(nn.Module):
    """Pre-activation basic block with squeeze-and-excitation on the residual branch."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1, reduction: int = 16) -> None:
        """Build a block mapping ``in_planes`` to ``planes`` channels at ``stride``."""
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(
            in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False
        )
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        # None means identity; a projection is only needed when the shape changes.
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False)
            )
        self.fc1 = nn.Conv2d(planes, planes // reduction, kernel_size=1)
        self.fc2 = nn.Conv2d(planes // reduction, planes, kernel_size=1)

    def forward(self, x: Tensor) -> Tensor:
        """Return ``shortcut + se_gate(branch) * branch`` for the pre-activated input."""
        out = F.relu(self.bn1(x))
        # Pre-activation: the projection shortcut sees the normalised input, identity sees x.
        shortcut = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        # Squeeze: global average per channel; excitation: bottleneck MLP + sigmoid gate.
        w = F.adaptive_avg_pool2d(out, 1)
        w = torch.sigmoid(self.fc2(F.relu(self.fc1(w))))
        return out * w + shortcut


class SENet18(nn.Module):
    """SENet-18: a 3x3 stem and four stages of [2, 2, 2, 2] SE blocks (64/128/256/512)."""

    def __init__(self, num_classes: int = 10) -> None:
        """Build SENet-18 with ``num_classes`` outputs."""
        super().__init__()
        self.in_planes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.layer1 = self._make_layer(64, 2, stride=1)
        self.layer2 = self._make_layer(128, 2, stride=2)
        self.layer3 = self._make_layer(256, 2, stride=2)
        self.layer4 = self._make_layer(512, 2, stride=2)
        self.linear = nn.Linear(512, num_classes)

    def _make_layer(self, planes: int, num_blocks: int, stride: int) -> nn.Sequential:
        """Stack ``num_blocks`` blocks; only the first one changes stride/width."""
        layers = []
        for block_stride in [stride] + [1] * (num_blocks - 1):
            layers.append(PreActSEBlock(self.in_planes, planes, block_stride))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Map images ``[batch, 3, 32, 32]`` to logits ``[batch, num_classes]``."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        # Same as kuangliu's avg_pool2d(out, 4) at 32x32, but tolerant of other sizes.
        out = torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)
        return self.linear(out)
