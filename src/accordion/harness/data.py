"""Datasets of the training harness, held in memory, with deterministic rank-sharded batches.

Tasks (:data:`TASKS`):

``mnist1d``    MNIST-1D (Greydanus, 2020), generated offline from the package's default arguments
               (20,000 samples: 16,000 train / 4,000 test; the harness uses 4,000 / 4,000),
               and cached in ``data_dir`` when one is given.
``cifar10``    CIFAR-10 from the official python pickles in ``data_dir``.
``cifar100``   CIFAR-100 from the official python pickles in ``data_dir``.
``wikitext2``  WikiText-2 word-level token files in ``data_dir``.
``synthetic``  random images or signals with random labels, for speed benchmarks.

Nothing is ever downloaded: CIFAR and WikiText-2 must already be on disk.
:func:`check_task` and :func:`find_task_files` check a task's settings and files without
loading anything, so that a command can fail before it starts its workers.

Training batches are drawn from one permutation per ``(seed, epoch)``, identical on every rank;
each global batch is cut into ``world_size`` contiguous slices, one per rank, so the ranks
together see each global batch exactly once and all take the same number of steps.

Example:
    >>> data = load_task("synthetic", synthetic_shape=(40,), train_samples=64)
    >>> batches = classification_batches(data, global_batch=32, rank=0, world_size=2,
    ...                                  epoch=0, seed=0)
    >>> [tuple(x.shape) for x, _ in batches]
    [(16, 40), (16, 40)]
"""

from __future__ import annotations

import functools
import numbers
import os
import pickle
import random
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

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

TASKS: tuple[str, ...] = ("mnist1d", "cifar10", "cifar100", "wikitext2", "synthetic")
"""Task names accepted by :func:`load_task`."""

FILE_TASKS: tuple[str, ...] = ("cifar10", "cifar100", "wikitext2")
"""The tasks that read their files from ``data_dir``; the others generate their data."""

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
"""Where to get the CIFAR-10/100 python archives (this module never downloads them)."""

_WIKITEXT2_HINT = (
    "WikiText-2 (word level) from https://blog.salesforceairesearch.com/"
    "the-wikitext-long-term-dependency-language-modeling-dataset/"
)

# Per-channel mean and std of the training images, in [0, 1] pixel units.
_CIFAR_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
_CIFAR_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
_CIFAR_FILES = {
    "cifar10": (tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",)),
    "cifar100": (("train",), ("test",)),
}
_CIFAR_LABEL_KEYS = {"cifar10": b"labels", "cifar100": b"fine_labels"}
_CIFAR_PAD = 4  # pixels of zero padding before the random 32 x 32 crop

# mnist1d's default arguments with more samples; the package's own seed (42) is kept so that
# every run of the project sees the same data.
_MNIST1D_NUM_SAMPLES = 20_000
_MNIST1D_TRAIN_SPLIT = 0.8  # the package's default, set explicitly: check_task relies on it
_MNIST1D_CLASSES = 10  # make_dataset draws num_samples // 10 samples of each of its 10 templates

# Training and test samples of the datasets read from files (WikiText-2 counts tokens, which
# are known only once the files are read).
_CIFAR_SIZES = (50_000, 10_000)

# What the models read; every model not named here reads 3-channel images.
_MODEL_INPUTS = {"lstm": "tokens", "mnist1d-cnn": "signals"}

_DEFAULT_SAMPLES = {"mnist1d": (4000, 4000), "synthetic": (1024, 256)}

_WIKITEXT_FOLDER = "wikitext-2"
_WIKITEXT_NAMINGS = ("wiki.{split}.tokens", "{split}.txt")
_EOS = "<eos>"
_UNK = "<unk>"

# Purpose tags keep the permutation, augmentation and synthetic streams independent.
_TAG_PERMUTATION, _TAG_AUGMENT, _TAG_SYNTHETIC = 0, 1, 2


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


# --------------------------------------------------------------------------- argument checks


def _check_task_name(name: object, allowed: Sequence[str] = TASKS) -> None:
    """``TypeError`` unless ``name`` is a str, ``ValueError`` unless it is in ``allowed``."""
    if not isinstance(name, str):
        raise TypeError(f"task must be a str, got {type(name).__name__}: {name!r}")
    if name not in allowed:
        raise ValueError(f"task must be one of {', '.join(allowed)}, got {name!r}")


def _check_int(name: str, value: object, *, minimum: int) -> int:
    """Return ``value`` as an int; ValueError naming ``name`` unless it is an int ``>= minimum``."""
    # bool is a subclass of int, but a count of True is surely a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _check_optional_count(name: str, value: object) -> int | None:
    return None if value is None else _check_int(name, value, minimum=1)


def _check_shards(global_batch: object, rank: object, world_size: object) -> tuple[int, int, int]:
    global_batch = _check_int("global_batch", global_batch, minimum=1)
    world_size = _check_int("world_size", world_size, minimum=1)
    rank = _check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if global_batch % world_size:
        raise ValueError(
            f"global_batch ({global_batch}) must be a multiple of world_size ({world_size}) "
            "so that every rank gets the same number of samples"
        )
    return global_batch, rank, world_size


def _cut(name: str, tensor: torch.Tensor, count: int | None, task: str) -> torch.Tensor:
    """First ``count`` entries of ``tensor`` (all when None); too many -> ValueError."""
    if count is None:
        return tensor
    if count > len(tensor):
        raise ValueError(f"{name}={count} exceeds the {len(tensor)} samples available in {task}")
    return tensor[:count]


def _generator(*key: int) -> torch.Generator:
    """A CPU torch.Generator seeded from a tuple of non-negative ints."""
    # SeedSequence hashes the whole tuple, so nearby keys give unrelated streams.
    state = np.random.SeedSequence(key).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & ((1 << 63) - 1))


# --------------------------------------------------------------------------- checks before loading


def check_task(
    name: str,
    data_dir: str | os.PathLike | None = None,
    *,
    model: str | None = None,
    train_samples: int | None = None,
    test_samples: int | None = None,
    synthetic_shape: Sequence[int] = (3, 32, 32),
) -> int | None:
    """Check a task's settings without reading or generating any data.

    Catches what :func:`load_task` and the model would otherwise only find in the workers.
    Files are not looked for here, nor is ``data_dir`` required, so that a configuration
    can be checked on another machine than its data: see :func:`find_task_files`.

    Args:
        name: one of :data:`TASKS`.
        data_dir: the folder of the files of the tasks of :data:`FILE_TASKS`; for ``mnist1d``
            the folder the generated dataset is cached in; refused for ``synthetic``, which
            has no use for it (a mistake better reported than ignored).
        model: a model name of :data:`accordion.models.MODEL_NAMES` (None: the task's
            default), checked to read the task's inputs (images, 1-D signals or tokens).
        train_samples: training samples asked for (None: the task's default).
        test_samples: test samples asked for (None: the task's default).
        synthetic_shape: one ``synthetic`` sample's shape.

    Returns:
        The number of training samples the run will have; None for ``wikitext2``, whose
        streams are counted in tokens once read.

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: naming the setting: an unknown task; ``data_dir`` given to
            ``synthetic``; a model that does not read the task's inputs; a sample count not
            positive or beyond the dataset; a bad synthetic shape.
    """
    _check_task_name(name)
    train_samples = _check_optional_count("train_samples", train_samples)
    test_samples = _check_optional_count("test_samples", test_samples)
    if name == "synthetic" and data_dir is not None:
        raise ValueError(
            f"data_dir ({str(data_dir)!r}) has no use for task 'synthetic', which generates "
            "random data and reads no file; leave it out"
        )
    inputs = _task_inputs(name, synthetic_shape)
    if model is not None:
        _check_model_fits(model, name, inputs)
    sizes = {"mnist1d": _mnist1d_sizes(), "cifar10": _CIFAR_SIZES, "cifar100": _CIFAR_SIZES}
    default_train, default_test = _DEFAULT_SAMPLES.get(name, (None, None))
    train_samples = default_train if train_samples is None else train_samples
    test_samples = default_test if test_samples is None else test_samples
    if name in sizes:
        for setting, count, available in zip(
            ("train_samples", "test_samples"), (train_samples, test_samples), sizes[name]
        ):
            if count is not None and count > available:
                raise ValueError(
                    f"{setting}={count} exceeds the {available} samples available in {name}"
                )
        return sizes[name][0] if train_samples is None else train_samples
    return train_samples


def check_global_batch(
    name: str, batch: int, world_size: int | None = None, train_size: int | None = None
) -> None:
    """``ValueError`` naming ``name`` unless a global batch of ``batch`` samples splits into
    ``world_size`` equal shares (when given) and fits in ``train_size`` training samples (when
    given), as :func:`classification_batches` requires."""
    if world_size is not None and batch % world_size:
        raise ValueError(
            f"{name} ({batch}) must be a multiple of the number of workers ({world_size}), "
            "so that every worker gets the same share of each batch"
        )
    if train_size is not None and batch > train_size:
        raise ValueError(
            f"{name} ({batch}) must be at most the {train_size} training samples, else an "
            "epoch has no step"
        )


def _task_inputs(name: str, synthetic_shape: Sequence[int]) -> str:
    """What the task feeds its model: "images", "signals" or "tokens"."""
    if name == "synthetic":
        return "images" if _synthetic_default_model(synthetic_shape) == "resnet18" else "signals"
    return {"mnist1d": "signals", "wikitext2": "tokens"}.get(name, "images")


def _check_model_fits(model: str, task: str, inputs: str) -> None:
    from ..models import MODEL_NAMES

    reads = _MODEL_INPUTS.get(model, "images")
    if reads != inputs:
        fitting = [m for m in MODEL_NAMES if _MODEL_INPUTS.get(m, "images") == inputs]
        raise ValueError(
            f"model {model!r} reads {reads}, but task {task!r} gives {inputs}; models "
            f"for {inputs}: {', '.join(fitting)}"
        )


def _mnist1d_sizes() -> tuple[int, int]:
    """Training and test samples of the generated MNIST-1D, as ``make_dataset`` splits them."""
    total = _MNIST1D_NUM_SAMPLES // _MNIST1D_CLASSES * _MNIST1D_CLASSES
    train = int(total * _MNIST1D_TRAIN_SPLIT)
    return train, total - train


def mnist1d_cache_file(data_dir: str | os.PathLike) -> Path:
    """The file in ``data_dir`` that ``mnist1d`` is cached in (``mnist1d_n20000.npz``)."""
    return Path(data_dir) / f"mnist1d_n{_MNIST1D_NUM_SAMPLES}.npz"


def find_task_files(name: str, data_dir: str | os.PathLike | None) -> list[Path]:
    """The files a task of :data:`FILE_TASKS` reads from ``data_dir``, without reading them.

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: ``name`` is not one of :data:`FILE_TASKS`, or ``data_dir`` is None.
        FileNotFoundError: the files are not there; the message lists every path looked for
            and where to get them.
    """
    _check_task_name(name, FILE_TASKS)
    if data_dir is None:
        raise ValueError(
            f"data_dir is required by task {name!r}, which reads its files from disk "
            "(nothing is downloaded)"
        )
    if name == "wikitext2":
        return _wikitext_paths(Path(data_dir))
    folder = _cifar_folder(name, Path(data_dir))
    train_files, test_files = _CIFAR_FILES[name]
    return [folder / file for file in (*train_files, *test_files)]


# --------------------------------------------------------------------------- loading


def load_task(
    name: str,
    data_dir: str | os.PathLike | None = None,
    *,
    train_samples: int | None = None,
    test_samples: int | None = None,
    seed: int = 0,
    synthetic_shape: tuple[int, ...] = (3, 32, 32),
    synthetic_classes: int = 10,
) -> ClassificationData | LanguageData:
    """Load a task's data into memory. Nothing is downloaded.

    Args:
        name: one of :data:`TASKS`.
        data_dir: folder holding the files of ``cifar10``, ``cifar100`` (the extracted folder
            ``cifar-10-batches-py`` / ``cifar-100-python`` or its parent) and ``wikitext2``
            (``wiki.{train,valid,test}.tokens`` or ``{train,valid,test}.txt``, in the folder or in
            its ``wikitext-2`` subfolder); required for those tasks. For ``mnist1d``, the folder
            the generated dataset is cached in (:func:`mnist1d_cache_file`, created when
            missing; without it the folder of the environment variable ``ACCORDION_CACHE``,
            if set). Ignored by ``synthetic``.
        train_samples: keep only the first ``train_samples`` training samples (tokens for
            ``wikitext2``). Defaults: 4,000 for ``mnist1d``, 1,024 for ``synthetic``, all for
            the others.
        test_samples: keep only the first ``test_samples`` test samples (tokens of the valid and
            test streams for ``wikitext2``). Defaults: 4,000 for ``mnist1d``, 256 for
            ``synthetic``, all for the others.
        seed: seed of the ``synthetic`` data (non-negative). The real datasets do not depend on
            it: ``mnist1d`` always uses the package's default seed so every run sees the same data.
        synthetic_shape: shape of one ``synthetic`` sample: ``(3, H, W)`` images (default model
            ``resnet18``) or ``(L,)`` signals (default model ``mnist1d-cnn``, built with
            ``length=L``).
        synthetic_classes: number of ``synthetic`` classes.

    Returns:
        :class:`ClassificationData` for the classification tasks, :class:`LanguageData` for
        ``wikitext2``.

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: unknown ``name``; a non-positive sample count, or one larger than the data;
            ``data_dir`` missing for a task that needs files; a bad synthetic shape or class count.
        FileNotFoundError: the files of ``cifar10``/``cifar100``/``wikitext2`` are not in
            ``data_dir``; the message lists every path looked for.
        ImportError: ``mnist1d`` is requested but the ``mnist1d`` package is not installed.
    """
    _check_task_name(name)
    train_samples = _check_optional_count("train_samples", train_samples)
    test_samples = _check_optional_count("test_samples", test_samples)
    seed = _check_int("seed", seed, minimum=0)
    default_train, default_test = _DEFAULT_SAMPLES.get(name, (None, None))
    train_samples = default_train if train_samples is None else train_samples
    test_samples = default_test if test_samples is None else test_samples

    if name == "mnist1d":
        return _load_mnist1d(train_samples, test_samples, data_dir)
    if name == "synthetic":
        return _make_synthetic(
            train_samples, test_samples, seed, synthetic_shape, synthetic_classes
        )
    if data_dir is None:
        raise ValueError(
            f"task {name!r} reads its files from disk: data_dir (--data-dir) is required"
        )
    if name == "wikitext2":
        return _load_wikitext2(Path(data_dir), train_samples, test_samples)
    return _load_cifar(name, Path(data_dir), train_samples, test_samples)


def _load_mnist1d(
    train_samples: int, test_samples: int, data_dir: str | os.PathLike | None
) -> ClassificationData:
    # Without data_dir, the one-argument call keeps the in-process cache key callers warm.
    if data_dir is None:
        arrays = _mnist1d_arrays(_MNIST1D_NUM_SAMPLES)
    else:
        arrays = _mnist1d_arrays(_MNIST1D_NUM_SAMPLES, str(data_dir))
    x_train, y_train, x_test, y_test = arrays
    # Copies, so that a caller writing into its tensors cannot corrupt the in-process cache.
    return ClassificationData(
        name="mnist1d",
        x_train=_cut("train_samples", torch.from_numpy(x_train), train_samples, "mnist1d").clone(),
        y_train=_cut("train_samples", torch.from_numpy(y_train), train_samples, "mnist1d").clone(),
        x_test=_cut("test_samples", torch.from_numpy(x_test), test_samples, "mnist1d").clone(),
        y_test=_cut("test_samples", torch.from_numpy(y_test), test_samples, "mnist1d").clone(),
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

    try:
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


def _synthetic_default_model(shape: object) -> str:
    """The model of ``synthetic`` samples of ``shape``; ValueError unless (3, H, W) or (L,)."""
    if not isinstance(shape, Sequence) or not all(
        not isinstance(size, bool) and isinstance(size, numbers.Integral) and size > 0
        for size in shape
    ):
        raise ValueError(f"synthetic_shape must be a tuple of positive ints, got {shape!r}")
    if len(shape) == 3 and shape[0] == 3:
        return "resnet18"
    if len(shape) == 1:
        return "mnist1d-cnn"
    raise ValueError(f"synthetic_shape must be (3, H, W) images or (L,) signals, got {shape!r}")


def _make_synthetic(
    train_samples: int,
    test_samples: int,
    seed: int,
    shape: Sequence[int],
    num_classes: int,
) -> ClassificationData:
    default_model = _synthetic_default_model(shape)
    shape = tuple(int(size) for size in shape)
    num_classes = _check_int("synthetic_classes", num_classes, minimum=1)

    def draw(count: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = _generator(_TAG_SYNTHETIC, seed, split)
        x = torch.randn((count, *shape), generator=generator)
        y = torch.randint(0, num_classes, (count,), generator=generator, dtype=torch.int64)
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


def _load_cifar(
    name: str, data_dir: Path, train_samples: int | None, test_samples: int | None
) -> ClassificationData:
    train_files, test_files = _CIFAR_FILES[name]
    folder = _cifar_folder(name, data_dir)
    label_key = _CIFAR_LABEL_KEYS[name]
    x_train, y_train = _read_cifar_pickles([folder / file for file in train_files], label_key)
    x_test, y_test = _read_cifar_pickles([folder / file for file in test_files], label_key)
    return ClassificationData(
        name=name,
        x_train=_cut("train_samples", x_train, train_samples, name),
        y_train=_cut("train_samples", y_train, train_samples, name),
        x_test=_cut("test_samples", x_test, test_samples, name),
        y_test=_cut("test_samples", y_test, test_samples, name),
        num_classes=100 if name == "cifar100" else 10,
        augment=True,
        default_model="resnet18",
    )


def _cifar_folder(name: str, data_dir: Path) -> Path:
    """``data_dir`` or its CIFAR subfolder, whichever holds all the files of ``name``."""
    train_files, test_files = _CIFAR_FILES[name]
    looked_for: list[Path] = []
    for candidate in (data_dir, data_dir / _CIFAR_FOLDERS[name]):
        paths = [candidate / file for file in (*train_files, *test_files)]
        looked_for.extend(paths)
        if all(path.is_file() for path in paths):
            return candidate
    raise FileNotFoundError(
        f"{name} files not found; looked for: {', '.join(str(p) for p in looked_for)}. "
        f"Nothing is downloaded: get the CIFAR python version from {CIFAR_URL}, extract it "
        f"and pass the extracted folder ({_CIFAR_FOLDERS[name]}) or its parent as data_dir."
    )


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


def _load_wikitext2(
    data_dir: Path, train_samples: int | None, test_samples: int | None
) -> LanguageData:
    paths = _wikitext_paths(data_dir)
    vocabulary: dict[str, int] = {}
    train = _tokenize(paths[0], vocabulary, grow=True)
    valid = _tokenize(paths[1], vocabulary, grow=False)
    test = _tokenize(paths[2], vocabulary, grow=False)
    return LanguageData(
        name="wikitext2",
        train=_cut("train_samples", train, train_samples, "wikitext2"),
        valid=_cut("test_samples", valid, test_samples, "wikitext2 (valid)"),
        test=_cut("test_samples", test, test_samples, "wikitext2"),
        vocab_size=len(vocabulary),
    )


def _wikitext_paths(data_dir: Path) -> list[Path]:
    """The train, valid and test files of WikiText-2 in ``data_dir`` or its subfolder."""
    looked_for: list[Path] = []
    for folder in (data_dir, data_dir / _WIKITEXT_FOLDER):
        for naming in _WIKITEXT_NAMINGS:
            candidate = [folder / naming.format(split=s) for s in ("train", "valid", "test")]
            looked_for.extend(candidate)
            if all(path.is_file() for path in candidate):
                return candidate
    raise FileNotFoundError(
        f"wikitext2 files not found; looked for: {', '.join(str(p) for p in looked_for)}. "
        f"Nothing is downloaded: get {_WIKITEXT2_HINT} and pass its folder as data_dir."
    )


def _tokenize(path: Path, vocabulary: dict[str, int], *, grow: bool) -> torch.Tensor:
    """Token ids of a file, as PyTorch's word_language_model: words of each line, then <eos>.

    With ``grow`` new words join ``vocabulary`` in order of first appearance; without it they map
    to ``<unk>`` (added to the vocabulary if it is not there yet).
    """
    ids: list[int] = []
    with open(path, encoding="utf8") as f:
        for line in f:
            for word in [*line.split(), _EOS]:
                index = vocabulary.get(word)
                if index is None:
                    if not grow:
                        word = _UNK
                    index = vocabulary.setdefault(word, len(vocabulary))
                ids.append(index)
    return torch.tensor(ids, dtype=torch.int64)


# --------------------------------------------------------------------------- classification


def steps_per_epoch(data: ClassificationData, global_batch: int) -> int:
    """Optimizer steps in one training epoch: full global batches only (the tail is dropped)."""
    global_batch = _check_int("global_batch", global_batch, minimum=1)
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
        ValueError: a bad argument, ``global_batch`` not a multiple of ``world_size``, or (for
            training) ``global_batch`` larger than the training set, which would leave no step.
    """
    global_batch, rank, world_size = _check_shards(global_batch, rank, world_size)
    epoch = _check_int("epoch", epoch, minimum=0)
    seed = _check_int("seed", seed, minimum=0)
    if not train:
        return _test_batches(data, global_batch)
    if global_batch > len(data.x_train):
        raise ValueError(
            f"global_batch ({global_batch}) exceeds the {len(data.x_train)} training samples of "
            f"{data.name}: an epoch would have no step"
        )
    return _train_batches(data, global_batch, rank, world_size, epoch, seed)


def _train_batches(
    data: ClassificationData, global_batch: int, rank: int, world_size: int, epoch: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    permutation = torch.randperm(
        len(data.x_train), generator=_generator(_TAG_PERMUTATION, seed, epoch)
    )
    augment_generator = _generator(_TAG_AUGMENT, seed, epoch, rank) if data.augment else None
    local = global_batch // world_size
    for step in range(steps_per_epoch(data, global_batch)):
        start = step * global_batch + rank * local
        index = permutation[start : start + local]
        x = data.x_train[index]
        if augment_generator is not None:
            x = _crop_and_flip(x, augment_generator)
        yield _normalise(data.name, x), data.y_train[index]


def _test_batches(
    data: ClassificationData, batch: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for start in range(0, len(data.x_test), batch):
        x = data.x_test[start : start + batch]
        yield _normalise(data.name, x), data.y_test[start : start + batch]


def _crop_and_flip(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
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


def _normalise(name: str, x: torch.Tensor) -> torch.Tensor:
    """CIFAR uint8 pixels -> float32 normalised per channel; other tasks' inputs unchanged."""
    stats = _CIFAR_STATS.get(name)
    if stats is None:
        return x
    mean, std = (torch.tensor(values).view(1, -1, 1, 1) * 255.0 for values in stats)
    # In place on the fresh float copy: one temporary instead of three.
    return x.float().sub_(mean).div_(std)


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
    batch_size_per_rank = _check_int("batch_size_per_rank", batch_size_per_rank, minimum=1)
    world_size = _check_int("world_size", world_size, minimum=1)
    _check_int("bptt", bptt, minimum=1)
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
        ValueError: a bad argument, or a stream too short for one window (fewer than
            ``2 * world_size * batch_size_per_rank`` tokens).
    """
    rows = _language_rows(tokens, batch_size_per_rank, world_size, bptt)
    rank = _check_int("rank", rank, minimum=0)
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
