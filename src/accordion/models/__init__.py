"""Model zoo of the Accordion paper (Agarwal et al., MLSys 2021) and a name-based registry.

CIFAR-10/100 image classifiers follow kuangliu/pytorch-cifar; the language model follows the
PyTorch ``word_language_model`` example; ``mnist1d-cnn`` is a small model for quick runs.

Example:
    >>> model = get_model("resnet18", num_classes=100)
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

from torch import nn

from .densenet import DenseNet, DenseNetCifar
from .googlenet import GoogLeNet
from .lstm import WIKITEXT2_VOCAB_SIZE, LSTMLanguageModel
from .mnist1d import MNIST1DCNN
from .resnet import ResNet, ResNet18
from .senet import SENet18
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

MODEL_NAMES: tuple[str, ...] = (
    "resnet18",
    "vgg19bn",
    "senet18",
    "googlenet",
    "densenet",
    "lstm",
    "mnist1d-cnn",
)
"""Names accepted by :func:`get_model`."""


def get_model(name: str, num_classes: int = 10, **kwargs: object) -> nn.Module:
    """Build a freshly initialised model by name.

    Args:
        name: one of :data:`MODEL_NAMES`.
        num_classes: number of output classes; must be a positive int (``bool`` is rejected).
            It is validated for every name but ignored by ``"lstm"``, whose output size is
            its vocabulary size ``ntoken``.
        **kwargs: extra constructor arguments, e.g. ``ntoken``, ``hidden_size``,
            ``num_layers``, ``dropout`` for ``"lstm"`` or ``width``, ``length`` for
            ``"mnist1d-cnn"``.

    Raises:
        TypeError: ``name`` is not a ``str``.
        ValueError: ``name`` is unknown, or ``num_classes`` is not a positive int.
    """
    if not isinstance(name, str):
        raise TypeError(f"model name must be a str, got {type(name).__name__}: {name!r}")
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; allowed names: {', '.join(MODEL_NAMES)}")
    # bool is a subclass of int, but num_classes=True is surely a mistake.
    if (
        isinstance(num_classes, bool)
        or not isinstance(num_classes, numbers.Integral)
        or num_classes < 1
    ):
        wrong_type = isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral)
        error = TypeError if wrong_type else ValueError
        raise error(f"num_classes must be a positive int (1, 2, ...), got {num_classes!r}")
    if name == "lstm":
        return LSTMLanguageModel(**kwargs)  # type: ignore[arg-type]
    return _CLASSIFIERS[name](num_classes=int(num_classes), **kwargs)
