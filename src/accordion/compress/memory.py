"""Error-feedback memories: what a compressor failed to send is added to the next step.

A memory is keyed by tensor (any hashable key: a parameter name or index). It is kept
apart from the compressor, as in GRACE, so that any compressor works with any memory,
and so that a compressor's level can change without touching what was owed.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import torch

from .._validate import check_state_keys, check_tensor_shapes


class ErrorFeedback:
    """Residual memory: ``M = grad + memory`` before compression, ``memory = M - sent`` after.

    ``compensate`` returns a tensor that the compressor may overwrite: a fresh one, or
    ``out`` when given, which may be the memory itself (the :class:`Reducer` compensates
    in place, so the memory and the next input share one buffer). ``update`` takes
    ownership of the residual it is given (no copy).
    """

    def __init__(self) -> None:
        self._memory: dict[Hashable, torch.Tensor] = {}

    def compensate(
        self, key: Hashable, grad: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Return ``grad + memory[key]`` as a new tensor (a copy of ``grad`` if none yet),
        or written into ``out`` (same shape) when given. ``out`` may be the memory itself
        (in place); partly overlapping it is an error (PyTorch refuses it)."""
        memory = self._memory.get(key)
        if memory is not None and memory.shape != grad.shape:
            raise ValueError(
                f"gradient for {key!r} has shape {tuple(grad.shape)} but its error-feedback "
                f"memory has shape {tuple(memory.shape)}"
            )
        if out is None:
            return grad.detach().clone() if memory is None else torch.add(grad.detach(), memory)
        if memory is None:
            return out.copy_(grad.detach())
        return torch.add(grad.detach(), memory, out=out)

    def update(self, key: Hashable, residual: torch.Tensor | None) -> None:
        """Store ``residual`` (the part of ``M`` not sent) for ``key``; ``None`` means zero."""
        if residual is None:
            self._memory.pop(key, None)
        else:
            self._memory[key] = residual

    def get(self, key: Hashable) -> torch.Tensor | None:
        """The memory held for ``key``, or ``None`` when it is zero."""
        return self._memory.get(key)

    def rename(self, old: Hashable, new: Hashable) -> None:
        """Move the memory of ``old`` to the key ``new``."""
        if old in self._memory:
            self._memory[new] = self._memory.pop(old)

    def keys(self) -> Iterable[Hashable]:
        """Keys with a non-zero memory."""
        return self._memory.keys()

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain keys only, readable with ``torch.load(weights_only=True)``."""
        return {"memory": {key: t.clone() for key, t in self._memory.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore memories saved by :meth:`state_dict`; anything else raises
        ``ValueError`` naming the bad entry, and changes nothing."""
        check_state_keys(state, frozenset({"memory"}), "ErrorFeedback")
        memory = state["memory"]
        if not isinstance(memory, Mapping):
            raise ValueError(f"memory must be a Mapping, got {type(memory).__name__}")
        for key, t in memory.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(f"memory[{key!r}] must be a floating-point tensor")
            # the reducer never keeps a non-finite residual: one would poison every step
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"memory[{key!r}] holds an inf or NaN")
        self._memory = {key: t.clone() for key, t in memory.items()}

    def check_shapes(self, shapes: Mapping[Hashable, Any]) -> None:
        """Raise ``ValueError`` unless each memory has the shape of its tensor."""
        check_tensor_shapes("memory", self._memory, shapes)


class NoMemory:
    """No error feedback: what the compressor drops is lost (for ablations)."""

    def compensate(
        self, key: Hashable, grad: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Return a copy of ``grad`` (written into ``out`` when given)."""
        return grad.detach().clone() if out is None else out.copy_(grad.detach())

    def update(self, key: Hashable, residual: torch.Tensor | None) -> None:
        """Discard the residual."""

    def get(self, key: Hashable) -> None:
        """Always ``None``: nothing is remembered."""
        return None

    def rename(self, old: Hashable, new: Hashable) -> None:
        """Nothing to move."""

    def keys(self) -> Iterable[Hashable]:
        """Always empty."""
        return ()

    def state_dict(self) -> dict[str, Any]:
        """Empty state."""
        return {"memory": {}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Nothing to restore."""

    def check_shapes(self, shapes: Mapping[Hashable, Any]) -> None:
        """Nothing to check."""
