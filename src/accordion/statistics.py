"""The statistics a rule decides from, gathered on this rank: the paper's gradient sums."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch


class GradientSums:
    """Per layer, the local gradient summed over the steps since the last check, in fp32
    (an epoch of fp16 gradients can overflow fp16): the paper's ``D_e``."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, key: str, grad: torch.Tensor) -> None:
        """Add one step's gradient of ``key``."""
        acc = self._sums.get(key)
        if acc is None:
            acc = torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
            self._sums[key] = acc
        acc.add_(grad)

    def keys_in(self, order: Iterable[str]) -> list[str]:
        """The keys with a sum, in the order of ``order``."""
        return [k for k in order if k in self._sums]

    def norms(self, keys: Sequence[str]) -> list[torch.Tensor]:
        """The L2 norm of each key's sum (0-d tensors, on the gradients' device)."""
        return [torch.linalg.vector_norm(self._sums[k]) for k in keys]

    @property
    def device(self) -> torch.device | None:
        """The device of the sums, or ``None`` before the first one."""
        return next(iter(self._sums.values())).device if self._sums else None

    def zero(self) -> None:
        """Start a new period: every sum back to 0 (the buffers are kept)."""
        for acc in self._sums.values():
            acc.zero_()

    def forget(self, key: str) -> None:
        """Drop ``key``'s sum (a layer sent dense has no level to decide)."""
        self._sums.pop(key, None)

    def rename(self, old: str, new: str) -> None:
        """Move ``old``'s sum to ``new``."""
        if old in self._sums:
            self._sums[new] = self._sums.pop(old)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The sums, cloned."""
        return {k: a.clone() for k, a in self._sums.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`; raises ``ValueError`` (and changes nothing) unless it
        maps keys to tensors."""
        if not isinstance(state, Mapping) or not all(
            isinstance(t, torch.Tensor) for t in state.values()
        ):
            raise ValueError("accumulators must map parameter keys to tensors")
        self._sums = {k: a.clone() for k, a in state.items()}
