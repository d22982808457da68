"""The batch-size lever's statistic: the norm of an epoch's mean per-step gradient.

The paper's statistic, the norm of the gradient *summed* over an epoch's steps, grows with
the number of steps: with a batch 8x smaller there are 8x more steps, so the summed norm
is about 8x larger and a switch of batch size would look like a sharp change by itself.
Here the sum is divided by the number of steps: the statistic is the norm of the epoch's
*mean* per-step gradient, whose expectation does not depend on the batch size (only its
noise does). The sums are :class:`accordion.statistics.GradientSums`, one per gradient
tensor, kept in float64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..statistics import GradientSums


def check_grads(grads: Sequence[torch.Tensor]) -> None:
    """Raise ``TypeError`` unless ``grads`` is a non-empty sequence of floating-point tensors."""
    if isinstance(grads, torch.Tensor) or not isinstance(grads, Sequence):
        raise TypeError(
            f"grads must be a sequence of gradient tensors (one per parameter), "
            f"got {type(grads).__name__}"
        )
    if not grads:
        raise TypeError("grads must name at least one gradient tensor, got an empty sequence")
    for i, g in enumerate(grads):
        if not isinstance(g, torch.Tensor) or not g.is_floating_point():
            raise TypeError(
                f"grads[{i}] must be a floating-point tensor (pass only parameters that "
                f"have a gradient), got {g!r:.80}"
            )


def _zero_sums(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    # float64 keeps an epoch of additions exact enough; MPS has no float64
    return [
        torch.zeros(
            t.shape, dtype=torch.float32 if t.device.type == "mps" else torch.float64,
            device=t.device,
        )
        for t in tensors
    ]  # fmt: skip


class MeanGradient:
    """The gradients of the steps of one epoch, summed per tensor; their mean's norm.

    A step whose gradient is not finite poisons the epoch: its statistic is NaN (a
    controller refuses it at the check, as the sum of such a gradient would be).

    Args:
        sums: the sums to start from, one tensor per gradient tensor (a checkpoint's), or
            None to start empty.
        steps: the optimizer steps those sums hold (>= 0).
    """

    def __init__(self, sums: Sequence[torch.Tensor] | None = None, steps: int = 0) -> None:
        self._sums: GradientSums | None = None
        self._shapes: list[tuple[int, ...]] = []
        if sums:
            self._start(sums)
        #: Optimizer steps added so far.
        self.steps = steps

    def _start(self, sums: Sequence[torch.Tensor]) -> GradientSums:
        """Start the sums at ``sums``; returns them (also ``self._sums``)."""
        self._sums = started = GradientSums()
        # the sums keep the dtype they load with: float64, where GradientSums starts fp32
        started.load_state_dict({
            "sums": {str(i): s for i, s in enumerate(sums)},
            "steps": {}, "skipped": {}, "skipped_total": {},
        })  # fmt: skip
        self._shapes = [tuple(s.shape) for s in sums]
        return started

    def add(self, grads: Sequence[torch.Tensor]) -> None:
        """Add one step's gradients (checked by :func:`check_grads`); the first call
        allocates one buffer the size of the model on the gradients' device.

        Raises:
            ValueError: the number or shapes of the tensors differ from the first call's.
        """
        sums = self._sums
        if sums is None:
            sums = self._start(_zero_sums(grads))
        elif len(grads) != len(self._shapes) or any(
            tuple(g.shape) != shape for g, shape in zip(grads, self._shapes)
        ):
            raise ValueError(
                f"grads must have the same tensors every step of an epoch: expected shapes "
                f"{self._shapes}, got {[tuple(g.shape) for g in grads]}"
            )
        for i, g in enumerate(grads):
            sums.add(str(i), g)
        self.steps += 1

    def statistic(self) -> float | None:
        """``|| sum over steps of the gradient ||_2 / steps`` over the whole model (all
        tensors as one vector), in gradient units; NaN when a step was not finite; None
        when no step was added. Synchronises with the gradients' device."""
        if self._sums is None or self.steps == 0:
            return None
        if self._sums.skipped_steps():
            return math.nan
        norms = torch.stack(self._sums.norms([str(i) for i in range(len(self._shapes))]))
        return float(torch.linalg.vector_norm(norms)) / self.steps

    def sums(self) -> list[torch.Tensor] | None:
        """Copies of the sums, one per gradient tensor (NaN where a step was not finite),
        or None before the first step."""
        if self._sums is None:
            return None
        state = self._sums.state_dict()
        sums = [state["sums"][str(i)] for i in range(len(self._shapes))]
        for key in state["skipped"]:
            if state["skipped"][key]:
                sums[int(key)].fill_(math.nan)  # the poison survives a checkpoint
        return sums
