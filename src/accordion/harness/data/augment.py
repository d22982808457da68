"""What a batch does to CIFAR's stored pixels: a random crop and flip (training only), then
the per-channel normalisation."""

from __future__ import annotations

import torch

# Per-channel mean and std of the training images, in [0, 1] pixel units.
_CIFAR_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
_CIFAR_PAD = 4  # pixels of zero padding before the random 32 x 32 crop


def crop_and_flip(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random crop of each ``[N, C, H, W]`` image from its zero-padded copy, and random h-flip.

    One gather for the whole batch: each image's rows and columns are offset by its crop, and
    its columns read backwards when it is flipped.
    """
    n, channels, height, width = images.shape
    pad = _CIFAR_PAD
    padded = torch.nn.functional.pad(images, (pad, pad, pad, pad))
    top = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    left = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    flip = torch.rand(n, generator=generator) < 0.5
    rows = top[:, None] + torch.arange(height)  # [N, H]
    columns = torch.arange(width).expand(n, width)
    columns = left[:, None] + torch.where(flip[:, None], width - 1 - columns, columns)  # [N, W]
    return padded[
        torch.arange(n)[:, None, None, None],
        torch.arange(channels)[None, :, None, None],
        rows[:, None, :, None],
        columns[:, None, None, :],
    ]


def normalise(name: str, x: torch.Tensor) -> torch.Tensor:
    """CIFAR uint8 pixels -> float32 normalised per channel; other tasks' inputs unchanged."""
    stats = _CIFAR_STATS.get(name)
    if stats is None:
        return x
    mean, std = (torch.tensor(values).view(1, -1, 1, 1) * 255.0 for values in stats)
    # In place on the fresh float copy: one temporary instead of three.
    return x.float().sub_(mean).div_(std)
