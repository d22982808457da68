"""What every task module shares: the task names, the in-memory forms of a task, and
the helpers that cut a split to a sample count and seed a generator from a key."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

TASKS: tuple[str, ...] = ("mnist1d", "cifar10", "cifar100", "wikitext2", "synthetic", "charlm")
"""Task names accepted by :func:`load_task`."""

FILE_TASKS: tuple[str, ...] = ("cifar10", "cifar100", "wikitext2")
"""The tasks that read their files from ``data_dir``; the others generate their data."""

# Purpose tags keep the permutation, augmentation and synthetic streams independent.
TAG_PERMUTATION, TAG_AUGMENT, TAG_SYNTHETIC = 0, 1, 2


@dataclass
class ClassificationData:
    """An image or signal classification task held in memory.

    Attributes:
        name: task name, one of :data:`TASKS`.
        x_train: training inputs, ``[N, ...]``: uint8 ``[N, 3, 32, 32]`` pixels for CIFAR
            (normalised at batch time), float32 otherwise.
        y_train: training labels, int64 ``[N]``, in ``[0, num_classes)``.
        x_test: test inputs, laid out as ``x_train``.
        y_test: test labels, int64.
        num_classes: number of classes.
        augment: whether training batches get a random crop (4-pixel zero padding) and a random
            horizontal flip (CIFAR only).
        default_model: the model name (see :func:`accordion.models.get_model`) for this task.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    augment: bool
    default_model: str


@dataclass
class SequenceData(ClassificationData):
    """A next-token task of fixed windows, batched as :class:`ClassificationData` is.

    Each sample is a window of ``T`` tokens: ``x_train`` int64 ``[N, T]`` token ids, and
    ``y_train`` int64 ``[N, T]`` the same window shifted one token ahead (``y[:, t]`` is the
    token after ``x[:, t]``). The model maps ``[B, T]`` tokens to logits ``[B, T, V]`` and
    every position is a classification over ``num_classes == vocab_size`` tokens; no state
    is carried between windows. ``x_test`` and ``y_test`` are laid out the same way.

    Attributes:
        vocabulary: the token of each id, in id order (for ``charlm`` one character each).
    """

    vocabulary: str = ""

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids (``num_classes``)."""
        return self.num_classes


@dataclass
class LanguageData:
    """A word-level language-modelling corpus: 1-D int64 streams of token ids.

    Attributes:
        name: task name (``"wikitext2"``).
        train: training stream, int64 ``[tokens]``.
        valid: validation stream, int64 ``[tokens]``.
        test: test stream, int64 ``[tokens]``.
        vocab_size: number of distinct token ids (words), ``<eos>`` and ``<unk>`` included.
        default_model: the model name for this task.
    """

    name: str
    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor
    vocab_size: int
    default_model: str = "lstm"


def cut(name: str, tensor: torch.Tensor, count: int | None, task: str) -> torch.Tensor:
    """First ``count`` entries of ``tensor`` (all when None); too many -> ValueError."""
    if count is None:
        return tensor
    if count > len(tensor):
        raise ValueError(f"{name}={count} exceeds the {len(tensor)} samples available in {task}")
    return tensor[:count]


def generator(*key: int) -> torch.Generator:
    """A CPU torch.Generator seeded from a tuple of non-negative ints."""
    # SeedSequence hashes the whole tuple, so nearby keys give unrelated streams.
    state = np.random.SeedSequence(key).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & ((1 << 63) - 1))


def first_complete(candidates: list[list[Path]], name: str, hint: str) -> list[Path]:
    """The first of ``candidates`` (lists of files) whose files all exist.

    Raises FileNotFoundError naming ``name``, every path looked for and ``hint`` (how to get
    the files: nothing is downloaded) when none is complete.
    """
    for paths in candidates:
        if all(path.is_file() for path in paths):
            return paths
    looked_for = ", ".join(str(path) for paths in candidates for path in paths)
    raise FileNotFoundError(
        f"{name} files not found; looked for: {looked_for}. Nothing is downloaded: {hint}"
    )
