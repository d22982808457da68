"""When decisions are made: every N epochs or N optimizer steps, and learning-rate decays."""

from __future__ import annotations

import math
from typing import Any

import torch

from .._validate import check_bool, check_choice, check_int

UNITS = ("epoch", "step")


class Schedule:
    """Decision points every ``interval`` epochs or optimizer steps.

    * ``unit="epoch"`` (the paper): epochs ``0, interval, 2 interval, ...`` are checks;
      the statistic is gathered during a check epoch only, and the decision holds for the
      ``interval`` epochs that follow. The check's index is its epoch.
    * ``unit="step"``: each window of ``interval`` steps is compared with the previous
      one; the statistic is gathered during every step, and the check at the end of
      window ``w`` (after ``(w + 1) interval`` steps) has index ``w``.

    A learning-rate decay between checks makes every layer take the mildest rung at once,
    until the next check (the lr-decay override).
    """

    def __init__(self, interval: int = 10, unit: str = "epoch"):
        self.interval = check_int("interval", interval, 1)
        self.unit = check_choice("interval_unit", unit, UNITS)

    def collecting(self, epoch: int) -> bool:
        """Whether the statistic is gathered during epoch ``epoch`` (0-based)."""
        return self.unit == "step" or epoch % self.interval == 0

    def check_index(self, count: int) -> int | None:
        """The index of the check due when ``count`` ends (the epoch that just ended, or the
        number of steps done so far), or ``None`` when ``count`` is not a check point."""
        if count % self.interval:
            return None
        return count if self.unit == "epoch" else count // self.interval - 1

    def __repr__(self) -> str:
        return f"Schedule(interval={self.interval}, unit={self.unit!r})"


class DecayDetector:
    """Notices learning-rate decays from the rate seen at each call."""

    def __init__(self) -> None:
        #: The learning rate seen at the last call, or ``None``.
        self.last_lr: float | None = None

    @staticmethod
    def lr_of(optimizer: torch.optim.Optimizer | None, next_lr: Any) -> float | None:
        """``next_lr`` (validated) if given, else the optimizer's first group's rate."""
        if next_lr is not None:
            if isinstance(next_lr, bool) or not isinstance(next_lr, int | float):
                raise TypeError(f"next_lr must be a float, got {next_lr!r}")
            if not math.isfinite(next_lr) or next_lr < 0:
                raise ValueError(f"next_lr must be a finite float >= 0, got {next_lr}")
            return float(next_lr)
        if optimizer is None:
            return None
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        return float(optimizer.param_groups[0]["lr"])

    def decay(self, lr: float | None, lr_will_decay: bool | None) -> bool:
        """Whether the rate decays now: ``lr_will_decay`` if given, else ``lr`` below the
        last rate seen. Remembers ``lr``."""
        if lr_will_decay is not None:
            decay = check_bool("lr_will_decay", lr_will_decay)
        else:
            decay = lr is not None and self.last_lr is not None and lr < self.last_lr
        if lr is not None:
            self.last_lr = lr
        return decay
