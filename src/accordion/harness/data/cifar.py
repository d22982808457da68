"""CIFAR-10 and CIFAR-100, read from the official python pickles (never downloaded)."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from .base import ClassificationData, cut, first_complete

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
"""Where to get the CIFAR-10/100 python archives (this module never downloads them)."""

#: Training and test samples of either CIFAR.
CIFAR_SIZES = (50_000, 10_000)

_CIFAR_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
_CIFAR_FILES = {
    "cifar10": (tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",)),
    "cifar100": (("train",), ("test",)),
}
_CIFAR_LABEL_KEYS = {"cifar10": b"labels", "cifar100": b"fine_labels"}


def load_cifar(
    name: str, data_dir: Path, train_samples: int | None, test_samples: int | None
) -> ClassificationData:
    """CIFAR ``name`` (``cifar10`` or ``cifar100``) from ``data_dir``, as uint8 pixels,
    cut to the first ``train_samples`` / ``test_samples`` (None: all)."""
    train_files, test_files = _CIFAR_FILES[name]
    folder = cifar_folder(name, data_dir)
    label_key = _CIFAR_LABEL_KEYS[name]
    x_train, y_train = _read_cifar_pickles([folder / file for file in train_files], label_key)
    x_test, y_test = _read_cifar_pickles([folder / file for file in test_files], label_key)
    return ClassificationData(
        name=name,
        x_train=cut("train_samples", x_train, train_samples, name),
        y_train=cut("train_samples", y_train, train_samples, name),
        x_test=cut("test_samples", x_test, test_samples, name),
        y_test=cut("test_samples", y_test, test_samples, name),
        num_classes=100 if name == "cifar100" else 10,
        augment=True,
        default_model="resnet18",
    )


def cifar_files(name: str, data_dir: Path) -> list[Path]:
    """The training then test files of CIFAR ``name`` in ``data_dir`` or its subfolder."""
    folder = cifar_folder(name, data_dir)
    train_files, test_files = _CIFAR_FILES[name]
    return [folder / file for file in (*train_files, *test_files)]


def cifar_folder(name: str, data_dir: Path) -> Path:
    """``data_dir`` or its CIFAR subfolder, whichever holds all the files of ``name``."""
    train_files, test_files = _CIFAR_FILES[name]
    folders = (data_dir, data_dir / _CIFAR_FOLDERS[name])
    candidates = [[folder / file for file in (*train_files, *test_files)] for folder in folders]
    hint = (
        f"get the CIFAR python version from {CIFAR_URL}, extract it and pass the extracted "
        f"folder ({_CIFAR_FOLDERS[name]}) or its parent as data_dir."
    )
    return first_complete(candidates, name, hint)[0].parent


def _read_cifar_pickles(
    paths: Sequence[Path], label_key: bytes
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate CIFAR pickle files into uint8 images ``[N, 3, 32, 32]`` and int64 labels."""
    images, labels = [], []
    for path in paths:
        # The official CIFAR format is a pickle: only load files from a source you trust.
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(batch[label_key], dtype=np.int64))
    x = torch.from_numpy(np.ascontiguousarray(np.concatenate(images)))
    y = torch.from_numpy(np.concatenate(labels))
    return x, y
