"""WikiText-2 (word level), read from its token files (never downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch

from .base import LanguageData, cut, first_complete

_WIKITEXT2_HINT = (
    "WikiText-2 (word level) from https://blog.salesforceairesearch.com/"
    "the-wikitext-long-term-dependency-language-modeling-dataset/"
)
_WIKITEXT_FOLDER = "wikitext-2"
_WIKITEXT_NAMINGS = ("wiki.{split}.tokens", "{split}.txt")
_EOS = "<eos>"
_UNK = "<unk>"


def load_wikitext2(
    data_dir: Path, train_samples: int | None, test_samples: int | None
) -> LanguageData:
    """WikiText-2 from ``data_dir`` as token streams, the training stream cut to its first
    ``train_samples`` tokens and the valid and test streams to ``test_samples`` (None: all)."""
    paths = wikitext_paths(data_dir)
    vocabulary: dict[str, int] = {}
    train = _tokenize(paths[0], vocabulary, grow=True)
    valid = _tokenize(paths[1], vocabulary, grow=False)
    test = _tokenize(paths[2], vocabulary, grow=False)
    return LanguageData(
        name="wikitext2",
        train=cut("train_samples", train, train_samples, "wikitext2"),
        valid=cut("test_samples", valid, test_samples, "wikitext2 (valid)"),
        test=cut("test_samples", test, test_samples, "wikitext2"),
        vocab_size=len(vocabulary),
    )


def wikitext_paths(data_dir: Path) -> list[Path]:
    """The train, valid and test files of WikiText-2 in ``data_dir`` or its subfolder."""
    candidates = [
        [folder / naming.format(split=split) for split in ("train", "valid", "test")]
        for folder in (data_dir, data_dir / _WIKITEXT_FOLDER)
        for naming in _WIKITEXT_NAMINGS
    ]
    hint = f"get {_WIKITEXT2_HINT} and pass its folder as data_dir."
    return first_complete(candidates, "wikitext2", hint)


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
