"""ResNet-18 for 32x32 inputs (CIFAR-10/100), in the kuangliu/pytorch-cifar layout.

Unlike the ImageNet ResNet, the stem is a single 3x3 convolution with stride 1 and there is
no max-pool, so the four stages run at 32, 16, 8 and 4 pixels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["BasicBlock", "ResNet", "ResNet18"]


class BasicBlock(nn.Module):
    """Two 3x3 conv+BN layers with an identity (or 1x1 conv+BN) shortcut."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        """Build a block mapping ``in_planes`` channels to ``planes`` channels at ``stride``."""
        super().__init__()
        self.conv1 = nn.Conv2d(
            in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False
        )
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        # An empty Sequential is the identity and keeps parameter names stable either way.
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes * self.expansion:
            self.shortcut = nn.Sequential(
                nn.Conv2d(
                    in_planes, planes * self.expansion, kernel_size=1, stride=stride, bias=False
                ),
                nn.BatchNorm2d(planes * self.expansion),
            )

    def forward(self, x: Tensor) -> Tensor:
        """Return ``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR ResNet built from :class:`BasicBlock` stages of widths 64/128/256/512."""

    def __init__(self, num_blocks: Sequence[int], num_classes: int = 10) -> None:
        """Build a ResNet with ``num_blocks[i]`` blocks in stage ``i`` (four stages)."""
        super().__init__()
        if len(num_blocks) != 4:
            raise ValueError(f"num_blocks must have 4 entries, got {list(num_blocks)}")
        self.in_planes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.layer1 = self._make_layer(64, num_blocks[0], stride=1)
        self.layer2 = self._make_layer(128, num_blocks[1], stride=2)
        self.layer3 = self._make_layer(256, num_blocks[2], stride=2)
        self.layer4 = self._make_layer(512, num_blocks[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.linear = nn.Linear(512 * BasicBlock.expansion, num_classes)

    def _make_layer(self, planes: int, num_blocks: int, stride: int) -> nn.Sequential:
        """Stack ``num_blocks`` blocks; only the first one changes stride/width."""
        layers = []
        for block_stride in [stride] + [1] * (num_blocks - 1):
            layers.append(BasicBlock(self.in_planes, planes, block_stride))
            self.in_planes = planes * BasicBlock.expansion
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Map images ``[batch, 3, H, W]`` to logits ``[batch, num_classes]``."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = torch.flatten(self.avgpool(out), 1)
        return self.linear(out)


class ResNet18(ResNet):
    """ResNet-18 for CIFAR: 11,173,962 parameters in 62 tensors for 10 classes."""

    def __init__(self, num_classes: int = 10) -> None:
        """Build ResNet-18 ([2, 2, 2, 2] basic blocks) with ``num_classes`` outputs."""
        super().__init__((2, 2, 2, 2), num_classes=num_classes)
