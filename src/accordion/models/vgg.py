"""VGG-19 with batch norm for 32x32 inputs (CIFAR-10/100), as in kuangliu/pytorch-cifar."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["VGG19_CONFIG", "VGG19BN"]

# Output channels of each 3x3 conv; "M" is a 2x2 max-pool. Five pools take 32x32 down to 1x1.
VGG19_CONFIG: tuple[int | str, ...] = (
    64, 64, "M",
    128, 128, "M",
    256, 256, 256, 256, "M",
    512, 512, 512, 512, "M",
    512, 512, 512, 512, "M",
)  # fmt: skip


class VGG19BN(nn.Module):
    """VGG-19 (conv3x3 + BN + ReLU blocks) with a single Linear(512, num_classes) classifier."""

    def __init__(self, num_classes: int = 10) -> None:
        """Build VGG-19-BN with ``num_classes`` outputs."""
        super().__init__()
        self.features = self._make_layers(VGG19_CONFIG)
        self.classifier = nn.Linear(512, num_classes)

    @staticmethod
    def _make_layers(config: tuple[int | str, ...]) -> nn.Sequential:
        """Turn a config into the feature extractor (parameter names ``features.<i>.*``)."""
        layers: list[nn.Module] = []
        in_channels = 3
        for item in config:
            if item == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                assert isinstance(item, int)
                layers += [
                    nn.Conv2d(in_channels, item, kernel_size=3, padding=1),
                    nn.BatchNorm2d(item),
                    nn.ReLU(inplace=True),
                ]
                in_channels = item
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Map images ``[batch, 3, 32, 32]`` to logits ``[batch, num_classes]``."""
        out = torch.flatten(self.features(x), 1)
        return self.classifier(out)
