"""The learning rate that goes with the batch in force: scaled with it, warmed up after a
switch to a larger one."""

from __future__ import annotations

import math

from .._validate import check_choice, check_int

#: Learning-rate scaling rules with the batch size: ``batch / small`` or its square root.
LR_SCALINGS = ("linear", "sqrt")


class LearningRate:
    """The multiplier on the small batch's learning rate, and its warm-up.

    Args:
        small: the global batch whose learning rate is the base (samples per step).
        scaling: ``"linear"`` (x ``batch / small``) or ``"sqrt"`` (x ``sqrt(batch / small)``).
        warmup_steps: optimizer steps over which the factor rises linearly to its new value
            after a switch to a larger batch (>= 0; 0: at once).
    """

    def __init__(self, small: int, scaling: str, warmup_steps: int) -> None:
        self.small = small
        self.scaling = check_choice("lr_scaling", scaling, LR_SCALINGS)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        #: Optimizer steps since the last switch of batch.
        self.steps_since_switch = 0
        #: The factor a warm-up starts from; None when no warm-up is in force.
        self.warmup_from: float | None = None

    def factor(self, batch: int, steps_since_switch: int | None = None) -> float:
        """The factor for ``batch``, ``steps_since_switch`` (an int >= 0; None: the count
        kept) optimizer steps after the last switch."""
        if steps_since_switch is None:
            steps = self.steps_since_switch
        else:
            steps = check_int("steps_since_switch", steps_since_switch, 0)
        ratio = batch / self.small
        target = ratio if self.scaling == "linear" else math.sqrt(ratio)
        if self.warmup_from is None or steps >= self.warmup_steps:
            return target
        return self.warmup_from + (target - self.warmup_from) * steps / self.warmup_steps

    def switch(self, old: int, new: int) -> None:
        """Start over after a switch of batch from ``old`` to ``new``."""
        current = self.factor(old)
        # up: ramp from the factor in force now; down: drop at once (a smaller lr is safe)
        going_up = new > old and self.warmup_steps > 0
        self.warmup_from = current if going_up else None
        self.steps_since_switch = 0
