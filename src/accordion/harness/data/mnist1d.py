"""MNIST-1D (Greydanus, 2020), generated offline and cached on disk when a folder is given."""

from __future__ import annotations

import functools
import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

from .base import ClassificationData, cut

# mnist1d's default arguments with more samples; the package's own seed (42) is kept so that
# every run of the project sees the same data.
_MNIST1D_NUM_SAMPLES = 20_000
_MNIST1D_TRAIN_SPLIT = 0.8  # the package's default, set explicitly: check_task relies on it
_MNIST1D_CLASSES = 10  # make_dataset draws num_samples // 10 samples of each of its 10 templates


def mnist1d_sizes() -> tuple[int, int]:
    """Training and test samples of the generated MNIST-1D, as ``make_dataset`` splits them."""
    total = _MNIST1D_NUM_SAMPLES // _MNIST1D_CLASSES * _MNIST1D_CLASSES
    train = int(total * _MNIST1D_TRAIN_SPLIT)
    return train, total - train


def mnist1d_cache_file(data_dir: str | os.PathLike) -> Path:
    """The file in ``data_dir`` that ``mnist1d`` is cached in (``mnist1d_n20000.npz``)."""
    return Path(data_dir) / f"mnist1d_n{_MNIST1D_NUM_SAMPLES}.npz"


def load_mnist1d(
    train_samples: int, test_samples: int, data_dir: str | os.PathLike | None
) -> ClassificationData:
    """The first ``train_samples`` / ``test_samples`` samples of MNIST-1D, generated or read
    from the cache in ``data_dir`` (see :func:`accordion.harness.data.load_task`)."""
    # Without data_dir, the one-argument call keeps the in-process cache key callers warm.
    if data_dir is None:
        arrays = _mnist1d_arrays(_MNIST1D_NUM_SAMPLES)
    else:
        arrays = _mnist1d_arrays(_MNIST1D_NUM_SAMPLES, str(data_dir))
    x_train, y_train, x_test, y_test = arrays
    # Copies, so that a caller writing into its tensors cannot corrupt the in-process cache.
    return ClassificationData(
        name="mnist1d",
        x_train=cut("train_samples", torch.from_numpy(x_train), train_samples, "mnist1d").clone(),
        y_train=cut("train_samples", torch.from_numpy(y_train), train_samples, "mnist1d").clone(),
        x_test=cut("test_samples", torch.from_numpy(x_test), test_samples, "mnist1d").clone(),
        y_test=cut("test_samples", torch.from_numpy(y_test), test_samples, "mnist1d").clone(),
        num_classes=10,
        augment=False,
        default_model="mnist1d-cnn",
    )


@functools.lru_cache(maxsize=4)
def _mnist1d_arrays(
    num_samples: int, cache_dir: str | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """MNIST-1D as (x_train float32, y_train int64, x_test, y_test), generated or from the cache.

    The disk cache is used only when ``cache_dir`` (``--data-dir``) or else the environment
    variable ``ACCORDION_CACHE`` names a folder.
    """
    cache_dir = cache_dir or os.environ.get("ACCORDION_CACHE")
    cache_file = Path(cache_dir) / f"mnist1d_n{num_samples}.npz" if cache_dir else None
    if cache_file is not None and cache_file.is_file():
        with np.load(cache_file) as saved:
            return tuple(saved[key] for key in ("x_train", "y_train", "x_test", "y_test"))

    try:  # imported here: mnist1d is an optional dependency (the harness extra)
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as error:
        raise ImportError(
            "task 'mnist1d' needs the mnist1d package: pip install 'torch-accordion[harness]'"
        ) from error
    args = get_dataset_args()
    args.num_samples = num_samples
    args.train_split = _MNIST1D_TRAIN_SPLIT
    # make_dataset reseeds the global `random` and numpy generators: restore the caller's state.
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        dataset = make_dataset(args)  # never get_dataset: that one downloads
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
    arrays = (
        np.ascontiguousarray(dataset["x"], dtype=np.float32),
        np.ascontiguousarray(dataset["y"], dtype=np.int64),
        np.ascontiguousarray(dataset["x_test"], dtype=np.float32),
        np.ascontiguousarray(dataset["y_test"], dtype=np.int64),
    )
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so that ranks generating at once never read a half-written file.
        with tempfile.NamedTemporaryFile(dir=cache_file.parent, suffix=".npz", delete=False) as f:
            np.savez(f, x_train=arrays[0], y_train=arrays[1], x_test=arrays[2], y_test=arrays[3])
        os.replace(f.name, cache_file)
    return arrays
