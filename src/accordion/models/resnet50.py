"""ResNet-50 for ImageNet (He et al., 2016), in the torchvision layout.

Used by ``accordion plan --model resnet50`` to predict traffic at data-centre scale: the plan
reads only parameter shapes, so it builds the model on the ``meta`` device (no memory).
The stem is a 7x7 stride-2 convolution and a max-pool; four stages of bottleneck blocks
(1x1, 3x3, 1x1 convolutions, the last widening by 4) of 3, 4, 6 and 3 blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["RESNET50_PARAMETERS", "Bottleneck", "ResNet50"]

RESNET50_PARAMETERS = 25_557_032
"""Parameters of :class:`ResNet50` with 1000 classes (torchvision's ``resnet50`` too)."""


class Bottleneck(nn.Module):
    """1x1 (narrow), 3x3 (at ``stride``), 1x1 (widen by 4) conv+BN, with a shortcut."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        """Map ``in_planes`` channels to ``4 * planes`` channels at ``stride``."""
        super().__init__()
        out_planes = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_planes != out_planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_planes),
            )

    def forward(self, x: Tensor) -> Tensor:
        """The block's output, ``relu(bottleneck(x) + shortcut(x))``."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class ResNet50(nn.Module):
    """ResNet-50 for ImageNet: 25,557,032 parameters in 161 tensors for 1000 classes."""

    def __init__(self, num_classes: int = 1000) -> None:
        """Build ResNet-50 ([3, 4, 6, 3] bottleneck blocks) with ``num_classes`` outputs."""
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        in_planes = 64
        stages = []
        for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            layers = []
            for block_stride in [stride] + [1] * (blocks - 1):
                layers.append(Bottleneck(in_planes, planes, block_stride))
                in_planes = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Map images ``[batch, 3, H, W]`` to logits ``[batch, num_classes]``."""
        out = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return self.fc(torch.flatten(self.avgpool(out), 1))
