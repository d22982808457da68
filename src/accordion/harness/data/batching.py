"""Deterministic rank-sharded batches: classification batches of a permutation per
``(seed, epoch)``, and ``bptt``-token windows of a language stream."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..._validate import check_int
from .augment import crop_and_flip, normalise
from .base import TAG_AUGMENT, TAG_PERMUTATION, ClassificationData, generator

# --------------------------------------------------------------------------- classification


def steps_per_epoch(data: ClassificationData, global_batch: int) -> int:
    """Optimizer steps in one training epoch: full global batches only (the tail is dropped)."""
    global_batch = check_int("global_batch", global_batch, 1)
    return len(data.x_train) // global_batch


def classification_batches(
    data: ClassificationData,
    *,
    global_batch: int,
    rank: int,
    world_size: int,
    epoch: int,
    seed: int,
    train: bool = True,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's ``(inputs, labels)`` batches of one epoch, or of the test set.

    Training (``train=True``): the training set is permuted with a generator seeded from
    ``(seed, epoch)`` (the same on every rank) and cut into :func:`steps_per_epoch` global
    batches of ``global_batch`` samples, the incomplete tail dropped; rank ``r`` takes the
    ``r``-th contiguous slice of ``global_batch // world_size`` samples of each. With
    ``data.augment`` each image is randomly cropped (4-pixel zero padding) and flipped, drawn
    from a generator seeded from ``(seed, epoch, rank)``.

    Evaluation (``train=False``): every rank gets the *whole* test set, in order, in batches of
    ``global_batch`` samples (the last may be smaller). Evaluation is not sharded: the test sets
    here are small, and every rank then reports the same accuracy.

    CIFAR inputs come out float32, normalised with the dataset's per-channel mean and std; other
    tasks' inputs come out as stored. Labels are int64.

    Args:
        data: the task, from :func:`load_task`.
        global_batch: samples per step over all ranks; a positive multiple of ``world_size``.
        rank: this process's rank, in ``[0, world_size)``.
        world_size: number of ranks.
        epoch: epoch index (>= 0); it changes the order and the augmentation.
        seed: run seed (>= 0).
        train: training batches (True) or the test set (False).

    Raises:
        TypeError: an argument that is not an int.
        ValueError: a bad argument, ``global_batch`` not a multiple of ``world_size``, or (for
            training) ``global_batch`` larger than the training set, which would leave no step.
    """
    global_batch, rank, world_size = _check_shards(global_batch, rank, world_size)
    epoch = check_int("epoch", epoch, 0)
    seed = check_int("seed", seed, 0)
    if not train:
        return _test_batches(data, global_batch)
    if global_batch > len(data.x_train):
        raise ValueError(
            f"global_batch ({global_batch}) exceeds the {len(data.x_train)} training samples of "
            f"{data.name}: an epoch would have no step"
        )
    return _train_batches(data, global_batch, rank, world_size, epoch, seed)


def _check_shards(global_batch: object, rank: object, world_size: object) -> tuple[int, int, int]:
    global_batch = check_int("global_batch", global_batch, 1)
    world_size = check_int("world_size", world_size, 1)
    rank = check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if global_batch % world_size:
        raise ValueError(
            f"global_batch ({global_batch}) must be a multiple of world_size ({world_size}) "
            "so that every rank gets the same number of samples"
        )
    return global_batch, rank, world_size


def _train_batches(
    data: ClassificationData, global_batch: int, rank: int, world_size: int, epoch: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    permutation = torch.randperm(
        len(data.x_train), generator=generator(TAG_PERMUTATION, seed, epoch)
    )
    augment_generator = generator(TAG_AUGMENT, seed, epoch, rank) if data.augment else None
    local = global_batch // world_size
    for step in range(steps_per_epoch(data, global_batch)):
        start = step * global_batch + rank * local
        index = permutation[start : start + local]
        x = data.x_train[index]
        if augment_generator is not None:
            x = crop_and_flip(x, augment_generator)
        yield normalise(data.name, x), data.y_train[index]


def _test_batches(
    data: ClassificationData, batch: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for start in range(0, len(data.x_test), batch):
        x = data.x_test[start : start + batch]
        yield normalise(data.name, x), data.y_test[start : start + batch]


# --------------------------------------------------------------------------- language


def language_steps(
    tokens: torch.Tensor, batch_size_per_rank: int, world_size: int, bptt: int = 30
) -> int:
    """Number of ``bptt``-token windows :func:`language_batches` yields per rank (steps)."""
    rows = _language_rows(tokens, batch_size_per_rank, world_size, bptt)
    return -(-(rows - 1) // bptt) if rows > 1 else 0


def _language_rows(
    tokens: torch.Tensor, batch_size_per_rank: int, world_size: int, bptt: int
) -> int:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
        raise ValueError(f"tokens must be a 1-D tensor of token ids, got {tokens!r:.80}")
    batch_size_per_rank = check_int("batch_size_per_rank", batch_size_per_rank, 1)
    world_size = check_int("world_size", world_size, 1)
    check_int("bptt", bptt, 1)
    return len(tokens) // (world_size * batch_size_per_rank)


def language_batches(
    tokens: torch.Tensor,
    *,
    batch_size_per_rank: int,
    rank: int,
    world_size: int,
    bptt: int = 30,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's ``(input, target)`` windows over a token stream, as PyTorch's word LM example.

    The stream is trimmed and laid out as ``world_size * batch_size_per_rank`` columns, each a
    contiguous run of tokens; this rank takes its own contiguous block of
    ``batch_size_per_rank`` columns. Windows of ``bptt`` rows (the last may be shorter) are
    yielded as int64 ``input [seq, batch]`` and ``target [seq, batch]``, the target being the
    input shifted one token ahead.

    Args:
        tokens: 1-D int64 token ids (e.g. ``LanguageData.train``).
        batch_size_per_rank: columns (sequences) per rank.
        rank: this process's rank, in ``[0, world_size)``.
        world_size: number of ranks.
        bptt: window length, tokens (truncated back-propagation through time).

    Raises:
        TypeError: a count that is not an int.
        ValueError: a bad argument, or a stream too short for one window (fewer than
            ``2 * world_size * batch_size_per_rank`` tokens).
    """
    rows = _language_rows(tokens, batch_size_per_rank, world_size, bptt)
    rank = check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    columns = world_size * batch_size_per_rank
    if rows < 2:
        raise ValueError(
            f"tokens holds {len(tokens)} tokens, fewer than 2 * world_size * batch_size_per_rank "
            f"= {2 * columns}: not one window"
        )
    # Same layout as word_language_model's batchify: column j is tokens[j*rows : (j+1)*rows].
    grid = tokens[: rows * columns].view(columns, rows).t()
    block = grid[:, rank * batch_size_per_rank : (rank + 1) * batch_size_per_rank]
    return _windows(block, bptt)


def _windows(block: torch.Tensor, bptt: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    rows = block.size(0)
    for start in range(0, rows - 1, bptt):
        length = min(bptt, rows - 1 - start)
        yield (
            block[start : start + length].contiguous(),
            block[start + 1 : start + 1 + length].contiguous(),
        )
