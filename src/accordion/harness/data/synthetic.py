"""Random images or signals with random labels, for speed benchmarks."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from ..._validate import check_int
from .base import TAG_SYNTHETIC, ClassificationData, generator


def synthetic_default_model(shape: object) -> str:
    """The model of ``synthetic`` samples of ``shape``; ValueError unless (3, H, W) or (L,)."""
    if not isinstance(shape, Sequence) or not all(
        not isinstance(size, bool) and isinstance(size, numbers.Integral) and int(size) > 0
        for size in shape
    ):
        raise ValueError(f"synthetic_shape must be a tuple of positive ints, got {shape!r}")
    if len(shape) == 3 and shape[0] == 3:
        return "resnet18"
    if len(shape) == 1:
        return "mnist1d-cnn"
    raise ValueError(f"synthetic_shape must be (3, H, W) images or (L,) signals, got {shape!r}")


def make_synthetic(
    train_samples: int,
    test_samples: int,
    seed: int,
    shape: Sequence[int],
    num_classes: int,
) -> ClassificationData:
    """``train_samples`` and ``test_samples`` standard-normal samples of ``shape`` with
    uniform labels in ``[0, num_classes)``, drawn from generators seeded from ``seed``."""
    default_model = synthetic_default_model(shape)
    shape = tuple(int(size) for size in shape)
    num_classes = check_int("synthetic_classes", num_classes, 1)

    def draw(count: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
        stream = generator(TAG_SYNTHETIC, seed, split)
        x = torch.randn((count, *shape), generator=stream)
        y = torch.randint(0, num_classes, (count,), generator=stream, dtype=torch.int64)
        return x, y

    # Separate streams: the test set does not change with train_samples.
    x_train, y_train = draw(train_samples, 0)
    x_test, y_test = draw(test_samples, 1)
    return ClassificationData(
        name="synthetic",
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=num_classes,
        augment=False,
        default_model=default_model,
    )
