"""Tests for the accordion.models zoo and its get_model registry."""

from __future__ import annotations

import pytest
import torch

from accordion.models import MODEL_NAMES, LSTMLanguageModel, ResNet18, get_model
from accordion.models.shapes import takes_classes

CIFAR_MODELS = ("resnet18", "vgg19bn", "senet18", "googlenet", "densenet")


def test_resnet18_has_paper_parameter_count_and_tensor_count() -> None:
    params = list(ResNet18(num_classes=10).parameters())
    assert sum(p.numel() for p in params) == 11_173_962
    assert len(params) == 62


def test_resnet18_parameter_names_are_stable() -> None:
    names = [name for name, _ in ResNet18().named_parameters()]
    assert names[:3] == ["conv1.weight", "bn1.weight", "bn1.bias"]
    assert "layer2.0.shortcut.0.weight" in names
    assert names[-2:] == ["linear.weight", "linear.bias"]


@pytest.mark.parametrize("num_classes", [10, 100])
@pytest.mark.parametrize("name", CIFAR_MODELS)
def test_cifar_model_maps_images_to_logits(name: str, num_classes: int) -> None:
    torch.manual_seed(0)
    model = get_model(name, num_classes=num_classes).eval()
    with torch.no_grad():
        logits = model(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, num_classes)
    assert torch.isfinite(logits).all()


def test_lstm_forward_returns_logits_and_hidden_shapes() -> None:
    model = LSTMLanguageModel(ntoken=50, hidden_size=16, num_layers=3, dropout=0.4)
    tokens = torch.randint(0, 50, (7, 2))
    logits, (h, c) = model(tokens, model.init_hidden(2))
    assert logits.shape == (7, 2, 50)
    assert h.shape == c.shape == (3, 2, 16)


def test_lstm_decoder_weight_is_tied_to_embedding() -> None:
    model = LSTMLanguageModel(ntoken=50, hidden_size=16)
    assert model.decoder.weight is model.encoder.weight


def test_lstm_defaults_match_paper_configuration() -> None:
    model = get_model("lstm")
    assert model.encoder.weight.shape == (33278, 650)
    assert (model.rnn.num_layers, model.rnn.hidden_size, model.rnn.dropout) == (3, 650, 0.4)


def test_get_model_passes_lstm_kwargs_and_ignores_num_classes() -> None:
    model = get_model("lstm", num_classes=100, ntoken=30, hidden_size=8, num_layers=1)
    logits, _ = model(torch.randint(0, 30, (3, 2)))
    assert logits.shape == (3, 2, 30)


@pytest.mark.parametrize("shape", [(4, 40), (4, 1, 40)])
def test_mnist1d_cnn_maps_signals_to_logits(shape: tuple[int, ...]) -> None:
    model = get_model("mnist1d-cnn")
    assert model(torch.randn(*shape)).shape == (4, 10)


def test_model_names_lists_every_model() -> None:
    assert MODEL_NAMES == (
        "resnet18",
        "vgg19bn",
        "senet18",
        "googlenet",
        "densenet",
        "lstm",
        "mnist1d-cnn",
        "transformer-tiny",
        "transformer-small",
    )


def test_get_model_rejects_unknown_name_listing_allowed_names() -> None:
    with pytest.raises(ValueError, match="resnet50") as excinfo:
        get_model("resnet50")
    assert all(name in str(excinfo.value) for name in MODEL_NAMES)


@pytest.mark.parametrize("name", [None, 18, ResNet18])
def test_get_model_rejects_non_str_name(name: object) -> None:
    with pytest.raises(TypeError, match="str"):
        get_model(name)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("num_classes", "error"),
    [(0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError), ("10", TypeError)],
)
def test_get_model_rejects_bad_num_classes(num_classes: object, error: type[Exception]) -> None:
    # the architecture issue: a wrong type is a TypeError, a bad value a ValueError
    with pytest.raises(error, match="num_classes") as excinfo:
        get_model("mnist1d-cnn", num_classes=num_classes)  # type: ignore[arg-type]
    assert repr(num_classes) in str(excinfo.value)
    assert "positive int" in str(excinfo.value)


def test_the_plan_counts_the_character_transformers_as_language_models() -> None:
    assert not takes_classes("transformer-tiny") and not takes_classes("transformer-small")
    assert takes_classes("mnist1d-cnn")
