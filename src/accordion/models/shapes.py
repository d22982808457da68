"""Parameter shapes of the models ``accordion plan`` knows, built on the ``meta`` device.

The plan needs shapes only, so every model is built without memory: this is what lets it
weigh a 1 B-parameter transformer. Beyond :data:`accordion.models.MODEL_NAMES` (the models
``train`` runs) it knows two data-centre models that this project does not train:
``resnet50`` (ImageNet, :class:`~accordion.models.resnet50.ResNet50`) and
``transformer-1b`` (:class:`~accordion.models.transformer.Transformer`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .._validate import check_int
from . import MODEL_NAMES, get_model
from .resnet50 import ResNet50
from .transformer import Transformer

__all__ = [
    "SCALE_MODEL_NAMES",
    "default_num_classes",
    "named_shapes",
    "plan_model_names",
    "takes_classes",
]

_SCALE_MODELS: dict[str, Callable[[int], nn.Module]] = {
    "resnet50": lambda num_classes: ResNet50(num_classes=num_classes),
    "transformer-1b": lambda num_classes: Transformer(),
}

SCALE_MODEL_NAMES: tuple[str, ...] = tuple(_SCALE_MODELS)
"""The models only the plan knows (shapes for data-centre scale; ``train`` does not run them)."""

# language models: their output is the vocabulary, so a number of classes means nothing
_LANGUAGE_MODELS = ("lstm", "transformer-tiny", "transformer-small", "transformer-1b")


def plan_model_names() -> tuple[str, ...]:
    """Every model name ``accordion plan --model`` takes."""
    return MODEL_NAMES + SCALE_MODEL_NAMES


def takes_classes(name: str) -> bool:
    """Whether model ``name`` has a number of classes (the language models do not)."""
    return name not in _LANGUAGE_MODELS


def default_num_classes(name: str) -> int:
    """The number of classes the plan assumes for ``name``: 1000 for the ImageNet
    ``resnet50``, else 10 (CIFAR-10; ignored by the language models)."""
    return 1000 if name == "resnet50" else 10


def named_shapes(name: str, num_classes: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of each parameter tensor of model ``name``, in ``named_parameters``
    order; ``num_classes`` defaults to :func:`default_num_classes`. Built on ``meta``."""
    if name not in plan_model_names():
        raise ValueError(f"model must be one of {', '.join(plan_model_names())}, got {name!r}")
    classes = default_num_classes(name) if num_classes is None else num_classes
    check_int("num_classes", classes, 1)
    # on the meta device a module has shapes but no storage: a 1 B model costs nothing
    with torch.device("meta"):
        if name in _SCALE_MODELS:
            model = _SCALE_MODELS[name](classes)
        else:
            model = get_model(name, num_classes=classes)
    return [(key, tuple(p.shape)) for key, p in model.named_parameters()]
