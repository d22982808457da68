"""Datasets of the training harness, held in memory, with deterministic rank-sharded batches.

Tasks (:data:`TASKS`), one module each:

``mnist1d``    MNIST-1D (Greydanus, 2020), generated offline from the package's default arguments
               (20,000 samples: 16,000 train / 4,000 test; the harness uses 4,000 / 4,000),
               and cached in ``data_dir`` when one is given (:mod:`.mnist1d`).
``cifar10``    CIFAR-10 from the official python pickles in ``data_dir`` (:mod:`.cifar`).
``cifar100``   CIFAR-100 from the official python pickles in ``data_dir`` (:mod:`.cifar`).
``wikitext2``  WikiText-2 word-level token files in ``data_dir`` (:mod:`.wikitext`).
``synthetic``  random images or signals with random labels, for speed benchmarks
               (:mod:`.synthetic`).

Nothing is ever downloaded: CIFAR and WikiText-2 must already be on disk.
:func:`check_task` and :func:`find_task_files` (:mod:`.tasks`) check a task's settings and
files without loading anything, so that a command can fail before it starts its workers.

Training batches (:mod:`.batching`) are drawn from one permutation per ``(seed, epoch)``,
identical on every rank; each global batch is cut into ``world_size`` contiguous slices, one
per rank, so the ranks together see each global batch exactly once and all take the same
number of steps. CIFAR's crop, flip and normalisation are in :mod:`.augment`.

Example:
    >>> data = load_task("synthetic", synthetic_shape=(40,), train_samples=64)
    >>> batches = classification_batches(data, global_batch=32, rank=0, world_size=2,
    ...                                  epoch=0, seed=0)
    >>> [tuple(x.shape) for x, _ in batches]
    [(16, 40), (16, 40)]
"""

from __future__ import annotations

from .base import FILE_TASKS, TASKS, ClassificationData, LanguageData
from .batching import classification_batches, language_batches, language_steps, steps_per_epoch
from .cifar import CIFAR_URL
from .mnist1d import mnist1d_cache_file
from .tasks import check_global_batch, check_task, find_task_files, load_task

__all__ = [
    "CIFAR_URL",
    "FILE_TASKS",
    "TASKS",
    "ClassificationData",
    "LanguageData",
    "classification_batches",
    "language_batches",
    "check_global_batch",
    "check_task",
    "find_task_files",
    "language_steps",
    "load_task",
    "mnist1d_cache_file",
    "steps_per_epoch",
]
