"""Model zoo of the Accordion paper (Agarwal et al., MLSys 2021) and a name-based registry.

CIFAR-10/100 image classifiers follow kuangliu/pytorch-cifar; the language model follows the
PyTorch ``word_language_model`` example; ``mnist1d-cnn`` is a small model for quick runs;
``transformer-tiny`` and ``transformer-small`` are CPU-size GPT-2-style character models
(:class:`~accordion.models.transformer.Transformer`).

Example:
    >>> model = get_model("resnet18", num_classes=100)
    >>> lm = get_model("transformer-tiny", ntoken=70)
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

from torch import nn

from .._validate import check_int
from .densenet import DenseNet, DenseNetCifar
from .googlenet import GoogLeNet
from .lstm import WIKITEXT2_VOCAB_SIZE, LSTMLanguageModel
from .mnist1d import MNIST1DCNN
from .resnet import ResNet, ResNet18
from .senet import SENet18
from .transformer import Transformer
from .vgg import VGG19BN

__all__ = [
    "MNIST1DCNN",
    "MODEL_NAMES",
    "VGG19BN",
    "WIKITEXT2_VOCAB_SIZE",
    "DenseNet",
    "DenseNetCifar",
    "GoogLeNet",
    "LSTMLanguageModel",
    "ResNet",
    "ResNet18",
    "SENet18",
    "TRANSFORMER_CONTEXT",
    "TRANSFORMER_VOCAB_SIZE",
    "Transformer",
    "get_model",
]

# Builders for classifiers take num_classes; the language model has a vocabulary instead.
_CLASSIFIERS: dict[str, Callable[..., nn.Module]] = {
    "resnet18": ResNet18,
    "vgg19bn": VGG19BN,
    "senet18": SENet18,
    "googlenet": GoogLeNet,
    "densenet": DenseNetCifar,
    "mnist1d-cnn": MNIST1DCNN,
}

#: The CPU-size language transformers: width, layers and heads of each.
_TRANSFORMERS: dict[str, dict[str, int]] = {
    "transformer-tiny": {"d_model": 64, "layers": 2, "heads": 4},
    "transformer-small": {"d_model": 128, "layers": 2, "heads": 4},
}

_TRANSFORMER_INIT_STD = 0.02  # GPT-2's initialisation of weights

TRANSFORMER_CONTEXT = 256
"""Positions (tokens) of ``transformer-tiny`` and ``transformer-small``: the longest window
they read."""

TRANSFORMER_VOCAB_SIZE = 70
"""The transformers' default ``ntoken``: the 70 characters of the harness's ``charlm``
corpus (the American Standard Version Bible)."""

MODEL_NAMES: tuple[str, ...] = (
    "resnet18",
    "vgg19bn",
    "senet18",
    "googlenet",
    "densenet",
    "lstm",
    "mnist1d-cnn",
    *_TRANSFORMERS,
)
"""Names accepted by :func:`get_model`."""


def get_model(name: str, num_classes: int = 10, **kwargs: Any) -> nn.Module:
    """Build a freshly initialised model by name.

    Args:
        name: one of :data:`MODEL_NAMES`.
        num_classes: number of output classes; must be a positive int (``bool`` is rejected).
            It is validated for every name but ignored by the language models (``"lstm"``
            and the transformers), whose output size is their vocabulary size ``ntoken``.
        **kwargs: extra constructor arguments, e.g. ``ntoken``, ``hidden_size``,
            ``num_layers``, ``dropout`` for ``"lstm"``; ``width``, ``length`` for
            ``"mnist1d-cnn"``; ``ntoken`` (default :data:`TRANSFORMER_VOCAB_SIZE`) and
            ``context`` (positions, default :data:`TRANSFORMER_CONTEXT`) for
            ``"transformer-tiny"`` (width 64, 2 layers, 4 heads) and
            ``"transformer-small"`` (width 128, 2 layers, 4 heads).

    Raises:
        TypeError: ``name`` is not a ``str``; ``ntoken`` or ``context`` is not an int.
        ValueError: ``name`` is unknown, or ``num_classes`` (``ntoken``, ``context``) is
            not a positive int.
    """
    if not isinstance(name, str):
        raise TypeError(f"model name must be a str, got {type(name).__name__}: {name!r}")
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; allowed names: {', '.join(MODEL_NAMES)}")
    # bool is a subclass of int, but num_classes=True is surely a mistake. int in the
    # tuples as well: mypy takes int and numbers.Integral as disjoint (no code after)
    integral = (int, numbers.Integral)
    if isinstance(num_classes, bool) or not isinstance(num_classes, integral) or num_classes < 1:
        wrong_type = isinstance(num_classes, bool) or not isinstance(num_classes, integral)
        error = TypeError if wrong_type else ValueError
        raise error(f"num_classes must be a positive int (1, 2, ...), got {num_classes!r}")
    if name == "lstm":
        return LSTMLanguageModel(**kwargs)
    if name in _TRANSFORMERS:
        return _transformer(name, **kwargs)
    return _CLASSIFIERS[name](num_classes=int(num_classes), **kwargs)


def _transformer(
    name: str, ntoken: int = TRANSFORMER_VOCAB_SIZE, context: int = TRANSFORMER_CONTEXT
) -> Transformer:
    """The transformer ``name`` of :data:`_TRANSFORMERS` over ``ntoken`` tokens and
    ``context`` positions, initialised as GPT-2: weights of the linear layers and the
    embeddings from N(0, 0.02^2), biases 0 (PyTorch's N(0, 1) embeddings, read by the
    tied head, would start the logits at a cross-entropy of about 13 nats)."""
    ntoken = check_int("ntoken", ntoken, 1)
    context = check_int("context", context, 1)
    model = Transformer(vocab_size=ntoken, context=context, **_TRANSFORMERS[name])
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=_TRANSFORMER_INIT_STD)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    return model
