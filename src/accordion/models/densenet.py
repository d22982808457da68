"""DenseNet-BC for 32x32 inputs (CIFAR-10/100), as in kuangliu/pytorch-cifar.

:class:`DenseNetCifar` is kuangliu's ``densenet_cifar``: bottleneck layers, dense blocks of
[6, 12, 24, 16] layers, growth rate 12 and compression 0.5 at each transition.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Bottleneck", "DenseNet", "DenseNetCifar", "Transition"]


class Bottleneck(nn.Module):
    """BN-ReLU-Conv1x1 (4k channels) then BN-ReLU-Conv3x3 (k channels), concatenated to input."""

    def __init__(self, in_planes: int, growth_rate: int) -> None:
        """Build a layer that appends ``growth_rate`` channels to its ``in_planes`` input."""
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, 4 * growth_rate, kernel_size=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4 * growth_rate)
        self.conv2 = nn.Conv2d(4 * growth_rate, growth_rate, kernel_size=3, padding=1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Return ``cat([new_features, x])`` along channels."""
        out = self.conv1(F.relu(self.bn1(x)))
        out = self.conv2(F.relu(self.bn2(out)))
        return torch.cat([out, x], dim=1)


class Transition(nn.Module):
    """BN-ReLU-Conv1x1 to ``out_planes`` channels followed by a 2x2 average pool."""

    def __init__(self, in_planes: int, out_planes: int) -> None:
        """Build a transition from ``in_planes`` to ``out_planes`` channels."""
        super().__init__()
        self.bn = nn.BatchNorm2d(in_planes)
        self.conv = nn.Conv2d(in_planes, out_planes, kernel_size=1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Compress channels and halve the spatial size."""
        return F.avg_pool2d(self.conv(F.relu(self.bn(x))), 2)


class DenseNet(nn.Module):
    """Four dense blocks of :class:`Bottleneck` layers joined by :class:`Transition` layers."""

    def __init__(
        self,
        nblocks: Sequence[int],
        growth_rate: int = 12,
        reduction: float = 0.5,
        num_classes: int = 10,
    ) -> None:
        """Build a DenseNet with ``nblocks[i]`` layers in dense block ``i`` (four blocks)."""
        super().__init__()
        if len(nblocks) != 4:
            raise ValueError(f"nblocks must have 4 entries, got {list(nblocks)}")
        self.growth_rate = growth_rate
        num_planes = 2 * growth_rate
        self.conv1 = nn.Conv2d(3, num_planes, kernel_size=3, padding=1, bias=False)

        self.dense1 = self._make_dense_layers(num_planes, nblocks[0])
        num_planes += nblocks[0] * growth_rate
        out_planes = int(math.floor(num_planes * reduction))
        self.trans1 = Transition(num_planes, out_planes)
        num_planes = out_planes

        self.dense2 = self._make_dense_layers(num_planes, nblocks[1])
        num_planes += nblocks[1] * growth_rate
        out_planes = int(math.floor(num_planes * reduction))
        self.trans2 = Transition(num_planes, out_planes)
        num_planes = out_planes

        self.dense3 = self._make_dense_layers(num_planes, nblocks[2])
        num_planes += nblocks[2] * growth_rate
        out_planes = int(math.floor(num_planes * reduction))
        self.trans3 = Transition(num_planes, out_planes)
        num_planes = out_planes

        self.dense4 = self._make_dense_layers(num_planes, nblocks[3])
        num_planes += nblocks[3] * growth_rate

        self.bn = nn.BatchNorm2d(num_planes)
        self.linear = nn.Linear(num_planes, num_classes)

    def _make_dense_layers(self, in_planes: int, nblock: int) -> nn.Sequential:
        """Stack ``nblock`` bottleneck layers, each adding ``growth_rate`` channels."""
        layers = []
        for _ in range(nblock):
            layers.append(Bottleneck(in_planes, self.growth_rate))
            in_planes += self.growth_rate
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Map images ``[batch, 3, 32, 32]`` to logits ``[batch, num_classes]``."""
        out = self.conv1(x)
        out = self.trans1(self.dense1(out))
        out = self.trans2(self.dense2(out))
        out = self.trans3(self.dense3(out))
        out = F.relu(self.bn(self.dense4(out)))
        # Equals kuangliu's avg_pool2d(out, 4) at 32x32 input, but works for any input size.
        out = torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)
        return self.linear(out)


class DenseNetCifar(DenseNet):
    """kuangliu's ``densenet_cifar``: nblocks [6, 12, 24, 16], growth rate 12, reduction 0.5."""

    def __init__(self, num_classes: int = 10) -> None:
        """Build the growth-rate-12 CIFAR DenseNet with ``num_classes`` outputs."""
        super().__init__((6, 12, 24, 16), growth_rate=12, reduction=0.5, num_classes=num_classes)
