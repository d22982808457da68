"""Stable names for the parameters whose gradients are averaged, the same on every rank."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (``module`` itself otherwise)."""
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


class ParameterTable:
    """Parameter keys, shapes and element sizes, in binding order.

    Parameters are named after ``module.named_parameters()`` once a module is bound;
    before that, parameters met in buckets are named ``"#0"``, ``"#1"``, ... in order of
    first appearance (the same on every rank: DDP's buckets are identical).
    """

    def __init__(self) -> None:
        self._names: dict[int, str] = {}  # id(parameter) -> key
        #: Key -> shape, in binding order.
        self.shapes: dict[str, tuple[int, ...]] = {}
        #: Key -> bytes per element of its gradient.
        self.element_size: dict[str, int] = {}
        #: Shapes a loaded checkpoint expects, or ``None``.
        self.expected: dict[str, tuple[int, ...]] | None = None
        #: The bound module (unwrapped), or ``None``.
        self.module: nn.Module | None = None

    def bind(self, model: nn.Module) -> dict[str, str]:
        """Name parameters after ``model`` (plain or DDP-wrapped); returns the renames
        ``{old lazy key: new name}`` that the owners of per-key state must apply."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        module = unwrap(model)
        renamed = {}
        for name, param in module.named_parameters():
            old = self._names.get(id(param))
            if old is not None and old != name:
                renamed[old] = name
            self._names[id(param)] = name
            if name not in self.shapes:
                self._register(name, tuple(param.shape), param.element_size())
        for old, new in renamed.items():
            self.shapes[new] = self.shapes.pop(old)
            self.element_size[new] = self.element_size.pop(old)
        self.module = module
        self.check_expected()
        return renamed

    def key_of(self, param: torch.Tensor) -> str | None:
        """``param``'s key, or ``None`` if it has none yet (nothing is registered)."""
        return self._names.get(id(param))

    def keys(self, params: Sequence[torch.Tensor]) -> list[str]:
        """The keys of ``params``, naming unknown ones lazily."""
        keys = []
        for param in params:
            key = self._names.get(id(param))
            if key is None:
                if self.module is not None:
                    raise ValueError(
                        f"a gradient of shape {tuple(param.shape)} belongs to no parameter "
                        f"of the bound module ({type(self.module).__name__}): the gradients "
                        "come from another model than the state was built for (the hook "
                        "registered on another DDP module, or reduce_gradients given "
                        "other parameters)"
                    )
                key = f"#{len(self.shapes)}"  # same on every rank: buckets are identical
                self._names[id(param)] = key
                self._register(key, tuple(param.shape), param.element_size())
            keys.append(key)
        return keys

    def add(self, key: str, shape: Sequence[int], element_size: int) -> None:
        """Register ``key`` for a tensor that is no module parameter (an FSDP gradient
        shard), so that its state is kept and checkpointed under that key."""
        self._register(key, tuple(shape), element_size)

    def expect(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """Check the bound parameters against a checkpoint's ``shapes`` and remember them
        for parameters bound later; raises ``ValueError`` on a mismatch."""
        expected = {k: tuple(s) for k, s in shapes.items()}
        for key, shape in self.shapes.items():
            if expected.get(key) != shape:
                raise ValueError(
                    f"the loaded Accordion state does not match the model: parameter {key!r} "
                    f"has shape {shape}, the checkpoint {expected.get(key)}"
                )
        previous, self.expected = self.expected, expected
        try:
            self.check_expected()
        except ValueError:
            self.expected = previous
            raise

    def check_expected(self) -> None:
        """Raise ``ValueError`` when a bound module's parameters differ from the checkpoint's."""
        if self.expected is None or self.module is None:
            return
        if set(self.shapes) != set(self.expected):
            missing = sorted(set(self.expected) - set(self.shapes))[:5]
            extra = sorted(set(self.shapes) - set(self.expected))[:5]
            raise ValueError(
                "the loaded Accordion state does not match the model: "
                f"parameters only in the checkpoint {missing}, only in the model {extra}"
            )

    def _register(self, key: str, shape: tuple[int, ...], element_size: int) -> None:
        if key in self.shapes:
            raise ValueError(f"parameter key {key!r} is registered twice")
        if self.expected is not None and self.expected.get(key) != shape:
            raise ValueError(
                f"the loaded Accordion state does not match the model: parameter {key!r} "
                f"has shape {shape}, the checkpoint {self.expected.get(key)}"
            )
        self.shapes[key] = shape
        self.element_size[key] = element_size

