"""GoogLeNet (Inception v1) for 32x32 inputs (CIFAR-10/100), as in kuangliu/pytorch-cifar.

The ImageNet stem is replaced by a single 3x3 conv with 192 channels and the auxiliary
classifiers are dropped; the "5x5" branch uses two stacked 3x3 convolutions.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["GoogLeNet", "Inception"]


def _conv_bn_relu(in_channels: int, out_channels: int, kernel_size: int) -> list[nn.Module]:
    """Return [conv (same padding, with bias), BN, ReLU] as a list of modules."""
    return [
        nn.Conv2d(in_channels, out_channels, kernel_size=kernel_size, padding=kernel_size // 2),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    ]


class Inception(nn.Module):
    """Four parallel branches (1x1, 1x1->3x3, 1x1->3x3->3x3, pool->1x1), concatenated."""

    def __init__(
        self,
        in_planes: int,
        n1x1: int,
        n3x3red: int,
        n3x3: int,
        n5x5red: int,
        n5x5: int,
        pool_planes: int,
    ) -> None:
        """Build a module with ``n1x1 + n3x3 + n5x5 + pool_planes`` output channels."""
        super().__init__()
        self.b1 = nn.Sequential(*_conv_bn_relu(in_planes, n1x1, 1))
        self.b2 = nn.Sequential(
            *_conv_bn_relu(in_planes, n3x3red, 1),
            *_conv_bn_relu(n3x3red, n3x3, 3),
        )
        self.b3 = nn.Sequential(
            *_conv_bn_relu(in_planes, n5x5red, 1),
            *_conv_bn_relu(n5x5red, n5x5, 3),
            *_conv_bn_relu(n5x5, n5x5, 3),
        )
        self.b4 = nn.Sequential(
            nn.MaxPool2d(3, stride=1, padding=1),
            *_conv_bn_relu(in_planes, pool_planes, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        """Concatenate the four branch outputs along the channel dimension."""
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], dim=1)


class GoogLeNet(nn.Module):
    """CIFAR GoogLeNet: 3x3 stem, inception a3..b5 with max-pools between stages, linear head."""

    def __init__(self, num_classes: int = 10) -> None:
        """Build GoogLeNet with ``num_classes`` outputs."""
        super().__init__()
        self.pre_layers = nn.Sequential(*_conv_bn_relu(3, 192, 3))
        self.a3 = Inception(192, 64, 96, 128, 16, 32, 32)
        self.b3 = Inception(256, 128, 128, 192, 32, 96, 64)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.a4 = Inception(480, 192, 96, 208, 16, 48, 64)
        self.b4 = Inception(512, 160, 112, 224, 24, 64, 64)
        self.c4 = Inception(512, 128, 128, 256, 24, 64, 64)
        self.d4 = Inception(512, 112, 144, 288, 32, 64, 64)
        self.e4 = Inception(528, 256, 160, 320, 32, 128, 128)
        self.a5 = Inception(832, 256, 160, 320, 32, 128, 128)
        self.b5 = Inception(832, 384, 192, 384, 48, 128, 128)
        # Equals kuangliu's AvgPool2d(8) at 32x32 input, but works for any input size.
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.linear = nn.Linear(1024, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Map images ``[batch, 3, 32, 32]`` to logits ``[batch, num_classes]``."""
        out = self.pre_layers(x)
        out = self.maxpool(self.b3(self.a3(out)))
        out = self.maxpool(self.e4(self.d4(self.c4(self.b4(self.a4(out))))))
        out = self.b5(self.a5(out))
        out = torch.flatten(self.avgpool(out), 1)
        return self.linear(out)
